"""Token heat map of one group: how EP-GRPO assigned credit (the paper's Figs 1 and 3).

    python -m epgrpo_jax.tools.heatmap RUN_DIR [--step N] [--group I] [--out FILE.html]
    python -m epgrpo_jax.tools.heatmap --checkpoint RUN_DIR [--problem "..."] [--answer A]
                                 [--samples G] [--seed S] [--out FILE.html]

The first form draws a group the run dumped to RUN_DIR/samples.jsonl (default:
the latest step, and its first group whose rewards differ). The second samples
G fresh responses to one problem with the run's latest checkpoint, scores
them, and computes the advantage exactly as a training step would.

The page is one self-contained HTML file (inline CSS and JS, no external
assets): each of the G responses token by token, one `<span class="tok">` per
token, coloured by final advantage, outcome advantage, progress advantage,
anchored signal, gate W, entropy, tau or bucket (buttons switch), with a colour
scale, each response's reward, the bucket boundaries marked, and every
token's numbers in its tooltip.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from epgrpo_jax.io import commandline
from epgrpo_jax.io.atomic import output_file
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.io.metrics import token_strings
from epgrpo_jax.io.paths import path_flag
from epgrpo_jax.io.records import jsonl_rows
from epgrpo_jax.tools.heatmap_sample import sample_group

# The modules that import JAX (models, data, training, parallel) are imported inside the
# functions that need them, so that --help, bad arguments and drawing a dumped group stay fast.

# key in samples.jsonl -> (data attribute, button label, scale kind, description)
QUANTITIES: dict[str, tuple[str, str, str, str]] = {
    "advantage": ("a", "Final advantage", "signed",
                  "A = W·A<sub>i</sub> + η·z: the token advantage the loss uses (eq. 26)."),
    "outcome": ("o", "Outcome advantage", "signed",
                "W·A<sub>i</sub>: GRPO's group-normalised reward A<sub>i</sub> of the response, "
                "weighted by the token's entropy gate (eqs. 3, 19)."),
    "progress": ("p", "Progress advantage", "signed",
                 "η·z: the anchored signal s̃ z-scored among the group's tokens of the same "
                 "progress bucket (eqs. 24-25)."),
    "signal": ("s", "Signal s̃", "signed",
               "s̃ = d<sub>i</sub>·λ(log π − log π<sub>ref</sub>): the implicit process signal, "
               "signed by the outcome (eqs. 20-22). Zero while π = π<sub>ref</sub>."),
    "gate": ("w", "Gate W", "unit",
             "W = σ(γ(H − μ<sub>H</sub>)/σ<sub>H</sub>): near 1 on tokens whose entropy is above "
             "the group's mean, near 0 below (eq. 18)."),
    "entropy": ("h", "Entropy H", "positive",
                "H: full-vocabulary entropy of the sampling policy at the token, in nats (eq. 15)."),
    "tau": ("t", "Progress τ", "unit",
            "τ: cumulative entropy up to the token over the response's total, in [0, 1] (eq. 23)."),
    "bucket": ("b", "Bucket", "bucket",
               "b = min(⌊τK⌋, K − 1): the progress bucket; its tokens, pooled over the group, are "
               "normalised together (eq. 24)."),
}
DEFAULT_QUANTITY = "advantage"
# Endpoint colours (RGB): signed uses NEG..white..POS (PiYG, colour-blind safe).
NEG, POS = (197, 27, 125), (77, 146, 33)
SEQ = {"positive": (230, 97, 1), "unit": (33, 102, 172)}
BUCKET_COLORS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
                 "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")


# ----------------------------------------------------------------------------
# Reading groups


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
  """The group records of RUN_DIR/samples.jsonl (written by the trainer)."""
  path = Path(run_dir) / "samples.jsonl"
  if not path.is_file():
    raise MissingFileError(f"{path}: not found (the run dumps samples every "
                            "logging.samples_every steps)")
  # A truncated last line of a killed run is skipped with a warning.
  groups = [rec for rec in jsonl_rows(path) if "responses" in rec]
  if not groups:
    raise UserError(f"{path}: no group records (written by an older version of the trainer?)")
  return groups


def select_group(groups: Sequence[dict], step: int | None = None,
                 group: int | None = None) -> dict[str, Any]:
  """The record of `step` (default: the latest) and `group` (default: the first whose
  rewards differ, else the first)."""
  steps = sorted({g["step"] for g in groups})
  step = steps[-1] if step is None else step
  at = [g for g in groups if g["step"] == step]
  if not at:
    raise UserError(f"--step {step}: no samples at that step; steps with samples: "
                     f"{', '.join(map(str, steps))}")
  if group is None:
    varied = [g for g in at if len({r["reward"] for r in g["responses"]}) > 1]
    return (varied or at)[0]
  chosen = [g for g in at if g["group"] == group]
  if not chosen:
    raise UserError(f"--group {group}: not dumped at step {step}; groups: "
                     f"{', '.join(str(g['group']) for g in at)}")
  return chosen[0]


def _run_tokenizer(run_dir: Path):
  from epgrpo_jax.models import load_tokenizer  # imports JAX: only when ids need strings
  cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
  return load_tokenizer(cfg["model"]["path"])


def ensure_tokens(group: dict[str, Any], run_dir: str | Path | None = None) -> dict[str, Any]:
  """Adds display strings (`tokens`) to responses that only have `token_ids`, with the
  run's tokenizer (config.yaml's model.path), else `<id>` placeholders."""
  missing = [r for r in group["responses"] if "tokens" not in r]
  if not missing:
    return group
  tokenizer = None
  if run_dir is not None:
    try:
      tokenizer = _run_tokenizer(Path(run_dir))
    except Exception as e:  # no config, moved model: fall back to ids
      print(f"note: cannot load the run's tokenizer ({type(e).__name__}: {e}); showing token ids",
            file=sys.stderr)
  for r in missing:
    r["tokens"] = (token_strings(tokenizer, r["token_ids"]) if tokenizer is not None
                   else [f"<{i}>" for i in r["token_ids"]])
  return group


# ----------------------------------------------------------------------------
# Rendering


def _mix(rgb: tuple[int, int, int], f: float) -> tuple[int, int, int]:
  f = min(max(f, 0.0), 1.0)
  return tuple(round(255 + (c - 255) * f) for c in rgb)


def color(kind: str, value: float, limit: float) -> str:
  """The CSS colour of `value` on a scale (the page's JS has the same function)."""
  if kind == "bucket":
    return BUCKET_COLORS[int(value) % len(BUCKET_COLORS)]
  if not math.isfinite(value):
    return "#ffffff"
  f = value / limit if limit > 0 else 0.0
  if kind == "signed":
    rgb = _mix(POS if f >= 0 else NEG, abs(f))
  else:
    rgb = _mix(SEQ[kind], f)
  return "rgb({},{},{})".format(*rgb)


def scale_limits(group: dict[str, Any]) -> dict[str, float]:
  """Colour-scale limit per quantity over the whole group: max |x| (signed), max (entropy),
  1 (gate, tau), K (buckets)."""
  out = {}
  for key, (_, _, kind, _) in QUANTITIES.items():
    vals = np.array([v for r in group["responses"] for v in r.get(key, [])], np.float64)
    vals = vals[np.isfinite(vals)]
    if kind == "signed":
      out[key] = float(np.abs(vals).max()) if vals.size else 0.0
    elif kind == "positive":
      out[key] = float(vals.max()) if vals.size else 0.0
    elif kind == "unit":
      out[key] = 1.0
    else:
      out[key] = float(vals.max() + 1) if vals.size else 1.0
  return out


def _display(tok: str) -> str:
  """Visible text of a token: newlines as ↵ (then a line break), tabs as →, other control
  characters as their Unicode pictures (␇), '' (part of a character) as ·."""
  if tok == "":
    return "·"
  tok = tok.replace("\t", "→").replace("\r", "␍").replace("\n", "↵\n")
  return "".join(chr(0x2400 + ord(c)) if ord(c) < 0x20 and c != "\n" else
                 "␡" if c == "\x7f" else c for c in tok)


def _fmt(v: float) -> str:
  return "nan" if not math.isfinite(v) else f"{v:.4g}"


def _signed(v: float) -> str:
  return "nan" if not math.isfinite(v) else f"{v:+.3f}"


def _response_html(r: dict[str, Any], index: int, limits: dict[str, float]) -> str:
  toks = r["tokens"]
  n = len(toks)
  for key in QUANTITIES:
    if len(r.get(key, ())) != n:
      raise UserError(f"response {r.get('sample', index)}: {key} has {len(r.get(key, ()))} "
                       f"values for {n} tokens")
  kind = QUANTITIES[DEFAULT_QUANTITY][2]
  parts = []
  prev_bucket = None
  for t in range(n):
    vals = {key: float(r[key][t]) for key in QUANTITIES}
    b = int(vals["bucket"])
    cls = "tok"
    if prev_bucket is not None and b != prev_bucket:
      cls += " bstart"
    prev_bucket = b
    attrs = " ".join(f'data-{QUANTITIES[k][0]}="{_fmt(v)}"' for k, v in vals.items())
    tip = (f"token {t}: {json.dumps(toks[t], ensure_ascii=False)}\n"
           f"final advantage {_signed(vals['advantage'])}\n"
           f"outcome advantage W·A_i {_signed(vals['outcome'])}\n"
           f"progress advantage η·z {_signed(vals['progress'])}\n"
           f"signal s̃ {_signed(vals['signal'])}\n"
           f"gate W {vals['gate']:.3f}   entropy H {vals['entropy']:.3f}\n"
           f"τ {vals['tau']:.3f}   bucket {b}")
    bg = color(kind, vals[DEFAULT_QUANTITY], limits[DEFAULT_QUANTITY])
    parts.append(f'<span class="{cls}" {attrs} style="background:{bg}" '
                 f'title="{html.escape(tip, quote=True)}">{html.escape(_display(toks[t]))}</span>')
  reward = float(r["reward"])
  ok = "good" if reward > 0.5 else "bad"
  extracted = r.get("extracted")
  answer = ("no boxed answer" if extracted is None
            else f"answer {html.escape(str(extracted))}")
  head = (f'<div class="rhead"><b>Response {r.get("sample", index) + 1}</b>'
          f'<div class="pill {ok}">reward {reward:g}</div>'
          f'<div class="kv">A<sub>i</sub> {_signed(float(r.get("outcome_adv", math.nan)))}</div>'
          f'<div class="kv">d<sub>i</sub> {float(r.get("anchor", math.nan)):+g}</div>'
          f'<div class="kv">{n} tokens</div><div class="kv">{answer}</div></div>')
  return f'<div class="resp">{head}<div class="toks">{"".join(parts)}</div></div>'


# The page's style sheet, and its script: a %-format template (`%(name)s` fields take the
# page's data, `%%` is a literal %). Both ship beside this module (package data).
CSS = resources.files("epgrpo_jax.tools").joinpath("heatmap.css").read_text(encoding="utf-8")
JS = resources.files("epgrpo_jax.tools").joinpath("heatmap.js").read_text(encoding="utf-8")


def render_html(group: dict[str, Any], *, title: str = "", source: str = "") -> str:
  """The self-contained page of one group record (see `sample_records` in training/rollouts.py)."""
  responses = group["responses"]
  if not responses:
    raise ValueError("the group has no responses")
  for r in responses:
    if "tokens" not in r:
      raise ValueError("responses need `tokens` (see ensure_tokens)")
  limits = scale_limits(group)
  rewards = [float(r["reward"]) for r in responses]
  total = sum(len(r["tokens"]) for r in responses)
  num_buckets = int(limits["bucket"])
  title = title or f"Step {group.get('step', '?')}, group {group.get('group', '?')}"
  buttons = "".join(
      f'<button data-q="{k}"{" class=on" if k == DEFAULT_QUANTITY else ""}>{label}</button>'
      for k, (_, label, _, _) in QUANTITIES.items())
  facts = [f"gold answer <b>{html.escape(str(group.get('answer', '?')))}</b>",
           f"{len(responses)} responses, {total} tokens",
           f"mean reward {np.mean(rewards):.3g}",
           f"correct {sum(r > 0.5 for r in rewards)}/{len(rewards)}"]
  if group.get("zero_variance"):
    facts.append("<b>zero-variance group</b>: A<sub>i</sub> = 0, the anchor d<sub>i</sub> = "
                 "sign(r − θ<sub>r</sub>) signs the progress signal")
  js = JS % {
      "quantities": json.dumps({k: {"attr": a, "kind": kind, "desc": d}
                                for k, (a, _, kind, d) in QUANTITIES.items()}, ensure_ascii=False),
      "limits": json.dumps(limits), "neg": json.dumps(NEG), "pos": json.dumps(POS),
      "seq": json.dumps(SEQ), "buckets": json.dumps(BUCKET_COLORS),
      "default": json.dumps(DEFAULT_QUANTITY)}
  body = "".join(_response_html(r, i, limits) for i, r in enumerate(responses))
  meta = " · ".join(x for x in (source, f"problem {group.get('problem_id', '?')}") if x)
  return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} · EP-GRPO token heat map</title>
<style>
{CSS}</style></head>
<body><main>
<h1>EP-GRPO token heat map · {html.escape(title)}</h1>
<div class="meta">{html.escape(meta)}</div>
<div class="card"><div class="label">Prompt</div>
<pre class="problem">{html.escape(str(group.get('prompt', '')))}</pre>
<div class="facts">{"".join(f"<div>{f}</div>" for f in facts)}</div></div>
<div class="controls"><div class="buttons">{buttons}</div>
<div class="desc" id="desc">{QUANTITIES[DEFAULT_QUANTITY][3]}</div>
<div class="legend"><div class="scale"><div class="bar" id="bar"></div>
<div class="ticks" id="ticks"><div>−</div><div>0</div><div>+</div></div></div>
<div><i class="mark"></i>bucket boundary ({num_buckets} buckets; the τ and Bucket views number
them) · hover a token for its numbers</div></div>
<div class="hover" id="hover"></div></div>
{body}
</main><script>
{js}</script></body></html>
"""


# ----------------------------------------------------------------------------
# The command


def write_page(group: dict[str, Any], out: str | Path, *, title: str = "",
               source: str = "") -> Path:
  out = output_file(out, "--out")
  out.write_text(render_html(group, title=title, source=source), encoding="utf-8")
  return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.tools.heatmap",
                         description=__doc__.splitlines()[0])
  p.add_argument("run", nargs="?", type=path_flag, metavar="RUN_DIR",
                 help="a run directory with samples.jsonl")
  p.add_argument("--step", type=int, help="the dumped step (default: the latest)")
  p.add_argument("--group", type=int, help="the group index within the step (default: the "
                 "first whose rewards differ)")
  p.add_argument("--checkpoint", metavar="RUN_DIR", type=path_flag,
                 help="sample a fresh group with this run's latest checkpoint instead")
  p.add_argument("--problem", help="with --checkpoint: the problem text (default: the run's "
                 "first held-out problem)")
  p.add_argument("--answer", help="with --checkpoint: its gold answer (default: from the run's "
                 "data when the problem is there)")
  p.add_argument("--samples", type=int, help="with --checkpoint: G (default: the run's "
                 "train.num_generations)")
  p.add_argument("--seed", type=int, default=0, help="with --checkpoint: sampling seed")
  p.add_argument("--out", type=path_flag,
                 help="the HTML file (default: RUN_DIR/heatmaps/step<N>_group<I>.html)")
  p.add_argument("--debug", action="store_true", help="show tracebacks")
  args = p.parse_args(argv)
  if (args.run is None) == (args.checkpoint is None):
    p.error("give either RUN_DIR (draw from samples.jsonl) or --checkpoint RUN_DIR (fresh sample)")
  if args.checkpoint is None and (args.problem or args.answer or args.samples):
    p.error("--problem, --answer and --samples need --checkpoint")
  if args.checkpoint is not None and (args.step is not None or args.group is not None):
    p.error("--step and --group select dumped samples; they do not apply to --checkpoint")
  if args.samples is not None and args.samples < 1:
    p.error(f"--samples: must be >= 1, got {args.samples}")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)

  def run() -> int:
    if args.out:  # before any sampling
      output_file(args.out, "--out")
    if args.checkpoint is not None:
      run_dir = Path(args.checkpoint)
      group = sample_group(run_dir, args.problem, args.answer, num_samples=args.samples,
                           seed=args.seed)
      name = f"fresh_step{group['step']}_seed{args.seed}.html"
      title = f"fresh sample, checkpoint step {group['step']}"
    else:
      run_dir = Path(args.run)
      group = ensure_tokens(select_group(read_samples(run_dir), args.step, args.group), run_dir)
      name = f"step{group['step']}_group{group['group']}.html"
      title = f"step {group['step']}, group {group['group']}"
    out = write_page(group, args.out or run_dir / "heatmaps" / name, title=title,
                     source=f"run {run_dir.resolve().name}")
    print(out)
    return 0

  return commandline.run_main(run, debug=args.debug)


if __name__ == "__main__":
  sys.exit(main())

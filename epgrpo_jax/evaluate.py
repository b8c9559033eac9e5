"""`python -m epgrpo_jax.evaluate`: Acc, Fmt and pass@k of a model on math benchmarks
(see docs/evaluation.md):

  python -m epgrpo_jax.evaluate --model DIR [--checkpoint CKPT] \\
      --benchmarks math500,amc23,minerva,aime24,aime25 [--samples 16] [--out DIR]

It renders each problem with the math prompt, samples with our `Sampler`,
scores with `RewardScorer` (reward checks of one batch overlap the sampling of
the next), and writes `OUT/results.md` (the table of the paper's Tables II/III),
`OUT/results.json` and `OUT/samples.jsonl`. Prompts that do not fit are
skipped and counted, never dropped silently. The scoring and the table are
`epgrpo_jax.evaluation.heldout`, the checkpoint restore `epgrpo_jax.evaluation.checkpoints`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
from flax import nnx

from epgrpo_jax.data import evalsets, pipeline
from epgrpo_jax.evaluation.checkpoints import (CheckpointRef, checkpoint_lora, config_section, load_policy,
                                               resolve_checkpoint)
from epgrpo_jax.evaluation.heldout import (EVAL_TEMPLATE, average_metrics, benchmark_metrics,
                                           evaluate_examples, markdown_table, percent, render_examples,
                                           skip_note, table_ks)
from epgrpo_jax.io import commandline
from epgrpo_jax.io.atomic import check_output_paths, output_dir, write_text_atomic
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.io.metrics import Progress
from epgrpo_jax.io.paths import expand_home, path_flag
from epgrpo_jax.models import (LoraConfig, ModelConfig, check_vocab, load_hf_config, load_tokenizer,
                               stop_token_ids)
from epgrpo_jax.rewards import RewardConfig, RewardScorer
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig

log = logging.getLogger("epgrpo_jax.evaluate")

DEFAULT_BENCHMARKS = ("math500", "amc23", "minerva", "aime24", "aime25")


# ----------------------------------------------------------------------------
# Flags


def _int_at_least(lo: int) -> Callable[[str], int]:
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lo:
      raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
    return value
  return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _float_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
      bracket = "(" if lo_open else "["
      raise argparse.ArgumentTypeError(f"must be in {bracket}{lo}, {hi}], got {text}")
    return value
  return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(
      prog="python -m epgrpo_jax.evaluate",
      description="Acc, Fmt and pass@k of a model (or a training checkpoint) on math benchmarks.")
  p.add_argument("--model", type=path_flag,
                 help="HF model directory (the base model of --checkpoint); default: "
                 "model.path of the run's config.yaml")
  p.add_argument("--checkpoint", type=path_flag,
                 help="a training run: RUN_DIR (latest step), RUN_DIR/checkpoints "
                 "or RUN_DIR/checkpoints/<step>; its trained weights are restored onto --model")
  p.add_argument("--benchmarks", default=",".join(DEFAULT_BENCHMARKS),
                 help="comma-separated names (default: %(default)s)")
  p.add_argument("--benchmark-file", action="append", default=[], metavar="NAME=PATH",
                 help="a benchmark's JSONL/JSON/Parquet file, folder saved by `datasets`, or "
                 "Hugging Face dataset id (repeatable)")
  p.add_argument("--data-dir", type=path_flag,
                 help="directory holding the benchmark files by their usual names "
                 "(default: $EPGRPO_DATA_DIR, then the copies shipped in epgrpo_jax/datasets)")
  p.add_argument("--samples", type=_positive_int, default=16, help="samples per problem")
  p.add_argument("--temperature", type=_float_in(0.0, math.inf), default=1.0,
                 help="0 samples greedily")
  p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0)
  p.add_argument("--max-new-tokens", type=_positive_int, default=2048)
  p.add_argument("--continuous-slots", type=_non_negative_int, default=0,
                 help="continuous batching over this many decode rows (sampling.continuous, "
                      "sampling.slots); 0: the static sampler (same completions)")
  p.add_argument("--max-prompt-tokens", type=_non_negative_int, default=0,
                 help="skip (and count) longer prompts; 0: only the model's context limits")
  p.add_argument("--limit", type=_positive_int, help="first N problems of each benchmark")
  p.add_argument("--out", type=path_flag, help="output directory (default: RUN_DIR/eval/step_<N> with "
                 "--checkpoint, else eval/<model dir name>)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--prompts-per-batch", type=_positive_int, default=16,
                 help="prompts sampled together (x --samples rows)")
  p.add_argument("--lora-rank", type=_positive_int, help="the run's lora.rank (default: "
                 "config.yaml of the run, else the checkpoint's shapes)")
  p.add_argument("--lora-alpha", type=_float_in(0.0, math.inf, lo_open=True),
                 help="the run's lora.alpha (default: config.yaml of the run)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute and weight dtype")
  p.add_argument("--prompt-template", help="user message with {problem} (default: the run's "
                 "data.prompt_template, else the paper's step-by-step \\boxed{} prompt)")
  p.add_argument("--system-prompt", help="system message (default: the run's, else the chat "
                 "template's own)")
  p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                 help="wrap the prompt in the tokenizer's chat template (default: on)")
  p.add_argument("--reward-timeout", type=_float_in(0.0, math.inf, lo_open=True), default=5.0,
                 help="CPU seconds per answer check (a timed-out check scores 0 and is counted)")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
  args = p.parse_args(argv)
  try:
    args.benchmark_names = _benchmark_names(args.benchmarks)
    args.benchmark_files = evalsets.parse_benchmark_files(args.benchmark_file)
  except (KeyError, ValueError) as e:
    p.error(str(e.args[0]) if isinstance(e, KeyError) else str(e))
  unused = [n for n in args.benchmark_files if n not in args.benchmark_names]
  if unused:
    p.error(f"--benchmark-file {unused[0]}=...: {unused[0]} is not in --benchmarks "
            f"({','.join(args.benchmark_names)})")
  if args.model is None and args.checkpoint is None:
    p.error("--model is required (or --checkpoint of a run whose config.yaml names its model)")
  if args.prompt_template is not None and "{problem}" not in args.prompt_template:
    p.error("--prompt-template: must contain {problem}")
  return args


def _benchmark_names(text: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  if not names:
    raise UserError("--benchmarks: empty list")
  out = []
  for n in names:
    name = evalsets.get_spec(n).name
    if name in out:
      raise UserError(f"--benchmarks: {name} listed twice")
    out.append(name)
  return out


def _bench_key(key: jax.Array, name: str) -> jax.Array:
  """A key per benchmark that does not depend on which others are evaluated."""
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


# ----------------------------------------------------------------------------
# The command: resolve inputs, load benchmarks, render prompts, load the policy, evaluate, write


def run(args: argparse.Namespace) -> int:
  """The evaluation command; returns the exit code.

  Every input is checked before the model loads: the flags and the checkpoint, the benchmark
  files, the prompts, then --out.
  """
  start = time.perf_counter()
  inputs = resolve_inputs(args)
  benchmarks = load_benchmarks(args)
  renderer = render_prompts(args, inputs, benchmarks)
  out_dir = prepare_out_dir(args, inputs)
  params, sampler = load_sampler(args, inputs, renderer.tokenizer)
  reward_cfg = RewardConfig(timeout_s=args.reward_timeout)
  samples_tmp = temporary_samples_file(out_dir)
  per_benchmark, reward_stats = evaluate_benchmarks(args, benchmarks, params, sampler,
                                                    renderer.tokenizer, reward_cfg, samples_tmp)
  ks = table_ks(args.samples)
  results = {"benchmarks": per_benchmark, "average": average_metrics(per_benchmark, ks),
             "config": settings_record(args, inputs, benchmarks, renderer, reward_cfg),
             "reward_check_stats": reward_stats,
             "seconds": round(time.perf_counter() - start, 3)}
  write_results(args, inputs, results, out_dir, samples_tmp)
  return 0


@dataclasses.dataclass
class Inputs:
  """What --model and --checkpoint resolve to, checked before any weights load."""

  model_dir: Path
  ref: CheckpointRef | None
  lora: LoraConfig | None  # None: no checkpoint, or one of full fine-tuning
  hf_config: ModelConfig  # the model's config.json
  run_data: dict[str, Any]  # the data section of the run's config.yaml ({} without one)

  @property
  def context(self) -> int:
    return self.hf_config.max_position_embeddings


@dataclasses.dataclass
class Benchmark:
  """One benchmark's problems as loaded, then (`render_prompts`) as prompts."""

  problems: list[evalsets.Problem]
  source: str
  load_skips: dict[str, int]
  examples: list[pipeline.Example] = dataclasses.field(default_factory=list)
  prompt_skips: Mapping[str, int] = dataclasses.field(default_factory=dict)


def resolve_inputs(args: argparse.Namespace) -> Inputs:
  """--checkpoint, --model (default: the run's model.path) and the LoRA settings, checked."""
  ref = resolve_checkpoint(args.checkpoint) if args.checkpoint else None
  run_model = config_section(ref.run_config if ref else None, "model")
  run_data = config_section(ref.run_config if ref else None, "data")
  model_dir = args.model or run_model.get("path")
  if not model_dir or model_dir == "embedded":
    raise UserError(f"--model: required (the run's config.yaml names model.path={model_dir!r})")
  model_dir = Path(expand_home(model_dir))
  if not model_dir.is_dir():
    raise MissingFileError(f"--model {model_dir}: not a directory")
  if not (model_dir / "config.json").is_file():
    raise MissingFileError(f"--model {model_dir}: no config.json (not a Hugging Face model "
                            "directory)")
  lora = checkpoint_lora(ref, args.lora_rank, args.lora_alpha) if ref else None
  inputs = Inputs(model_dir, ref, lora, load_hf_config(model_dir), run_data)
  if args.max_new_tokens >= inputs.context:
    raise UserError(f"--max-new-tokens {args.max_new_tokens}: leaves no room for a prompt in "
                     f"the model's context of {inputs.context} tokens (max_position_embeddings)")
  return inputs


def load_benchmarks(args: argparse.Namespace) -> dict[str, Benchmark]:
  """The problems of each of --benchmarks: a missing benchmark file fails before the model loads."""
  out = {}
  for name in args.benchmark_names:
    problems, stats = evalsets.load_benchmark_with_stats(
        name, args.benchmark_files.get(name), args.data_dir, args.limit)
    out[name] = Benchmark(problems, stats.source, {k: int(v) for k, v in stats.skipped.items() if v})
  return out


def render_prompts(args: argparse.Namespace, inputs: Inputs,
                   benchmarks: dict[str, Benchmark]) -> pipeline.PromptRenderer:
  """Each benchmark's prompts (the flags' prompt settings, else the run's, else the paper's),
  skipping and counting those that do not fit; returns the renderer (tokenizer and settings)."""
  tokenizer = load_tokenizer(inputs.model_dir)
  check_vocab(tokenizer, inputs.hf_config, inputs.model_dir)
  run_data = inputs.run_data
  data_cfg = pipeline.DataConfig(
      prompt_template=(args.prompt_template if args.prompt_template is not None
                       else run_data.get("prompt_template") or EVAL_TEMPLATE),
      use_chat_template=(args.chat_template if args.chat_template is not None
                         else bool(run_data.get("use_chat_template", True))),
      system_prompt=(args.system_prompt if args.system_prompt is not None
                     else run_data.get("system_prompt") or ""))
  renderer = pipeline.PromptRenderer(tokenizer, data_cfg)
  for name, bench in benchmarks.items():
    bench.examples, bench.prompt_skips = render_examples(
        bench.problems, renderer, max_new_tokens=args.max_new_tokens, context_tokens=inputs.context,
        max_prompt_tokens=args.max_prompt_tokens)
    if bench.prompt_skips:
      log.warning("%s: %d of %d prompts skipped (%s; context %d, max new tokens %d)", name,
                  sum(bench.prompt_skips.values()), len(bench.problems),
                  ", ".join(f"{k}={v}" for k, v in sorted(bench.prompt_skips.items())),
                  inputs.context, args.max_new_tokens)
    if not bench.examples:
      skipped = {**bench.load_skips, **bench.prompt_skips}
      raise UserError(f"--benchmarks {name}: no usable problem in {bench.source} (skipped: "
                      f"{', '.join(f'{k}={v}' for k, v in sorted(skipped.items())) or 'none'})")
  return renderer


def prepare_out_dir(args: argparse.Namespace, inputs: Inputs) -> Path:
  """--out (default RUN_DIR/eval/step_<N> with --checkpoint, else eval/<model dir name>),
  created before the model loads."""
  ref = inputs.ref
  out_dir = Path(args.out) if args.out else (
      ref.run_dir / "eval" / f"step_{ref.step}" if ref else Path("eval") / inputs.model_dir.name)
  check_output_paths(output_dir(out_dir, "--out"), "--out",
                     files=("samples.jsonl", "results.json", "results.md"))
  return out_dir


def load_sampler(args: argparse.Namespace, inputs: Inputs, tokenizer) -> tuple[Any, Sampler]:
  """The policy (--model, with the checkpoint's weights restored) as sampler params, and the
  sampler of the flags' settings."""
  ref = inputs.ref
  model = load_policy(inputs.model_dir, dtype=args.dtype, checkpoint=ref, lora=inputs.lora,
                      seed=args.seed)
  if ref:
    log.info("restored the %s of step %d from %s", "LoRA adapters (merged)" if inputs.lora else
             "trained weights", ref.step, ref.step_dir)
  params = nnx.split(model)
  sampler = Sampler(SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                                   max_new_tokens=args.max_new_tokens,
                                   continuous=args.continuous_slots > 0,
                                   slots=max(1, args.continuous_slots)),
                    eos_ids=stop_token_ids(tokenizer, model.cfg, model_dir=inputs.model_dir),
                    pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
  return params, sampler


def temporary_samples_file(out_dir: Path) -> Path:
  """Where this evaluation writes its samples. The file replaces samples.jsonl only with the
  new results, so an interrupted evaluation leaves an earlier one in the directory whole and
  consistent; those an interrupted evaluation left are removed."""
  for stale in out_dir.glob(".samples.jsonl.tmp-*"):
    stale.unlink()
  return out_dir / f".samples.jsonl.tmp-{os.getpid()}"


def evaluate_benchmarks(args: argparse.Namespace, benchmarks: dict[str, Benchmark], params,
                        sampler: Sampler, tokenizer, reward_cfg: RewardConfig, samples_path: Path
                        ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
  """Samples and scores each benchmark, its records written to `samples_path`; returns the
  metrics per benchmark and the reward checks' stats."""
  ks = table_ks(args.samples)
  key = jax.random.key(args.seed)
  per_benchmark: dict[str, dict[str, Any]] = {}
  with RewardScorer(reward_cfg) as scorer, open(samples_path, "w") as samples_file:
    for name, bench in benchmarks.items():
      bench_start = time.perf_counter()
      exs = bench.examples
      bar = Progress(len(exs), name, enabled=not args.no_progress, every=1)
      result = evaluate_examples(sampler, params, exs, tokenizer, scorer,
                                 num_samples=args.samples, key=_bench_key(key, name),
                                 prompts_per_batch=min(args.prompts_per_batch, len(exs)),
                                 progress=bar)
      bar.close()
      for r in result.records:
        samples_file.write(json.dumps({"benchmark": name, **r}, ensure_ascii=False) + "\n")
      samples_file.flush()
      m = benchmark_metrics(result, bench.prompt_skips, ks)
      m.update(source=bench.source, load_skipped=bench.load_skips,
               seconds=round(time.perf_counter() - bench_start, 3))
      per_benchmark[name] = m
      log.info("%s: acc %s%% fmt %s%% over %d problems x %d samples (%.1fs)", name,
               percent(m["accuracy"]), percent(m["format"]), m["problems"], args.samples,
               m["seconds"])
    reward_stats = scorer.stats
  return per_benchmark, reward_stats


def settings_record(args: argparse.Namespace, inputs: Inputs, benchmarks: dict[str, Benchmark],
                    renderer: pipeline.PromptRenderer, reward_cfg: RewardConfig) -> dict[str, Any]:
  """The "config" of results.json: what was evaluated, and how."""
  ref, lora, data_cfg = inputs.ref, inputs.lora, renderer.cfg
  return {
      "model": str(inputs.model_dir), "checkpoint": str(ref.step_dir) if ref else None,
      "checkpoint_step": ref.step if ref else None,
      "lora": dataclasses.asdict(lora) if lora else None,
      "full_finetune": ref.full_finetune if ref else None,
      "benchmarks": args.benchmark_names,
      "benchmark_files": {name: b.source for name, b in benchmarks.items()}, "limit": args.limit,
      "samples": args.samples, "temperature": args.temperature, "top_p": args.top_p,
      "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
      "context_tokens": inputs.context, "seed": args.seed,
      "prompts_per_batch": args.prompts_per_batch,
      "dtype": args.dtype, "prompt_template": data_cfg.prompt_template,
      "use_chat_template": renderer.chat, "system_prompt": data_cfg.system_prompt,
      "rendered_prompt": renderer.text("{problem}"),
      "reward": dataclasses.asdict(reward_cfg), "pass_ks": list(table_ks(args.samples))}


def write_results(args: argparse.Namespace, inputs: Inputs, results: dict[str, Any], out_dir: Path,
                  samples_tmp: Path) -> None:
  """samples.jsonl (the temporary file renamed), results.json and results.md in `out_dir`;
  prints the table and where the files are."""
  per_benchmark = results["benchmarks"]
  table = markdown_table(per_benchmark, results["average"], table_ks(args.samples))
  ref = inputs.ref
  title = f"{inputs.model_dir}" + (f" + {ref.step_dir} (step {ref.step})" if ref else "")
  settings = (f"{args.samples} samples per problem, temperature {args.temperature}, top-p "
              f"{args.top_p}, max {args.max_new_tokens} new tokens, seed {args.seed}")
  note = skip_note(per_benchmark, inputs.context, args.max_prompt_tokens, args.max_new_tokens)
  results_md = (
      f"# Evaluation of {title}\n\n{settings}. Acc, Fmt and pass@k in %; Average is the "
      f"unweighted mean over benchmarks.\n\n{table}\n" + (f"\n{note}\n" if note else ""))
  os.replace(samples_tmp, out_dir / "samples.jsonl")
  write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
  write_text_atomic(out_dir / "results.md", results_md)
  print(table + (f"\n\n{note}" if note else ""), flush=True)
  print(f"results: {out_dir / 'results.md'}, {out_dir / 'results.json'}, "
        f"{out_dir / 'samples.jsonl'}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)
  return commandline.run_main(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
  sys.exit(main())

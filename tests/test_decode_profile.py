"""benchmarks/_profile.py (the profile reader update_gpu.py and rollout.py share) and
benchmarks/rollout.py --profile: the parts of a decode step on bench-tiny, on the CPU."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _profile as prof  # noqa: E402
import rollout  # noqa: E402


def test_scopes_are_whole_components_also_inside_transformations():
  assert prof.in_scope("jit(f)/while/body/attention/dot_general", "attention")
  assert prof.in_scope("transpose(jvp(lm_head))/mul", "lm_head")
  assert not prof.in_scope("jit(f)/my_attention_x/dot_general", "attention")
  assert prof.first_scope("jit(f)/projections/attention/add", ("attention", "projections")) == "attention"
  assert prof.first_scope(None, ("attention",)) == "rest"
  assert prof.first_scope("jit(f)/add", ("attention",), "outside") == "outside"


def first(x):
  return x * 2.0 + 1.0


def second(x):
  return x * 3.0 + 1.0


def merged(*parts: dict) -> dict:
  return {key: (set().union(*(p[key] for p in parts)) if key == "ids" else
                {k: v for p in parts for k, v in p[key].items()}) for key in parts[0]}


def test_the_ops_of_two_programs_are_told_apart_in_a_trace():
  programs = [jax.jit(fn).lower(jnp.ones(8)).compile() for fn in (first, second)]
  ids = [prof.module_id(p.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto())
         for p in programs]
  assert None not in ids and ids[0] != ids[1]
  parts = merged(*(prof.op_parts([program], lambda ins, part=part: [part] * len(ins))
                   for program, part in zip(programs, ("first", "second"))))
  names = {name for name, *_ in prof.hlo_instructions(programs[0].as_text())}
  assert {(ids[0], name) for name in names} <= set(parts["by_id"])
  x = jnp.ones(8)
  split = prof.time_by_part(lambda: [p(x) for p in programs], parts, default="")
  assert set(split) == {"first", "second"}, split  # one op name in each, told apart
  assert all(seconds > 0 for seconds in split.values())


def test_an_event_of_a_program_under_another_id_goes_by_its_module():
  parts = {"by_id": {(4, "fusion"): "a"}, "ids": {4}, "by_module": {("jit_f", "fusion"): "b"},
           "by_name": {"fusion": "c"}}
  assert prof.part_of_event({"program_id": 4, "hlo_module": "jit_f"}, "fusion", parts, "x") == "a"
  assert prof.part_of_event({"program_id": 4}, "copy", parts, "x") == "x"
  # loaded from the persistent compilation cache: the trace's id is not the module's
  assert prof.part_of_event({"program_id": 9, "hlo_module": "jit_f"}, "fusion", parts, "x") == "b"
  assert prof.part_of_event({"program_id": 9, "hlo_module": "jit_g"}, "fusion", parts, "x") == "x"
  assert prof.part_of_event({}, "fusion", parts, "x") == "c"


def test_decode_parts_of_a_literal_program():
  ins = [("a", "add", "jit(_generate)/while/body/while/body/closed_call/attention/dot_general", "body"),
         ("b", "fusion", "jit(_generate)/while/body/projections/dot_general", "body"),
         ("c", "copy", None, "body"),
         ("d", "fusion", "jit(_generate)/vmap()/request_keys/while/body/closed_call/add", "keys_body"),
         ("e", "fusion", "jit(_generate)/sampling/while/body/add", "choose_body"),
         ("f", "copy", None, "entry"),
         ("g", "fusion", "jit(run_block)/while/body/sampling/sort", "body2"),
         ("h", "fusion", "jit(run_block)/while/body/lm_head/dot", "body2"),
         ("i", "fusion", "jit(run_block)/while/body/closed_call/cache_write/dus", "body2"),
         ("j", "fusion", "jit(run_block)/while/body/closed_call/add", "body2")]
  assert rollout.decode_parts(ins) == ["attention", "projections", "rest", "outside", "outside", "outside",
                                       "sampling", "lm_head", "cache_write", "rest"]


def test_known_bandwidths():
  assert prof.hbm_bandwidth("NVIDIA H200") == 4.8e12
  assert prof.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
  assert prof.hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
  assert prof.hbm_bandwidth("cpu") is None
  assert prof.hbm_bandwidth("cpu", 100.0) == 100e9


MS = r"([\d.]+) ms"


@pytest.mark.slow
def test_rollout_profile_on_cpu(capsys):
  cache = jax.config.jax_enable_compilation_cache
  try:
    rollout.main(["--preset", "bench-tiny", "--prompts", "2", "--samples", "2", "--new-tokens", "16",
                  "--max-prompt-tokens", "64", "--slots", "2", "--rounds", "1", "--profile",
                  "--profile-tokens", "9", "--hbm-gbps", "20"])
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
  out = capsys.readouterr().out
  # bench-tiny in float32: 4 layers of q/k/v (+ biases), o, gate/up/down and two norms, the
  # final norm and the tied head (the embedding table read as the head).
  d, kv, f, v = 256, 128, 704, 1024
  layer = d * d + d + 2 * (d * kv + kv) + d * d + 3 * d * f + 2 * d
  assert f"weights read per decode step {(4 * layer + d + v * d) * 4 / 1e6:.3f} MB at 20 GB/s" in out
  floor_ms = (4 * layer + d + v * d) * 4 / 20e9 * 1e3
  for side, steps in (("static", 8), ("continuous", None)):
    line = re.search(rf"profile {side}: (\d+) decode steps traced, [\d.]+ rows a step on average; "
                     rf"device op time per decode step {MS}: (.*)\n", out)
    assert line, out
    if steps is not None:  # 9 tokens: the first from the prefill, then one block of 8 steps
      assert int(line.group(1)) == steps
    total = float(line.group(2))
    parts = dict(re.findall(rf"(\w+) {MS} \(\d+%\)", line.group(3)))
    assert list(parts) == list(rollout.DECODE_PARTS), parts
    assert total > 0 and float(parts["attention"]) > 0 and float(parts["projections"]) > 0
    assert abs(sum(float(ms) for ms in parts.values()) - total) <= 0.0005 * len(parts) + 1e-9
    ratio = re.search(rf"profile {side}: outside the decode steps [\d.]+ ms .*; ([\d.]+)x the "
                      rf"weight-read floor {MS}", out)
    assert ratio, out
    assert float(ratio.group(2)) == pytest.approx(floor_ms, abs=5e-4)
    assert float(ratio.group(1)) == pytest.approx(total / float(ratio.group(2)), rel=0.05, abs=0.06)

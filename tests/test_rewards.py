"""Tests of answer extraction, checking, the parallel scorer and pass@k."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from epgrpo_jax import rewards as R

# (gold, answer) pairs a mathematician calls equal.
EQUIVALENT = [
    (r"\frac{1}{2}", "0.5"),
    (r"\frac{1}{2}", r"\dfrac12"),
    (r"\frac{1}{2}", "1/2"),
    (r"\frac12", r"\tfrac{1}{2}"),
    (r"\text{(B)}", "(B)"),
    (r"\text{(B)}", "B"),
    (r"\text{(B)}", r"\textbf{(B)}"),
    (r"5\text{ cm}", "5"),
    ("5", r"5\text{ cm}"),
    (r"10^\circ", "10"),
    ("90", r"90^{\circ}"),
    (r"\$5", "5"),
    (r"\$18.90", "18.90"),
    ("025", "25"),
    (27.0, "27"),
    (104, "104"),
    (r"10,\!080", "10080"),
    ("1,-2", "-2, 1"),
    (r"x \in [-2,7]", "[-2,7]"),
    ("p - q", "-q + p"),
    (r"3\sqrt{13}", r"\sqrt{117}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)"),
    ("4.5e33", r"4.5\times 10^{33}"),
    ("1e-5", "10^{-5}"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("0.15", r"\frac{3}{20}"),
    (r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}", r"\begin{pmatrix} 0.2 \\ -3.6 \end{pmatrix}"),
    (r"1\frac{4}{5}", "1.8"),
    ("y = 2x + 3", "2x+3"),
    (r"\text{Evelyn}", "Evelyn"),
    ("6 - 5i", "6-5i"),
    (r"137 \frac{1}{2}", "275/2"),
    ("2.88e-19", r"2.88 \times 10^{-19}\ \mathrm{J}"),
    (r"\{1\pm\sqrt{5},-2\}", r"-2, 1+\sqrt{5}, 1-\sqrt{5}"),
    (r"864 \mbox{ inches}^2", "864"),
    (r"(-\infty, 0]", r"(-\infty,0]"),
]

# (gold, answer) pairs that are close but wrong.
NEAR_MISS = [
    (r"\frac{1}{2}", r"\frac{1}{3}"),
    (r"\frac{1}{2}", "0.51"),
    (r"\text{(B)}", "(C)"),
    ("25", "26"),
    ("025", "250"),
    (27.0, "27.5"),
    ("10080", "1008"),
    ("1,-2", "1, 2"),
    ("[-2,7]", "(-2,7)"),
    ("p - q", "q - p"),
    (r"3\sqrt{13}", r"3\sqrt{12}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi)"),
    ("4.5e33", r"4.5\times 10^{32}"),
    ("2.88e-19", "1.325e-27"),  # math-verify alone says equal (6-decimal rounding)
    ("2.88e-19", r"1.325\times 10^{-27}"),
    ("x^2+2x+1", "(x-1)^2"),
    (r"\text{Evelyn}", r"\text{Navin}"),
    (r"2\sqrt{2}", r"\sqrt{2}"),
    (r"(2,\infty)", r"[2,\infty)"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}"),
    ("6 - 5i", "6 + 5i"),
    ("0.15", "0.16"),
    ("1e-5", "1e-6"),
    (r"\frac{\sqrt{3}}{3}", r"\sqrt{3}"),
    (r"90^\circ", "45"),
    ("-3", "3"),
    (r"\text{east}", r"\text{west}"),
    ("0.0000672", "0.0000673"),
]

ADVERSARIAL = r"\boxed{2^{2^{2^{2^{2^{100}}}}}}"


def raising_checker(answer: str, gold: str) -> bool:
  raise RuntimeError("checker failure")


def crashing_checker(answer: str, gold: str) -> bool:
  os._exit(3)


@pytest.fixture(scope="module")
def scorer():
  with R.RewardScorer(R.RewardConfig(timeout_s=10.0), num_workers=2) as s:
    yield s


# -- extraction


@pytest.mark.parametrize("text, expected", [
    (r"so $\boxed{5}$.", "5"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{\text{(B)}}", r"\text{(B)}"),
    (r"\fbox{7}", "7"),
    (r"The answer is $\boxed 5$.", "5"),
    (r"\boxed{3} and then \boxed{4", "3"),  # truncated last box: the earlier one
    (r"\boxed{ 12 }", "12"),
    (r"\boxed{}", None),
    ("no box here: 42", None),
    (r"\boxedx{3}", None),
    ("", None),
])
def test_extract_boxed(text, expected):
  assert R.extract_boxed(text) == expected


def test_extract_answer_fallbacks():
  text = "We compute things.\nThe final answer is $\\frac{1}{2}$.\nThat's 3 things."
  assert R.extract_answer(text, R.RewardConfig()) == (None, False)
  assert R.extract_answer(text, R.RewardConfig(fallback="answer_is")) == ("\\frac{1}{2}", False)
  assert R.extract_answer(text, R.RewardConfig(fallback="last_number")) == ("3", False)
  assert R.extract_answer("so 1,234 and 5.5", R.RewardConfig(fallback="any")) == ("5.5", False)
  assert R.extract_answer(r"x \boxed{2}", R.RewardConfig(fallback="any")) == ("2", True)
  with pytest.raises(ValueError, match="reward.fallback"):
    R.RewardConfig(fallback="first_number")


def test_parse_gold():
  assert R.parse_gold(27.0).raw == "27"
  assert R.parse_gold(np.float32(2.5)).raw == "2.5"
  assert R.parse_gold(np.int64(70)).raw == "70"
  g = R.parse_gold("025")
  assert g.raw == "025" and g.number == (25.0, 25)
  assert R.parse_gold(" 4.5e33 ").text == r"4.5\times 10^{33}"
  assert R.parse_gold("025") is g  # cached
  assert R.parse_gold(g) is g
  assert g.parsed  # math-verify parses it
  for bad in ("", "  "):
    with pytest.raises(ValueError):
      R.parse_gold(bad)
  with pytest.raises(TypeError):
    R.parse_gold(True)
  with pytest.raises(TypeError):
    R.parse_gold([1])


# -- single checks


PURE_MATH_VERIFY = R.RewardConfig(fast_path=False, numeric_rel_tol=-1.0)


@pytest.mark.parametrize("gold, answer", EQUIVALENT)
def test_equivalent_forms(gold, answer):
  assert R.check(f"... so the answer is $\\boxed{{{answer}}}$.", gold)
  assert R.check(answer, gold, cfg=R.RewardConfig(fast_path=False))
  assert R.check(answer, gold, cfg=PURE_MATH_VERIFY)


@pytest.mark.parametrize("gold, answer", NEAR_MISS)
def test_near_misses(gold, answer):
  assert not R.check(f"... so the answer is $\\boxed{{{answer}}}$.", gold)
  assert not R.check(answer, gold, cfg=R.RewardConfig(fast_path=False))


@pytest.mark.parametrize("gold, answer", [("2.88e-19", "1.325e-27"), ("0.0000672", "0.0000673")])
def test_small_numbers_are_compared_relatively(gold, answer):
  """math-verify alone rounds to 6 decimal places, so it equates these; the
  numeric rule (both sides plain numbers) does not."""
  assert R.check(answer, gold, cfg=PURE_MATH_VERIFY)
  assert not R.check(answer, gold)


def test_known_math_verify_leniency():
  """Characterisation, not a wish: math-verify accepts a percentage for the
  bare number either way (1% for gold 1), and an assignment for its value."""
  assert R.check(r"1\%", "1")
  assert R.check(r"10", r"10\%")
  assert R.check("x=5", "5")


def test_table_sizes():
  assert len(EQUIVALENT) >= 20 and len(NEAR_MISS) >= 20


def test_check_with_timeout_off_main_thread():
  """math-verify's own signal timeout fails off the main thread; ours does not."""
  out = {}

  def run():
    t0 = time.monotonic()
    out["ok"] = R.check(r"\boxed{\frac{2}{4}}", "0.5", timeout_s=20.0,
                        cfg=R.RewardConfig(fast_path=False))
    out["bad"] = R.check(ADVERSARIAL, "5", timeout_s=1.0)
    out["seconds"] = time.monotonic() - t0

  before = R.check_stats().get("timeouts", 0)
  t = threading.Thread(target=run)
  t.start()
  t.join(120)
  assert not t.is_alive()
  assert out["ok"] is True and out["bad"] is False
  assert R.check_stats()["timeouts"] == before + 1


# -- the scorer


def test_scorer_basic(scorer):
  completions = [r"\boxed{1/2}", "no answer", r"\boxed{3}", r"\boxed{0.5}", r"\boxed{4}",
                 r"\boxed{1/2}"]
  golds = [r"\frac12", "1", 3, 0.5, "5", r"\frac12"]
  res = scorer.submit(completions, golds).result(timeout=120)
  np.testing.assert_array_equal(res.accuracy, [1, 0, 1, 1, 0, 1])
  np.testing.assert_array_equal(res.format, [1, 0, 1, 1, 1, 1])
  np.testing.assert_array_equal(res.reward, res.accuracy)
  assert res.answers == ["1/2", None, "3", "0.5", "4", "1/2"]
  assert res.status == ["verified", "no_answer", "fast", "fast", "fast", "verified"]
  assert res.checked == 1  # the two identical (answer, gold) pairs are checked once
  assert (res.timeouts, res.errors, res.fast) == (0, 0, 3)
  assert scorer.stats.get("jax_in_worker", 0) == 0


def test_reward_weights(scorer):
  cfg = R.RewardConfig(accuracy_weight=1.0, format_weight=0.25, format_penalty=0.5,
                       fallback="last_number")
  res = scorer.score([r"\boxed{2}", r"\boxed{3}", "it is 2", "nothing"], [2, 2, 2, 2], cfg)
  np.testing.assert_allclose(res.accuracy, [1, 0, 1, 0])
  np.testing.assert_allclose(res.format, [1, 1, 0, 0])
  np.testing.assert_allclose(res.reward, [1.25, 0.25, 0.5, -0.5])
  assert res.reward.dtype == np.float32


def test_too_long_answer(scorer):
  res = scorer.score([r"\boxed{" + "1+" * 600 + "1}"], ["1201"])
  assert res.status == ["too_long"] and res.accuracy[0] == 0


def test_parallel_equals_serial(scorer):
  pairs = EQUIVALENT + NEAR_MISS
  cfg = R.RewardConfig(fast_path=False, timeout_s=20.0)
  completions = [f"Hence $\\boxed{{{a}}}$." for _, a in pairs]
  golds = [g for g, _ in pairs]
  parallel = scorer.score(completions, golds, cfg)
  serial = [R.check(c, g, cfg=cfg) for c, g in zip(completions, golds)]
  assert parallel.timeouts == 0 and parallel.errors == 0
  np.testing.assert_array_equal(parallel.accuracy, np.array(serial, np.float32))
  np.testing.assert_array_equal(parallel.accuracy[:len(EQUIVALENT)], 1)
  np.testing.assert_array_equal(parallel.accuracy[len(EQUIVALENT):], 0)


def test_async_submit_overlaps(scorer):
  f1 = scorer.submit([r"\boxed{x^2-1}"] * 4, ["(x-1)(x+1)"] * 4)
  f2 = scorer.submit([r"\boxed{\sqrt{8}}", r"\boxed{3}"], [r"2\sqrt{2}", "4"])
  assert f1.result(timeout=120).accuracy.tolist() == [1, 1, 1, 1]
  assert f2.result(timeout=120).accuracy.tolist() == [1, 0]


def test_adversarial_input_times_out_and_pool_recovers():
  with R.RewardScorer(R.RewardConfig(timeout_s=2.0), num_workers=1) as s:
    s.score([r"\boxed{1/2}"], ["0.5"])  # worker started
    t0 = time.monotonic()
    res = s.score([ADVERSARIAL, r"\boxed{9^{9^{9^{9}}}}", r"\boxed{3}"], ["5", "7", 3])
    seconds = time.monotonic() - t0
    assert res.accuracy.tolist() == [0, 0, 1]
    assert res.status[:2] == ["timeout", "timeout"] and res.timeouts == 2
    assert seconds < 2 * 2.0 + 60  # two deadlines plus a worker restart on a busy machine
    assert s.stats["timeouts"] == 2 and s.stats["restarts"] == 2
    after = s.score([r"\boxed{\frac{6}{8}}"], ["0.75"], R.RewardConfig(fast_path=False))
    assert after.accuracy.tolist() == [1] and after.status == ["verified"]


def test_raising_checker_scores_zero_and_is_counted():
  golds = ["1", "2"]
  completions = [r"\boxed{a}", r"\boxed{b}"]
  with R.RewardScorer(num_workers=1, checker=raising_checker) as s:
    res = s.score(completions, golds)
  assert res.accuracy.tolist() == [0, 0] and res.errors == 2
  assert res.status == ["error", "error"]
  inline = R.RewardScorer(num_workers=0, checker=raising_checker)
  res = inline.score(completions, golds)
  assert res.errors == 2 and res.accuracy.tolist() == [0, 0]


def test_crashing_worker_scores_zero_and_is_replaced():
  with R.RewardScorer(num_workers=1, checker=crashing_checker) as s:
    res = s.score([r"\boxed{a}", r"\boxed{b}"], ["1", "2"])
    assert res.status == ["error", "error"] and res.errors == 2
    assert s.stats["restarts"] == 2


def test_closed_scorer_refuses_work():
  s = R.RewardScorer(num_workers=1)
  s.close()
  with pytest.raises(RuntimeError, match="closed"):
    s.submit([r"\boxed{x}"], ["1"])


def test_mismatched_lengths(scorer):
  with pytest.raises(ValueError, match="2 completions but 1 golds"):
    scorer.submit(["a", "b"], ["1"])


def test_module_is_import_light():
  """Loaded on its own (as the workers load it), the rewards package imports neither
  JAX nor sympy/math-verify."""
  path = Path(R.__file__).resolve()
  code = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('rw', {str(path)!r})\n"
          "m = importlib.util.module_from_spec(spec); sys.modules['rw'] = m\n"
          "spec.loader.exec_module(m)\n"
          "print(sorted(k for k in ('jax', 'sympy', 'math_verify') if k in sys.modules))")
  out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


# -- pass@k


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
  samples = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_matches_brute_force(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      assert math.isclose(R.pass_at_k(n, c, k), _brute_pass_at_k(n, c, k), abs_tol=1e-12)


def test_pass_at_k_vectorised_and_edges():
  n = np.array([16, 16, 16, 16, 10])
  c = np.array([0, 1, 8, 16, 3])
  got = R.pass_at_k(n, c, 4)
  expected = [1 - math.comb(int(a) - int(b), 4) / math.comb(int(a), 4) for a, b in zip(n, c)]
  np.testing.assert_allclose(got, expected, rtol=1e-12)
  assert got.shape == (5,)
  assert R.pass_at_k(16, 0, 16) == 0.0 and R.pass_at_k(16, 1, 16) == 1.0
  assert R.pass_at_k(16, 3, 1) == pytest.approx(3 / 16)
  # Stable where the binomials overflow a float.
  assert 0.0 < R.pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
  assert np.asarray(R.pass_at_k(np.full((2, 3), 8), np.zeros((2, 3), int), 2)).shape == (2, 3)
  # Float counts (e.g. sums of 0/1 accuracies) are fine when whole.
  np.testing.assert_allclose(R.pass_at_k(np.full(2, 8), np.array([2.0, 0.0], np.float32), 4),
                             [R.pass_at_k(8, 2, 4), 0.0])
  with pytest.raises(ValueError, match="whole"):
    R.pass_at_k(8, 2.5, 4)
  with pytest.raises(ValueError):
    R.pass_at_k(4, 2, 5)
  with pytest.raises(ValueError):
    R.pass_at_k(4, 5, 1)
  with pytest.raises(ValueError):
    R.pass_at_k(4, 2, 0)


def length_parity_reward(completions: list[str], answers: list[str]) -> list[float]:
  """A custom reward for the `reward.function` tests: 1 for an even number of characters."""
  return [float(len(c) % 2 == 0) for c in completions]


def test_custom_reward_function_runs_in_process_without_workers():
  cfg = R.RewardConfig(function=f"{__name__}:length_parity_reward")
  with R.RewardScorer(cfg) as s:
    assert s.num_workers == 0 and s.stats == {}
    res = s.score(["ab", "abc", r"\boxed{7}"], ["1", 2, "7"])
  assert res.reward.tolist() == [1.0, 0.0, 0.0]  # the function's value, not math checking
  assert res.accuracy.tolist() == [1.0, 0.0, 0.0] and res.status == ["custom"] * 3
  with R.RewardScorer(num_workers=0) as s:  # a per-call config switches to the function too
    assert s.score(["ab"], ["1"], cfg).reward.tolist() == [1.0]


def test_custom_reward_function_errors_are_one_line():
  with pytest.raises(ValueError, match="expected 'module:function'"):
    R.RewardConfig(function="no_colon")
  with pytest.raises(ValueError, match="cannot import"):
    R.RewardScorer(R.RewardConfig(function="no_such_module_xyz:f"))


def one_reward_only(completions: list[str], answers: list[str]) -> list[float]:
  return [0.5]


def picky_reward(completions: list[str], answers: list[str]) -> list[float]:
  """Raises on a completion containing "boom"; NaN for "nan"; else 1."""
  if any("boom" in c for c in completions):
    raise RuntimeError("boom")
  return [float("nan") if c == "nan" else 1.0 for c in completions]


def test_custom_reward_failures_score_zero_and_are_counted(caplog):
  res = R.custom_rewards(f"{__name__}:picky_reward", ["ok", "boom!", "nan", "fine"], ["1"] * 4)
  assert res.reward.tolist() == [1.0, 0.0, 0.0, 1.0]
  assert res.status == ["custom", "error", "error", "custom"] and res.errors == 2
  assert "failed on 2 of 4 completions" in caplog.text
  # One value for a batch of two: retried one at a time, where it gives one value each.
  res = R.custom_rewards(f"{__name__}:one_reward_only", ["a", "b"], ["1", "2"])
  assert res.reward.tolist() == [0.5, 0.5] and res.errors == 0

"""The held-out accuracy's standard error (over problems, each scored over its k samples), the
paired gain between two evaluations of the same problems, and the line `train` prints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from epgrpo_jax.evaluation.heldout import EvalResult, paired_gain, standard_error
from epgrpo_jax.train import accuracy_line


def result(correct) -> EvalResult:
  correct = np.asarray(correct, np.float32)
  return EvalResult(correct=correct, boxed=np.ones_like(correct), records=[])


def test_standard_error_literal():
  # Problem means 1, 0.5, 0: mean 0.5, sample SD 0.5, SE 0.5 / sqrt(3).
  assert standard_error(np.array([1.0, 0.5, 0.0])) == pytest.approx(0.5 / math.sqrt(3))
  assert standard_error(np.array([0.7])) == 0.0 and standard_error(np.array([])) == 0.0


def test_summary_counts_problems_not_samples():
  # 2 problems x 4 samples, one always right, one always wrong: the 8 samples are not 8
  # independent draws; the SE is that of 2 problems (SD 0.707 / sqrt(2) = 0.5).
  summary = result([[1, 1, 1, 1], [0, 0, 0, 0]]).summary()
  assert summary["accuracy"] == 0.5 and summary["accuracy_se"] == pytest.approx(0.5)
  assert result(np.zeros((0, 4))).summary()["accuracy_se"] == 0.0


def test_paired_gain_literal():
  before = result([[0, 0], [1, 0], [0, 0]])
  after = result([[1, 1], [1, 1], [0, 0]])  # per-problem gains 1, 0.5, 0
  assert paired_gain(before, after) == pytest.approx((0.5, 0.5 / math.sqrt(3)))
  # The same gain on every problem: no doubt about it, whatever the problems' spread.
  assert paired_gain(result([[0, 0], [1, 0]]), result([[1, 0], [1, 1]])) == pytest.approx((0.5, 0.0))
  with pytest.raises(ValueError, match="3 problems before, 2 after"):
    paired_gain(before, result([[1, 1], [0, 0]]))


scores = hnp.arrays(np.float32, st.tuples(st.integers(2, 12), st.integers(1, 6)),
                    elements=st.sampled_from([0.0, 1.0]))


@settings(max_examples=settings.default.max_examples // 5)
@given(scores, st.data())
def test_paired_gain_invariants(a, data):
  b = data.draw(hnp.arrays(np.float32, a.shape, elements=st.sampled_from([0.0, 1.0])))
  gain, se = paired_gain(result(a), result(b))
  back, se_back = paired_gain(result(b), result(a))
  assert gain == pytest.approx(b.mean() - a.mean(), abs=1e-6) and back == pytest.approx(-gain)
  assert se == pytest.approx(se_back) and se >= 0
  assert paired_gain(result(a), result(a)) == (0.0, 0.0)
  # Shuffling the samples within a problem, or the problems, changes nothing.
  rng = np.random.default_rng(0)
  shuffled = rng.permuted(a, axis=1)[rng.permutation(a.shape[0])]
  assert result(shuffled).summary()["accuracy_se"] == pytest.approx(result(a).summary()["accuracy_se"])


def test_accuracy_line():
  line = accuracy_line({"accuracy": 0.414, "accuracy_se": 0.0112},
                       {"accuracy": 0.555, "accuracy_se": 0.0108},
                       {"accuracy": 0.141, "accuracy_se": 0.0149})
  assert line == "held-out accuracy: 41.4% ± 1.1 -> 55.5% ± 1.1 (+14.1 points ± 1.5)"

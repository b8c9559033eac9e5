"""Token-level EP-GRPO advantages (paper eqs. 3, 15-26; spec sections 1-5).

Shape suffixes: P prompts (groups), G responses per prompt, T padded response
length. Every statistic is taken per group over the masked (response) tokens;
padding never enters a statistic and every output is zero (or bucket 0) there.
All inputs are constants of the loss: `compute_advantages` stop-gradients them.

Decisions beyond the paper:
  * Zero variance is `std(r) < zero_std_tol`; such a group's outcome advantage
    is set to exactly 0 (its numerators are float noise), which is also what a
    group of one response (ddof=1 std undefined) gets.
  * tau of a response with zero total entropy is its positional progress
    `(t + 1) / |o_i|` over its masked tokens (0-based t), so its last token has
    tau = 1, like the cumulative-entropy tau, whose sum includes token t.
  * Every masked token of a group enters its bucket's statistics, including
    those whose anchor is 0 (s~ = 0). With the anchor switch off, a
    zero-variance group has d_i = 0 for all its responses, so all its buckets
    are constant and get z = 0: its progress advantage is exactly 0.
  * A bucket with one token, or whose values are all equal, gets z = 0 (the
    bucket statistics are shifted by the bucket minimum, so "all equal" is
    detected exactly, without float noise).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from epgrpo_jax.io.errors import UserError

VARIANTS: dict[str, dict[str, bool]] = {
    # Table IV. "-" anchors (no progress signal) are set off; they are unused.
    "grpo": dict(entropy_gate=False, progress_signal=False, zero_variance_anchor=False),
    "eg": dict(entropy_gate=True, progress_signal=False, zero_variance_anchor=False),
    "ips": dict(entropy_gate=False, progress_signal=True, zero_variance_anchor=False),
    "eg_ips": dict(entropy_gate=True, progress_signal=True, zero_variance_anchor=False),
    "ips_zvd": dict(entropy_gate=False, progress_signal=True, zero_variance_anchor=True),
    "epgrpo": dict(entropy_gate=True, progress_signal=True, zero_variance_anchor=True),
}


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """The advantage estimator and its hyper-parameters (EP-GRPO with the paper's defaults).

  `estimator` names an entry of the registry in `epgrpo_jax.estimators` (checked with the
  training config); the switches and gamma, lam, eta, num_buckets, reward_threshold are the
  options of `epgrpo`, the rest are shared by every estimator of the GRPO family.
  """

  estimator: str = "epgrpo"  # epgrpo | grpo | dr_grpo | rloo (docs/method.md, "Estimators")
  gamma: float = 5.0  # entropy-gate steepness (eq. 18)
  lam: float = 0.1  # implicit-signal scale lambda (eq. 20)
  eta: float = 0.2  # progress-advantage weight (eq. 25)
  num_buckets: int = 10  # K progress buckets (eq. 24)
  reward_threshold: float = 0.5  # theta_r of the zero-variance anchor (eq. 21)
  eps: float = 1e-6  # gate and bucket z-score stabiliser (eqs. 18, 24)
  delta: float = 1e-4  # outcome-advantage stabiliser (eq. 3)
  std_ddof: int = 1  # Bessel-corrected reward std, as TRL
  zero_std_tol: float = 1e-6  # std(r) below this is "zero variance"
  entropy_gate: bool = True  # the three switches of Table IV; all false is GRPO
  progress_signal: bool = True
  zero_variance_anchor: bool = True

  def __post_init__(self):
    if not (isinstance(self.estimator, str) and self.estimator):
      raise UserError(f"advantage.estimator: must be an estimator's name, got {self.estimator!r}")
    is_number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    for name in ("gamma", "lam", "eta", "eps", "delta", "zero_std_tol"):
      value = getattr(self, name)
      if not (is_number(value) and value > 0):
        raise UserError(f"advantage.{name}: must be a number > 0, got {value!r}")
    if not is_number(self.reward_threshold):
      raise UserError(f"advantage.reward_threshold: must be a number, got "
                       f"{self.reward_threshold!r}")
    if not (isinstance(self.num_buckets, int) and not isinstance(self.num_buckets, bool)
            and self.num_buckets >= 1):
      raise UserError(f"advantage.num_buckets: must be >= 1, got {self.num_buckets!r}")
    if isinstance(self.std_ddof, bool) or self.std_ddof not in (0, 1):
      raise UserError(f"advantage.std_ddof: must be 0 or 1, got {self.std_ddof!r}")
    for name in ("entropy_gate", "progress_signal", "zero_variance_anchor"):
      if not isinstance(getattr(self, name), bool):
        raise UserError(f"advantage.{name}: must be a bool, got {getattr(self, name)!r}")

  def replace(self, **kw: Any) -> AdvantageConfig:
    return dataclasses.replace(self, **kw)

  @classmethod
  def variant(cls, name: str, **overrides: Any) -> AdvantageConfig:
    """The Table IV variant `name` (a key of `VARIANTS`), with `overrides`."""
    if name not in VARIANTS:
      raise UserError(f"advantage.variant: unknown {name!r}; use one of {sorted(VARIANTS)}")
    return cls(**{**VARIANTS[name], **overrides})


@struct.dataclass
class Components:
  """The parts of the advantage, for metrics and the token heat map."""

  outcome: jax.Array  # A_i, [P, G] (eq. 3)
  gate: jax.Array  # W, [P, G, T] (eq. 18; 1 on tokens when the gate is off)
  outcome_token: jax.Array  # W * A_i, [P, G, T] (eq. 19)
  anchor: jax.Array  # d_i, [P, G] (eq. 21)
  signal: jax.Array  # s~ = d_i * s, [P, G, T] (eqs. 20, 22)
  tau: jax.Array  # progress in [0, 1], [P, G, T] (eq. 23)
  bucket: jax.Array  # int32 bucket in [0, K), [P, G, T]
  progress: jax.Array  # eta * z, [P, G, T] (eqs. 24-25)
  zero_variance: jax.Array  # bool, [P]


def group_deviation(rewards_PxG: jax.Array, *, ddof: int) -> tuple[jax.Array, jax.Array]:
  """`(r - mean(r), std(r))` per group: `(dev_PxG, std_P)`, the std `ddof`-corrected (0 when a
  group has too few responses for the ddof)."""
  r_PxG = rewards_PxG.astype(jnp.float32)
  num = r_PxG.shape[-1]
  dev_PxG = r_PxG - jnp.mean(r_PxG, axis=-1, keepdims=True)
  if num - ddof > 0:
    std_P = jnp.sqrt(jnp.sum(dev_PxG * dev_PxG, axis=-1) / (num - ddof))
  else:
    std_P = jnp.zeros(r_PxG.shape[:-1], jnp.float32)
  return dev_PxG, std_P


def outcome_advantage(rewards_PxG: jax.Array, *, delta: float, ddof: int,
                      zero_std_tol: float) -> tuple[jax.Array, jax.Array]:
  """GRPO's group-normalised reward (eq. 3): `(A_PxG, zero_variance_P)`.

  `A = (r - mean(r)) / (std(r) + delta)` with `ddof`-corrected std. Groups with
  `std < zero_std_tol`, or too few responses for the ddof, are zero-variance
  and get A = 0 exactly.
  """
  dev_PxG, std_P = group_deviation(rewards_PxG, ddof=ddof)
  zero_variance_P = std_P < zero_std_tol
  adv_PxG = jnp.where(zero_variance_P[:, None], 0.0, dev_PxG / (std_P[:, None] + delta))
  return adv_PxG, zero_variance_P


def centred_advantage(rewards_PxG: jax.Array, *, ddof: int,
                      zero_std_tol: float) -> tuple[jax.Array, jax.Array]:
  """Dr. GRPO's unscaled advantage `A = r - mean(r)`: `(A_PxG, zero_variance_P)`.

  No division by the std (Liu et al., 2025). Zero-variance groups (as in
  `outcome_advantage`) get A = 0 exactly, not the mean's rounding residue.
  """
  dev_PxG, std_P = group_deviation(rewards_PxG, ddof=ddof)
  zero_variance_P = std_P < zero_std_tol
  return jnp.where(zero_variance_P[:, None], 0.0, dev_PxG), zero_variance_P


def leave_one_out_advantage(rewards_PxG: jax.Array, *, ddof: int,
                            zero_std_tol: float) -> tuple[jax.Array, jax.Array]:
  """RLOO's advantage `A_i = r_i - mean_{j != i} r_j`: `(A_PxG, zero_variance_P)`.

  Each response's baseline is the mean reward of the other G - 1 responses of
  its group (Ahmadian et al., 2024). Zero-variance groups (as in
  `outcome_advantage`; every group when G = 1) get A = 0 exactly.
  """
  r_PxG = rewards_PxG.astype(jnp.float32)
  num = r_PxG.shape[-1]
  _, std_P = group_deviation(r_PxG, ddof=ddof)
  zero_variance_P = std_P < zero_std_tol
  if num > 1:
    others_PxG = (jnp.sum(r_PxG, axis=-1, keepdims=True) - r_PxG) / (num - 1)
    adv_PxG = r_PxG - others_PxG
  else:
    adv_PxG = jnp.zeros_like(r_PxG)
  return jnp.where(zero_variance_P[:, None], 0.0, adv_PxG), zero_variance_P


def token_advantage(adv_PxG: jax.Array, mask_PxGxT: jax.Array) -> jax.Array:
  """A response's advantage on each of its tokens, 0 on padding: `adv_PxGxT`."""
  return jnp.where(mask_PxGxT, adv_PxG[..., None], 0.0)


def entropy_gate(entropy_PxGxT: jax.Array, mask_PxGxT: jax.Array, *, gamma: float,
                 eps: float) -> jax.Array:
  """Entropy gate W (eqs. 16-18); 0 on padding.

  `W = sigmoid(gamma * (H - mu_H) / (sigma_H + eps))`, with mu_H and the
  population std sigma_H over all masked tokens of the group. The entropies are
  shifted by the group's minimum first, so a group whose tokens share one entropy
  value gets exactly `W = sigmoid(0) = 0.5` (no rounding residue over `eps`).
  """
  low_P = jnp.min(jnp.where(mask_PxGxT, entropy_PxGxT, jnp.inf), axis=(1, 2))
  low_P = jnp.where(jnp.isfinite(low_P), low_P, 0.0)
  h_PxGxT = jnp.where(mask_PxGxT, entropy_PxGxT - low_P[:, None, None], 0.0)
  count_P = jnp.maximum(jnp.sum(mask_PxGxT, axis=(1, 2)), 1).astype(jnp.float32)
  mu_P = jnp.sum(h_PxGxT, axis=(1, 2)) / count_P
  dev_PxGxT = jnp.where(mask_PxGxT, h_PxGxT - mu_P[:, None, None], 0.0)
  sigma_P = jnp.sqrt(jnp.sum(dev_PxGxT * dev_PxGxT, axis=(1, 2)) / count_P)
  gate_PxGxT = jax.nn.sigmoid(gamma * dev_PxGxT / (sigma_P[:, None, None] + eps))
  return jnp.where(mask_PxGxT, gate_PxGxT, 0.0)


def anchor_sign(rewards_PxG: jax.Array, outcome_PxG: jax.Array, zero_variance_P: jax.Array,
                *, reward_threshold: float, zero_variance_anchor: bool) -> jax.Array:
  """The anchor d_i (eq. 21).

  `sign(A_i)` in groups with reward variance; in zero-variance groups
  `sign(r_i - reward_threshold)` when `zero_variance_anchor` (ZVD), else 0.
  """
  if zero_variance_anchor:
    degraded_PxG = jnp.sign(rewards_PxG.astype(jnp.float32) - reward_threshold)
  else:
    degraded_PxG = jnp.zeros_like(outcome_PxG)
  return jnp.where(zero_variance_P[:, None], degraded_PxG, jnp.sign(outcome_PxG))


def anchored_signal(logp_PxGxT: jax.Array, logp_ref_PxGxT: jax.Array, anchor_PxG: jax.Array,
                    mask_PxGxT: jax.Array, *, lam: float) -> jax.Array:
  """The anchored implicit signal s~ = d_i * lam * (log pi - log pi_ref) (eqs. 20, 22)."""
  s_PxGxT = lam * (logp_PxGxT - logp_ref_PxGxT)
  return jnp.where(mask_PxGxT, anchor_PxG[..., None] * s_PxGxT, 0.0)


def entropy_progress(entropy_PxGxT: jax.Array, mask_PxGxT: jax.Array, *,
                     num_buckets: int) -> tuple[jax.Array, jax.Array]:
  """Cumulative-entropy progress and its bucket (eqs. 23-24): `(tau, bucket)`.

  `tau_t = S_t / S_|o|` with `S_t = sum_{k<=t} H_k` over the masked tokens of
  a response (negative entropies, float noise, count as 0); a response with
  zero total entropy uses positional progress `(t + 1) / |o_i|`. The bucket is
  `min(floor(tau * K), K - 1)`, decided on `S_t * K` against `b * S_|o|` so
  that the division's rounding cannot move a token across a boundary.
  Padding gets tau = 0 and bucket 0.
  """
  h_PxGxT = jnp.where(mask_PxGxT, jnp.maximum(entropy_PxGxT, 0.0), 0.0)
  cum_PxGxT = jnp.cumsum(h_PxGxT, axis=-1)
  pos_PxGxT = jnp.cumsum(mask_PxGxT.astype(jnp.float32), axis=-1)
  has_entropy_PxGx1 = cum_PxGxT[..., -1:] > 0
  num_PxGxT = jnp.where(has_entropy_PxGx1, cum_PxGxT, pos_PxGxT)
  den_PxGx1 = jnp.maximum(num_PxGxT[..., -1:], 1e-30)  # the total; 0 only for empty rows
  tau_PxGxT = jnp.clip(num_PxGxT / den_PxGx1, 0.0, 1.0)
  # floor(tau * K) from the rounded quotient, then corrected by exact comparisons.
  guess_PxGxT = jnp.clip(jnp.floor(tau_PxGxT * num_buckets), 0, num_buckets - 1)
  scaled_PxGxT = num_PxGxT * num_buckets
  guess_PxGxT = guess_PxGxT + (scaled_PxGxT >= (guess_PxGxT + 1) * den_PxGx1)
  guess_PxGxT = guess_PxGxT - (scaled_PxGxT < guess_PxGxT * den_PxGx1)
  bucket_PxGxT = jnp.clip(guess_PxGxT, 0, num_buckets - 1).astype(jnp.int32)
  return (jnp.where(mask_PxGxT, tau_PxGxT, 0.0), jnp.where(mask_PxGxT, bucket_PxGxT, 0))


def bucket_zscore(signal_PxGxT: jax.Array, bucket_PxGxT: jax.Array, mask_PxGxT: jax.Array, *,
                  num_buckets: int, eps: float) -> jax.Array:
  """Z-score of the signal within each (group, bucket) (eq. 24); 0 on padding.

  `z = (x - mean_k) / (std_k + eps)` with the population std of bucket k of
  the group, pooled over all G responses. One segment reduction per moment,
  segment id `group * K + bucket` (padding goes to an extra, dropped segment).
  Buckets with one token or with all-equal values give z = 0.
  """
  num_p = signal_PxGxT.shape[0]
  num_seg = num_p * num_buckets + 1
  group_PxGxT = jnp.arange(num_p, dtype=jnp.int32)[:, None, None]
  seg_N = jnp.where(mask_PxGxT, group_PxGxT * num_buckets + bucket_PxGxT,
                    num_seg - 1).reshape(-1)
  x_N = jnp.where(mask_PxGxT, signal_PxGxT, 0.0).reshape(-1)
  w_N = mask_PxGxT.reshape(-1).astype(jnp.float32)
  segment_sum = functools.partial(jax.ops.segment_sum, segment_ids=seg_N, num_segments=num_seg)
  # Shift by the bucket minimum: exact zeros for constant buckets, better conditioning.
  low_S = jax.ops.segment_min(jnp.where(w_N > 0, x_N, jnp.inf), seg_N, num_segments=num_seg)
  y_N = x_N - jnp.where(jnp.isfinite(low_S), low_S, 0.0)[seg_N]
  count_S = segment_sum(w_N)
  mean_S = segment_sum(y_N * w_N) / jnp.maximum(count_S, 1.0)
  dev_N = (y_N - mean_S[seg_N]) * w_N
  std_S = jnp.sqrt(segment_sum(dev_N * dev_N) / jnp.maximum(count_S, 1.0))
  ok_S = (count_S > 1) & (std_S > 0)
  z_N = jnp.where(ok_S[seg_N] & (w_N > 0), dev_N / (std_S[seg_N] + eps), 0.0)
  return z_N.reshape(signal_PxGxT.shape)


def final_advantage(outcome_token_PxGxT: jax.Array, progress_PxGxT: jax.Array,
                    mask_PxGxT: jax.Array) -> jax.Array:
  """A_final = A_outcome + A_progress (eq. 26); 0 on padding."""
  return jnp.where(mask_PxGxT, outcome_token_PxGxT + progress_PxGxT, 0.0)


def advantage_inputs(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """The inputs of an advantage, checked and made constants: float32 stop-gradient arrays
  and a bool mask (rewards [P, G], the others [P, G, T]); a shape mismatch is a ValueError."""
  shape = entropy_PxGxT.shape
  if len(shape) != 3 or rewards_PxG.shape != shape[:2]:
    raise ValueError(f"advantages: rewards {rewards_PxG.shape} must be [P, G] of the "
                     f"token arrays' [P, G, T] {shape}")
  for name, arr in (("logp_old", logp_old_PxGxT), ("logp_ref", logp_ref_PxGxT),
                    ("mask", mask_PxGxT)):
    if arr.shape != shape:
      raise ValueError(f"advantages: {name} has shape {arr.shape}, expected {shape}")
  sg = lambda x: jax.lax.stop_gradient(jnp.asarray(x))
  return (sg(rewards_PxG).astype(jnp.float32),
          sg(entropy_PxGxT).astype(jnp.float32),
          sg(logp_old_PxGxT).astype(jnp.float32),
          sg(logp_ref_PxGxT).astype(jnp.float32),
          sg(mask_PxGxT).astype(bool))


def compute_advantages(rewards_PxG: jax.Array, entropy_PxGxT: jax.Array, logp_old_PxGxT: jax.Array,
                       logp_ref_PxGxT: jax.Array, mask_PxGxT: jax.Array,
                       cfg: AdvantageConfig = AdvantageConfig()) -> tuple[jax.Array, Components]:
  """EP-GRPO token advantages `(adv_PxGxT, Components)` (eqs. 3, 15-26).

  `entropy_PxGxT` and `logp_old_PxGxT` come from the scoring pass of the
  sampling policy, `logp_ref_PxGxT` from the reference; `mask_PxGxT` (bool or
  0/1) marks response tokens. Pure and traceable; `cfg` is static under jit
  (see `compute_advantages_jit`). With every switch off the result is GRPO's
  A_i on every response token.
  """
  rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT = advantage_inputs(
      rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT)
  shape = entropy_PxGxT.shape

  outcome_PxG, zero_variance_P = outcome_advantage(
      rewards_PxG, delta=cfg.delta, ddof=cfg.std_ddof, zero_std_tol=cfg.zero_std_tol)
  if cfg.entropy_gate:
    gate_PxGxT = entropy_gate(entropy_PxGxT, mask_PxGxT, gamma=cfg.gamma, eps=cfg.eps)
  else:
    gate_PxGxT = mask_PxGxT.astype(jnp.float32)
  outcome_token_PxGxT = jnp.where(mask_PxGxT, gate_PxGxT * outcome_PxG[..., None], 0.0)

  anchor_PxG = anchor_sign(rewards_PxG, outcome_PxG, zero_variance_P,
                           reward_threshold=cfg.reward_threshold,
                           zero_variance_anchor=cfg.zero_variance_anchor)
  signal_PxGxT = anchored_signal(logp_old_PxGxT, logp_ref_PxGxT, anchor_PxG, mask_PxGxT,
                                 lam=cfg.lam)
  tau_PxGxT, bucket_PxGxT = entropy_progress(entropy_PxGxT, mask_PxGxT,
                                             num_buckets=cfg.num_buckets)
  if cfg.progress_signal:
    z_PxGxT = bucket_zscore(signal_PxGxT, bucket_PxGxT, mask_PxGxT,
                            num_buckets=cfg.num_buckets, eps=cfg.eps)
    progress_PxGxT = cfg.eta * z_PxGxT
  else:
    progress_PxGxT = jnp.zeros(shape, jnp.float32)

  adv_PxGxT = final_advantage(outcome_token_PxGxT, progress_PxGxT, mask_PxGxT)
  return adv_PxGxT, Components(
      outcome=outcome_PxG, gate=gate_PxGxT, outcome_token=outcome_token_PxGxT,
      anchor=anchor_PxG, signal=signal_PxGxT, tau=tau_PxGxT, bucket=bucket_PxGxT,
      progress=progress_PxGxT, zero_variance=zero_variance_P)


compute_advantages_jit = jax.jit(compute_advantages, static_argnames=("cfg",))

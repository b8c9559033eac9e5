"""The sampler's settings (`SamplingConfig`: token choice, shape buckets, the decode loop's
blocks and segments, continuous batching) and the decode segments they give (`segment_ends`).
`rollout.sampling` re-exports both."""

from __future__ import annotations

import dataclasses
from typing import Literal


from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import as_dtype


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
  return tuple(2 ** i for i in range(lo.bit_length() - 1, hi.bit_length()))


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick tokens and how to bucket shapes.

  temperature 0 or `greedy` picks the argmax; `top_k` 0 and `top_p` 1.0 are
  off. Prompt lengths round up to the next of `prompt_buckets` and
  `max_new_tokens` to the next of `length_buckets` (beyond the largest: a
  multiple of it). `cache_dtype` None uses the model's compute dtype. The
  decode loop runs in up to `decode_segments` segments whose caches grow, so
  early steps attend over fewer slots (each segment is one more loop body to
  compile). `ignore_eos` never stops at a stop token: every completion gets
  exactly `max_new_tokens` (benchmarks). `merge_lora` folds LoRA adapters into
  the kernels once per call instead of applying them at every decode step
  (the same policy up to rounding in the compute dtype). `cpu_kernels` runs
  the decode steps' attention (float32 or bfloat16 cache) and the top-k / top-p
  thresholds (with top-k off, the whole draw) in C++ kernels on a single CPU
  device, and, with `packed_weights`, the projections and head as C++ products
  over weights packed once per call: a bfloat16 model's on AMX tiles, a float32
  model's on AVX-512, where the CPU has them (built on first use; XLA where they
  cannot be built, on accelerators, and over a mesh of several devices). The
  packed weights are a second copy for the duration of a call;
  `packed_weights=false` saves that memory (and also keeps the q/k/v and gate/up
  concatenations, made once per call otherwise, inside the loop).

  The decode loop tests "all done" once per `stop_check_every` tokens. With
  `continuous` the requests (prompt, sample) run through `slots` rows:
  `refill_every` tokens decode in one program, then finished slots take the
  next requests; `slot_tokens` (0: the longest prompt's bucket + max_new_tokens)
  is each slot's cache capacity, fixed so calls do not recompile. `shared_prompt_cache` (static
  sampler; true, false, or "auto": per backend, `seam.shared_prompt_cache`) keeps each prompt's
  cache once for its G rows, read once per group by the decode steps' attention.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  max_new_tokens: int = 256
  prompt_buckets: tuple[int, ...] = _powers_of_two(32, 8192)
  length_buckets: tuple[int, ...] = _powers_of_two(16, 8192)
  cache_dtype: str | None = None
  decode_segments: int = 2
  ignore_eos: bool = False
  merge_lora: bool = True
  cpu_kernels: bool = True
  packed_weights: bool = True
  stop_check_every: int = 8
  continuous: bool = False
  slots: int = 32
  refill_every: int = 8
  slot_tokens: int = 0
  shared_prompt_cache: bool | Literal["auto"] = "auto"

  def __post_init__(self):
    if not self.temperature >= 0:  # also rejects NaN
      raise UserError(f"sampling.temperature: must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise UserError(f"sampling.top_k: must be >= 0 (0 = off), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise UserError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 1:
      raise UserError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
    for name in ("prompt_buckets", "length_buckets"):
      buckets = tuple(getattr(self, name))
      object.__setattr__(self, name, buckets)
      if not buckets or any(int(b) != b or b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise UserError(f"sampling.{name}: must be increasing positive integers, got {buckets}")
    if self.decode_segments < 1:
      raise UserError(f"sampling.decode_segments: must be >= 1, got {self.decode_segments}")
    for name in ("stop_check_every", "slots", "refill_every"):
      if getattr(self, name) < 1:
        raise UserError(f"sampling.{name}: must be >= 1, got {getattr(self, name)}")
    if self.shared_prompt_cache not in (True, False, "auto"):
      raise UserError(f"sampling.shared_prompt_cache: must be true, false or auto, got "
                      f"{self.shared_prompt_cache!r}")
    if self.slot_tokens < 0:
      raise UserError(f"sampling.slot_tokens: must be >= 0 (0 = sized to the requests), "
                      f"got {self.slot_tokens}")
    if self.cache_dtype is not None:
      try:
        as_dtype(self.cache_dtype)
      except ValueError as e:
        raise UserError(f"sampling.cache_dtype: {e}") from None

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0

  def replace(self, **kw) -> "SamplingConfig":
    return dataclasses.replace(self, **kw)


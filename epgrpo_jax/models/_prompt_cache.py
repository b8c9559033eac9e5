"""A decode cache whose prompt part is stored once per group of rows: the G completions of a
prompt attend to one copy of its keys and values instead of G identical copies.

Shape suffixes as in `_decoder`: P prompts, G rows per prompt (B = P * G, row p * G + g),
K key/value heads, Q query heads per KV head, Tp prompt slots, C completion slots.

The cache is the model's usual one (`init_cache`: keys [B, K, Hd, C], values [B, K, C, Hd],
valid [B, C], index) over the completion slots only, index 0 being the first generated
token's slot, plus `"prompt"`: the prompts' keys [P, K, Hd, Tp] and values [P, K, Tp, Hd] per
layer and their valid slots [P, Tp]. A row's slots are then its prompt's Tp slots followed by
its own C, the same slots a per-row cache of Tp + C would hold, in the same order.

The decode attention (`attend_shared`) reads each prompt's slots once for its G rows: the
queries of a group's rows, [G, Q] per KV head, against the prompt's keys in one product, and
each row's queries against its own completion slots in another. The two parts share one
softmax: the scores' maximum and the sum of their exponentials are taken over both, so the
result is the softmax over the Tp + C slots, as `_attention.attend` computes it over the
per-row cache (up to the order of the float32 sums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from epgrpo_jax.models._attention import _NEG
from epgrpo_jax.models.interface import Cache


def split_cache(prompt_cache: Cache, rows_per_prompt: int, completion: Cache,
                prompt_slots: int | None = None) -> Cache:
  """The shared layout: `completion` (an `init_cache` of B = P * G rows over the completion
  slots) with the first `prompt_slots` (None: all) slots of the prompts' cache `prompt_cache`
  (P rows) kept once as its `"prompt"` part. `rows_per_prompt`: G, checked against the row
  counts."""
  p = prompt_cache["valid"].shape[0]
  if completion["valid"].shape[0] != p * rows_per_prompt:
    raise ValueError(f"split_cache: {completion['valid'].shape[0]} completion rows for {p} prompts "
                     f"x {rows_per_prompt}")
  tp = prompt_cache["valid"].shape[1] if prompt_slots is None else prompt_slots
  out = dict(completion)
  out["prompt"] = {"k": [x[..., :tp] for x in prompt_cache["k"]],
                   "v": [x[:, :, :tp] for x in prompt_cache["v"]], "valid": prompt_cache["valid"][:, :tp]}
  return out


def grown(cache: Cache, larger: Cache) -> Cache:
  """`cache` copied into `larger`, an empty cache of the same layout with more slots (written
  slots kept, new ones empty); of a split cache (`split_cache`) only the completion part grows
  (`larger` is then the completion part's)."""
  own = {name: x for name, x in cache.items() if name != "prompt"}
  out = jax.tree.map(
      lambda new, old: jax.lax.dynamic_update_slice(new, old, (0,) * old.ndim) if old.ndim else old,
      larger, own)
  if "prompt" in cache:
    out["prompt"] = cache["prompt"]
  return out


def attend_shared(q_BxKxQxTxHd, keys_BxKxHdxC, values_BxKxCxHd, allowed_BxTxC, prompt_keys_PxKxHdxTp,
                  prompt_values_PxKxTpxHd, prompt_valid_PxTp):
  """softmax(q . keys / sqrt(Hd)) . values over a row's prompt slots (its group's, read once
  for the G rows) and its own allowed completion slots; the softmax and the dtypes as
  `_attention.attend` has them over the concatenated slots (every prompt slot precedes the
  queries: a valid one is visible). A query with no visible slot gets uniform weights."""
  b, k, q, t, hd = q_BxKxQxTxHd.shape
  p = prompt_valid_PxTp.shape[0]
  g = b // p
  dtype = q_BxKxQxTxHd.dtype
  scale = jnp.sqrt(hd).astype(jnp.float32)
  q_PxGxKxQxTxHd = q_BxKxQxTxHd.reshape(p, g, k, q, t, hd)
  prompt_PxGxKxQxTxTp = jnp.einsum("pgkqth,pkhs->pgkqts", q_PxGxKxQxTxHd,
                                   prompt_keys_PxKxHdxTp.astype(dtype),
                                   preferred_element_type=jnp.float32) / scale
  prompt_PxGxKxQxTxTp = jnp.where(prompt_valid_PxTp[:, None, None, None, None], prompt_PxGxKxQxTxTp,
                                  _NEG)
  own_BxKxQxTxC = jnp.einsum("bkqth,bkhs->bkqts", q_BxKxQxTxHd, keys_BxKxHdxC.astype(dtype),
                             preferred_element_type=jnp.float32) / scale
  own_BxKxQxTxC = jnp.where(allowed_BxTxC[:, None, None], own_BxKxQxTxC, _NEG)
  prompt_BxKxQxTxTp = prompt_PxGxKxQxTxTp.reshape(b, k, q, t, -1)
  probs_prompt, probs_own = shared_softmax(prompt_BxKxQxTxTp, own_BxKxQxTxC)
  out_PxGxKxQxTxHd = jnp.einsum("pgkqts,pksh->pgkqth",
                                probs_prompt.astype(dtype).reshape(p, g, k, q, t, -1),
                                prompt_values_PxKxTpxHd.astype(dtype),
                                preferred_element_type=jnp.float32)
  out_BxKxQxTxHd = out_PxGxKxQxTxHd.reshape(b, k, q, t, hd) + jnp.einsum(
      "bkqts,bksh->bkqth", probs_own.astype(dtype), values_BxKxCxHd.astype(dtype),
      preferred_element_type=jnp.float32)
  return out_BxKxQxTxHd.astype(dtype)


def shared_softmax(scores_a, scores_b):
  """The softmax over the concatenation of two score arrays along their last axis, returned as
  its two parts: one maximum and one sum of exponentials over both (their log-sum-exp merge)."""
  max_ = jnp.maximum(scores_a.max(-1, keepdims=True), scores_b.max(-1, keepdims=True))
  exp_a, exp_b = jnp.exp(scores_a - max_), jnp.exp(scores_b - max_)
  total = exp_a.sum(-1, keepdims=True) + exp_b.sum(-1, keepdims=True)
  return exp_a / total, exp_b / total

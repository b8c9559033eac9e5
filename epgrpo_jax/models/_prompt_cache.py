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
each row's queries against its own completion slots in another. Each part's softmax is left
unnormalised (its maximum, its sum of exponentials) and the two are merged by log-sum-exp
(`merge_partials`, the GPU kernel's merge of its splits too), so the result is the softmax over the
Tp + C slots, as `_attention.attend` computes it over the per-row cache (up to the order of
the float32 sums and where the products round).
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
  for the G rows) and its own allowed completion slots; the dtypes as `_attention.attend` has
  them over the concatenated slots (every prompt slot precedes the queries: a valid one is
  visible). The two parts are `partial_softmax` results merged by `merge_partials`. A query with no
  visible slot gets uniform weights."""
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
  e_prompt, m_prompt, l_prompt = partial_softmax(prompt_PxGxKxQxTxTp)
  out_prompt = jnp.einsum("pgkqts,pksh->pgkqth", e_prompt.astype(dtype), prompt_values_PxKxTpxHd.astype(dtype),
                          preferred_element_type=jnp.float32).reshape(b, k, q, t, hd)
  e_own, m_own, l_own = partial_softmax(own_BxKxQxTxC)
  out_own = jnp.einsum("bkqts,bksh->bkqth", e_own.astype(dtype), values_BxKxCxHd.astype(dtype),
                       preferred_element_type=jnp.float32)
  out_BxKxQxTxHd = merge_partials(jnp.stack([out_prompt, out_own]),
                          jnp.stack([m_prompt.reshape(b, k, q, t), m_own]),
                          jnp.stack([l_prompt.reshape(b, k, q, t), l_own]))
  return out_BxKxQxTxHd.astype(dtype)


def partial_softmax(scores_Nx):
  """A softmax over the last axis left unnormalised, for `merge_partials`: (exp(scores - m), m, the
  sum l of the exponentials), m the scores' maximum."""
  m_N = scores_Nx.max(-1)
  e_Nx = jnp.exp(scores_Nx - m_N[..., None])
  return e_Nx, m_N, e_Nx.sum(-1)


def merge_partials(o_JxNxHd, m_JxN, l_JxN) -> jax.Array:
  """Partial softmax results over J disjoint slot sets merged by log-sum-exp: sum_j o_j
  e^(m_j - M) / sum_j l_j e^(m_j - M), M the largest m_j; o_j the unnormalised output (the
  exponentials times the values), m_j the set's largest score, l_j its sum of exponentials
  (0 where no slot was read: a result of 0 where none was read at all). The one merge of the
  shared prompt cache's two parts (`attend_shared`) and of the GPU kernel's splits
  (`kernels.gpu`)."""
  m_N = m_JxN.max(axis=0)
  w_JxN = jnp.exp(m_JxN - m_N[None])
  l_N = (l_JxN * w_JxN).sum(axis=0)
  o_NxHd = (o_JxNxHd * w_JxN[..., None]).sum(axis=0)
  return o_NxHd / jnp.where(l_N > 0, l_N, 1.0)[..., None]

"""The shared decoder-only transformer (the Qwen2 architecture) in Flax NNX, which the model
families (`models/<family>/`) build on, with a preallocated KV cache (a plain pytree).

Shape suffixes: B batch, T new tokens, S cache slots, D hidden, H query heads,
K key/value heads, Hd head dim, F intermediate, V vocabulary, L layers.

The cache holds every layer's keys and values in slots `[0, S)`, a per-slot
validity mask, and `index`: the next slot to write. All rows write the same
slots; a row's real tokens are those whose slots are valid, and positions
(for the rotary embedding) are given by the caller per token.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import _attention
from epgrpo_jax.models._attention import attend  # noqa: F401 (re-exported)
from epgrpo_jax.models._config import LoraConfig, ModelConfig, as_dtype
from epgrpo_jax.models._kernels import XLA, Kernels
from epgrpo_jax.models._dense import Dense
from epgrpo_jax.models._lora import LoRA, Projection, fused, fused_product
from epgrpo_jax.models._prompt_cache import attend_shared
from epgrpo_jax.models._rope import rope_angles, rotate
from epgrpo_jax.models.interface import Cache


def _attend(q, keys, values, valid_BxS, offset, write_index, attention, segments_BxS,
            kernels: Kernels, prompt=None):
  """softmax(q . keys) . values by the resolved `attention` (the kernels' decode attention for
  one token with a cache, where they have one); with `prompt` (keys, values, valid of a
  prompt cache kept once per group: `_prompt_cache`), over the group's prompt and the row's
  own slots (`attend_shared`)."""
  t = q.shape[3]
  decode = kernels.decode_attention if prompt is None else kernels.shared_decode_attention
  if (decode is not None and t == 1 and write_index is not None
      and keys.dtype == values.dtype and keys.dtype in (jnp.float32, jnp.bfloat16)):
    # a per-row index (continuous batching): the kernel reads the slots below the largest
    return decode(q[:, :, :, 0], keys, values, valid_BxS, jnp.max(write_index) + 1,
                  *(prompt or ()))[:, :, :, None]
  if prompt is not None:
    return attend_shared(q, keys, values, _attention.visible(valid_BxS, offset, t), *prompt)
  if attention[0] == "plain" or t == 1:
    return _attention.attend(q, keys, values, _attention.visible(valid_BxS, offset, t, segments_BxS))
  if attention[0] == "blockwise":
    return _attention.blockwise(q, keys, values, valid_BxS, offset, block=attention[1],
                                segments_BxS=segments_BxS)
  return _attention.cudnn(q, keys, values, valid_BxS, offset, segments_BxS=segments_BxS,
                          max_segments=attention[2])


def _write(k_BxKxHdxS, v_BxKxSxHd, k_BxKxHdxT, v_BxKxTxHd, write_index, kernels: Kernels):
  """The cache's keys and values with this block's written at `write_index` (one slot per row
  where it is [B], so t == 1; else the same slots for every row)."""
  if write_index.ndim:
    return (kernels.write_row_slots(k_BxKxHdxS, k_BxKxHdxT[..., 0], write_index, 3),
            kernels.write_row_slots(v_BxKxSxHd, v_BxKxTxHd[:, :, 0], write_index, 2))
  return (kernels.write_slots(k_BxKxHdxS, k_BxKxHdxT, (0, 0, 0, write_index)),
          kernels.write_slots(v_BxKxSxHd, v_BxKxTxHd, (0, 0, write_index, 0)))


def _remat_block(layer: "Block", x, angles, valid, segments, attention: tuple[str, int, int],
                 adapters: bool, kernels: Kernels):
  """`Block.__call__` without a cache, its activations recomputed in the backward pass.

  The layer enters as a pure state, so this works when the model was merged from a
  state inside a transform (`jax.value_and_grad` of the update step), where
  `nnx.remat` would try to write the layer back across trace levels.
  """
  graphdef, state = nnx.split(layer)

  def pure(state, x, angles, valid, segments):
    return nnx.merge(graphdef, state)(x, angles, None, None, valid, 0, None, attention, adapters,
                                      segments, kernels)[0]

  return kernels.remat(pure)(state, x, angles, valid, segments)


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=None) -> Cache:
  """An empty cache for `batch` rows and `slots` positions.

  Heads-major layouts, keys [B, K, Hd, S] and values [B, K, S, Hd], make both
  attention einsums plain batched matmuls over (b, k): XLA then never copies a
  transposed cache (on CPU that copy dominated each decode step).
  """
  dtype = dtype or as_dtype(cfg.dtype)
  k, hd = cfg.num_kv_heads, cfg.head_dim
  return {
      "k": [jnp.zeros((batch, k, hd, slots), dtype) for _ in range(cfg.num_layers)],
      "v": [jnp.zeros((batch, k, slots, hd), dtype) for _ in range(cfg.num_layers)],
      "valid": jnp.zeros((batch, slots), bool),
      "index": jnp.zeros((), jnp.int32),
  }


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(jnp.float32) * x32.astype(x.dtype).astype(jnp.float32)


def _linear(cfg: ModelConfig, lora: LoraConfig | None, name: str, d_in, d_out, bias,
            rngs) -> Projection:
  """The projection `name`: a dense layer, wrapped in an adapter where `lora` targets it."""
  layer = Dense(d_in, d_out, use_bias=bias, param_dtype=as_dtype(cfg.param_dtype),
                dtype=as_dtype(cfg.dtype), rngs=rngs)
  if lora is not None and name in lora.targets:
    return LoRA(layer, lora.rank, lora.scale, rngs=rngs)
  return layer


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, lora: LoraConfig | None, rngs: nnx.Rngs):
    d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.attention_bias
    self.q = _linear(cfg, lora, "q", d, h * hd, bias, rngs)
    self.k = _linear(cfg, lora, "k", d, k * hd, bias, rngs)
    self.v = _linear(cfg, lora, "v", d, k * hd, bias, rngs)
    self.o = _linear(cfg, lora, "o", h * hd, d, False, rngs)
    if cfg.qk_norm:  # one weight over head_dim, shared by every head (HF Qwen3Attention)
      self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, as_dtype(cfg.param_dtype))
      self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, as_dtype(cfg.param_dtype))
    self.cfg = cfg

  def __call__(self, x_BxTxD, angles, k_BxKxHdxS, v_BxKxSxHd, valid_BxS, offset, write_index,
               attention: tuple[str, int, int], adapters: bool, segments_BxS=None,
               kernels: Kernels = XLA, prompt=None):
    """Rotates q and k by `angles` (`rope_angles`: cos, sin), writes this block's keys/values at
    `write_index` (None: no cache) and attends: query t
    (at slot `offset + t`) sees the slots s <= offset + t where `valid_BxS` (and of its own
    segment, given `segments_BxS`), by the resolved `attention` (implementation, block size,
    most sequences per row for cuDNN)
    (a one-token step: the plain path or the kernels' decode attention; without a cache, the
    kernels' causal attention where they have one). `kernels.products` holds this block's
    prepared products (q/k/v, o, gate/up, down), if any. `prompt`: this layer's part of a
    prompt cache kept once per group (`_prompt_cache.split_cache`), or None."""
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    with jax.named_scope("projections"):  # a profile's parts (benchmarks/_profile.py)
      q, k, v = fused([self.q, self.k, self.v], x_BxTxD, adapters, kernels, kernels.product(0))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # per head, before the rotary embedding
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    q, k = rotate(q, *angles), rotate(k, *angles)
    groups = cfg.num_heads // cfg.num_kv_heads
    def o(x):
      with jax.named_scope("projections"):
        return self.o(x, adapters=adapters, kernels=kernels, product=kernels.product(1))
    if write_index is None and kernels.causal_attention is not None:
      segments = jnp.zeros(valid_BxS.shape, jnp.int32) if segments_BxS is None else segments_BxS
      with jax.named_scope("attention"):
        out = kernels.causal_attention(
            q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim), k, v, valid_BxS, segments)
      return o(out.reshape(b, t, cfg.num_heads * cfg.head_dim)), None, None
    k_BxKxHdxT, v_BxKxTxHd = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    if write_index is None:
      keys, values = k_BxKxHdxT, v_BxKxTxHd
    else:
      with jax.named_scope("cache_write"):
        keys, values = _write(k_BxKxHdxS, v_BxKxSxHd, k_BxKxHdxT, v_BxKxTxHd, write_index, kernels)
    q = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim).transpose(0, 2, 3, 1, 4)
    with jax.named_scope("attention"):  # a profile's attention share (benchmarks/update_gpu.py)
      out = _attend(q, keys, values, valid_BxS, offset, write_index, attention, segments_BxS,
                    kernels, prompt)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads * cfg.head_dim)
    return o(out), keys, values


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, lora: LoraConfig | None, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate = _linear(cfg, lora, "gate", d, f, False, rngs)
    self.up = _linear(cfg, lora, "up", d, f, False, rngs)
    self.down = _linear(cfg, lora, "down", f, d, False, rngs)

  def __call__(self, x_BxTxD, adapters: bool, kernels: Kernels = XLA):
    """down(silu(gate) * up); `kernels.products` holds this block's prepared products, if any
    (gate/up third, down fourth)."""
    down = functools.partial(self.down, adapters=adapters, kernels=kernels,
                             product=kernels.product(3))
    gate_up = fused_product([self.gate, self.up], x_BxTxD, adapters, kernels, kernels.product(2))
    if gate_up is not None:
      return down(kernels.swiglu(gate_up))
    gate, up = [layer(x_BxTxD, adapters, kernels) for layer in (self.gate, self.up)]
    return down(jax.nn.silu(gate) * up)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, lora: LoraConfig | None, rngs: nnx.Rngs):
    pdt = as_dtype(cfg.param_dtype)
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
    self.attn = Attention(cfg, lora, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
    self.mlp = MLP(cfg, lora, rngs)

  GROUPS = 4  # projection groups per block: q/k/v, o, gate/up, down (`linear_groups`)

  def linear_groups(self) -> list[list[Projection]]:
    """The block's projections as its forward pass multiplies them: q/k/v and gate/up each as
    one `fused` group, o and down alone."""
    return [[self.attn.q, self.attn.k, self.attn.v], [self.attn.o], [self.mlp.gate, self.mlp.up],
            [self.mlp.down]]

  def __call__(self, x, angles, k, v, valid, offset, write_index, attention: tuple[str, int, int],
               adapters: bool, segments=None, kernels: Kernels = XLA, prompt=None):
    dtype = x.dtype
    h, k, v = self.attn(self.input_norm(x).astype(dtype), angles, k, v, valid, offset,
                        write_index, attention, adapters, segments, kernels, prompt)
    x = x + h.astype(dtype)
    y = self.post_attn_norm(x).astype(dtype)
    with jax.named_scope("projections"):  # the MLP, for a profile's parts
      y = self.mlp(y, adapters, kernels)
    x = x + y.astype(dtype)
    return x, k, v


def check_flags(cfg: ModelConfig, flags: dict[str, Any]) -> None:
  """UserError unless `cfg` has the decoder flags `flags` (a family's: its checkpoints have
  exactly those tensors, so another value could not be loaded or exported)."""
  wrong = {name: value for name, value in flags.items() if getattr(cfg, name) != value}
  if wrong:
    raise UserError(f"model.{', model.'.join(wrong)}: a {cfg.model_type} decoder has "
                    + ", ".join(f"{name}={value}" for name, value in wrong.items()))


class Decoder(nnx.Module):
  """A decoder-only causal LM (`models.interface.CausalLM`); families subclass it. `__call__` returns final-norm hidden states; `logits` applies the head."""

  FLAGS: dict[str, Any] = {}  # the decoder flags a subclass's family fixes (`check_flags`)

  def __init__(self, cfg: ModelConfig, *, lora: LoraConfig | None = None, rngs: nnx.Rngs):
    check_flags(cfg, self.FLAGS)
    pdt = as_dtype(cfg.param_dtype)
    self.cfg = cfg
    self.lora = lora
    self.embed = nnx.Param(jax.nn.initializers.normal(0.02)(
        rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdt))
    self.layers = nnx.List([Block(cfg, lora, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
    if cfg.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Param(jax.nn.initializers.normal(0.02)(
          rngs.params(), (cfg.hidden_size, cfg.vocab_size), pdt))

  def linear_groups(self) -> list[list[Projection]]:
    """The projections as the forward pass multiplies them: q/k/v and gate/up each as one
    `fused` group, o and down alone."""
    return [group for block in self.layers for group in block.linear_groups()]

  def head_DxV(self) -> jax.Array:
    """The output projection, [hidden, vocab], in the compute dtype."""
    w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return w.astype(as_dtype(self.cfg.dtype))

  def logits(self, hidden_BxTxD) -> jax.Array:
    """Full float32 logits (for small vocabularies and tests; the losses chunk instead)."""
    return jnp.einsum("btd,dv->btv", hidden_BxTxD, self.head_DxV(),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens_BxT, positions_BxT, mask_BxT, cache: Cache | None = None, *,
               adapters: bool = True, rope_table: tuple[jax.Array, jax.Array] | None = None,
               segments_BxT=None, kernels: Kernels = XLA):
    """Runs the decoder over `tokens_BxT`.

    Without a cache: causal attention within the batch, keys restricted to
    `mask_BxT`. With a cache: the tokens are written to slots
    `[index, index + T)`, marked valid where `mask_BxT`, and attend causally to
    every valid slot. Returns `(hidden_BxTxD, cache)` (the cache updated, or None). A cache
    with a `"prompt"` part (`_prompt_cache.split_cache`) also attends to its group's prompt.
    `rope_table` (from `rope_table(cfg, L)`) looks the rotary cos/sin up by position
    instead of computing them; positions must be < L (beyond it they read NaN).
    `segments_BxT` (no cache): packed rows, a token attends only to its own segment's tokens.
    `kernels`: the backend's implementations (`Kernels`; chosen once per program by
    `epgrpo_jax.kernels.seam.choose`), plain XLA by default.
    """
    cfg = self.cfg
    dtype = as_dtype(cfg.dtype)
    b, t = tokens_BxT.shape
    constrain = kernels.constrain
    table = constrain(self.embed[...], "embedding")
    x = constrain(jnp.take(table, tokens_BxT, axis=0).astype(dtype))
    mask_BxT = mask_BxT.astype(bool)
    attention = (kernels.attention or _attention.configured(cfg.attention), cfg.attention_block,
                 cfg.attention_segments)
    if cache is None:
      write_index, valid, offset = None, mask_BxT, 0
    elif segments_BxT is not None:
      raise ValueError("segments_BxT: packed rows run without a cache")
    else:
      write_index = cache["index"]
      slots = cache["valid"].shape[1]
      if write_index.ndim:  # [B]: each row writes its token at its own slot (continuous batching)
        if t != 1:
          raise ValueError(f"cache: a per-row index writes one token per row, got {t}")
        slot_BxS = jnp.arange(slots)[None, :]
        valid = jnp.where(slot_BxS == write_index[:, None], mask_BxT, cache["valid"])
        valid, offset = valid & (slot_BxS <= write_index[:, None]), slots - 1
      else:
        if not isinstance(write_index, jax.core.Tracer) and int(write_index) + t > slots:
          # Under jit this cannot be checked; dynamic_update_slice would clamp silently.
          raise ValueError(f"cache: writing {t} tokens at slot {int(write_index)} overflows "
                           f"its {slots} slots")
        valid = jax.lax.dynamic_update_slice(cache["valid"], mask_BxT, (0, write_index))
        offset = write_index

    angles = rope_angles(positions_BxT, cfg.head_dim, cfg.rope_theta, rope_table, cfg.rope_scaling)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      block_kernels = kernels.groups(i * Block.GROUPS, Block.GROUPS)
      if cache is None and cfg.remat:  # remat matters for the backward pass (no cache)
        x = _remat_block(layer, x, angles, valid, segments_BxT, attention, adapters, block_kernels)
        k = v = None
      else:
        ck = cache["k"][i] if cache is not None else None
        cv = cache["v"][i] if cache is not None else None
        prompt = cache.get("prompt") if cache is not None else None
        x, k, v = layer(x, angles, ck, cv, valid, offset, write_index, attention, adapters,
                        segments_BxT, block_kernels,
                        None if prompt is None else (prompt["k"][i], prompt["v"][i], prompt["valid"]))
      x = constrain(x)
      new_k.append(k)
      new_v.append(v)
    hidden = self.final_norm(x).astype(dtype)
    if cache is None:
      return hidden, None
    out = {"k": new_k, "v": new_v, "valid": valid, "index": write_index + t}
    return hidden, out if "prompt" not in cache else {**out, "prompt": cache["prompt"]}

"""Scaled dot-product and multi-head attention, with the positional variants that live there.

Rotary embeddings (RoPE) rotate queries and keys; ALiBi adds a distance penalty to the
attention logits. Sinusoidal and learned positions are added to the embeddings instead and
live in `models.py`.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import TransformerConfig

Array = jax.Array

# Xavier/Glorot uniform over the flattened fan-in/fan-out, as fairseq and PyTorch initialise
# attention projections.
_QKV_INIT = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
_OUT_INIT = nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2)


def rope(x: Array, positions: Array, base: float = 10000.0) -> Array:
  """Rotary position embedding (Su et al. 2021), half-split layout as in GPT-NeoX.

  Each pair (x1, x2) = (x[i], x[i + head_dim/2]) turns by its angle: (x1 cos - x2 sin,
  x2 cos + x1 sin), written as x * [cos, cos] + [x2, x1] * [-sin, sin] over the whole head,
  with the halves swapped by a reshape: on CPU that is 2.7x faster than splitting x and
  concatenating the two halves (XLA copies each), with the same arithmetic.

  Args:
    x: [batch, length, heads, head_dim] queries or keys.
    positions: [batch, length] integer positions (restarting per packed segment).
    base: the frequency base.

  Returns:
    x rotated by its positions, same shape and dtype.
  """
  batch, length, heads, head_dim = x.shape
  half = head_dim // 2
  inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, length, half]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  cos = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]
  sin = jnp.concatenate([-sin, sin], axis=-1)[:, :, None, :]
  rotated = x.astype(jnp.float32)
  swapped = rotated.reshape(batch, length, heads, 2, half)[..., ::-1, :].reshape(x.shape)
  return (rotated * cos + swapped * sin).astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """Per-head ALiBi slopes (Press et al. 2021), including their rule for non-powers of 2."""

  def power_of_2_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  if math.log2(num_heads).is_integer():
    slopes = power_of_2_slopes(num_heads)
  else:
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = (
        power_of_2_slopes(closest) + power_of_2_slopes(2 * closest)[0::2][: num_heads - closest]
    )
  return np.asarray(slopes, np.float32)


def alibi_bias(num_heads: int, q_positions: Array, kv_positions: Array) -> Array:
  """ALiBi's linear distance penalty, symmetric so that it also serves the encoder.

  Args:
    num_heads: number of heads.
    q_positions: [batch, q_length] positions of the queries.
    kv_positions: [batch, kv_length] positions of the keys.

  Returns:
    [batch, heads, q_length, kv_length] float32 bias to add to the attention logits.
  """
  distance = jnp.abs(q_positions[:, :, None] - kv_positions[:, None, :]).astype(jnp.float32)
  slopes = jnp.asarray(alibi_slopes(num_heads))
  return -slopes[None, :, None, None] * distance[:, None, :, :]


@dataclasses.dataclass(frozen=True)
class Lengths:
  """Which keys each query sees, for right-padded unpacked rows, in place of a dense mask.

  Query i of row b attends to key j when i < query[b], j < key_value[b] and, if `causal`,
  j <= i. cuDNN's fused kernel takes exactly this (sequence lengths and a causal flag), so it
  needs no [batch, 1, q, kv] mask and no bias gradient.
  """

  query: Array  # [batch] int32.
  key_value: Array  # [batch] int32.
  causal: bool = False

  def dense(self, q_length: int, kv_length: int) -> Array:
    """The same rule as a boolean [batch, 1, q_length, kv_length] mask."""
    q = jnp.arange(q_length)[None, :, None] < self.query[:, None, None]
    kv = jnp.arange(kv_length)[None, None, :] < self.key_value[:, None, None]
    mask = q & kv
    if self.causal:
      mask &= jnp.arange(q_length)[:, None] >= jnp.arange(kv_length)[None, :]
    return mask[:, None, :, :]


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | Lengths | None,
    bias: Array | None = None,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    implementation: str | None = None,
    return_weights: bool = False,
    heads_major_kv: bool = False,
) -> tuple[Array, Array | None]:
  """softmax(Q K^T / sqrt(d_k) + bias) V, masked positions excluded.

  This goes through `jax.nn.dot_product_attention`, so that a GPU can pick its fused kernel,
  unless there is attention dropout, the weights are asked for, keys and values are
  heads-major or `implementation='explicit'`; then the weights are formed here (softmax in
  float32 either way). 'explicit' is what `kernel_choice` picks on a CPU, where `jax.nn`'s
  XLA path spends about twice as long in the softmax and masks (the main job's step
  1.01-1.02x faster without it, bench/RESULTS.md).

  Args:
    query: [batch, q_length, heads, head_dim].
    key: [batch, kv_length, heads, head_dim], or [batch, heads, kv_length, head_dim] with
      `heads_major_kv`.
    value: shaped as `key`.
    mask: boolean, broadcastable to [batch, heads, q_length, kv_length] (True attends), or
      `Lengths` for right-padded rows.
    bias: float, broadcastable to [batch, heads, q_length, kv_length], or None.
    dropout_rate: dropout on the attention weights (needs `dropout_rng`).
    dropout_rng: PRNG key for that dropout; None means no dropout.
    implementation: 'explicit' forms the weights here; else passed to
      `jax.nn.dot_product_attention` ('xla', 'cudnn' or None).
    return_weights: also return the [batch, heads, q_length, kv_length] weights.
    heads_major_kv: keys and values are [batch, heads, kv_length, head_dim], the layout of
      the decode caches: XLA's batched products over (batch, heads) read them as they are,
      where the [batch, kv_length, heads, head_dim] layout is transposed at every call,
      which in a decode step means copying every layer's whole cache.

  Returns:
    ([batch, q_length, heads, head_dim] output in the query's dtype, weights or None).
  """
  use_dropout = dropout_rng is not None and dropout_rate > 0.0
  explicit = use_dropout or return_weights or heads_major_kv or implementation == 'explicit'
  if not explicit:
    if bias is not None:
      bias = bias.astype(query.dtype)
    if isinstance(mask, Lengths):
      out = jax.nn.dot_product_attention(
          query,
          key,
          value,
          bias=bias,
          query_seq_lengths=mask.query,
          key_value_seq_lengths=mask.key_value,
          is_causal=mask.causal,
          implementation=implementation,
      )
    else:
      out = jax.nn.dot_product_attention(
          query, key, value, bias=bias, mask=mask, implementation=implementation
      )
    return out, None
  if isinstance(mask, Lengths):
    mask = mask.dense(query.shape[1], key.shape[1])
  depth = query.shape[-1]
  kv = 'bhkd' if heads_major_kv else 'bkhd'
  logits = jnp.einsum(f'bqhd,{kv}->bhqk', query, key, preferred_element_type=jnp.float32) / np.sqrt(
      depth
  ).astype(np.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)  # [batch, heads, q_length, kv_length]
  probs = weights
  if use_dropout:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  if heads_major_kv and query.shape[1] > 1:
    # Heads-major out, then a transpose of the small [batch, heads, q, head_dim] result: asked
    # for [batch, q, heads, head_dim] directly, XLA:CPU computes value^T x weights per (batch,
    # head) and transposes, 4.5x slower for the beams of a sentence over the source's cache
    # (q = beams); with one query position both forms are the same product.
    out = jnp.swapaxes(jnp.einsum('bhqk,bhkd->bhqd', probs.astype(value.dtype), value), 1, 2)
  else:
    out = jnp.einsum(f'bhqk,{kv}->bqhd', probs.astype(value.dtype), value)
  return out, (weights if return_weights else None)


def _heads_major(x: Array) -> Array:
  """[batch, length, heads, head_dim] -> [batch, heads, length, head_dim]."""
  return jnp.swapaxes(x, 1, 2)


class MultiHeadAttention(nn.Module):
  """Multi-head attention (the paper's section 3.2.2), for self and encoder-decoder use.

  In decode mode (`config.decode`), self-attention keeps a key/value cache of the whole
  output length in the 'cache' collection and writes one position a call; encoder-decoder
  attention projects the encoder output to keys and values once, when the cache is created,
  and keeps them, with the source mask, in the 'encoder_cache' collection, which decode steps
  only read (see `Transformer.init_cache`); with n decoder rows a sentence (beams or
  samples, rows b * n + j) it stays one row a sentence, and the n rows attend to it as n
  query positions. Cached keys and values are heads-major,
  [batch, heads, length, head_dim]. Decode mode takes XLA's kernel whatever
  `attention_implementation` says: cuDNN's wants full [q, kv] masks, not a cache's.

  Attributes:
    config: the model config.
    is_self_attention: True for self-attention, False for encoder-decoder attention.
    in_decoder: True in the decoder; only there does decode mode use a cache.
  """

  config: TransformerConfig
  is_self_attention: bool
  in_decoder: bool = False

  def _projection_params(self, name: str) -> tuple[Array, Array]:
    cfg = self.config
    kernel = self.param(
        name + '_kernel',
        nn.with_logical_partitioning(_QKV_INIT, ('embed', 'heads', 'kv')),
        (cfg.d_model, cfg.num_heads, cfg.head_dim),
        cfg.param_dtype,
    )
    bias = self.param(
        name + '_bias',
        nn.with_logical_partitioning(nn.initializers.zeros_init(), ('heads', 'kv')),
        (cfg.num_heads, cfg.head_dim),
        cfg.param_dtype,
    )
    return jnp.asarray(kernel, cfg.dtype), jnp.asarray(bias, cfg.dtype)

  def _projection(self, name: str, x: Array) -> Array:
    kernel, bias = self._projection_params(name)
    y = jnp.einsum('bld,dhk->blhk', x, kernel) + bias
    return nn.with_logical_constraint(y, ('batch', 'length', 'heads', 'kv'))

  def _projections(self, names: tuple[str, ...], x: Array) -> tuple[Array, ...]:
    """The projections of x by several kernels, as `_projection` gives them, from one matmul
    when `config.qkv_projection` is 'stacked' (the kernels stacked at use, on an axis of
    their own so that a split of the heads stays where it is; the parameters do not change)."""
    if self.config.qkv_projection != 'stacked':
      return tuple(self._projection(name, x) for name in names)
    kernels, biases = zip(*(self._projection_params(name) for name in names))
    y = jnp.einsum('bld,dnhk->blnhk', x, jnp.stack(kernels, 1)) + jnp.stack(biases)
    return tuple(
        nn.with_logical_constraint(y[:, :, i], ('batch', 'length', 'heads', 'kv'))
        for i in range(len(names))
    )

  def _heads_major_projection(self, name: str, x: Array) -> Array:
    return _heads_major(self._projection(name, x))

  @nn.compact
  def __call__(
      self,
      inputs_q: Array,
      inputs_kv: Array | None,
      mask: Array | Lengths | None,
      q_positions: Array | None = None,
      kv_positions: Array | None = None,
      decode_index: Array | None = None,
  ) -> Array:
    """Attends from `inputs_q` to `inputs_kv`.

    Args:
      inputs_q: [batch, q_length, d_model].
      inputs_kv: [batch, kv_length, d_model]; for self-attention pass `inputs_q`. In decode
        mode, encoder-decoder attention may get None once its 'encoder_cache' exists.
      mask: boolean, broadcastable to [batch, heads, q_length, kv_length], or `Lengths`
        (training and scoring with `config.attention_lengths`). Ignored in a
        decode step: self-attention's cache index decides, encoder-decoder attention uses
        the mask cached when the cache was created.
      q_positions: [batch, q_length] positions (for RoPE and ALiBi).
      kv_positions: [batch, kv_length] positions (for RoPE and ALiBi).
      decode_index: scalar position of the current token in a decode step, else None.

    Returns:
      [batch, q_length, d_model] in the computation dtype.
    """
    cfg = self.config
    uses_rope = cfg.positional_encoding == 'rope' and self.is_self_attention
    uses_alibi = cfg.positional_encoding == 'alibi' and self.is_self_attention
    cached = cfg.decode and self.in_decoder
    if self.is_self_attention and inputs_kv is inputs_q:
      # [batch, length, heads, head_dim] each.
      query, key, value = self._projections(('query', 'key', 'value'), inputs_q)
    else:
      query = self._projection('query', inputs_q)
      if not cached or self.is_self_attention:
        key, value = self._projections(('key', 'value'), inputs_kv)
    if uses_rope:
      query = rope(query, q_positions)
    bias = None

    if cached and not self.is_self_attention:
      # Keys and values of the source: projected once, when the cache is created, and the
      # same at every step, so they live apart from the per-step 'cache'.
      key = self.variable(
          'encoder_cache', 'cached_key', self._heads_major_projection, 'key', inputs_kv
      ).value
      value = self.variable(
          'encoder_cache', 'cached_value', self._heads_major_projection, 'value', inputs_kv
      ).value
      mask = self.variable('encoder_cache', 'cached_mask', lambda: mask).value
    else:
      if uses_rope:
        key = rope(key, kv_positions)
      if uses_alibi:
        bias = alibi_bias(cfg.num_heads, q_positions, kv_positions)

    if cached and self.is_self_attention:
      # The caches are heads-major, [batch, heads, length, head_dim] (see
      # `scaled_dot_product_attention`'s `heads_major_kv`).
      key, value = _heads_major(key), _heads_major(value)
      is_initialized = self.has_variable('cache', 'cached_key')
      cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape, key.dtype)
      cached_value = self.variable('cache', 'cached_value', jnp.zeros, value.shape, value.dtype)
      if is_initialized:
        # One new token: write its key/value at decode_index, attend to positions <= it.
        batch, max_length = cached_key.value.shape[0], cached_key.value.shape[2]
        start = (0, 0, decode_index, 0)
        key = jax.lax.dynamic_update_slice(cached_key.value, key, start)
        value = jax.lax.dynamic_update_slice(cached_value.value, value, start)
        cached_key.value, cached_value.value = key, value
        key_positions = jnp.arange(max_length)
        mask = (key_positions <= decode_index)[None, None, None, :]
        if uses_alibi:
          bias = alibi_bias(
              cfg.num_heads, q_positions, jnp.broadcast_to(key_positions, (batch, max_length))
          )

    dropout_rng = None
    if not cfg.deterministic and cfg.attention_dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    return_weights = self.is_mutable_collection('intermediates')
    rows = query.shape[0]
    if cached and not self.is_self_attention and rows != key.shape[0]:
      # n queries a sentence (beams or samples, rows b * n + j) over the sentence's one
      # copy of the source: they become n query positions of row b, so each product reads
      # the source's keys and values once for all n, not once a beam.
      query = query.reshape((key.shape[0], -1) + query.shape[2:])
    out, weights = scaled_dot_product_attention(
        query,
        key,
        value,
        mask,
        bias,
        dropout_rate=cfg.attention_dropout_rate,
        dropout_rng=dropout_rng,
        implementation=None if cfg.decode else cfg.attention_implementation,
        return_weights=return_weights,
        heads_major_kv=cached,
    )
    out = out.reshape((rows, -1) + out.shape[2:])
    if return_weights:
      self.sow('intermediates', 'attention_weights', weights)

    kernel = self.param(
        'out_kernel',
        nn.with_logical_partitioning(_OUT_INIT, ('heads', 'kv', 'embed')),
        (cfg.num_heads, cfg.head_dim, cfg.d_model),
        cfg.param_dtype,
    )
    bias_out = self.param(
        'out_bias',
        nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',)),
        (cfg.d_model,),
        cfg.param_dtype,
    )
    y = jnp.einsum('blhk,hkd->bld', out, jnp.asarray(kernel, cfg.dtype)) + jnp.asarray(
        bias_out, cfg.dtype
    )
    return nn.with_logical_constraint(y, ('batch', 'length', 'embed'))

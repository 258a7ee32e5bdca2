"""Multi-head attention (the paper's section 3.2.2), with the positional variants that live
there.

Rotary embeddings (RoPE) rotate queries and keys; ALiBi adds a distance penalty to the
attention logits. Sinusoidal and learned positions are added to the embeddings instead and
live in `models.py`. Scaled dot-product attention itself, softmax(Q K^T / sqrt(d_k)) V, is
computed by the kernel the platform gets (`kernels.dot_product_attention`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.kernels import dot_product_attention
from transformer_jax.model.kernels import stacked_projection
from transformer_jax.model.kernels.dot_product_attention import Lengths

Array = jax.Array

# Xavier/Glorot uniform over the flattened fan-in/fan-out, as fairseq and PyTorch initialise
# attention projections.
_QKV_INIT = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2))
_OUT_INIT = nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2)


def rope(x: Array, positions: Array, base: float = 10000.0) -> Array:
  """Rotary position embedding (Su et al. 2021), half-split layout as in GPT-NeoX.

  Each pair (x1, x2) = (x[i], x[i + head_dim/2]) turns by its angle: (x1 cos - x2 sin,
  x2 cos + x1 sin), written as x * [cos, cos] + [x2, x1] * [-sin, sin] over the whole head,
  with the halves swapped by a reshape: on a CPU that is faster than splitting x and
  concatenating the two halves, which XLA copies each (bench/RESULTS.md, section
  "CPU: rotary positions in the main job"), with the same arithmetic.

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
    """The projections of x by several kernels, as `_projection` gives them (from one product
    with `config.qkv_projection='stacked'`)."""
    if self.config.qkv_projection != 'stacked':
      return tuple(self._projection(name, x) for name in names)
    kernels, biases = zip(*(self._projection_params(name) for name in names))
    return tuple(
        nn.with_logical_constraint(y, ('batch', 'length', 'heads', 'kv'))
        for y in stacked_projection.project(x, kernels, biases)
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
    cached = self.config.decode and self.in_decoder
    if cached and not self.is_self_attention:
      query = self._projection('query', inputs_q)
      key, value, mask = self._source_cache(inputs_kv, mask)
      bias = None
    else:
      query, key, value = self._query_key_value(inputs_q, inputs_kv)
      query, key, bias = self._positions(query, key, q_positions, kv_positions)
      if cached:
        key, value, mask, bias = self._self_attention_cache(
            key, value, mask, bias, q_positions, decode_index
        )
    out = self._attend(query, key, value, mask, bias, heads_major_kv=cached)
    return self._output_projection(out)

  def _query_key_value(self, inputs_q: Array, inputs_kv: Array) -> tuple[Array, Array, Array]:
    """Q, K, V: [batch, length, heads, head_dim] each."""
    if self.is_self_attention and inputs_kv is inputs_q:
      return self._projections(('query', 'key', 'value'), inputs_q)
    query = self._projection('query', inputs_q)
    key, value = self._projections(('key', 'value'), inputs_kv)
    return query, key, value

  def _positions(
      self, query: Array, key: Array, q_positions: Array | None, kv_positions: Array | None
  ) -> tuple[Array, Array, Array | None]:
    """Self-attention's positional variants: RoPE rotates the queries and keys, ALiBi gives a
    [batch, heads, q, kv] distance bias (None for the others)."""
    if not self.is_self_attention:
      return query, key, None
    if self.config.positional_encoding == 'rope':
      return rope(query, q_positions), rope(key, kv_positions), None
    if self.config.positional_encoding == 'alibi':
      return query, key, alibi_bias(self.config.num_heads, q_positions, kv_positions)
    return query, key, None

  def _self_attention_cache(
      self,
      key: Array,
      value: Array,
      mask: Array | Lengths | None,
      bias: Array | None,
      q_positions: Array | None,
      decode_index: Array | None,
  ) -> tuple[Array, Array, Array | Lengths | None, Array | None]:
    """The decoder's self-attention cache, heads-major [batch, heads, length, head_dim] (see
    `dot_product_attention.attention`'s `heads_major_kv`): made with room for the whole
    output when first called; at each later call (a decode step) the new token's key and
    value are written at `decode_index` and the query attends to positions up to it."""
    key, value = _heads_major(key), _heads_major(value)
    is_initialized = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros, value.shape, value.dtype)
    if not is_initialized:
      return key, value, mask, bias
    batch, max_length = cached_key.value.shape[0], cached_key.value.shape[2]
    start = (0, 0, decode_index, 0)
    key = jax.lax.dynamic_update_slice(cached_key.value, key, start)
    value = jax.lax.dynamic_update_slice(cached_value.value, value, start)
    cached_key.value, cached_value.value = key, value
    key_positions = jnp.arange(max_length)
    mask = (key_positions <= decode_index)[None, None, None, :]
    if bias is not None:  # ALiBi, over every position of the cache.
      bias = alibi_bias(
          self.config.num_heads, q_positions, jnp.broadcast_to(key_positions, (batch, max_length))
      )
    return key, value, mask, bias

  def _source_cache(
      self, inputs_kv: Array | None, mask: Array | None
  ) -> tuple[Array, Array, Array]:
    """Encoder-decoder attention's keys, values and source mask in decode mode: projected
    once, when the cache is created, and the same at every step, so they live apart from the
    per-step 'cache', in 'encoder_cache'."""
    key = self.variable(
        'encoder_cache', 'cached_key', self._heads_major_projection, 'key', inputs_kv
    ).value
    value = self.variable(
        'encoder_cache', 'cached_value', self._heads_major_projection, 'value', inputs_kv
    ).value
    mask = self.variable('encoder_cache', 'cached_mask', lambda: mask).value
    return key, value, mask

  def _attend(
      self,
      query: Array,
      key: Array,
      value: Array,
      mask: Array | Lengths | None,
      bias: Array | None,
      *,
      heads_major_kv: bool,
  ) -> Array:
    """softmax(Q K^T / sqrt(d_k) + bias) V with attention dropout: [batch, q, heads, head_dim].

    With n decoder rows a sentence (beams or samples, rows b * n + j) over the sentence's one
    cached copy of the source, the n rows become n query positions of row b, so each product
    reads the source's keys and values once for all n, not once a beam.
    """
    cfg = self.config
    dropout_rng = None
    if not cfg.deterministic and cfg.attention_dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    return_weights = self.is_mutable_collection('intermediates')
    rows = query.shape[0]
    if rows != key.shape[0]:  # The beams of a sentence over its source cache.
      query = query.reshape((key.shape[0], -1) + query.shape[2:])
    out, weights = dot_product_attention.attention(
        query,
        key,
        value,
        mask,
        bias,
        dropout_rate=cfg.attention_dropout_rate,
        dropout_rng=dropout_rng,
        implementation=None if cfg.decode else cfg.attention_implementation,
        return_weights=return_weights,
        heads_major_kv=heads_major_kv,
    )
    if return_weights:
      self.sow('intermediates', 'attention_weights', weights)
    return out.reshape((rows, -1) + out.shape[2:])

  def _output_projection(self, out: Array) -> Array:
    """[batch, length, heads, head_dim] -> [batch, length, d_model]: the heads concatenated
    and projected by W^O."""
    cfg = self.config
    kernel = self.param(
        'out_kernel',
        nn.with_logical_partitioning(_OUT_INIT, ('heads', 'kv', 'embed')),
        (cfg.num_heads, cfg.head_dim, cfg.d_model),
        cfg.param_dtype,
    )
    bias = self.param(
        'out_bias',
        nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',)),
        (cfg.d_model,),
        cfg.param_dtype,
    )
    y = jnp.einsum('blhk,hkd->bld', out, jnp.asarray(kernel, cfg.dtype))
    y = y + jnp.asarray(bias, cfg.dtype)
    return nn.with_logical_constraint(y, ('batch', 'length', 'embed'))

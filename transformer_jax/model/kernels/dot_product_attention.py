"""Scaled dot-product attention, softmax(Q K^T / sqrt(d_k) + bias) V, by the kernel a
platform gets (`attention`), and `Lengths`, the form of a mask that fused kernels take.

`jax.nn.dot_product_attention` serves where it can (cuDNN's fused kernel on a GPU, XLA's
elsewhere); the weights are formed here, in float32, for attention dropout, for the weights
themselves (attention plots), for the heads-major decode caches and on a CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


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


def attention(
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
  XLA path spends longer in the softmax and masks (bench/RESULTS.md, section
  "CPU training: the explicit softmax against `jax.nn`'s XLA attention").

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
    # head) and transposes, slower for the beams of a sentence over the source's cache
    # (q = beams; bench/RESULTS.md, section "heads-major decode caches");
    # with one query position both forms are the same product.
    out = jnp.swapaxes(jnp.einsum('bhqk,bhkd->bhqd', probs.astype(value.dtype), value), 1, 2)
  else:
    out = jnp.einsum(f'bhqk,{kv}->bqhd', probs.astype(value.dtype), value)
  return out, (weights if return_weights else None)

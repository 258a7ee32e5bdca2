"""A post-norm sub-layer's dropout + residual + LayerNorm as one Pallas kernel each way.

`LayerNorm(x + Dropout(y))` ends every post-norm sub-layer (`models.SubLayer`, which calls
`add_and_norm` here). XLA computes
it as several kernels forward and backward. `residual_layer_norm` is one Pallas kernel
forward (the dropped sum, its float32 statistics, the normalised output) and one backward
(the input gradients and each row block's partial scale and bias gradients), with the
gradient by `jax.custom_vjp`. It is `config.post_norm_kernel='pallas'`: compiled by Triton on
GPUs, run by Pallas's interpreter on CPU (for tests: slow), off by default because no GPU
has yet shown it faster than XLA's kernels (bench/RESULTS.md, section
"Compile-only: a Pallas post-norm kernel, stacked q/k/v and a packed optimizer").

The dropout mask is drawn as `nn.Dropout` would, from the same random stream
(`DropoutMask`), one byte an element.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import TransformerConfig

Array = jax.Array

# Rows a kernel instance normalises. Triton's blocks are powers of two, so d_model must be.
BLOCK_ROWS = 16


def _sum_and_stats(x, y, keep, rate, dtype):
  """The dropped sum in the model's dtype (as `x + Dropout(y)` rounds it) and its float32
  mean and 1/std's ingredients."""
  y = y.astype(jnp.float32)
  if keep is not None:
    # Rounded to the model's dtype, as XLA rounds `y / keep_rate` (Triton has no bfloat16
    # division, XLA computes it in float32 as well).
    y = jnp.where(keep != 0, y / (1.0 - rate), 0.0).astype(dtype).astype(jnp.float32)
  total = (x.astype(jnp.float32) + y).astype(dtype)
  t = total.astype(jnp.float32)
  mean = jnp.mean(t, axis=-1)
  return total, mean, t - mean[:, None]


def _forward_kernel(*refs, rate, epsilon, has_keep):
  if has_keep:
    x_ref, y_ref, keep_ref, scale_ref, bias_ref, out_ref, sum_ref, mean_ref, rstd_ref = refs
    keep = keep_ref[...]
  else:
    x_ref, y_ref, scale_ref, bias_ref, out_ref, sum_ref, mean_ref, rstd_ref = refs
    keep = None
  total, mean, centred = _sum_and_stats(x_ref[...], y_ref[...], keep, rate, out_ref.dtype)
  rstd = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1) + epsilon)
  scale = scale_ref[...].astype(jnp.float32)
  bias = bias_ref[...].astype(jnp.float32)
  out = centred * rstd[:, None] * scale[None, :] + bias[None, :]
  out_ref[...] = out.astype(out_ref.dtype)
  sum_ref[...] = total
  mean_ref[...] = mean
  rstd_ref[...] = rstd


def _backward_kernel(*refs, rate, has_keep):
  if has_keep:
    (
        grad_ref,
        sum_ref,
        keep_ref,
        scale_ref,
        mean_ref,
        rstd_ref,
        dx_ref,
        dy_ref,
        dscale_ref,
        dbias_ref,
    ) = refs
  else:
    grad_ref, sum_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dy_ref, dscale_ref, dbias_ref = refs
  g = grad_ref[...].astype(jnp.float32)
  rstd = rstd_ref[...][:, None]
  normed = (sum_ref[...].astype(jnp.float32) - mean_ref[...][:, None]) * rstd
  scaled = g * scale_ref[...].astype(jnp.float32)[None, :]
  dx = rstd * (
      scaled
      - jnp.mean(scaled, axis=-1)[:, None]
      - normed * jnp.mean(scaled * normed, axis=-1)[:, None]
  )
  dx_ref[...] = dx.astype(dx_ref.dtype)
  if has_keep:
    dy = jnp.where(keep_ref[...] != 0, dx / (1.0 - rate), 0.0)
  else:
    dy = dx
  dy_ref[...] = dy.astype(dy_ref.dtype)
  dscale_ref[...] = jnp.sum(g * normed, axis=0)[None, :]
  dbias_ref[...] = jnp.sum(g, axis=0)[None, :]


def _call(kernel, inputs, outputs, *, interpret):
  """`pallas_call` of `kernel` over blocks of BLOCK_ROWS rows.

  Args:
    inputs: (array, kind) pairs: 'rows' ([n, d] or [n], blocked by rows) or 'whole' ([d]).
    outputs: (ShapeDtypeStruct, kind) pairs: 'rows', or 'partial' ([n / BLOCK_ROWS, d], one
      row per block).
  """

  def spec(shape, kind):
    if kind == 'whole':
      return pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    if kind == 'partial':
      return pl.BlockSpec((1, shape[1]), lambda i: (i, 0))
    block = (BLOCK_ROWS,) + tuple(shape[1:])
    return pl.BlockSpec(block, lambda i: (i,) + (0,) * (len(shape) - 1))

  rows = inputs[0][0].shape[0]
  return pl.pallas_call(
      kernel,
      out_shape=tuple(s for s, _ in outputs),
      grid=(rows // BLOCK_ROWS,),
      in_specs=[spec(a.shape, kind) for a, kind in inputs],
      out_specs=tuple(spec(s.shape, kind) for s, kind in outputs),
      compiler_params=None if interpret else pallas_triton.CompilerParams(num_warps=4),
      interpret=interpret,
  )(*(a for a, _ in inputs))


def _local_forward(x, y, keep, scale, bias, *, rate, epsilon, interpret):
  """One device's rows: the output like x, and the backward's residuals over padded rows."""
  shape, d = x.shape, x.shape[-1]
  rows = x.size // d
  flat = lambda a: jnp.pad(a.reshape(rows, d), ((0, -rows % BLOCK_ROWS), (0, 0)))
  n = rows + -rows % BLOCK_ROWS
  inputs = [(flat(x), 'rows'), (flat(y), 'rows')]
  if keep is not None:
    inputs.append((flat(keep), 'rows'))
  row = jax.ShapeDtypeStruct((n, d), x.dtype)
  stat = jax.ShapeDtypeStruct((n,), jnp.float32)
  out, total, mean, rstd = _call(
      functools.partial(_forward_kernel, rate=rate, epsilon=epsilon, has_keep=keep is not None),
      inputs + [(scale, 'whole'), (bias, 'whole')],
      [(row, 'rows'), (row, 'rows'), (stat, 'rows'), (stat, 'rows')],
      interpret=interpret,
  )
  return out[:rows].reshape(shape), total, mean, rstd


def _local_backward(grad, total, keep, scale, mean, rstd, *, rate, interpret):
  """One device's rows: the input gradients like grad, and each row block's partial sums
  of the scale and bias gradients."""
  shape, d = grad.shape, grad.shape[-1]
  rows, n = grad.size // d, total.shape[0]
  inputs = [(jnp.pad(grad.reshape(rows, d), ((0, n - rows), (0, 0))), 'rows'), (total, 'rows')]
  if keep is not None:
    inputs.append((jnp.pad(keep.reshape(rows, d), ((0, n - rows), (0, 0))), 'rows'))
  row = jax.ShapeDtypeStruct((n, d), total.dtype)
  partial = jax.ShapeDtypeStruct((n // BLOCK_ROWS, d), jnp.float32)
  dx, dy, dscale, dbias = _call(
      functools.partial(_backward_kernel, rate=rate, has_keep=keep is not None),
      inputs + [(scale, 'whole'), (mean, 'rows'), (rstd, 'rows')],
      [(row, 'rows'), (row, 'rows'), (partial, 'partial'), (partial, 'partial')],
      interpret=interpret,
  )
  unpad = lambda a: a[:rows].reshape(shape)
  return unpad(dx), unpad(dy), dscale, dbias


def _mesh_axes(entries) -> list[str]:
  """The mesh axes that PartitionSpec entries (None, a name, or a tuple of names) split over."""
  axes = []
  for entry in entries:
    axes.extend(entry if isinstance(entry, tuple) else [entry] if entry else [])
  return axes


def _on_rows(fn, spec, in_kinds, out_kinds):
  """fn on each device's rows (`jax.shard_map` over spec's axes), or as it is without one.

  Kinds: 'x' ([..., d], split as spec says), 'flat' (one device's rows after another's, in
  the residuals), 'whole' (replicated), None (an absent input).
  """
  if spec is None:
    return fn
  flat = P(tuple(_mesh_axes(spec[:-1])) or None)
  specs = {'x': spec, 'flat': flat, 'whole': P(), None: None}
  return jax.shard_map(
      fn,
      in_specs=tuple(specs[k] for k in in_kinds),
      out_specs=tuple(specs[k] for k in out_kinds),
      check_vma=False,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(x, y, keep, scale, bias, rate, epsilon, interpret, spec):
  return _fused_forward(x, y, keep, scale, bias, rate, epsilon, interpret, spec)[0]


def _fused_forward(x, y, keep, scale, bias, rate, epsilon, interpret, spec):
  forward = _on_rows(
      functools.partial(_local_forward, rate=rate, epsilon=epsilon, interpret=interpret),
      spec,
      ('x', 'x', 'x' if keep is not None else None, 'whole', 'whole'),
      ('x', 'flat', 'flat', 'flat'),
  )
  out, total, mean, rstd = forward(x, y, keep, scale, bias)
  return out, (total, keep, scale, mean, rstd)


def _fused_backward(rate, epsilon, interpret, spec, residuals, grad):
  del epsilon
  total, keep, scale, mean, rstd = residuals
  backward = _on_rows(
      functools.partial(_local_backward, rate=rate, interpret=interpret),
      spec,
      ('x', 'flat', 'x' if keep is not None else None, 'whole', 'flat', 'flat'),
      ('x', 'x', 'flat', 'flat'),
  )
  dx, dy, dscale, dbias = backward(grad, total, keep, scale, mean, rstd)
  return (
      dx,
      dy,
      None,
      jnp.sum(dscale, axis=0).astype(scale.dtype),
      jnp.sum(dbias, axis=0).astype(scale.dtype),
  )


_fused.defvjp(_fused_forward, _fused_backward)


def residual_layer_norm(
    x: Array,
    y: Array,
    keep: Array | None,
    scale: Array,
    bias: Array,
    *,
    rate: float,
    epsilon: float,
    interpret: bool,
    spec: P | None = None,
) -> Array:
  """LayerNorm(x + Dropout(y)) with float32 statistics, as one kernel each way.

  Args:
    x: the residual, [..., d], in the model's dtype; d a power of two.
    y: the sub-layer's output, like x (cast to x's dtype).
    keep: where dropout keeps y (nonzero = kept), x's shape; None: no dropout.
    scale, bias: the LayerNorm's parameters, [d], of one dtype.
    rate: the dropout rate (kept elements are divided by 1 - rate).
    epsilon: added to the variance.
    interpret: run Pallas's interpreter (CPU) instead of compiling for a GPU.
    spec: how x is split over the current mesh (its last entry None), so that each device
      normalises its own rows; None: no mesh (XLA cannot split a Pallas call: it would
      gather every row to every device). Rows that do not split evenly (a small decoding
      batch) are normalised whole.

  Returns:
    The normalised sum, like x.
  """
  if spec is not None:
    sizes = jax.sharding.get_abstract_mesh().shape
    if any(
        size % math.prod(sizes[a] for a in _mesh_axes([entry]))
        for size, entry in zip(x.shape, spec)
    ):
      spec = None
  if keep is not None:
    keep = keep.astype(jnp.int8)
  return _fused(
      x, y.astype(x.dtype), keep, scale, bias, float(rate), float(epsilon), bool(interpret), spec
  )


class DropoutMask(nn.Module):
  """Where `nn.Dropout(rate)` keeps its input. Named as that module is, it draws the same
  random bits."""

  rate: float

  @nn.compact
  def __call__(self, shape: tuple[int, ...]) -> Array:
    return jax.random.bernoulli(self.make_rng('dropout'), 1.0 - self.rate, shape)


class FusedResidualNorm(nn.Module):
  """LayerNorm(x + Dropout(y)) by `residual_layer_norm`, with the parameters `nn.LayerNorm`
  has; on a mesh, each device normalises its own rows."""

  rate: float
  epsilon: float
  dtype: Any
  param_dtype: Any
  interpret: bool
  scale_init: Callable[..., Array]
  bias_init: Callable[..., Array]

  @nn.compact
  def __call__(self, x: Array, y: Array, keep: Array | None) -> Array:
    scale = self.param('scale', self.scale_init, (x.shape[-1],), self.param_dtype)
    bias = self.param('bias', self.bias_init, (x.shape[-1],), self.param_dtype)
    mesh = jax.sharding.get_abstract_mesh()
    spec = None
    if not mesh.empty and mesh.size > 1:
      spec = P(*nn.logical_to_mesh_axes(('batch', 'length')), None)
    return residual_layer_norm(
        x.astype(self.dtype),
        y,
        keep,
        scale,
        bias,
        rate=self.rate,
        epsilon=self.epsilon,
        interpret=self.interpret,
        spec=spec,
    )


def add_and_norm(
    config: TransformerConfig, x: Array, y: Array, norm_init: tuple[Callable, Callable]
) -> Array:
  """LayerNorm(x + Dropout(y)) in one kernel each way, called inside a sub-layer's compact
  method: its modules, 'Dropout_0' and 'norm', are the caller's children, named and drawing
  random bits as `nn.Dropout` and `nn.LayerNorm` there would.

  Args:
    config: the model config.
    x: [batch, length, d_model] the sub-layer's input (the residual).
    y: [batch, length, d_model] the sub-layer's output.
    norm_init: (scale_init, bias_init) of the layer norm's parameters.
  """
  keep = None
  if not config.deterministic and config.dropout_rate > 0:
    keep = DropoutMask(config.dropout_rate, name='Dropout_0')(y.shape)
  return FusedResidualNorm(
      rate=config.dropout_rate,
      epsilon=config.layer_norm_epsilon,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      interpret=config.post_norm_kernel == 'pallas_interpret',
      scale_init=norm_init[0],
      bias_init=norm_init[1],
      name='norm',
  )(x, y, keep)

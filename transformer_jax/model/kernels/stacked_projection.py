"""Several projections of one input, by [d_model, heads, head_dim] kernels, as one product
(`config.qkv_projection='stacked'`, what a GPU gets: one large matrix product keeps its matrix
units busier than three small ones; `kernel_choice.for_platform`).

The kernels are stacked at use, on an axis of their own so that a split of the heads over a
mesh stays where it is; the parameters are those of the separate projections.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def project(x: Array, kernels: Sequence[Array], biases: Sequence[Array]) -> tuple[Array, ...]:
  """[batch, length, d_model] -> one [batch, length, heads, head_dim] a kernel: x times each
  kernel plus its bias, from one product."""
  y = jnp.einsum('bld,dnhk->blnhk', x, jnp.stack(kernels, 1)) + jnp.stack(biases)
  return tuple(y[:, :, i] for i in range(len(kernels)))

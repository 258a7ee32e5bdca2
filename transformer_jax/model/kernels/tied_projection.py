"""The tied output layer's product, `x` against the embedding's rows, with its own backward.

`project(x, rows)` is `jnp.einsum('...d,vd->...v', x, rows)`. Autodiff's transpose rule makes
XLA:CPU form the logits' [tokens, vocab] gradient twice, once in each layout, to multiply it by
the rows and by x; the backward written here reads it in the one layout it has. Measured on the
main job's step in bench/RESULTS.md, section "CPU: the main job in ten minutes on a Zen 3".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.custom_vjp
def project(x: Array, rows: Array) -> Array:
  """[..., d] -> [..., v]: `x` against each of the [v, d] `rows`."""
  return jnp.einsum('...d,vd->...v', x, rows)


def _project_fwd(x, rows):
  return project(x, rows), (x, rows)


def _project_bwd(residuals, g):
  x, rows = residuals
  dx = jnp.einsum('...v,vd->...d', g, rows)
  drows = jnp.einsum('...d,...v->dv', x, g).T
  return dx, drows


project.defvjp(_project_fwd, _project_bwd)

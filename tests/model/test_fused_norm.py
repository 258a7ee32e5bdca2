"""The fused dropout + residual + LayerNorm kernel (`fused_norm`), in Pallas's interpreter:
its values and gradients against the same math in JAX, and on a mesh of 4 simulated devices
(a subprocess: this file run as a script) against one device.

Triton compiles the same kernels for GPUs: `test_aot` compiles tiny with them for H100 hosts.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_testlib
from transformer_jax.model.kernels import fused_norm


def _reference(x, y, keep, scale, bias, rate, epsilon):
  """LayerNorm(x + Dropout(y)) in float32 from x and y as given."""
  x, y = x.astype(jnp.float32), y.astype(jnp.float32)
  if keep is not None:
    y = jnp.where(keep, y / (1.0 - rate), 0.0)
  total = x + y
  mean = total.mean(-1, keepdims=True)
  var = ((total - mean) ** 2).mean(-1, keepdims=True)
  return (total - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias


def _inputs(dtype, shape=(3, 7, 64)):
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], shape, dtype)
  y = jax.random.normal(keys[1], shape, dtype)
  keep = jax.random.bernoulli(keys[2], 0.7, shape)
  scale = 1.0 + 0.1 * jax.random.normal(keys[3], shape[-1:])
  bias = 0.1 * jax.random.normal(keys[4], shape[-1:])
  weights = jax.random.normal(keys[5], shape)  # A loss that weighs every output differently.
  return x, y, keep, scale, bias, weights


@pytest.mark.parametrize(
    'dtype,tolerance',
    [
        # float32: the same sums in another order. bfloat16: the kernel rounds the dropped sum
        # to bfloat16 as the model does (2^-8 of its size), then normalises in float32.
        (jnp.float32, 1e-5),
        (jnp.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize('dropout', [True, False])
def test_values_and_gradients_match_the_same_math_in_jax(dtype, tolerance, dropout):
  """21 rows (padded to 32: two blocks of 16), with and without a dropout mask."""
  x, y, keep, scale, bias, weights = _inputs(dtype)
  keep = keep if dropout else None

  def loss(fn, x, y, scale, bias):
    return jnp.sum(weights * fn(x, y, scale, bias).astype(jnp.float32))

  fused = lambda x, y, s, b: fused_norm.residual_layer_norm(
      x, y, keep, s, b, rate=0.3, epsilon=1e-6, interpret=True
  )
  reference = lambda x, y, s, b: _reference(x, y, keep, s, b, 0.3, 1e-6)
  out = jax.jit(fused)(x, y, scale, bias)
  assert out.dtype == dtype and out.shape == x.shape
  expected = reference(x, y, scale, bias)
  np.testing.assert_allclose(
      np.asarray(out, np.float32), expected, atol=tolerance * float(jnp.abs(expected).max())
  )
  grads = jax.jit(jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2, 3)))(x, y, scale, bias)
  want = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(
      x.astype(jnp.float32), y.astype(jnp.float32), scale, bias
  )
  for name, got, exact in zip(('x', 'y', 'scale', 'bias'), grads, want):
    largest = float(jnp.abs(exact).max())
    np.testing.assert_allclose(
        np.asarray(got, np.float32), exact, atol=tolerance * largest, err_msg=name
    )
  if dropout:  # Dropped elements get no gradient; the mask is applied, not ignored.
    assert not np.asarray(grads[1])[~np.asarray(keep)].any()
    assert np.asarray(grads[1])[np.asarray(keep)].any()


def _sharded_worker() -> dict:
  """Runs in the 4-device subprocess: the model's fused norm on a data x tensor mesh and on
  one device; returns the largest differences."""
  import ml_collections

  from transformer_jax.model import models
  from transformer_jax.model.config import TransformerConfig
  from transformer_jax.runtime.partitioning import Partitioner

  assert jax.device_count() == 4, jax.devices()
  cfg = TransformerConfig(
      vocab_size=40,
      d_model=64,
      num_heads=4,
      d_ff=64,
      dropout_rate=0.3,
      post_norm_kernel='pallas_interpret',
  )
  x, y, _, _, _, weights = _inputs(jnp.float32, (4, 8, 64))
  module = models.SubLayer(cfg)
  variables = module.init(jax.random.key(1), x, lambda h: h * y)
  rngs = {'dropout': jax.random.key(2)}

  def loss(params, x):
    out = module.apply({'params': params}, x, lambda h: h * y, rngs=rngs)
    return jnp.sum(weights * out)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  single = grad(variables['params'], x)
  config = ml_collections.ConfigDict(
      {'mesh': {'data': 2, 'fsdp': 1, 'tensor': 2}, 'logical_axis_rules': ()}
  )
  partitioner = Partitioner.from_config(config, devices=jax.devices())
  with partitioner.activate():
    x_split = jax.device_put(x, partitioner.batch_sharding)
    sharded = grad(variables['params'], x_split)
    lowered = grad.lower(variables['params'], x_split).as_text()
  return {
      'largest': max(float(np.abs(np.asarray(a)).max()) for a in jax.tree.leaves(single)),
      'difference': max(
          float(np.abs(np.asarray(a) - np.asarray(b)).max())
          for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single))
      ),
      'manual': lowered.count('manual_computation'),
  }


def test_a_mesh_of_four_devices_normalises_as_one_device_does():
  """Rows split over 'data', the scale and bias gradients summed over it: the same values."""
  process = subprocess.run(
      [sys.executable, __file__],
      capture_output=True,
      text=True,
      timeout=600,
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(devices=4),
      check=False,
  )
  assert process.returncode == 0, process.stderr[-3000:]
  report = json.loads(process.stdout.strip().splitlines()[-1])
  assert report['difference'] <= 1e-5 * report['largest'], report
  # Forward and backward each ran per device (a `shard_map`), not on gathered rows.
  assert report['manual'] == 2, report


if __name__ == '__main__':
  print(json.dumps(_sharded_worker()))

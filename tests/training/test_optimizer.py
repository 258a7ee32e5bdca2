"""The learning-rate schedule and the optax chain against the paper's formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from transformer_jax.config import base_config
from transformer_jax.config import ConfigError
from transformer_jax.training import optimizer


def paper_lrate(step, d_model=512, warmup=4000):
  """Section 5.3, written independently: step counts from 1."""
  return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def test_schedule_is_the_papers_formula():
  schedule = optimizer.learning_rate_schedule(512, 4000)
  for count in (0, 1, 99, 3998, 3999, 4000, 10_000, 99_999):
    np.testing.assert_allclose(float(schedule(count)), paper_lrate(count + 1), rtol=1e-6)


def test_schedule_rises_linearly_then_decays_as_inverse_sqrt():
  schedule = optimizer.learning_rate_schedule(1024, 100, scale=2.0)
  rates = np.array([float(schedule(c)) for c in range(400)])
  peak = int(np.argmax(rates))
  assert peak == 99  # Step 100 = warmup_steps (count 99).
  np.testing.assert_allclose(rates[peak], 2.0 * 1024**-0.5 * 100**-0.5, rtol=1e-6)
  np.testing.assert_allclose(np.diff(rates[: peak + 1]), rates[0], rtol=1e-4)  # Linear.
  np.testing.assert_allclose(rates[399] / rates[99], (100 / 400) ** 0.5, rtol=1e-5)


def test_cooldown_falls_linearly_to_zero_over_the_last_steps():
  paper = optimizer.learning_rate_schedule(128, 10)
  cooled = optimizer.learning_rate_schedule(128, 10, num_train_steps=100, cooldown_steps=40)
  for count in (0, 9, 30, 59, 60):  # Before the cooldown (and its first update): the paper.
    np.testing.assert_allclose(float(cooled(count)), float(paper(count)), rtol=1e-6)
  for count in (61, 80, 99):
    np.testing.assert_allclose(
        float(cooled(count)), float(paper(count)) * (100 - count) / 40, rtol=1e-6
    )
  assert float(cooled(100)) == 0.0 and float(cooled(500)) == 0.0


def test_cooldown_comes_from_the_config_and_reaches_the_chain():
  config = tiny.get_config()
  config.num_train_steps, config.lr_cooldown_steps = 20, 5
  cfg = optimizer.OptimizerConfig.from_config(config, d_model=32)
  _, schedule = optimizer.create_optimizer(cfg)
  assert float(schedule(14)) > 0 and float(schedule(19)) == pytest.approx(
      float(optimizer.learning_rate_schedule(32, config.warmup_steps)(19)) / 5, rel=1e-6
  )


def test_constant_schedule_holds_the_peak_then_cools_down():
  paper = optimizer.learning_rate_schedule(128, 10)
  wsd = optimizer.learning_rate_schedule(
      128, 10, num_train_steps=100, cooldown_steps=40, after_warmup='constant'
  )
  peak = 128**-0.5 * 10**-0.5
  for count in range(10):  # The warmup is the paper's.
    np.testing.assert_allclose(float(wsd(count)), float(paper(count)), rtol=1e-6)
  for count in (9, 30, 60):
    np.testing.assert_allclose(float(wsd(count)), peak, rtol=1e-6)
  for count in (61, 80, 99):
    np.testing.assert_allclose(float(wsd(count)), peak * (100 - count) / 40, rtol=1e-6)
  assert float(wsd(100)) == 0.0


def test_schedule_comes_from_the_config():
  config = tiny.get_config()
  config.lr_schedule = 'constant'
  _, schedule = optimizer.create_optimizer(optimizer.OptimizerConfig.from_config(config, 32))
  late = config.warmup_steps * 50
  assert float(schedule(late)) == pytest.approx(float(schedule(config.warmup_steps - 1)))


def adam_reference(grads_seq, params, lr_fn, b1=0.9, b2=0.98, eps=1e-9):
  """Kingma & Ba's Adam with bias correction, in numpy."""
  m = np.zeros_like(params)
  v = np.zeros_like(params)
  for t, g in enumerate(grads_seq, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    params = params - lr_fn(t - 1) * m_hat / (np.sqrt(v_hat) + eps)
  return params


def test_default_chain_is_adam_with_the_papers_hyperparameters():
  cfg = optimizer.OptimizerConfig.from_config(base_config(), d_model=512)
  assert (cfg.b1, cfg.b2, cfg.eps, cfg.warmup_steps) == (0.9, 0.98, 1e-9, 4000)
  tx, schedule = optimizer.create_optimizer(cfg)
  rng = np.random.default_rng(0)
  params = rng.normal(size=(5, 3)).astype(np.float32)
  grads_seq = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(4)]
  state = tx.init(jnp.asarray(params))
  p = jnp.asarray(params)
  for g in grads_seq:
    updates, state = tx.update(jnp.asarray(g), state, p)
    p = p + updates
  expected = adam_reference(grads_seq, params.astype(np.float64), lambda c: paper_lrate(c + 1))
  np.testing.assert_allclose(np.asarray(p), expected, rtol=1e-5, atol=1e-8)


def test_clipping_scales_gradients_to_the_global_norm():
  base = optimizer.OptimizerConfig(d_model=16, warmup_steps=1)
  clipped = optimizer.OptimizerConfig(d_model=16, warmup_steps=1, grad_clip_norm=0.5)
  params = {'a': jnp.ones((2, 2)), 'b': jnp.ones((3,))}
  grads = {'a': jnp.full((2, 2), 3.0), 'b': jnp.array([4.0, 0.0, -1.0])}
  norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in grads.values())))
  scaled = jax.tree.map(lambda g: g * 0.5 / norm, grads)
  # Adam's first step is nearly scale-invariant, so compare the second step, whose moments
  # mix the (clipped or pre-scaled) first gradient with a small unclipped one.
  tx_c, _ = optimizer.create_optimizer(clipped)
  tx_b, _ = optimizer.create_optimizer(base)
  state_c, state_b = tx_c.init(params), tx_b.init(params)
  second = jax.tree.map(lambda g: -0.01 * g, grads)  # Below the threshold: untouched.
  for g_c, g_b in ((grads, scaled), (second, second)):
    up_c, state_c = tx_c.update(g_c, state_c, params)
    up_b, state_b = tx_b.update(g_b, state_b, params)
  for k in params:
    np.testing.assert_allclose(up_c[k], up_b[k], rtol=1e-5)


def test_weight_decay_shrinks_matrices_but_not_vectors():
  cfg = optimizer.OptimizerConfig(d_model=16, warmup_steps=1, weight_decay=0.5)
  tx, schedule = optimizer.create_optimizer(cfg)
  params = {'kernel': jnp.full((2, 2), 2.0), 'bias': jnp.full((2,), 2.0)}
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  lr = float(schedule(0))
  np.testing.assert_allclose(updates['kernel'], -lr * 0.5 * 2.0, rtol=1e-6)
  np.testing.assert_allclose(updates['bias'], 0.0)


@pytest.mark.parametrize(
    'field,value',
    [
        ('warmup_steps', 0),
        ('learning_rate_scale', 0.0),
        ('adam_b2', 1.0),
        ('adam_eps', 0.0),
        ('weight_decay', -1.0),
        ('grad_clip_norm', -0.1),
        ('lr_cooldown_steps', -1),
        ('lr_cooldown_steps', 10**9),
        ('lr_schedule', 'cosine'),
    ],
)
def test_bad_fields_raise_config_error_naming_them(field, value):
  config = tiny.get_config()
  config[field] = value
  with pytest.raises(ConfigError, match=field):
    optimizer.OptimizerConfig.from_config(config, d_model=32)

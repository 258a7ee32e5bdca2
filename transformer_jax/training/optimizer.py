"""The optimizer: the paper's learning-rate schedule and Adam, as one optax chain.

Section 5.3 of the paper: Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9 and

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5),

a linear rise for `warmup_steps` steps, then inverse-square-root decay. Optional extras for
runs that want them: a constant rate after the warmup instead of the decay (`lr_schedule`), a
linear cooldown to zero over the last `lr_cooldown_steps` steps (the two together are the
warmup-stable-decay schedule of short runs), gradient clipping by global norm and decoupled
weight decay (AdamW).
Gradient accumulation is not an optax wrapper here; the train step sums microbatch gradients
itself (see `train_steps.py` for why).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import optax

from transformer_jax.config import ConfigError

# After the warmup: 'rsqrt', the paper's inverse-square-root decay; 'constant', the peak rate.
SCHEDULES = ('rsqrt', 'constant')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer's fields of the run config, validated and frozen."""

  d_model: int
  warmup_steps: int = 4000
  learning_rate_scale: float = 1.0
  schedule: str = 'rsqrt'
  num_train_steps: int = 0
  cooldown_steps: int = 0
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0

  def __post_init__(self):
    checks = (
        (
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 1,
            f'warmup_steps={self.warmup_steps!r} must be an int >= 1 (the paper: 4000).',
        ),
        (
            self.learning_rate_scale > 0,
            f'learning_rate_scale={self.learning_rate_scale!r} must be > 0 (1.0 is the '
            "paper's schedule).",
        ),
        (
            self.schedule in SCHEDULES,
            f"lr_schedule={self.schedule!r} must be one of {SCHEDULES} ('rsqrt': the paper).",
        ),
        (
            isinstance(self.cooldown_steps, int)
            and 0 <= self.cooldown_steps <= max(self.num_train_steps, 0),
            f'lr_cooldown_steps={self.cooldown_steps!r} must be an int in [0, num_train_steps='
            f"{self.num_train_steps}] (0: the paper's schedule, no cooldown).",
        ),
        (
            0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0,
            f'adam_b1={self.b1!r} and adam_b2={self.b2!r} must be in [0, 1) (the paper: '
            '0.9, 0.98).',
        ),
        (self.eps > 0, f'adam_eps={self.eps!r} must be > 0 (the paper: 1e-9).'),
        (
            self.weight_decay >= 0,
            f'weight_decay={self.weight_decay!r} must be >= 0 (0 disables it).',
        ),
        (
            self.grad_clip_norm >= 0,
            f'grad_clip_norm={self.grad_clip_norm!r} must be >= 0 (0 disables clipping).',
        ),
    )
    for ok, message in checks:
      if not ok:
        raise ConfigError(message + ' Set --config.<field> accordingly.')

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, d_model: int) -> 'OptimizerConfig':
    """Reads the training fields of the run config (see `config.base_config`).

    Raises:
      ConfigError: a field is out of range; the message names it.
    """
    return cls(
        d_model=d_model,
        warmup_steps=config.warmup_steps,
        learning_rate_scale=float(config.learning_rate_scale),
        schedule=config.lr_schedule,
        num_train_steps=config.num_train_steps,
        cooldown_steps=config.lr_cooldown_steps,
        b1=float(config.adam_b1),
        b2=float(config.adam_b2),
        eps=float(config.adam_eps),
        weight_decay=float(config.weight_decay),
        grad_clip_norm=float(config.grad_clip_norm),
    )


def learning_rate_schedule(
    d_model: int,
    warmup_steps: int,
    scale: float = 1.0,
    num_train_steps: int = 0,
    cooldown_steps: int = 0,
    after_warmup: str = 'rsqrt',
) -> optax.Schedule:
  """The paper's schedule as an optax schedule of the update count.

  optax counts updates from 0 and the paper counts steps from 1, so update `count` uses
  step = count + 1: the first update already has a non-zero rate, and the peak,
  d_model^-0.5 * warmup^-0.5, is reached at update `warmup_steps - 1`. Written by hand
  because optax has no inverse-square-root schedule.

  With `cooldown_steps` > 0 the rate is further multiplied by
  `(num_train_steps - count) / cooldown_steps` over the last `cooldown_steps` updates: a
  linear fall to 1/cooldown_steps of the paper's rate at the last update. Changing
  `num_train_steps` on resume moves the cooldown with it.

  With `after_warmup='constant'` the rate holds the peak after the warmup instead of
  decaying; with a cooldown that is the warmup-stable-decay schedule.

  Args:
    d_model: the model width.
    warmup_steps: steps of linear warmup.
    scale: a factor on the whole schedule.
    num_train_steps: the run's length; read only with `cooldown_steps`.
    cooldown_steps: updates of linear cooldown at the end (0: none, the paper).
    after_warmup: one of `SCHEDULES`.

  Returns:
    A function from the update count (int array) to the learning rate (float32).
  """

  def schedule(count: jax.Array) -> jax.Array:
    count = jnp.asarray(count, jnp.float32)
    step = count + 1.0
    after = (
        jax.lax.rsqrt(step) if after_warmup == 'rsqrt' else jnp.float32(float(warmup_steps) ** -0.5)
    )
    rate = (scale * d_model**-0.5) * jnp.minimum(after, step * float(warmup_steps) ** -1.5)
    if cooldown_steps:
      rate *= jnp.clip((num_train_steps - count) / cooldown_steps, 0.0, 1.0)
    return rate

  return schedule


def _decay_mask(params):
  """Weight decay on matrices only: biases and layer-norm scales are left alone."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def create_optimizer(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Adam (or AdamW) with the paper's schedule, after optional global-norm clipping.

  Args:
    cfg: the optimizer config.

  Returns:
    (the optax transformation, its learning-rate schedule, for logging).
  """
  schedule = learning_rate_schedule(
      cfg.d_model,
      cfg.warmup_steps,
      cfg.learning_rate_scale,
      cfg.num_train_steps,
      cfg.cooldown_steps,
      cfg.schedule,
  )
  if cfg.weight_decay > 0:
    adam = optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask
    )
  else:
    adam = optax.adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
  if cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adam), schedule
  return adam, schedule

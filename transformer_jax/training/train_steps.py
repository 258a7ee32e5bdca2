"""The train state and the sharded train and eval steps.

One loss function serves both steps (`batch_metrics`). The train step:

  * derives its dropout key from the seed and the step number, so a resumed run draws the
    same masks as an uninterrupted one;
  * accumulates gradients over `grad_accum_steps` microbatches with `lax.scan`, summing the
    *unnormalized* loss and dividing once by the batch's token count, so the update is
    the full batch's (token-weighted) gradient. `optax.MultiSteps` would instead average
    per-microbatch means, weighting microbatches with few tokens as much as full ones, and
    would turn one step into several calls with the accumulator in the checkpoint;
  * skips an update whose loss or gradient is not finite (parameters and optimizer state
    unchanged, `skipped_steps` counted). `optax.apply_if_finite` only inspects gradients
    and keeps its counter inside the optimizer state, hence the few lines here;
  * with `ema_decay`, moves the exponential moving average of the parameters towards the
    updated ones (`update_ema`), in the state beside them rather than as an optax
    transformation, whose state would hide it among the optimizer's.

`jit_train_step` and `jit_eval_step` compile them with explicit input and output shardings
(parameters and optimizer state by the logical-axis rules, batches over the batch axes,
metrics replicated) and donate the state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformer_jax.config import PAD_ID
from transformer_jax.model import losses
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import BATCH_KEYS
from transformer_jax.model.models import Transformer
from transformer_jax.runtime.partitioning import Partitioner

Array = jax.Array
Batch = Mapping[str, Array]
Metrics = dict[str, Array]


@flax.struct.dataclass
class TrainState:
  """Everything a step changes; all of it goes into the checkpoint.

  Attributes:
    step: int32 scalar, steps taken (= batches consumed, skipped updates included).
    params: the model parameters (float32).
    opt_state: the optax state.
    skipped_steps: int32 scalar, updates skipped for a non-finite loss or gradient.
    ema_params: with `ema_decay`, the exponential moving average of `params` (float32,
      sharded as they are); None without.
  """

  step: Array
  params: Any
  opt_state: optax.OptState
  skipped_steps: Array
  ema_params: Any = None


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The fixed settings of the train step (hashable, closed over by `jax.jit`).

  Attributes:
    model: the model config for training (dropout on).
    seed: the run's seed; dropout keys are derived from it and the step.
    dropout_rng_impl: the PRNG implementation of the dropout keys (`jax.random.key`'s impl).
    label_smoothing: eps of the label-smoothed loss.
    grad_accum_steps: microbatches a step.
    ema_decay: the decay of the parameters' moving average (0: none kept).
  """

  model: TransformerConfig
  seed: int = 0
  dropout_rng_impl: str = 'rbg'
  label_smoothing: float = 0.1
  grad_accum_steps: int = 1
  ema_decay: float = 0.0

  @classmethod
  def from_config(cls, config: Any, model: TransformerConfig) -> 'StepConfig':
    """The step settings of a run config (`config.base_config` fields)."""
    return cls(
        model,
        seed=config.seed,
        dropout_rng_impl=config.dropout_rng_impl,
        label_smoothing=config.label_smoothing,
        grad_accum_steps=config.grad_accum_steps,
        ema_decay=float(config.ema_decay),
    )


def batch_metrics(
    model: Transformer,
    params: Any,
    batch: Batch,
    label_smoothing: float,
    dropout_key: Array | None = None,
) -> Metrics:
  """The loss and metric sums of one batch; the train and eval steps both call this.

  Args:
    model: a `Transformer` (deterministic for evaluation).
    params: its parameters.
    batch: [rows, length] int32 arrays under `BATCH_KEYS`.
    label_smoothing: eps.
    dropout_key: the dropout key; None for a deterministic model.

  Returns:
    Sums over the non-padding target tokens, see `losses.compute_metrics`.
  """
  rngs = {} if dropout_key is None else {'dropout': dropout_key}
  inputs = {k: batch[k] for k in BATCH_KEYS}
  logit_sums = None
  if model.config.logits_sum == 'linear':
    logits, state = model.apply({'params': params}, **inputs, rngs=rngs, mutable=['logit_sums'])
    logit_sums = state['logit_sums']['decoder']['sums'][0]
  else:
    logits = model.apply({'params': params}, **inputs, rngs=rngs)  # [rows, length, output]
  targets = batch['targets']
  weights = targets != PAD_ID
  if model.config.output_ids is not None:  # Ids -> their indices among the logits.
    targets = jnp.asarray(model.config.output_positions())[targets]
  return losses.compute_metrics(logits, targets, weights, label_smoothing, logit_sums)


def _microbatches(batch: Batch, k: int) -> Batch:
  """[rows, length] -> [k, rows / k, length], microbatch j taking rows j, j+k, j+2k, ...

  Strided rather than contiguous, so each device's rows split into k local microbatches
  and the reshape moves no data between devices.
  """

  def split(x):
    rows = x.shape[0]
    return x.reshape((rows // k, k) + x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(split, batch)


def update_ema(ema: Any, params: Any, decay: float) -> Any:
  """decay * ema + (1 - decay) * params, leaf by leaf, in float32."""
  keep, take = jnp.float32(decay), jnp.float32(1.0 - decay)
  return jax.tree.map(lambda e, p: keep * e + take * p.astype(jnp.float32), ema, params)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    cfg: StepConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
) -> tuple[TrainState, Metrics]:
  """One optimizer step on one batch (split into microbatches if configured).

  Returns:
    The new state and the step's metrics: the sums of `losses.compute_metrics` plus
    'grad_norm', 'learning_rate', 'finite' (1.0 if the update was applied) and the token
    counts 'source_tokens' and 'slots' (rows x length of both sides, for padding share).
  """
  model = Transformer(cfg.model)
  step_key = jax.random.fold_in(jax.random.key(cfg.seed, impl=cfg.dropout_rng_impl), state.step)

  def loss_fn(params, microbatch, key):
    sums = batch_metrics(model, params, microbatch, cfg.label_smoothing, key)
    return sums['loss'], sums

  grad_fn = jax.grad(loss_fn, has_aux=True)
  k = cfg.grad_accum_steps
  if k == 1:
    grads, sums = grad_fn(state.params, batch, step_key)
  else:

    def accumulate(carry, xs):
      index, microbatch = xs
      grads, sums = grad_fn(state.params, microbatch, jax.random.fold_in(step_key, index))
      return jax.tree.map(jnp.add, carry, (grads, sums)), None

    zeros = jax.tree.map(
        jnp.zeros_like,
        (
            state.params,
            jax.eval_shape(
                lambda: loss_fn(
                    state.params, jax.tree.map(lambda x: x[0], _microbatches(batch, k)), step_key
                )[1]
            ),
        ),
    )
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(k), _microbatches(batch, k)))

  # The mean over the batch's tokens: one division for the whole batch.
  grads = jax.tree.map(lambda g: g / jnp.maximum(sums['tokens'], 1.0), grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(sums['loss']) & jnp.isfinite(grad_norm)
  updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = state.replace(
      step=state.step + 1,
      params=keep(new_params, state.params),
      opt_state=keep(new_opt_state, state.opt_state),
      skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
  )
  if state.ema_params is not None:  # A skipped update leaves the average too.
    new_state = new_state.replace(
        ema_params=keep(update_ema(state.ema_params, new_params, cfg.ema_decay), state.ema_params)
    )

  metrics = dict(sums)
  metrics['grad_norm'] = grad_norm
  # The schedule counts applied updates, which skipped steps do not advance.
  metrics['learning_rate'] = schedule(state.step - state.skipped_steps)
  metrics['finite'] = finite.astype(jnp.float32)
  metrics['source_tokens'] = jnp.sum(batch['inputs'] != PAD_ID).astype(jnp.float32)
  metrics['slots'] = jnp.float32(batch['inputs'].size + batch['targets'].size)
  return new_state, metrics


def eval_step(
    params: Any, batch: Batch, *, model_config: TransformerConfig, label_smoothing: float
) -> Metrics:
  """Metric sums of one evaluation batch, dropout off."""
  model = Transformer(dataclasses.replace(model_config, deterministic=True))
  return batch_metrics(model, params, batch, label_smoothing)


# --- Initialization and compilation with shardings. ---


def _example_batch(rows: int = 1, length: int = 8) -> dict[str, Array]:
  tokens = jnp.ones((rows, length), jnp.int32)
  return {k: tokens for k in BATCH_KEYS}


def _init_state(
    rng: Array, model_config: TransformerConfig, tx: optax.GradientTransformation, ema: bool
) -> TrainState:
  """A fresh state whose parameters (and their average, with `ema`: a float32 copy) are
  still boxed with their logical axis names."""
  batch = _example_batch()
  params = Transformer(model_config).init({'params': rng}, batch['inputs'], batch['targets'])[
      'params'
  ]
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=tx.init(params),
      skipped_steps=jnp.zeros((), jnp.int32),
      ema_params=init_ema(params) if ema else None,
  )


def init_ema(params: Any) -> Any:
  """The moving average's start: the parameters themselves, in float32."""
  return jax.tree.map(lambda p: p.astype(jnp.float32), params)


def abstract_state(
    model_config: TransformerConfig,
    tx: optax.GradientTransformation,
    partitioner: Partitioner,
    *,
    ema: bool = False,
) -> tuple[TrainState, TrainState]:
  """Shapes and shardings of the state, without allocating it (`ema`: with the parameters'
  moving average, sharded as they are).

  Returns:
    (the state as `jax.ShapeDtypeStruct`s carrying their shardings, the shardings).
  """
  boxed = jax.eval_shape(lambda: _init_state(jax.random.key(0), model_config, tx, ema))
  shardings = partitioner.tree_shardings(boxed)
  shapes = nn.unbox(boxed)
  abstract = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )
  return abstract, shardings


# XLA:CPU without LLVM's optimization: for programs that run once.
_UNOPTIMIZED = {'xla_backend_optimization_level': 0}


def create_train_state(
    seed: int,
    model_config: TransformerConfig,
    tx: optax.GradientTransformation,
    partitioner: Partitioner,
    shardings: TrainState,
) -> TrainState:
  """Initializes the state directly into its shardings (no host holds it whole); with the
  parameters' moving average when `shardings` has one (`abstract_state(..., ema=True)`)."""
  ema = shardings.ema_params is not None

  def init(rng):
    return nn.unbox(_init_state(rng, model_config, tx, ema))

  key = jax.random.key(seed)
  with partitioner.activate():
    jitted = jax.jit(init, out_shardings=shardings)
    if jax.default_backend() != 'cpu':
      return jitted(key)
    # It runs once, in milliseconds: LLVM's optimization passes would only add to its compile
    # (bench/RESULTS.md, section "CPU: the main job in ten minutes on a Zen 3").
    return jitted.lower(key).compile(compiler_options=_UNOPTIMIZED)(key)


def jit_train_step(
    cfg: StepConfig,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    partitioner: Partitioner,
    shardings: TrainState,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  """`train_step` compiled with the state's shardings; the state argument is donated.

  Call the result inside `partitioner.activate()` so that the model's activation
  constraints apply when it traces.
  """
  return jax.jit(
      functools.partial(train_step, cfg=cfg, tx=tx, schedule=schedule),
      in_shardings=(shardings, partitioner.batch_sharding),
      out_shardings=(shardings, partitioner.replicated),
      donate_argnums=(0,),
  )


def jit_eval_step(
    model_config: TransformerConfig,
    label_smoothing: float,
    partitioner: Partitioner,
    param_shardings: Any,
) -> Callable[[Any, Batch], Metrics]:
  """`eval_step` compiled with the parameters' shardings; returns replicated sums."""
  return jax.jit(
      functools.partial(eval_step, model_config=model_config, label_smoothing=label_smoothing),
      in_shardings=(param_shardings, partitioner.batch_sharding),
      out_shardings=partitioner.replicated,
  )


@jax.jit
def all_finite(tree: Any) -> Array:
  """True when every floating-point leaf of `tree` is finite (checked before saving)."""
  leaves = [
      jnp.all(jnp.isfinite(x))
      for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.floating)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def count_params(params: Any) -> int:
  """The number of parameters (shared embeddings counted once)."""
  return sum(x.size for x in jax.tree.leaves(params))

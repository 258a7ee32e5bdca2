"""Loading a checkpoint for inference: `load(workdir, step=..., average_last=...)`.

The one way evaluation, translation and the tests get a model out of a work directory: it
reads the checkpoint's `meta` (the run's config and vocabulary), builds the model config,
chooses the device layout (`Partitioner.for_inference`: the training mesh if it fits these
devices, else data parallelism), and restores the parameters straight onto it (a run with
`ema_for_evaluation`: their moving average), averaging the last N checkpoints in memory when
asked (the paper's evaluation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from transformer_jax import config as config_lib
from transformer_jax.checkpoints import averaging
from transformer_jax.checkpoints import checkpointing
from transformer_jax.config import ConfigError
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import CheckpointGoneError
from transformer_jax.errors import CheckpointNotFoundError
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer
from transformer_jax.runtime.partitioning import Partitioner
from transformer_jax.storage.layout import RunLayout

PyTree = Any


@dataclasses.dataclass
class InferenceCheckpoint:
  """A checkpoint ready for inference.

  Attributes:
    config: the training run's full config (a locked `ConfigDict`).
    model_config: the model config, with dropout off (`deterministic=True`).
    params: the parameters, placed by `partitioner`.
    tokenizer: the run's vocabulary.
    step: the checkpoint's step (of an average: the last averaged step).
    steps: the steps whose parameters `params` holds (one, or those averaged).
    partitioner: the device mesh and rules the parameters are placed with.
  """

  config: ml_collections.ConfigDict
  model_config: TransformerConfig
  params: PyTree
  tokenizer: Tokenizer
  step: int
  steps: list[int]
  partitioner: Partitioner


def _boxed_param_shapes(model_config: TransformerConfig) -> PyTree:
  def init():
    tokens = jnp.ones((1, 8), jnp.int32)
    return Transformer(model_config).init(jax.random.key(0), tokens, tokens)['params']

  return jax.eval_shape(init)


def param_shapes(model_config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """Every parameter's path and shape (nothing is allocated)."""
  flat = jax.tree_util.tree_leaves_with_path(nn.unbox(_boxed_param_shapes(model_config)))
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in flat}


def param_shardings(model_config: TransformerConfig, partitioner: Partitioner) -> PyTree:
  """The parameters' shardings under `partitioner`'s rules (nothing is allocated)."""
  return partitioner.tree_shardings(_boxed_param_shapes(model_config))


def abstract_params(model_config: TransformerConfig, partitioner: Partitioner) -> PyTree:
  """The parameters as `jax.ShapeDtypeStruct`s with their shardings (to compile for)."""
  boxed = _boxed_param_shapes(model_config)
  return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      nn.unbox(boxed),
      partitioner.tree_shardings(boxed),
  )


_RETRIES = 2  # Of `load`, when a running training job rotates away the steps it reads.


def load(
    workdir: str, *, step: int | str | None = None, average_last: int = 0
) -> InferenceCheckpoint:
  """One checkpoint of `workdir`, or the average of its last `average_last`.

  Args:
    workdir: a training run's (or `average_checkpoints`') work directory.
    step: a checkpoint step; None for the latest; 'best' (`checkpointing.BEST`) for the
      best by the run's `best_checkpoint_metric`. Not allowed with `average_last`.
    average_last: average the last this many checkpoints (0: no averaging).

  Returns:
    The checkpoint, its parameters on the devices.

  Raises:
    errors.CheckpointNotFoundError: no such work directory, checkpoint or step.
    errors.CheckpointError: the checkpoint is damaged.
    ConfigError: both `step` and `average_last`, too few checkpoints to average, or a
      saved config that cannot work.
  """
  if average_last and step is not None:
    raise ConfigError('Give --step or --average_last, not both.')
  directory = RunLayout.of(workdir).checkpoints
  for _ in range(_RETRIES if step is None else 0):
    try:
      return _load(directory, step, average_last)
    except CheckpointGoneError as e:
      # A training run rotated away a step being read: "the latest" (or "the last N")
      # now means other steps, which are read instead. A step asked for by number is gone.
      logging.warning('%s Reading the checkpoints there now instead.', e)
  return _load(directory, step, average_last)


def _load(directory: str, step: int | str | None, average_last: int) -> InferenceCheckpoint:
  """`load` from a checkpoint directory, once."""
  steps = averaging.last_steps(directory, average_last) if average_last else None
  meta, last = checkpointing.read_meta(directory, steps[-1] if steps else step)
  config = config_lib.from_saved(meta['config'])
  config_lib.validate(config, vocab_size=meta['vocab_size'])
  model_config = TransformerConfig.from_config(
      config,
      vocab_size=meta['vocab_size'],
      output_ids=meta.get('output_ids'),
      deterministic=True,
  )
  partitioner = Partitioner.for_inference(config)
  shardings = param_shardings(model_config, partitioner)
  try:
    if steps:
      params = averaging.average_params(directory, steps, shardings=shardings)
    else:
      params, _ = checkpointing.restore_params(directory, last, shardings=shardings)
  except CheckpointNotFoundError as e:
    # Listed a moment ago, so gone since: deleted by the training run writing there.
    gone = sorted(set(steps or [last]) - set(checkpointing.list_steps(directory)))
    if isinstance(e, CheckpointGoneError) or not gone:
      raise
    raise CheckpointGoneError(
        f'Checkpoint(s) {gone} in {directory} were deleted while being read: the training '
        'run writing there keeps only its latest checkpoints (keep_checkpoints) and '
        'rotated them away.'
    ) from e
  if not steps:
    steps = meta.get('averaged_steps') or [last]
  return InferenceCheckpoint(
      config,
      model_config,
      params,
      checkpointing.tokenizer_from_meta(meta),
      last,
      list(steps),
      partitioner,
  )

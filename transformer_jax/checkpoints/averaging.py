"""Checkpoint averaging.

The paper evaluates the average of the parameters of the last checkpoints: 5 for the base
model, 20 for the big one (written every 10 minutes). `average_params` averages in memory
(`loading.load(..., average_last=N)` uses it for one evaluation); `average_checkpoints`
writes the average as a checkpoint of its own, in a new work directory
(`checkpointing.write_params_checkpoint`): `OUT/checkpoints/<step>/` with the items `params`
and `meta` (the last averaged checkpoint's meta, plus `averaged_steps`). It
has no optimizer or data state, so it is for evaluation and translation, not for resuming;
hence it never goes into the training run's own directory.
"""

from __future__ import annotations

from collections.abc import Sequence
import copy
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.checkpoints import checkpointing
from transformer_jax.errors import CheckpointNotFoundError
from transformer_jax.errors import ConfigError
from transformer_jax.storage import paths
from transformer_jax.storage.layout import RunLayout

PyTree = Any


def last_steps(directory: str, num: int) -> list[int]:
  """The last `num` checkpoint steps in `directory` (`RunLayout.checkpoints`), ascending.

  Raises:
    CheckpointNotFoundError: `directory` has no checkpoints.
    ConfigError: it has fewer than `num`, or `num` < 1.
  """
  if num < 1:
    raise ConfigError(f'Cannot average {num} checkpoints; ask for 1 or more.')
  steps = checkpointing.list_steps(directory)
  if not steps:
    raise CheckpointNotFoundError(f'{directory} has no complete checkpoint.')
  if len(steps) < num:
    raise ConfigError(
        f'Asked to average the last {num} checkpoints, but {directory} has only '
        f'{len(steps)} ({steps}); ask for at most {len(steps)}, or keep more '
        'with --config.keep_checkpoints / keep_checkpoint_period.'
    )
  return steps[-num:]


@jax.jit
def _add(total: PyTree, params: PyTree) -> PyTree:
  return jax.tree.map(lambda a, b: a + b.astype(a.dtype), total, params)


def average_params(directory: str, steps: Sequence[int], *, shardings: PyTree = None) -> PyTree:
  """The element-wise mean of the parameters of `steps` (those `checkpointing.restore_params`
  reads: the moving average of a run with `ema_for_evaluation`), summed in float32.

  Checkpoints are read one at a time, so memory holds two copies of the parameters, not N.

  Args:
    directory: a training run's checkpoint directory (`RunLayout.checkpoints`).
    steps: the checkpoints to average.
    shardings: where the parameters go (see `checkpointing.restore_params`).

  Returns:
    The averaged parameters, in the checkpoints' dtypes and the given shardings.
  """
  if not steps:
    raise ValueError('No checkpoint steps to average.')
  total, dtypes = None, None
  for step in steps:
    params, _ = checkpointing.restore_params(directory, step, shardings=shardings)
    if total is None:
      dtypes = jax.tree.map(lambda x: x.dtype, params)
      total = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    else:
      total = _add(total, params)
  scale = 1.0 / len(steps)
  return jax.jit(lambda t: jax.tree.map(lambda x, d: (x * scale).astype(d), t, dtypes))(total)


def average_checkpoints(workdir: str, output_workdir: str, num: int) -> tuple[str, list[int]]:
  """Averages the last `num` checkpoints of `workdir` into a checkpoint in `output_workdir`.

  The new checkpoint has the last averaged step's number and meta (config, vocabulary), with
  `averaged_steps` added.

  Args:
    workdir: the training run.
    output_workdir: a different directory; gets `checkpoints/<step>/{params,meta}`.
    num: how many checkpoints (the paper: 5 for base, 20 for big).

  Returns:
    The written step directory and the steps averaged.

  Raises:
    ConfigError: `output_workdir` is `workdir` (a training run must not find a checkpoint
      it cannot resume from), or too few checkpoints.
    CheckpointNotFoundError: no checkpoints in `workdir`.
    OutputExistsError: `output_workdir` already has that step.
  """
  if paths.same_path(workdir, output_workdir):
    raise ConfigError(
        'The output directory must differ from the training work directory: '
        'an averaged checkpoint has no optimizer state to resume from.'
    )
  source, output = RunLayout.of(workdir), RunLayout.of(output_workdir)
  steps = last_steps(source.checkpoints, num)
  meta, last = checkpointing.read_meta(source.checkpoints, steps[-1])
  params = average_params(source.checkpoints, steps)
  meta = copy.deepcopy(meta)
  meta['averaged_steps'] = steps
  meta['averaged_from'] = source.root
  return checkpointing.write_params_checkpoint(output.checkpoints, last, params, meta), steps

"""Checkpoints: what a step directory holds, saving and resuming, loading for inference.

`WORKDIR/checkpoints/<step>/` is written by an orbax `CheckpointManager` (asynchronously,
atomically: it appears under its final name only once complete) and holds four items (five
with `ema_decay`), and orbax's `metrics` in the checkpoints saved at an evaluation (the
validation metrics the best checkpoints are kept by, see `best_step`):

  * `params`:    the model parameters (an orbax PyTree; restorable onto any mesh);
  * `ema`:       with `ema_decay`, their exponential moving average (as `params`);
  * `optimizer`: {'opt_state', 'step', 'skipped_steps'};
  * `data`:      the training iterator's state, one JSON file per host (grain's handler);
  * `meta`:      JSON: the run's whole config, the vocabulary size, and the SentencePiece
                 model (its original path, fingerprint and bytes), so that evaluation needs
                 nothing but the step directory; which item holds the parameters to infer
                 with (`INFERENCE_ITEM`); and the training loop's early-stopping count.

Evaluation and checkpoint averaging read checkpoints through `list_steps`, `read_meta` and
`restore_params` (`loading.load` puts them together), never through the training flags.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping, Sequence
import contextlib
import hashlib
import json
import logging as std_logging
import os
import tempfile
import time
import traceback
from typing import Any

import grain
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from transformer_jax.config import BEST_CHECKPOINT_METRICS
from transformer_jax.config import ConfigError
from transformer_jax.config import LEGACY_VALUES
from transformer_jax.config import RESUMABLE_FIELDS
from transformer_jax.data.tokenizer import load_tokenizer
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import CheckpointError
from transformer_jax.errors import CheckpointGoneError
from transformer_jax.errors import CheckpointNotFoundError
from transformer_jax.errors import DiskFullError
from transformer_jax.errors import find_user_error
from transformer_jax.errors import OutputExistsError
from transformer_jax.errors import UserError
from transformer_jax.storage import storage

META_FORMAT = 1
BEST = 'best'  # The step argument that asks for the best checkpoint (`best_step`).
# The meta key naming the item `restore_params` reads: 'ema' with `ema_for_evaluation`;
# absent: 'params'.
INFERENCE_ITEM = 'inference_item'


class ConfigMismatchError(ConfigError):
  """The config differs from the one of the checkpoint it would resume."""


def config_to_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config as plain JSON values (tuples become lists)."""
  return json.loads(config.to_json())


def _flatten(tree: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, Mapping) and value:
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def flat_config(config: ml_collections.ConfigDict) -> dict[str, str]:
  """{'field.subfield': its value as JSON} for every field of `config`."""
  return {key: json.dumps(value) for key, value in _flatten(config_to_json(config)).items()}


def config_differences(
    saved: Mapping[str, Any],
    config: ml_collections.ConfigDict,
    ignore: frozenset[str] = RESUMABLE_FIELDS,
) -> list[str]:
  """Lines 'field: checkpoint=<saved> now=<current>' for fields that may not differ."""
  old = {**LEGACY_VALUES, **_flatten(saved)}
  new = _flatten(config_to_json(config))
  missing = object()
  lines = []
  for key in sorted(set(old) | set(new)):
    if key.split('.')[0] in ignore:
      continue
    a, b = old.get(key, missing), new.get(key, missing)
    if a != b:
      show = lambda v: '(absent)' if v is missing else json.dumps(v)
      lines.append(f'{key}: checkpoint={show(a)} now={show(b)}')
  return lines


def check_config_matches(
    saved: Mapping[str, Any], config: ml_collections.ConfigDict, directory: str
) -> None:
  """Raises `ConfigMismatchError` listing the fields that differ from the checkpoint's."""
  lines = config_differences(saved, config)
  if lines:
    raise ConfigMismatchError(
        f'The config does not match the checkpoint in {directory} that this run would '
        'resume; these fields differ:\n  ' + '\n  '.join(lines) + '\nSet them back to the '
        "checkpoint's values to resume, or use a new --workdir to start a new run. (Fields "
        f'that may change on resume: {", ".join(sorted(RESUMABLE_FIELDS))}.)'
    )


def make_meta(
    config: ml_collections.ConfigDict,
    tokenizer: Tokenizer,
    output_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
  """The `meta` item: enough to rebuild the model and its vocabulary without flags (and,
  with `output_vocabulary='target'`, the ids its output layer scores: 'output_ids')."""
  with open(tokenizer.model_path, 'rb') as f:
    model_bytes = f.read()
  meta = {
      'format': META_FORMAT,
      'config': config_to_json(config),
      'vocab_size': tokenizer.vocab_size,
      'tokenizer': {
          'path': os.path.abspath(tokenizer.model_path),
          'sha256': hashlib.sha256(model_bytes).hexdigest(),
          'model_base64': base64.b64encode(model_bytes).decode('ascii'),
      },
  }
  if output_ids is not None:
    meta['output_ids'] = [int(i) for i in output_ids]
  if config.ema_decay and config.ema_for_evaluation:
    meta[INFERENCE_ITEM] = 'ema'
  return meta


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32 words (narrower types widened; 8-byte ones split in two)."""
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # Adds a trailing axis of 2.
  narrow = {2: jnp.uint16, 1: jnp.uint8}[size]
  return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)


@jax.jit
def _checksum_words(x: jax.Array) -> jax.Array:
  """(sum of the words of `x`, sum of words x (1 + position mod 65521)), mod 2^32.

  Computed where the array lives (a sharded array's shards sum on their devices), so the
  cost is one read of the state; any changed word changes the first sum, and moved words
  the second. Compiled once per shape, which a model's layers share.
  """
  w = _words(x)
  position = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(
        stride % (1 << 32)
    )
    stride *= w.shape[axis]
  weight = position % jnp.uint32(65521) + jnp.uint32(1)
  return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])


def checksums(tree: Any) -> dict[str, str]:
  """A checksum of every array of `tree`, keyed by its path (`jax.tree_util.keystr`)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  values = jax.device_get([_checksum_words(jnp.asarray(x)) for _, x in flat])
  return {
      jax.tree_util.keystr(path): f'{int(v[0]):08x}{int(v[1]):08x}'
      for (path, _), v in zip(flat, values)
  }


def verify_checksums(expected: Mapping[str, str] | None, tree: Any) -> None:
  """Raises ValueError naming the arrays of `tree` whose checksums differ from `expected`
  (the ones saved with the checkpoint); checkpoints saved without checksums pass."""
  if not expected:
    return
  actual = checksums(tree)
  wrong = [k for k, v in actual.items() if k in expected and expected[k] != v]
  if wrong:
    raise ValueError(
        f'{len(wrong)} of {len(actual)} arrays differ from the checksums saved '
        f'with the checkpoint (first: {wrong[0]}); the files were changed '
        'after they were written'
    )


def _saved_state(state: Any) -> dict[str, Any]:
  """The arrays of a `TrainState` as the checkpoint stores them (items and keys)."""
  arrays = {
      'params': state.params,
      'optimizer': {
          'opt_state': state.opt_state,
          'step': state.step,
          'skipped_steps': state.skipped_steps,
      },
  }
  if state.ema_params is not None:
    arrays['ema'] = state.ema_params
  return arrays


def _metric_key(metric: str) -> Any:
  """Orders checkpoints' metrics so that the best has the largest key."""
  sign = 1.0 if BEST_CHECKPOINT_METRICS[metric] else -1.0
  return lambda metrics: sign * float(metrics[metric])


def _options(
    *,
    save_every: int,
    final_step: int,
    keep: int,
    keep_period: int,
    best_metric: str = '',
    keep_best: int = 1,
    read_only: bool = False,
) -> ocp.CheckpointManagerOptions:
  policies = ocp.checkpoint_managers
  preserve = [policies.LatestN(keep or None)]  # 0 keeps everything.
  if keep_period:
    # Kept forever besides the latest K: every M-th step (for averaging, analysis).
    preserve.append(policies.EveryNSteps(keep_period))
  best_fn = None
  if best_metric:
    # Besides those: the best `keep_best` of the checkpoints saved with metrics.
    best_fn = _metric_key(best_metric)
    preserve.append(
        policies.BestN(get_metric_fn=best_fn, n=keep_best, keep_checkpoints_without_metrics=False)
    )
  return ocp.CheckpointManagerOptions(
      best_fn=best_fn,  # Also what makes orbax write the metrics.
      best_mode='max',
      save_decision_policy=policies.AnySavePolicy(
          [
              policies.FixedIntervalPolicy(save_every),
              policies.SpecificStepsPolicy((final_step,)),
          ]
      ),
      preservation_policy=policies.AnyPreservationPolicy(preserve),
      enable_async_checkpointing=True,
      cleanup_tmp_directories=not read_only,  # Remove what a killed save left behind.
      read_only=read_only,
      create=not read_only,
  )


class Checkpointer:
  """The run's checkpoints: one orbax `CheckpointManager` over its checkpoint directory
  (`RunLayout.checkpoints`).

  Every process of the job must create it and call `save` and `restore` together.
  """

  def __init__(
      self,
      directory: str,
      *,
      save_every: int,
      final_step: int,
      keep: int = 5,
      keep_period: int = 0,
      best_metric: str = '',
      keep_best: int = 1,
  ):
    """Opens (and creates) `directory`.

    Args:
      directory: the run's checkpoint directory (`RunLayout.checkpoints`).
      save_every: save every this many steps.
      final_step: always save at this step (the end of the run).
      keep: keep the latest `keep` checkpoints (0: all).
      keep_period: also keep every `keep_period`-th step (0: none).
      best_metric: also keep the `keep_best` best checkpoints saved with metrics, by this
        one ('bleu', 'chrf' or 'loss'; '': none).
      keep_best: see `best_metric`.
    """
    self.directory = directory
    self._bytes = 0  # Of the last checkpoint's arrays.
    options = _options(
        save_every=save_every,
        final_step=final_step,
        keep=keep,
        keep_period=keep_period,
        best_metric=best_metric,
        keep_best=keep_best,
    )
    self._manager = _Bounded(
        self.directory, lambda: ocp.CheckpointManager(self.directory, options=options)
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def steps(self) -> list[int]:
    """The complete checkpoints' steps, ascending."""
    return sorted(self._manager.all_steps())

  def set_aside(self, step: int) -> str:
    """Renames a damaged checkpoint to `<step>.damaged` (kept, no longer a step), on every
    process together; returns the new path. On Cloud Storage, where a rename is a copy and a
    delete of every object, orbax's mark of a finished step (`commit_success.txt`) is copied
    last and deleted first (`storage.rename_directory`): a kill at any point leaves the step,
    found damaged again, or the whole copy, which orbax's cleanup of unfinished saves (any
    folder there without the mark) leaves alone."""
    path = f'{self.directory}/{step}.damaged'
    if jax.process_index() == 0:
      storage.rename_directory(
          f'{self.directory}/{step}', path, mark=_GCS_COMMIT_MARKER, flag='the checkpoint'
      )
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'set_aside_{step}')
    self._manager.reload()
    return path

  def should_save(self, step: int) -> bool:
    """Whether the policy wants `step` saved (every `save_every` steps, and the last)."""
    return self._manager.should_save(step)

  def save(
      self,
      state: Any,
      data_iterator: Any,
      meta: Mapping[str, Any],
      *,
      force: bool = False,
      metrics: Mapping[str, float] | None = None,
  ) -> bool:
    """Starts saving `state` at its step if the policy (or `force`) says so, with the
    validation `metrics` of that step if given (what the best checkpoints are kept by).

    Returns after the arrays are copied off the devices; the write finishes in the
    background (see `wait`). The iterator's state is captured now, so call this before
    drawing the next batch.

    Returns:
      Whether a save was started.
    """
    step = int(state.step)
    if not force and not self.should_save(step):
      return False  # Before computing checksums, which read the whole state.
    arrays = _saved_state(state)
    self._bytes = sum(x.nbytes for x in jax.tree.leaves(arrays))
    return self._manager.save(
        step,
        args=ocp.args.Composite(
            **{name: ocp.args.StandardSave(tree) for name, tree in arrays.items()},
            data=grain.checkpoint.CheckpointSave(data_iterator),
            meta=ocp.args.JsonSave({**meta, 'checksums': checksums(arrays)}),
        ),
        metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()},
        force=force,
    )

  def restore_meta(self, step: int) -> dict[str, Any]:
    with _damaged(self._manager, self.directory, step, 'meta', resuming=True):
      return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
          'meta'
      ]

  def restore(
      self,
      step: int,
      abstract_state: Any,
      data_iterator: Any,
      expected_checksums: Mapping[str, str] | None = None,
  ) -> Any:
    """Restores the state onto the shardings carried by `abstract_state` and the iterator.

    Args:
      step: the step to restore.
      abstract_state: a `TrainState` of `jax.ShapeDtypeStruct`s with shardings (any mesh:
        orbax reshards on load).
      data_iterator: the training iterator; its position is set in place.
      expected_checksums: the `meta['checksums']` saved with the step; the restored arrays
        must match them.

    Returns:
      The restored `TrainState`.

    Raises:
      CheckpointError: a file is missing or unreadable, or an array's checksum differs.
    """
    abstract = _saved_state(abstract_state)
    with _damaged(
        self._manager, self.directory, step, 'state (params, optimizer or data)', resuming=True
    ):
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
              **{name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()},
              data=grain.checkpoint.CheckpointRestore(data_iterator),
          ),
      )
      verify_checksums(expected_checksums, {name: restored[name] for name in abstract})
    optimizer = restored['optimizer']
    return abstract_state.replace(
        step=optimizer['step'],
        params=restored['params'],
        opt_state=optimizer['opt_state'],
        skipped_steps=optimizer['skipped_steps'],
        ema_params=restored['ema'] if 'ema' in abstract else None,
    )

  @contextlib.contextmanager
  def reporting_full_disk(self) -> Iterator[None]:
    """A full disk met inside (however orbax, TensorStore or a writer wraps it) as one
    message naming the work directory and what a checkpoint needs there."""
    try:
      yield
    except Exception as e:
      if not isinstance(find_user_error(e), DiskFullError):
        raise
      size = (
          f'about {self._bytes / 1e6:,.1f} MB'
          if self._bytes
          else 'the size of the parameters and twice that for Adam'
      )
      raise DiskFullError(
          f'No space left on the disk of {os.path.dirname(self.directory)} while writing a '
          f'checkpoint (each needs {size} there); the checkpoints before it are complete. '
          'Free some space or point --workdir at a disk with room, then rerun the same '
          'command to resume.'
      ) from e

  def check_for_errors(self) -> None:
    """Raises now, not at the next save, if the save in the background failed."""
    self._manager.check_for_errors()

  def wait(self) -> None:
    """Blocks until the pending save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


_GCS_COMMIT_MARKER = 'commit_success.txt'  # Orbax's, in a finished step on Cloud Storage.


# --- Reading checkpoints outside training (evaluation, averaging). ---


# What orbax's listing of the steps raises when a training run rotates a step away between
# listing the folder and reading the step's metadata (local and gs://).
_LISTING_RACES = (FileNotFoundError, NotADirectoryError)


def _listed(list_steps: Callable[[], Any]) -> Any:
  """`list_steps()`, listed again when a step was rotated away while it was being listed
  (the next listing no longer has it)."""
  for attempt in range(10):
    try:
      return list_steps()
    except _LISTING_RACES:
      time.sleep(0.05 * (attempt + 1))
  return list_steps()


def _reader(directory: str) -> '_Bounded':
  if not storage.is_directory(directory):
    raise CheckpointNotFoundError(
        f'{directory} does not exist: its work directory holds no checkpoints; pass the '
        '--workdir of a training run.'
    )
  options = _options(save_every=1, final_step=0, keep=0, keep_period=0, read_only=True)
  make = lambda: ocp.CheckpointManager(directory, options=options)
  return _Bounded(directory, lambda: _listed(make))


class _Bounded:
  """An orbax `CheckpointManager` of `directory` whose every call (and its creation, which
  lists the steps) is a wait on storage, bounded on Cloud Storage (`storage.waiting`): orbax
  and TensorStore retry a lost bucket for many minutes on their own. A call that fails while
  the bucket is silent waits for it to answer (`storage.wait_for_answer`), so that an outage
  orbax reports as something else ("Checkpoint directory does not exist" for the step it
  was finishing) ends with the outage's message."""

  def __init__(self, directory: str, make: Callable[[], ocp.CheckpointManager]):
    self._directory = directory
    with storage.waiting(directory, f'opening the checkpoints {directory}'):
      self._manager = make()

  def __getattr__(self, name: str) -> Any:
    attribute = getattr(self._manager, name)
    if not callable(attribute):
      return attribute
    what = _DOING.get(name, 'reading the checkpoints')

    def bounded(*args, **kwargs):
      step = f' {args[0]}' if args and isinstance(args[0], int) else ''
      doing = f'{what}{step} in {self._directory}'
      with storage.waiting(self._directory, doing):
        try:
          return attribute(*args, **kwargs)
        except Exception:
          storage.wait_for_answer(self._directory, doing)  # An outage, reported as one.
          raise

    return bounded

  def __enter__(self) -> '_Bounded':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


_DOING = {
    'save': 'saving checkpoint',
    'wait_until_finished': 'finishing a checkpoint',
    'restore': 'restoring checkpoint',
    'close': 'finishing a checkpoint',
    'reload': 'listing the checkpoints',
}


def list_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in `directory` (`RunLayout.checkpoints`),
  ascending."""
  with _reader(directory) as manager:
    return sorted(manager.all_steps())


def _resolve_step(manager: ocp.CheckpointManager, directory: str, step: int | str | None) -> int:
  steps = sorted(manager.all_steps())
  if not steps:
    raise CheckpointNotFoundError(
        f'{directory} has no complete checkpoint; train first, or '
        'pass the --workdir of a training run.'
    )
  if step is None:
    return steps[-1]
  if step == BEST:
    return _best_step(manager, directory, steps)
  if step not in steps:
    raise CheckpointNotFoundError(f'{directory} has no checkpoint for step {step}; it has {steps}.')
  return step


def _best_step(manager: ocp.CheckpointManager, directory: str, steps: list[int]) -> int:
  """The step of the best checkpoint by the run's `best_checkpoint_metric` (of the latest
  checkpoint's config), among those saved with validation metrics; ties: the later."""
  with _damaged(manager, manager.directory, steps[-1], 'meta'):
    meta = manager.restore(steps[-1], args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  metric = meta.get('config', {}).get('best_checkpoint_metric', '')
  if not metric:
    raise CheckpointNotFoundError(
        f"{directory} keeps no best checkpoint (its run has best_checkpoint_metric=''); pass "
        f'--step (it has {steps}), or train with --config.best_checkpoint_metric=bleu.'
    )
  key = _metric_key(metric)
  scored = []
  for step in steps:
    metrics = manager.metrics(step)
    if isinstance(metrics, Mapping) and metric in metrics:
      scored.append((key(metrics), step))
  if not scored:
    raise CheckpointNotFoundError(
        f'No checkpoint of {directory} ({steps}) was saved with validation {metric} yet; one is '
        'at each evaluation (eval_every_steps). Pass --step meanwhile.'
    )
  return max(scored)[1]


def _rotated_away(directory: str, step: int, wait_s: float = 3.0) -> bool:
  """Whether checkpoint `step` is being or was deleted (rotation, by a training run): its
  folder is gone, or goes within `wait_s` (a deletion under way leaves a part of it for a
  moment, which reads as damaged). A damaged checkpoint stays."""
  deadline = time.monotonic() + wait_s
  while storage.is_directory(f'{directory}/{step}'):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.1)
  return True


@contextlib.contextmanager
def _damaged(
    manager: ocp.CheckpointManager, directory: str, step: int, item: str, *, resuming: bool = False
) -> Iterator[None]:
  """Turns any failure to read `item` of checkpoint `step` into a `CheckpointError`."""
  try:
    yield
  except UserError:
    raise
  except Exception as e:  # Orbax and TensorStore raise many.
    if _rotated_away(directory, step):
      _listed(manager.reload)
      raise CheckpointGoneError(
          f'Checkpoint {step} in {directory} was deleted while it was being read: the '
          'training run writing there keeps only its latest checkpoints (keep_checkpoints) '
          f'and rotated it away. It has {sorted(manager.all_steps())} now; rerun to take '
          'those.'
      ) from e
    others = [s for s in sorted(manager.all_steps()) if s != step]
    detail = ' '.join(f'{type(e).__name__}: {e}'.split())[:160]
    problem = (
        f'Checkpoint {step} in {directory} cannot be read: its {item} is damaged or '
        f'incomplete ({detail})'
    )
    if resuming:
      # Seen only when no checkpoint is intact: otherwise training resumes from the newest
      # intact one and sets this one aside itself, saying so with `problem` alone.
      advice = (
          f'Training resumes from the newest intact checkpoint if there is one '
          f'({others or "none left"}); to start over instead, move this one aside '
          f'(mv {directory}/{step} {directory}/{step}.damaged)'
      )
    else:
      advice = (
          f'Pick another checkpoint with --step (this run has {others or "no other"})'
          ', or restore the files from a copy'
      )
    error = CheckpointError(f'{problem}. {advice}.')
    error.problem = problem  # What the fallback's warning says (it says what it does itself).
    raise error from e


def restore_params(
    directory: str, step: int | str | None = None, *, shardings: Any = None
) -> tuple[Any, int]:
  """The parameters to infer with of one checkpoint (nothing else is read): the item its
  meta names (`INFERENCE_ITEM`: the moving average of a run with `ema_for_evaluation`), else
  the trained parameters.

  Args:
    directory: a training run's checkpoint directory (`RunLayout.checkpoints`).
    step: which checkpoint; None for the latest, `BEST` for the best (`_best_step`).
    shardings: a pytree of shardings matching the parameters, or one sharding for all;
      None places them on this process's first device.

  Returns:
    (params, step).
  """
  with _reader(directory) as manager:
    step = _resolve_step(manager, directory, step)
    with _damaged(manager, manager.directory, step, 'meta'):
      saved = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
      saved = saved if isinstance(saved, dict) else {}
    item = saved.get(INFERENCE_ITEM, 'params')
    with _damaged(manager, manager.directory, step, item):
      metadata = manager.item_metadata(step)[item]
      if metadata is None:  # A manager that has not restored the item yet has no handler.
        # Not a restore without a target: that places arrays as they were saved, and fails
        # for a checkpoint of several processes (their devices are not this one's).
        metadata = (
            ocp.StandardCheckpointHandler().metadata(manager.directory / str(step) / item).tree
        )
      if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, metadata)
      abstract = jax.tree.map(
          lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s), metadata, shardings
      )
      params = manager.restore(
          step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract)})
      )[item]
      verify_checksums(saved.get('checksums'), {item: params})
  return params, step


def write_params_checkpoint(directory: str, step: int, params: Any, meta: dict[str, Any]) -> str:
  """Writes `params` and `meta` as `directory/<step>` (readable by
  `loading.load` and `init_from`): no optimizer or data state, so not a run to resume.
  `params` are what it is read for, whatever item of its source `meta` named
  (`INFERENCE_ITEM`).

  Returns:
    The step directory.

  Raises:
    OutputExistsError: that step already exists there.
  """
  if storage.is_directory(f'{directory}/{step}'):
    raise OutputExistsError(
        f'{directory}/{step} already exists; choose another output directory or remove it.'
    )
  meta = {k: v for k, v in meta.items() if k != INFERENCE_ITEM}
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  with _Bounded(directory, lambda: ocp.CheckpointManager(directory, options=options)) as manager:
    manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            meta=ocp.args.JsonSave({**meta, 'checksums': checksums({'params': params})}),
        ),
        force=True,
    )
    manager.wait_until_finished()
  return f'{directory}/{step}'


def read_meta(directory: str, step: int | str | None = None) -> tuple[dict[str, Any], int]:
  """The `meta` item of a checkpoint of `directory` (`RunLayout.checkpoints`): config and
  vocabulary, and its step (`step`: an int, None for the latest, `BEST` for the best)."""
  with _reader(directory) as manager:
    step = _resolve_step(manager, directory, step)
    with _damaged(manager, manager.directory, step, 'meta'):
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
      if not isinstance(meta, dict) or not {'config', 'vocab_size', 'tokenizer'} <= set(meta):
        raise ValueError('the meta item lacks config, vocab_size or tokenizer')
  return meta, step


def newest_readable_meta(directory: str) -> dict[str, Any] | None:
  """The `meta` of the newest checkpoint in `directory` (`RunLayout.checkpoints`) whose meta
  can be read; None if it has none (damaged checkpoints are skipped here and dealt with when
  restoring)."""
  if not storage.is_directory(directory):
    return None
  with _reader(directory) as manager:
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        with _damaged(manager, manager.directory, step, 'meta'):
          meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
      except CheckpointError:
        continue
      if isinstance(meta, dict) and 'config' in meta:
        return meta
  return None


def tokenizer_from_meta(meta: Mapping[str, Any]) -> Tokenizer:
  """The checkpoint's SentencePiece model: its original file if unchanged, else its bytes."""
  info = meta['tokenizer']
  path = info['path']
  if os.path.exists(path):
    with open(path, 'rb') as f:
      if hashlib.sha256(f.read()).hexdigest() == info['sha256']:
        return load_tokenizer(path)
  cache = os.path.join(tempfile.gettempdir(), 'transformer_jax_vocab')
  os.makedirs(cache, exist_ok=True)
  path = os.path.join(cache, f'{info["sha256"][:16]}.model')
  if not os.path.exists(path):
    storage.write_file(path, base64.b64decode(info['model_base64']))
  return load_tokenizer(path)


# --- What of orbax's logging the commands show. ---


# Orbax warnings about what the commands do on purpose: checkpoints saved between evaluations
# carry no metrics; reading opens the checkpoints read-only; a restore of some items leaves
# the others ("Item ... was found in the checkpoint, but could not be restored").
_EXPECTED_ORBAX_WARNINGS = (
    'did not provide metrics',
    'Given directory is read only',
    'read_only=True, setting save_interval_steps=0',
    'was found in the checkpoint, but could not be restored',
)


def quiet_orbax(record: std_logging.LogRecord, verbose: bool) -> bool:
  """A log filter for the commands (`cli.run`): drops orbax's INFO lines (dozens a save) and,
  without `verbose` (--verbose), the errors its
  background threads log (each also reaches the main thread, which reports it) and its
  warnings about what the commands do on purpose (`_EXPECTED_ORBAX_WARNINGS`); its other
  warnings still show."""
  if '/orbax/' not in record.pathname:
    # An orbax failure can also arrive through asyncio ("Task exception was never
    # retrieved") with orbax's frames in its traceback.
    failure = record.exc_info[2] if record.exc_info else None
    from_orbax = failure is not None and any(
        '/orbax/' in frame.filename for frame in traceback.extract_tb(failure)
    )
    return not from_orbax or verbose
  if record.levelno >= std_logging.ERROR:
    return verbose
  if any(phrase in record.getMessage() for phrase in _EXPECTED_ORBAX_WARNINGS):
    return verbose
  return record.levelno >= std_logging.WARNING

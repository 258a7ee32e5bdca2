"""The training loop: `train_and_evaluate(config, workdir)`.

Checks the config, the devices and the data before anything compiles; resumes from the
latest complete checkpoint in `workdir`; trains for `config.num_train_steps` steps with
periodic logging, validation and checkpoints; and on SIGTERM saves the current step on
every process, waits for the write and returns normally.

Validation (every `eval_every_steps`) gives the loss and perplexity of the validation split
and, with `eval_bleu_sentences`, sacreBLEU and chrF of that many of its sentences spread over
the split, translated with the run's decoding options (a few samples go to TensorBoard).
With `best_checkpoint_metric`, every evaluation also saves a checkpoint carrying its metrics,
and the best `keep_best_checkpoints` of those are kept besides the latest ones; with
`early_stopping_patience`, the run ends when that many evaluations in a row bring no new best
(`early_stopping`). With `ema_decay`, validation evaluates the parameters' moving average.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
import dataclasses
import hashlib
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from transformer_jax import config as config_lib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.checkpoints import loading
from transformer_jax.config import ConfigError
from transformer_jax.data import corpora
from transformer_jax.data import data_sources
from transformer_jax.data import input_pipeline
from transformer_jax.data import prefetch
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.decoding import evaluation
from transformer_jax.decoding import translator as translator_lib
from transformer_jax.errors import CheckpointError
from transformer_jax.errors import CheckpointNotFoundError
from transformer_jax.errors import PathError
from transformer_jax.model import flops as model_flops
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.kernels import kernel_choice
from transformer_jax.runtime import multihost
from transformer_jax.runtime.partitioning import Partitioner
from transformer_jax.storage import paths
from transformer_jax.storage import storage
from transformer_jax.storage import workdir_lock
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import config_checks
from transformer_jax.training import early_stopping as early_stopping_lib
from transformer_jax.training import metrics_writer
from transformer_jax.training import optimizer
from transformer_jax.training import train_steps


class NonFiniteError(RuntimeError):
  """Training met a non-finite loss or gradient with `nonfinite='stop'`, skipped
  `max_skipped_steps_in_a_row` updates in a row with `nonfinite='skip'`, or a checkpoint
  about to be written held non-finite values."""


@dataclasses.dataclass
class TrainResult:
  """How a call to `train_and_evaluate` ended.

  Attributes:
    state: the final train state.
    stopped_early: True when a stop signal (SIGTERM or Ctrl-C) ended it before
      `num_train_steps`, after saving that step.
    eval_metrics: the last validation metrics, if any were computed.
    interrupted: True when that signal was Ctrl-C (SIGINT).
    out_of_patience: True when early stopping (`early_stopping_patience`) ended it, now or
      in an earlier run of the work directory.
  """

  state: train_steps.TrainState
  stopped_early: bool
  eval_metrics: dict[str, float] | None
  interrupted: bool = False
  out_of_patience: bool = False


def evaluate(
    eval_step: Callable,
    params: Any,
    batches: Iterable[Mapping[str, np.ndarray]],
    partitioner: Partitioner,
    max_batches: int = 0,
) -> dict[str, float]:
  """Validation metrics over `batches` (the first `max_batches`, or all when 0)."""
  outputs = []
  for i, batch in enumerate(batches):
    if max_batches and i >= max_batches:
      break
    outputs.append(eval_step(params, partitioner.shard_batch(batch)))
  return metrics_writer.summarize_eval(metrics_writer.sum_metrics(jax.device_get(outputs)))


SAMPLE_TRANSLATIONS = 4  # Shown in TensorBoard at each evaluation.


class ValidationTranslation:
  """sacreBLEU and chrF of a fixed validation subset, translated with the current
  parameters (compiled once per shape, on the training mesh)."""

  def __init__(
      self,
      config: ml_collections.ConfigDict,
      datasets: input_pipeline.Datasets,
      model_config: TransformerConfig,
      params: Any,
      partitioner: Partitioner,
  ):
    pairs = data_sources.spread_subset(datasets.eval_text, config.eval_bleu_sentences)
    self.sources = [s for s, _ in pairs]
    self.references = [t for _, t in pairs]
    self.translator = translator_lib.Translator(
        model_config,
        params,
        datasets.tokenizer,
        translator_lib.DecodeOptions.from_config(config),
        partitioner,
    )

  def __call__(self, params: Any) -> tuple[dict[str, float], str]:
    """The metrics (bleu, chrf, translate_seconds) and a Markdown table of samples."""
    start = time.time()
    self.translator.params = params  # Same shardings, so the compiled searches serve.
    hypotheses, _ = self.translator.translate(self.sources)
    scores = evaluation.score(hypotheses, self.references)
    rows = ['| source | reference | translation |', '|---|---|---|']
    for source, reference, hypothesis in list(zip(self.sources, self.references, hypotheses))[
        :SAMPLE_TRANSLATIONS
    ]:
      cells = (
          ' '.join(text.replace('|', '\\|').split()) for text in (source, reference, hypothesis)
      )
      rows.append('| ' + ' | '.join(cells) + ' |')
    return (
        {'bleu': scores['bleu'], 'chrf': scores['chrf'], 'translate_seconds': time.time() - start},
        '\n'.join(rows),
    )


def _peak_flops(partitioner: Partitioner) -> float | None:
  peak = model_flops.peak_flops(partitioner.device_kind)
  return peak * partitioner.mesh.size if peak else None


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    stop_signal: multihost.StopSignal | None = None,
) -> TrainResult:
  """Trains (or resumes training) the model of `config`, writing everything to `workdir`.

  Args:
    config: the run config (see `config.base_config`).
    workdir: checkpoints, vocabulary, metrics and TensorBoard files go here.
    stop_signal: defaults to one listening for SIGTERM.

  Returns:
    How the run ended.

  Raises:
    ConfigError: a config field, the mesh or the work directory cannot work; raised before
      anything compiles. `checkpointing.ConfigMismatchError` when the config differs from
      the checkpoint being resumed.
    data_sources.DatasetNotFoundError: the dataset is not prepared.
    workdir_lock.WorkdirBusyError: another training job holds `workdir`.
    NonFiniteError: see the class.
  """
  paths.check_scheme(workdir, '--workdir')
  _check_data_paths(config)
  corpora.check(config)  # Before the work directory is made.
  data_sources.check_prepared(config)
  workdir = storage.resolve(workdir)
  # Every field, checked now with a stand-in vocabulary size: building the real vocabulary
  # can take minutes.
  config_checks.validate_run(config, training=True)
  paths.check_output_directory(workdir, '--workdir', {'--config.init_from': config.init_from})
  layout = RunLayout.of(workdir)
  lock = _lock_workdir(layout)
  try:
    return _train_and_evaluate(config, layout, stop_signal)
  finally:
    if lock is not None:
      lock.release()


def _check_data_paths(config: ml_collections.ConfigDict) -> None:
  """Checks the config's own paths (local or gs://) before anything is built: the scheme,
  and on Cloud Storage that the bucket answers and, where the run may write (a Bible corpus
  prepared there, a vocabulary trained there), that it takes objects."""
  for split, files in config.text_files.items():
    for path in (p.strip() for p in files.split(',') if p.strip()) if files else []:
      paths.check_scheme(path, f'--config.text_files.{split}')
      if storage.is_remote(path):
        paths.check_input_file(path, f'--config.text_files.{split}')
  if config.init_from:
    paths.check_scheme(config.init_from, '--config.init_from')
  for name in ('tfds_data_dir', 'vocab_path'):
    path, flag = config[name], f'--config.{name}'
    paths.check_scheme(path, flag)
    if name == 'vocab_path' and path and storage.is_directory(path, flag):
      raise PathError(
          f'{flag}={path} is a directory; give the path of a SentencePiece model file (read if '
          'it exists, trained and written there if not), or leave it empty for one in the '
          'work directory.'
      )
    if not storage.is_remote(path):
      continue
    if name == 'vocab_path':
      if not storage.exists(path):  # Trained, then uploaded there.
        paths.check_output_file(path, flag)
    elif config.dataset == 'bible_en_es':  # Prepared, then uploaded there.
      paths.check_output_directory(path, flag)
    else:
      paths.check_input_directory(path, flag, 'a TFDS data directory')


def _lock_workdir(layout: RunLayout) -> workdir_lock.WorkdirLock | None:
  """Process 0 takes the work directory's lock; every process fails alike if it cannot."""
  lock, error = None, None
  if jax.process_index() == 0:
    lock = workdir_lock.WorkdirLock(layout.lock)
    try:
      lock.acquire()
    except workdir_lock.WorkdirBusyError as e:
      lock, error = None, e
  if jax.process_count() > 1:
    busy = multihost.from_process_0('workdir_lock', str(int(error is not None))) == '1'
    if busy and error is None:
      raise workdir_lock.WorkdirBusyError(
          f'{layout.root} is in use by another training job (process 0 says more).'
      )
  if error is not None:
    raise error
  return lock


def _train_and_evaluate(
    config: ml_collections.ConfigDict, layout: RunLayout, stop_signal: multihost.StopSignal | None
) -> TrainResult:
  """`train_and_evaluate` once the work directory is checked and locked."""
  config, init_source = _init_source(config)
  partitioner = Partitioner.from_config(config)
  rows_multiple = partitioner.rows_multiple(config.grad_accum_steps)
  optimizer_config = optimizer.OptimizerConfig.from_config(config, config.d_model)
  logging.info('%s', partitioner.describe())

  # A resume that the config would refuse is refused now, before the vocabulary and token
  # store are built for a config that will never train here.
  saved = checkpointing.newest_readable_meta(layout.checkpoints)
  if saved is not None:
    checkpointing.check_config_matches(saved['config'], config, layout.checkpoints)
  datasets = input_pipeline.get_datasets(
      config,
      layout,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      row_multiple=rows_multiple,
  )
  model_config = TransformerConfig.from_config(
      config, vocab_size=datasets.tokenizer.vocab_size, output_ids=datasets.output_ids
  )
  if model_config.output_ids is not None:
    logging.info(
        'The output layer scores the %d of %d pieces on the target side of the training '
        'split (output_vocabulary=target).',
        model_config.output_size,
        model_config.vocab_size,
    )
  logging.info(
      'Attention: %s.',
      kernel_choice.attention_choice(
          config, jax.default_backend(), np.dtype(model_config.dtype).name
      ).reason,
  )
  checkpointer = checkpointing.Checkpointer(
      layout.checkpoints,
      save_every=config.checkpoint_every_steps,
      final_step=config.num_train_steps,
      keep=config.keep_checkpoints,
      keep_period=config.keep_checkpoint_period,
      best_metric=config.best_checkpoint_metric if config.eval_every_steps else '',
      keep_best=config.keep_best_checkpoints,
  )
  own_signal = stop_signal is None
  stop_signal = stop_signal or multihost.StopSignal()
  writer = batches = profiler = None
  with checkpointer.reporting_full_disk():  # One message, whichever write fails.
    try:
      batches = prefetch.DevicePrefetcher(
          datasets.train, partitioner.shard_batch, config.prefetch_batches
      )
      tx, schedule = optimizer.create_optimizer(optimizer_config)
      abstract, shardings = train_steps.abstract_state(
          model_config, tx, partitioner, ema=bool(config.ema_decay)
      )
      state, restored_meta = _restore_or_initialize(
          config,
          checkpointer,
          datasets,
          batches,
          model_config,
          tx,
          (abstract, shardings),
          partitioner,
          init_source,
      )
      step_config = train_steps.StepConfig.from_config(config, model_config)
      train_step = train_steps.jit_train_step(step_config, tx, schedule, partitioner, shardings)
      eval_step = train_steps.jit_eval_step(
          model_config, config.label_smoothing, partitioner, shardings.params
      )
      start = int(state.step)
      early_stopping = early_stopping_lib.EarlyStopping.from_meta(config, restored_meta)
      writer = metrics_writer.MetricsWriter(
          layout.metrics,
          layout.tensorboard,
          total_steps=config.num_train_steps,
          start_step=start,
          enabled=jax.process_index() == 0,
          config=config,
      )
      to_do = (
          f'training steps {start + 1} to {config.num_train_steps}'
          if start < config.num_train_steps
          else f'the run is already finished (step {start} of num_train_steps='
          f'{config.num_train_steps}): nothing to train; raise '
          '--config.num_train_steps to train on'
      )
      if early_stopping is not None and early_stopping.out_of_patience:
        to_do = (
            f'the run already stopped early at step {start}: {early_stopping.describe()}; '
            'nothing to train; raise --config.early_stopping_patience to train on'
        )
      writer.log(
          f'{train_steps.count_params(state.params):,} parameters; '
          f'{datasets.steps_per_epoch} steps an epoch; {to_do}.'
      )
      meta = checkpointing.make_meta(config, datasets.tokenizer, model_config.output_ids)
      validation = None
      if config.eval_every_steps and config.eval_bleu_sentences:
        validation = ValidationTranslation(
            config, datasets, model_config, state.params, partitioner
        )
      profiler = StepProfiler(config, layout.profile, writer)
      context = _LoopContext(
          config=config,
          model_config=model_config,
          partitioner=partitioner,
          datasets=datasets,
          batches=batches,
          train_step=train_step,
          eval_step=eval_step,
          checkpointer=checkpointer,
          meta=meta,
          writer=writer,
          stop_signal=stop_signal,
          profiler=profiler,
          validation=validation,
          early_stopping=early_stopping,
      )
      with partitioner.activate():
        return _train_loop(context, state)
    finally:
      if profiler is not None:
        profiler.stop()
      if batches is not None:
        batches.close()
      checkpointer.wait()
      checkpointer.close()
      if writer is not None:
        writer.close()
      if own_signal:
        stop_signal.close()


@dataclasses.dataclass(frozen=True)
class _InitSource:
  """The checkpoint a fine-tuning run (`config.init_from`) takes its parameters from."""

  checkpoints: str  # Its run's checkpoint directory (`RunLayout.checkpoints`).
  step: int
  tokenizer: Tokenizer  # The checkpoint's vocabulary.
  map_vocab: bool  # The run has its own vocabulary, mapped by piece (`_map_vocabulary`).


def _init_source(
    config: ml_collections.ConfigDict,
) -> tuple[ml_collections.ConfigDict, _InitSource | None]:
  """Checks `config.init_from` against the config, before anything is compiled.

  Returns the config with `vocab_path` set to the checkpoint's vocabulary (when it was
  empty), and the checkpoint to start from (None without `init_from`).

  Raises:
    ConfigError: another vocabulary, or model fields that change parameter shapes.
    CheckpointNotFoundError: no such work directory, step or best checkpoint.
  """
  if not config.init_from:
    return config, None
  step = config.init_from_step
  try:
    meta, step = checkpointing.read_meta(
        RunLayout.of(config.init_from).checkpoints,
        int(step) if step.isdigit() else (step or None),
    )
  except CheckpointNotFoundError as e:
    raise CheckpointNotFoundError(f'--config.init_from has no checkpoint to start from: {e}') from e
  where = f'init_from={config.init_from!r} (step {step})'
  tokenizer = checkpointing.tokenizer_from_meta(meta)
  if config.init_from_map_vocab:
    pass  # The run's own vocabulary; the embeddings are mapped by piece.
  elif config.vocab_path:
    if not storage.exists(config.vocab_path) or storage.is_directory(config.vocab_path):
      raise ConfigError(
          f'vocab_path={config.vocab_path!r} does not exist; leave '
          '--config.vocab_path empty to take the vocabulary of '
          f'{where}.'
      )
    with storage.open_file(config.vocab_path) as f:
      if hashlib.sha256(f.read()).hexdigest() != meta['tokenizer']['sha256']:
        raise ConfigError(
            f'vocab_path={config.vocab_path!r} is not the vocabulary of {where}, whose '
            f'embeddings are rows of {meta["tokenizer"]["path"]}; leave --config.vocab_path '
            "empty to take the checkpoint's vocabulary, or set "
            '--config.init_from_map_vocab=True to map the embeddings of the pieces both '
            'vocabularies have.'
        )
  else:
    config = config.copy_and_resolve_references()
    with config.unlocked():
      config.vocab_path = tokenizer.model_path
  vocab_size = meta['vocab_size']
  source = TransformerConfig.from_config(
      config_lib.from_saved(meta['config']), vocab_size=vocab_size
  )
  target = TransformerConfig.from_config(config, vocab_size=vocab_size)
  shapes = loading.param_shapes(source)
  if loading.param_shapes(target) != shapes:
    changed = [
        f'{field.name}: checkpoint {getattr(source, field.name)!r}, this run '
        f'{getattr(target, field.name)!r}'
        for field in dataclasses.fields(TransformerConfig)
        if getattr(source, field.name) != getattr(target, field.name)
        and loading.param_shapes(
            dataclasses.replace(source, **{field.name: getattr(target, field.name)})
        )
        != shapes
    ]
    raise ConfigError(
        f'The model of this run has parameters of other shapes than {where}; these fields '
        'change them:\n  '
        + '\n  '.join(changed or ['(several together)'])
        + "\nSet them to the checkpoint's values to fine-tune it."
    )
  source = _InitSource(
      RunLayout.of(config.init_from).checkpoints, step, tokenizer, config.init_from_map_vocab
  )
  return config, source


def _map_vocabulary(params: Any, fresh: Any, old: Tokenizer, new: Tokenizer) -> Any:
  """`params` (over `old`'s ids) moved to `new`'s ids: along the vocabulary axis of every
  parameter that has one, the row of each piece `old` also has is copied; the other rows
  keep `fresh` (the run's random initialization)."""
  index = {piece: i for i, piece in enumerate(old.pieces())}
  new_pieces = new.pieces()
  rows = np.array([index.get(piece, 0) for piece in new_pieces])
  known = np.array([piece in index for piece in new_pieces])
  logging.info(
      "Mapping the vocabulary: %d of this run's %d pieces are in the checkpoint's "
      '%d and keep their embeddings; the other %d start random.',
      known.sum(),
      len(new_pieces),
      old.vocab_size,
      (~known).sum(),
  )

  def map_leaf(param, init):
    if param.shape == init.shape:
      return param
    axis = next(a for a in range(param.ndim) if param.shape[a] != init.shape[a])
    shape = [1] * param.ndim
    shape[axis] = -1
    # Under jit, so that arrays spread over several hosts can be mapped too.
    return jax.jit(
        lambda p, i: jnp.where(known.reshape(shape), jnp.take(p, rows, axis=axis), i),
        out_shardings=init.sharding,
    )(param, init)

  return jax.tree.map(map_leaf, params, fresh)


def _restore_or_initialize(
    config: ml_collections.ConfigDict,
    checkpointer: checkpointing.Checkpointer,
    datasets: input_pipeline.Datasets,
    batches: prefetch.DevicePrefetcher,
    model_config: TransformerConfig,
    tx: optax.GradientTransformation,
    abstract_and_shardings: tuple[train_steps.TrainState, train_steps.TrainState],
    partitioner: Partitioner,
    init_source: _InitSource | None = None,
) -> tuple[train_steps.TrainState, dict[str, Any] | None]:
  """The latest checkpoint's state (after checking its config) and meta, or a fresh state
  and None: random parameters, or those of `init_source` with a fresh optimizer state (and
  moving average) and step 0.
  `abstract_and_shardings`: `train_steps.abstract_state(model_config, tx, partitioner)`."""
  abstract, shardings = abstract_and_shardings
  steps = checkpointer.steps()
  if not steps:
    state = train_steps.create_train_state(config.seed, model_config, tx, partitioner, shardings)
    if init_source is None:
      return state, None
    params, _ = checkpointing.restore_params(
        init_source.checkpoints, init_source.step, shardings=shardings.params
    )
    if init_source.map_vocab:
      params = _map_vocabulary(params, state.params, init_source.tokenizer, datasets.tokenizer)
    params = jax.tree.map(lambda p, a: p.astype(a.dtype), params, state.params)
    logging.info(
        'Fine-tuning: parameters from %s, step %d; optimizer, schedule and data '
        'order start afresh.',
        init_source.checkpoints,
        init_source.step,
    )
    state = state.replace(params=params)
    if state.ema_params is not None:  # Under jit: new buffers, not the parameters' own.
      ema = jax.jit(train_steps.init_ema, out_shardings=shardings.ema_params)(params)
      state = state.replace(ema_params=ema)
    return state, None
  damaged = []
  for step in reversed(steps):  # The newest intact checkpoint.
    try:
      saved = checkpointer.restore_meta(step)
      checkpointing.check_config_matches(saved['config'], config, checkpointer.directory)
      if saved['vocab_size'] != datasets.tokenizer.vocab_size:
        raise ConfigError(
            f'The checkpoint at step {step} was trained with a {saved["vocab_size"]}-piece '
            f'vocabulary, but {datasets.tokenizer.model_path} has '
            f'{datasets.tokenizer.vocab_size}; point --config.vocab_path at the original '
            f'model ({saved["tokenizer"]["path"]}) or use a new --workdir.'
        )
      ids = datasets.output_ids
      if saved.get('output_ids') != (None if ids is None else list(ids)):
        raise ConfigError(
            f'The checkpoint at step {step} scores '
            f'{len(saved.get("output_ids") or []) or "all"} pieces in its output layer, but the '
            f'training data now gives {len(ids or []) or "all"} (output_vocabulary='
            f'{config.output_vocabulary}: the pieces on the target side of the training '
            'split): the data changed under the run; restore it, or use a new --workdir.'
        )
      state = checkpointer.restore(step, abstract, batches, saved.get('checksums'))
    except CheckpointError as e:
      damaged.append((step, e))
      continue
    for bad, error in damaged:
      path = checkpointer.set_aside(bad)
      logging.warning(
          'Checkpoint %d is damaged, so training resumes from %d, the newest '
          'intact one; the damaged one is kept as %s. (%s.)',
          bad,
          step,
          path,
          getattr(error, 'problem', error),
      )
    logging.info('Resumed from the checkpoint at step %d.', step)
    return state, saved
  raise CheckpointError(
      f'Every checkpoint in {checkpointer.directory} ({steps}) is damaged; the newest: '
      f'{damaged[0][1]}'
  )


@dataclasses.dataclass(frozen=True)
class _LoopContext:
  """What the training loop works with, built once by `_train_and_evaluate` (the state it
  steps is passed on its own).

  Attributes:
    config: the run config.
    model_config: the model's config (for the model FLOPs of each batch).
    partitioner: the mesh the steps run on.
    datasets: the validation batches come from here.
    batches: the training batches, on the devices (checkpointed with the state).
    train_step: `train_steps.jit_train_step`'s step.
    eval_step: `train_steps.jit_eval_step`'s step.
    checkpointer: saves the state and the data iterator.
    meta: what every checkpoint carries besides (`checkpointing.make_meta`).
    writer: the log lines and metrics.
    stop_signal: asks the loop to save and stop.
    profiler: traces the steps `config.profile_steps` names.
    validation: translates the validation subset at each evaluation (None: no BLEU).
    early_stopping: counts the evaluations without a new best (None: no best kept).
  """

  config: ml_collections.ConfigDict
  model_config: TransformerConfig
  partitioner: Partitioner
  datasets: input_pipeline.Datasets
  batches: prefetch.DevicePrefetcher
  train_step: Callable
  eval_step: Callable
  checkpointer: checkpointing.Checkpointer
  meta: Mapping[str, Any]
  writer: metrics_writer.MetricsWriter
  stop_signal: multihost.StopSignal
  profiler: StepProfiler
  validation: ValidationTranslation | None = None
  early_stopping: early_stopping_lib.EarlyStopping | None = None

  def save(self, state: train_steps.TrainState, metrics: Mapping[str, float] | None = None) -> None:
    """Saves `state` with the data iterator's position (and its validation `metrics`, if
    given) unless it holds a non-finite value (then raises)."""
    step = int(state.step)
    if self.checkpointer.latest_step() == step:
      return
    if not bool(train_steps.all_finite((state.params, state.opt_state, state.ema_params))):
      raise NonFiniteError(
          f'The parameters or optimizer state at step {step} are not finite; no checkpoint '
          f'was written (latest checkpoint: {self.checkpointer.latest_step() or "none"}). Lower '
          '--config.learning_rate_scale or set --config.grad_clip_norm.'
      )
    meta = dict(self.meta)
    if self.early_stopping is not None:  # The count as of this step, for a resume.
      meta.update(self.early_stopping.to_meta())
    self.checkpointer.save(state, self.batches, meta, force=True, metrics=metrics)
    self.writer.log(f'Saving checkpoint {step} (asynchronously).')


def _train_loop(context: _LoopContext, state: train_steps.TrainState) -> TrainResult:
  """Steps from `state.step` to `config.num_train_steps` (or to a stop signal)."""
  config, batches, checkpointer, writer = (
      context.config,
      context.batches,
      context.checkpointer,
      context.writer,
  )
  start = int(state.step)
  peak = _peak_flops(context.partitioner)
  pending: list[dict[str, jax.Array]] = []  # Step metrics since the last log line.
  untimed = 0  # How many of them throughput ignores (the first step: it compiles).
  flops = 0.0
  interval_start = time.time()
  eval_metrics = None
  stopped = False
  skipped_in_a_row = 0  # Up to the last step fetched.
  early_stopping = context.early_stopping
  if early_stopping is not None and early_stopping.out_of_patience:  # In an earlier run.
    return TrainResult(state=state, stopped_early=False, eval_metrics=None, out_of_patience=True)
  for step in range(start, config.num_train_steps):
    context.profiler.before(step)
    batch, device_batch = next(batches)
    state, metrics = context.train_step(state, device_batch)
    done = step + 1
    context.profiler.after(done, metrics)
    pending.append(metrics)
    checkpointer.check_for_errors()  # A failed background save surfaces at once.
    if step == start:
      jax.block_until_ready(metrics)
      writer.log(f'First step (with compilation) took {time.time() - interval_start:.1f}s.')
      interval_start, untimed = time.time(), 1
      batches.take_wait_seconds()  # The first batch's wait is part of compiling.
    else:
      # Model FLOPs of the real tokens; other hosts' batches are taken to be alike.
      flops += jax.process_count() * model_flops.batch_flops(
          context.model_config,
          (batch['inputs_segmentation'] > 0).sum(axis=1),
          (batch['targets_segmentation'] > 0).sum(axis=1),
      )
    if config.nonfinite == 'stop' and not float(metrics['finite']):
      raise NonFiniteError(
          f'The loss or gradient at step {done} is not finite (the update was not applied; '
          f'latest checkpoint: {checkpointer.latest_step() or "none"}). Lower '
          '--config.learning_rate_scale, set --config.grad_clip_norm, or use '
          '--config.nonfinite=skip to drop such updates.'
      )
    stopped = context.stop_signal.should_stop(done)
    writer.step_done(done)
    evaluating = config.eval_every_steps and (
        done % config.eval_every_steps == 0 or done == config.num_train_steps
    )
    # An evaluation may end the run for want of patience: its steps are logged before it.
    may_end = evaluating and early_stopping is not None and early_stopping.patience

    if done % config.log_every_steps == 0 or done == config.num_train_steps or stopped or may_end:
      fetched = jax.device_get(pending)
      summary = metrics_writer.summarize_train(
          metrics_writer.sum_metrics(fetched),
          steps=len(fetched),
          last=fetched[-1],
          skipped_total=int(state.skipped_steps),
          timed=metrics_writer.sum_metrics(fetched[untimed:]),
          seconds=time.time() - interval_start,
          flops=flops,
          peak_flops=peak,
          data_wait_seconds=batches.take_wait_seconds(),
      )
      # A mixture of directions: the examples drawn from each so far (this host's).
      drawn = batches.get_state().get('drawn') or ()
      summary.update(zip((f'examples_drawn/{n}' for n in context.datasets.source_names), drawn))
      writer.write(done, 'train', summary)
      pending, untimed, flops, interval_start = [], 0, 0.0, time.time()
      for m in fetched:
        skipped_in_a_row = 0 if m['finite'] else skipped_in_a_row + 1
      limit = config.max_skipped_steps_in_a_row
      if limit and skipped_in_a_row >= limit:
        raise NonFiniteError(
            f'The last {skipped_in_a_row} updates (to step {done}) were all skipped for a '
            'non-finite loss or gradient: the run has diverged. Nothing non-finite was '
            f'saved (latest checkpoint: {checkpointer.latest_step() or "none"}). Start a new '
            'run (another --workdir) with a lower --config.learning_rate_scale or a '
            '--config.grad_clip_norm, or raise --config.max_skipped_steps_in_a_row to '
            'resume this one as it is.'
        )

    if evaluating:
      eval_start = time.time()
      # With ema_decay, the moving average is what validation (and so the best) measures.
      eval_params = state.params if state.ema_params is None else state.ema_params
      eval_metrics = evaluate(
          context.eval_step,
          eval_params,
          context.datasets.eval_batches(),
          context.partitioner,
          config.eval_batches,
      )
      if context.validation is not None:
        translation_metrics, samples = context.validation(eval_params)
        eval_metrics.update(translation_metrics)
        writer.text(done, 'eval/samples', samples)
      writer.write(done, 'eval', eval_metrics)
      interval_start += time.time() - eval_start  # Evaluation is not training throughput.
      if config.best_checkpoint_metric:  # Each evaluation's checkpoint competes for best.
        if early_stopping is not None:
          early_stopping.update(done, eval_metrics)
        context.save(state, metrics=eval_metrics)
        if early_stopping is not None and early_stopping.out_of_patience:
          writer.log(f'Stopping early at step {done}: {early_stopping.describe()}.')
          return TrainResult(
              state=state, stopped_early=False, eval_metrics=eval_metrics, out_of_patience=True
          )

    if stopped or checkpointer.should_save(done):
      context.save(state)
    if stopped:
      logging.info(
          'Stop requested: saving step %d on process %d, then exiting.', done, jax.process_index()
      )
      writer.log(f'Stop requested: saved step {done}; rerun the same command to resume.')
      break
  return TrainResult(
      state=state,
      stopped_early=stopped,
      eval_metrics=eval_metrics,
      interrupted=stopped and context.stop_signal.interrupted,
  )


class StepProfiler:
  """A `jax.profiler` trace of the steps `config.profile_steps` names (A:B traces steps A+1
  to B; a resumed run that starts between them traces from its first step), written by every
  process under `target` (`RunLayout.profile`; on a gs:// work directory traced to the local
  cache, then uploaded)."""

  def __init__(
      self, config: ml_collections.ConfigDict, target: str, writer: metrics_writer.MetricsWriter
  ):
    self._range = config_lib.profile_range(config)
    self._target = target
    self._remote = storage.is_remote(target)
    self._directory = storage.local_cache(self._target) if self._remote else self._target
    self._writer = writer
    self._active = False

  def before(self, step: int) -> None:
    """Called before the step that makes `step + 1`."""
    if self._range and not self._active and self._range[0] <= step < self._range[1]:
      jax.profiler.start_trace(self._directory)
      self._active = True
      self._first = step + 1

  def after(self, done: int, metrics: Any) -> None:
    if self._active and done >= self._range[1]:
      jax.block_until_ready(metrics)  # The trace holds the last step's device work too.
      self.stop()

  def stop(self) -> None:
    if not self._active:
      return
    self._active = False
    jax.profiler.stop_trace()
    if self._remote:
      storage.upload(self._directory, self._target, '--config.profile_steps')
    self._writer.log(
        f'Traced steps {self._first} to {self._range[1]} into {self._target}: '
        f'view with `tensorboard --logdir={self._target}` (the Profile tab) or '
        'at ui.perfetto.dev (the .trace.json.gz files).'
    )

"""The train step (accumulation, non-finite handling, dropout keys, the parameters' moving
average) and the training loop end to end on one device: outputs, checkpoints, loading for
inference, stop and resume, early stopping, config mismatch, and train.py's errors."""

import dataclasses
import gc
import glob
import gzip
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import tiny
import train_testlib
from transformer_jax import errors
from transformer_jax.checkpoints import averaging
from transformer_jax.checkpoints import checkpointing
from transformer_jax.checkpoints import loading
from transformer_jax.config import base_config
from transformer_jax.config import ConfigError
from transformer_jax.data import input_pipeline
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.model import models
from transformer_jax.model.config import TransformerConfig
from transformer_jax.runtime import multihost
from transformer_jax.runtime.partitioning import Partitioner
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import metrics_writer
from transformer_jax.training import optimizer
from transformer_jax.training import train_loop
from transformer_jax.training import train_steps

VOCAB = 64


def synthetic_batch(seed, rows=4, length=12):
  """Rows with different numbers of real tokens (so microbatches weigh differently)."""
  rng = np.random.default_rng(seed)
  batch = {k: np.zeros((rows, length), np.int32) for k in models.BATCH_KEYS}
  for r in range(rows):
    for side, n in (('inputs', 3 + (r * 5) % (length - 3)), ('targets', 2 + (r * 7) % 9)):
      batch[side][r, :n] = rng.integers(4, VOCAB, n)
      batch[f'{side}_positions'][r, :n] = np.arange(n)
      batch[f'{side}_segmentation'][r, :n] = 1
  return batch


class StepHarness:
  """One initialized state (compiled once) and steps compiled for variants of it."""

  def __init__(self):
    self.config = tiny.get_config()
    self.config.update(dict(num_encoder_layers=1, num_decoder_layers=1))
    self.partitioner = Partitioner.from_config(self.config, devices=jax.devices()[:1])
    self.model_config = TransformerConfig.from_config(self.config, vocab_size=VOCAB)
    self.tx, self.schedule = optimizer.create_optimizer(
        optimizer.OptimizerConfig.from_config(self.config, self.model_config.d_model)
    )
    _, self.shardings = train_steps.abstract_state(self.model_config, self.tx, self.partitioner)
    self._state = train_steps.create_train_state(
        0, self.model_config, self.tx, self.partitioner, self.shardings
    )

  def state(self, tx=None, ema=False):
    """A copy of the initial state (the step donates its input), optionally for `tx`, and
    with the parameters' moving average (`ema`: a copy of them)."""
    state = jax.tree.map(jnp.copy, self._state)
    if tx is not None:
      state = state.replace(opt_state=tx.init(state.params))
    if ema:
      state = state.replace(ema_params=jax.tree.map(jnp.copy, state.params))
    return state

  def step(
      self, grad_accum_steps=1, dropout_rate=0.0, tx=None, dropout_rng_impl='rbg', ema_decay=0.0
  ):
    tx = tx or self.tx
    schedule = self.schedule if tx is self.tx else optax.constant_schedule(1.0)
    model_config = dataclasses.replace(self.model_config, dropout_rate=dropout_rate)
    _, shardings = train_steps.abstract_state(
        model_config, tx, self.partitioner, ema=bool(ema_decay)
    )
    step = train_steps.jit_train_step(
        train_steps.StepConfig(
            model_config,
            seed=0,
            grad_accum_steps=grad_accum_steps,
            dropout_rng_impl=dropout_rng_impl,
            ema_decay=ema_decay,
        ),
        tx,
        schedule,
        self.partitioner,
        shardings,
    )

    def run(state, batch):
      with self.partitioner.activate():
        return step(state, self.partitioner.shard_batch(batch))

    return run


@pytest.fixture(scope='module')
def harness():
  return StepHarness()


def test_gradient_accumulation_matches_the_full_batch(harness):
  """SGD with rate 1 makes the parameter change the (negated) gradient itself."""
  batch = synthetic_batch(0)
  sgd = optax.sgd(1.0)
  before = jax.device_get(harness.state().params)
  results = {}
  for k in (1, 4):
    after, metrics = harness.step(grad_accum_steps=k, tx=sgd)(harness.state(sgd), batch)
    grads = jax.tree.map(lambda b, a: b - a, before, jax.device_get(after.params))
    results[k] = grads, jax.device_get(metrics)
  for name in ('loss', 'nll', 'tokens', 'correct', 'grad_norm'):
    np.testing.assert_allclose(results[4][1][name], results[1][1][name], rtol=1e-5)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
      results[4][0],
      results[1][0],
  )


def test_nonfinite_loss_skips_the_update_and_counts_it(harness):
  step = harness.step()
  state = harness.state()
  params = jax.tree.map(jnp.copy, state.params)
  emb = params['shared_embedding']['embedding']
  params['shared_embedding']['embedding'] = emb.at[5, 0].set(jnp.inf)
  poisoned = state.replace(params=params)
  batch = synthetic_batch(1)
  batch['targets'][0, 0] = 5  # The poisoned row is read: the loss becomes non-finite.
  before = jax.device_get(poisoned)
  after, metrics = step(poisoned, batch)
  assert float(metrics['finite']) == 0.0
  assert int(after.step) == 1 and int(after.skipped_steps) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(after.params), before.params)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(after.opt_state), before.opt_state)
  assert not bool(train_steps.all_finite(after.params))
  # A healthy state takes the update.
  healthy, metrics = step(harness.state(), batch)
  assert float(metrics['finite']) == 1.0 and int(healthy.skipped_steps) == 0


def test_the_moving_average_is_the_float32_recurrence_over_applied_updates(harness):
  """Three updates, each followed by ema = decay * ema + (1 - decay) * params (recomputed in
  numpy from the parameters after each step), then a skipped one, which leaves it."""
  decay = 0.75
  step = harness.step(ema_decay=decay)
  state = harness.state(ema=True)
  expected = jax.device_get(state.params)
  for seed in range(3):
    state, metrics = step(state, synthetic_batch(seed))
    assert float(metrics['finite']) == 1.0
    params = jax.device_get(state.params)
    expected = jax.tree.map(
        lambda e, p: np.float32(decay) * e + np.float32(1 - decay) * p, expected, params
    )
    ema = jax.device_get(state.ema_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), ema, expected)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(ema))
  # Not the parameters themselves: they moved away from their average.
  assert not np.allclose(
      ema['shared_embedding']['embedding'], params['shared_embedding']['embedding']
  )
  # An update skipped for a non-finite loss leaves the average as it was.
  params = dict(state.params)
  emb = params['shared_embedding']['embedding']
  params['shared_embedding'] = {'embedding': emb.at[5, 0].set(jnp.inf)}
  batch = synthetic_batch(1)
  batch['targets'][0, 0] = 5  # The poisoned row is read: the loss becomes non-finite.
  state, metrics = step(state.replace(params=params), batch)
  assert float(metrics['finite']) == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.ema_params), ema)
  # Sharded exactly as the parameters.
  _, shardings = train_steps.abstract_state(
      harness.model_config, harness.tx, harness.partitioner, ema=True
  )
  assert shardings.ema_params == shardings.params
  assert (
      train_steps.abstract_state(harness.model_config, harness.tx, harness.partitioner)[
          1
      ].ema_params
      is None
  )


@pytest.mark.parametrize('impl', ['rbg', 'threefry2x32'])
def test_dropout_masks_depend_only_on_the_step(harness, impl):
  """Same state and batch: same masks (a resumed run redraws them); another step: new ones."""
  batch = synthetic_batch(2)
  step = harness.step(dropout_rate=0.3, dropout_rng_impl=impl)
  a, _ = step(harness.state(), batch)
  b, _ = step(harness.state(), batch)
  state = harness.state()  # Step 7, placed as the state's step is: the same program runs.
  c, _ = step(state.replace(step=jax.device_put(np.int32(7), state.step.sharding)), batch)
  emb = lambda s: np.asarray(s.params['shared_embedding']['embedding'])
  np.testing.assert_array_equal(emb(a), emb(b))
  assert not np.array_equal(emb(a), emb(c))


# --- The loop, end to end. ---


@pytest.fixture(scope='module')
def data_files(tmp_path_factory):
  return train_testlib.write_parallel_text(str(tmp_path_factory.mktemp('data')))


@pytest.fixture(scope='module')
def finished_run(data_files, tmp_path_factory):
  """Six steps with validation (BLEU of 8 sentences) every 3 and checkpoints every 2 (keep 1,
  plus every 4th, plus the best by BLEU); steps 5 and 6 traced by jax.profiler; the output
  layer over the target side's pieces."""
  workdir = str(tmp_path_factory.mktemp('run'))
  config = train_testlib.small_config(
      data_files,
      output_vocabulary='target',
      eval_every_steps=3,
      keep_checkpoints=1,
      keep_checkpoint_period=4,
      eval_bleu_sentences=8,
      best_checkpoint_metric='bleu',
      profile_steps='4:6',
  )
  result = train_loop.train_and_evaluate(config, workdir)
  return config, workdir, result


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_a_logging_interval_becomes_means_and_rates():
  """Step metrics arrive as sums over the interval's steps; the summary divides them by the
  tokens, the steps and the timed seconds (the first, compiling steps not timed)."""
  step = {
      'loss': 6.0,
      'nll': 4.0,
      'correct': 1.0,
      'tokens': 4.0,
      'source_tokens': 6.0,
      'slots': 16.0,
      'grad_norm': 2.0,
  }
  sums = metrics_writer.sum_metrics([step, step])
  summary = metrics_writer.summarize_train(
      sums,
      steps=2,
      last={'learning_rate': 0.5},
      skipped_total=1,
      timed=step,
      seconds=2.0,
      flops=1e9,
      peak_flops=1e10,
      data_wait_seconds=0.5,
  )
  assert summary['loss'] == 1.5 and summary['accuracy'] == 0.25
  assert summary['perplexity'] == pytest.approx(np.e)
  assert summary['grad_norm'] == 2.0 and summary['learning_rate'] == 0.5
  assert summary['padding_share'] == pytest.approx(1 - 20 / 32)
  assert summary['tokens_per_second'] == 5.0 and summary['target_tokens_per_second'] == 2.0
  assert summary['mfu'] == pytest.approx(0.05) and summary['data_wait_share'] == 0.25
  assert summary['skipped_steps'] == 1.0
  untimed = metrics_writer.summarize_train(
      sums, steps=2, last={'learning_rate': 0.5}, skipped_total=0
  )
  assert 'tokens_per_second' not in untimed and 'mfu' not in untimed


def test_validation_sums_every_batch_up_to_the_limit(harness):
  batches = [{'tokens': np.full((1, 1), n)} for n in (1, 2, 4, 8)]
  seen = []

  def eval_step(params, batch):
    seen.append(int(np.asarray(batch['tokens']).sum()))
    n = float(seen[-1])
    return {'loss': 2 * n, 'nll': 0.0, 'correct': n / 2, 'tokens': n}

  metrics = train_loop.evaluate(eval_step, None, batches, harness.partitioner, max_batches=3)
  assert seen == [1, 2, 4]
  assert metrics == {'loss': 2.0, 'perplexity': 1.0, 'accuracy': 0.5, 'tokens': 7.0}
  assert train_loop.evaluate(eval_step, None, batches, harness.partitioner)['tokens'] == 15.0


def test_train_py_imports_neither_pytorch_nor_the_cloud_storage_client(tmp_path):
  """tensorboardX imports both where they are installed (seconds of every start); the metrics
  writer gives it neither, and they still import afterwards: neither is left blocked (a None
  in sys.modules would be listed), and the lighter one imports (torch would cost seconds)."""
  layout = RunLayout.of(str(tmp_path))
  code = (
      'import sys, importlib.util\n'
      'from transformer_jax.commands import train\n'
      'from transformer_jax.training import metrics_writer\n'
      f'metrics_writer.MetricsWriter({layout.metrics!r}, {layout.tensorboard!r},\n'
      '                              total_steps=1, start_step=0, enabled=True)\n'
      'print(sorted(m for m in ("torch", "google.cloud.storage", "tensorboardX")\n'
      '             if m in sys.modules))\n'
      'import google.cloud.storage\n'
  )
  result = subprocess.run(
      [sys.executable, '-c', code],
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split('\n')[0] == "['tensorboardX']"
  assert glob.glob(str(tmp_path / 'tensorboard' / 'events.out.tfevents.*'))


@pytest.mark.slow
def test_run_writes_metrics_tensorboard_and_checkpoints(finished_run):
  _, workdir, result = finished_run
  assert int(result.state.step) == 6 and not result.stopped_early
  lines = read_metrics(workdir)
  train = [m for m in lines if m['split'] == 'train']
  assert [m['step'] for m in train] == [1, 2, 3, 4, 5, 6]
  for m in train:
    keys = (
        'loss',
        'perplexity',
        'learning_rate',
        'grad_norm',
        'padding_share',
        'skipped_steps',
    ) + (('tokens_per_second',) if m['step'] > 1 else ())
    for key in keys:  # Step 1 compiles, so it reports no throughput.
      assert np.isfinite(m[key]), (key, m)
    assert 0.0 <= m['padding_share'] < 1.0 and m['skipped_steps'] == 0
  assert train[-1]['loss'] < train[0]['loss']
  assert all(m['time'] >= lines[0]['time'] for m in lines)  # Wall-clock seconds.
  evals = [m for m in lines if m['split'] == 'eval']
  assert [m['step'] for m in evals] == [3, 6]
  np.testing.assert_allclose(evals[-1]['perplexity'], np.exp(evals[-1]['loss']), rtol=0.5)
  assert result.eval_metrics['loss'] == pytest.approx(evals[-1]['loss'])
  for m in evals:  # sacreBLEU and chrF of 8 validation sentences, and what they cost.
    assert 0 <= m['bleu'] <= 100 and 0 <= m['chrf'] <= 100 and m['translate_seconds'] > 0
  events = os.listdir(os.path.join(workdir, 'tensorboard'))
  assert any(name.startswith('events.out.tfevents') for name in events)
  tags = _tensorboard_tags(os.path.join(workdir, 'tensorboard'))
  assert {'config/text_summary', 'eval/samples/text_summary', 'eval/bleu'} <= tags, tags
  # keep_checkpoints=1 keeps step 6; keep_checkpoint_period=4 keeps step 4; and the best
  # by BLEU of the checkpoints saved at evaluations (3 and 6; ties: the later) is kept.
  best = max((m['bleu'], m['step']) for m in evals)[1]
  assert checkpointing.list_steps(RunLayout.of(workdir).checkpoints) == sorted({4, 6, best})
  assert loading.load(workdir, step='best').step == best


@pytest.mark.slow
def test_profile_steps_trace_the_train_step(finished_run):
  _, workdir, _ = finished_run
  traces = glob.glob(os.path.join(workdir, 'profile', 'plugins', 'profile', '*', '*'))
  assert {name.split('.', 1)[1] for name in map(os.path.basename, traces)} == {
      'xplane.pb',
      'trace.json.gz',
  }, traces
  with gzip.open(next(t for t in traces if t.endswith('.trace.json.gz'))) as f:
    events = json.load(f)['traceEvents']
  names = {e.get('name', '') for e in events if e.get('ph') == 'X'}
  assert 'PjitFunction(train_step)' in names  # The two steps' dispatches,
  assert any(n.startswith(('fusion', 'dot', 'loop_')) for n in names), sorted(names)[:50]  # ops.


def _tensorboard_tags(directory):
  """The summary tags in TensorBoard event files (TFRecords of `Event` protos)."""
  from tensorboardX.proto import event_pb2

  tags = set()
  for name in os.listdir(directory):
    with open(os.path.join(directory, name), 'rb') as f:
      data = f.read()
    offset = 0
    while offset < len(data):  # length (8 bytes), its CRC (4), the record, its CRC (4).
      length = int.from_bytes(data[offset : offset + 8], 'little')
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      tags.update(value.tag for value in event.summary.value)
      offset += 16 + length
  return tags


def _fake_state(step):
  return train_steps.TrainState(
      step=jnp.int32(step),
      params={'w': jnp.full(3, step, jnp.float32)},
      opt_state={'m': jnp.zeros(3)},
      skipped_steps=jnp.int32(0),
  )


@pytest.mark.slow
@pytest.mark.parametrize('metric,kept,best', [('bleu', [2, 4, 6], 2), ('loss', [2, 3, 6], 3)])
def test_the_best_checkpoints_are_kept_besides_the_latest(tmp_path, metric, kept, best):
  import grain

  checkpointer = checkpointing.Checkpointer(
      RunLayout.of(str(tmp_path)).checkpoints,
      save_every=100,
      final_step=100,
      keep=1,
      best_metric=metric,
      keep_best=2,
  )
  meta = {'config': {'best_checkpoint_metric': metric}, 'vocab_size': 8, 'tokenizer': {}}
  data = iter(grain.MapDataset.range(4).to_iter_dataset())
  validation = {
      1: (5.0, 3.0),
      2: (9.0, 2.0),
      3: (1.0, 0.5),
      4: (7.0, 2.5),
      5: None,
      6: (2.0, 9.0),
  }  # step: (bleu, loss); step 5 was saved without metrics.
  for step, values in validation.items():
    metrics = None if values is None else {'bleu': values[0], 'loss': values[1]}
    checkpointer.save(_fake_state(step), data, meta, force=True, metrics=metrics)
    checkpointer.wait()
  checkpointer.close()
  assert checkpointing.list_steps(RunLayout.of(str(tmp_path)).checkpoints) == kept
  meta_read, step = checkpointing.read_meta(
      RunLayout.of(str(tmp_path)).checkpoints, checkpointing.BEST
  )
  assert step == best and meta_read['vocab_size'] == 8
  params, step = checkpointing.restore_params(
      RunLayout.of(str(tmp_path)).checkpoints, checkpointing.BEST
  )
  assert step == best and float(params['w'][0]) == best


@pytest.mark.slow
def test_loading_for_inference_needs_only_the_workdir(finished_run, tmp_path):
  config, workdir, result = finished_run
  loaded = loading.load(workdir)
  assert loaded.step == 6
  assert loaded.model_config.deterministic and loaded.model_config.num_encoder_layers == 1
  # The output layer's pieces come with the checkpoint: the target side's, not all 128.
  ids = loaded.model_config.output_ids
  assert ids == tuple(checkpointing.read_meta(RunLayout.of(workdir).checkpoints)[0]['output_ids'])
  assert 2 < len(ids) < loaded.model_config.vocab_size == 128
  assert loaded.config.d_model == config.d_model
  jax.tree.map(
      np.testing.assert_array_equal,
      jax.device_get(loaded.params),
      jax.device_get(result.state.params),
  )
  sentence = 'abc fed'
  # The vocabulary survives the loss of its original file (it is inside the checkpoint).
  original = loaded.tokenizer.model_path
  expected = loaded.tokenizer.encode(sentence)
  os.rename(original, original + '.moved')
  try:
    meta, _ = checkpointing.read_meta(RunLayout.of(workdir).checkpoints, 4)
    assert checkpointing.tokenizer_from_meta(meta).encode(sentence) == expected
  finally:
    os.rename(original + '.moved', original)
  params, step = checkpointing.restore_params(RunLayout.of(workdir).checkpoints, 4)
  assert step == 4
  assert not np.array_equal(
      params['shared_embedding']['embedding'], loaded.params['shared_embedding']['embedding']
  )
  with pytest.raises(FileNotFoundError, match='no checkpoint for step 5'):
    checkpointing.restore_params(RunLayout.of(workdir).checkpoints, 5)


@pytest.mark.slow
@pytest.mark.slow
def test_rerunning_a_finished_run_says_so_and_trains_nothing(finished_run, tmp_path, caplog):
  config, workdir, _ = finished_run
  copy = str(tmp_path / 'run')
  shutil.copytree(workdir, copy)
  with caplog.at_level(logging.INFO):
    again = train_loop.train_and_evaluate(config, copy)
  assert int(again.state.step) == 6 and not again.stopped_early
  assert (
      'the run is already finished (step 6 of num_train_steps=6): nothing to train; '
      'raise --config.num_train_steps to train on'
  ) in caplog.text, caplog.text[-3000:]
  assert 'training steps' not in caplog.text
  assert [m['step'] for m in read_metrics(copy) if m['split'] == 'train'] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_resuming_with_a_different_config_lists_the_fields(finished_run):
  config, workdir, _ = finished_run
  changed = train_testlib.small_config(
      {k: config.text_files[k] for k in config.text_files},
      eval_every_steps=3,
      d_model=64,
      label_smoothing=0.2,
      num_train_steps=8,
  )
  with pytest.raises(checkpointing.ConfigMismatchError) as error:
    train_loop.train_and_evaluate(changed, workdir)
  message = str(error.value)
  assert 'd_model: checkpoint=32 now=64' in message
  assert 'label_smoothing: checkpoint=0.1 now=0.2' in message
  assert 'num_train_steps' not in message.split('Fields that may change')[0]


@pytest.mark.slow
def test_a_refused_resume_builds_nothing_first(finished_run):
  """Another vocabulary size would need a new vocabulary and token store: the resume is
  refused before they are built, and the work directory is left as it was."""
  config, workdir, _ = finished_run
  before = sorted(
      os.path.relpath(os.path.join(d, f), workdir)
      for d, _, files in os.walk(workdir)
      for f in files
  )
  changed = train_testlib.small_config(
      {k: config.text_files[k] for k in config.text_files}, vocab_size_target=96
  )
  with pytest.raises(
      checkpointing.ConfigMismatchError, match='vocab_size_target: checkpoint=128 now=96'
  ):
    train_loop.train_and_evaluate(changed, workdir)
  after = sorted(
      os.path.relpath(os.path.join(d, f), workdir)
      for d, _, files in os.walk(workdir)
      for f in files
  )
  assert after == before


@pytest.mark.slow
def test_a_resume_whose_data_gives_other_output_pieces_is_refused(
    finished_run, tmp_path, monkeypatch
):
  config, workdir, _ = finished_run
  copy = str(tmp_path / 'run')
  shutil.copytree(workdir, copy)
  found = input_pipeline.target_side_ids
  # As if a piece had left the training targets since the checkpoints were written.
  monkeypatch.setattr(input_pipeline, 'target_side_ids', lambda *a: found(*a)[:-1])
  with pytest.raises(ConfigError, match=r'scores \d+ pieces in its output layer, but the '):
    train_loop.train_and_evaluate(config, copy)


@pytest.mark.slow
def test_init_from_starts_a_new_run_from_the_checkpoint_parameters(finished_run, tmp_path):
  config, workdir, _ = finished_run
  files = {k: config.text_files[k] for k in config.text_files}
  # A learning rate of ~0 keeps the parameters where they started, so the run ends with
  # those of step 4; its own step, optimizer and schedule start at 0.
  tuned = train_testlib.small_config(
      files,
      init_from=workdir,
      init_from_step='4',
      num_train_steps=2,
      learning_rate_scale=1e-30,
      label_smoothing=0.0,
      dropout_rate=0.2,
  )
  tuned_dir = str(tmp_path / 'tuned')
  result = train_loop.train_and_evaluate(tuned, tuned_dir)
  assert int(result.state.step) == 2
  source, _ = checkpointing.restore_params(RunLayout.of(workdir).checkpoints, 4)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-12),
      jax.device_get(result.state.params),
      jax.device_get(source),
  )
  # The checkpoint's vocabulary, not a new one trained in the new work directory.
  assert not os.path.exists(os.path.join(tuned_dir, 'vocab'))
  meta, _ = checkpointing.read_meta(RunLayout.of(tuned_dir).checkpoints)
  assert (
      meta['tokenizer']['sha256']
      == checkpointing.read_meta(RunLayout.of(workdir).checkpoints, 4)[0]['tokenizer']['sha256']
  )
  assert loading.load(tuned_dir).config.init_from == workdir
  # Resuming it goes on from its own checkpoint, not from step 4 again.
  longer = train_testlib.small_config(
      files,
      init_from=workdir,
      init_from_step='4',
      num_train_steps=3,
      learning_rate_scale=1e-30,
      label_smoothing=0.0,
      dropout_rate=0.2,
  )
  assert int(train_loop.train_and_evaluate(longer, tuned_dir).state.step) == 3
  assert [m['step'] for m in read_metrics(tuned_dir) if m['split'] == 'train'] == [1, 2, 3]


@pytest.mark.slow
def test_init_from_refuses_other_shapes_and_vocabularies_before_compiling(finished_run, tmp_path):
  config, workdir, _ = finished_run
  files = {k: config.text_files[k] for k in config.text_files}

  def start(**overrides):
    with pytest.raises((ConfigError, errors.CheckpointNotFoundError)) as error:
      train_loop.train_and_evaluate(
          train_testlib.small_config(files, init_from=workdir, **overrides), str(tmp_path / 'run')
      )
    return str(error.value)

  message = start(d_ff=96, num_decoder_layers=2, dropout_rate=0.3)
  assert 'd_ff: checkpoint 64, this run 96' in message
  assert 'num_decoder_layers: checkpoint 1, this run 2' in message
  assert 'dropout' not in message  # It changes no shape.
  other = tokenizer_lib.load_or_train_tokenizer(
      str(tmp_path / 'other.model'),
      lambda: iter(open(files['train'].split(',')[0])),
      vocab_size=100,
      model_type='bpe',
  )
  assert 'init_from_map_vocab=True' in start(vocab_path=other.model_path)
  assert 'does not exist' in start(vocab_path=str(tmp_path / 'missing.model'))
  assert 'no checkpoint for step 5' in start(init_from_step='5')
  with pytest.raises(ConfigError, match='needs --config.init_from'):
    train_loop.train_and_evaluate(
        train_testlib.small_config(files, init_from_step='4'), str(tmp_path / 'run')
    )
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')

  # Asked to, it maps the checkpoint's embeddings onto the other vocabulary by piece.
  mapped = train_loop.train_and_evaluate(
      train_testlib.small_config(
          files,
          init_from=workdir,
          vocab_path=other.model_path,
          init_from_map_vocab=True,
          num_train_steps=1,
          learning_rate_scale=1e-30,
      ),
      str(tmp_path / 'mapped'),
  )
  source, _ = checkpointing.restore_params(RunLayout.of(workdir).checkpoints)
  source = jax.device_get(source)
  params = jax.device_get(mapped.state.params)
  old_pieces = checkpointing.tokenizer_from_meta(
      checkpointing.read_meta(RunLayout.of(workdir).checkpoints)[0]
  ).pieces()
  new_pieces = other.pieces()
  shared = [(i, old_pieces.index(p)) for i, p in enumerate(new_pieces) if p in old_pieces]
  assert 8 < len(shared) < len(new_pieces)  # Some pieces are shared, not all.
  embedding = params['shared_embedding']['embedding']
  assert embedding.shape[0] == len(new_pieces)
  new_ids, old_ids = map(list, zip(*shared))
  np.testing.assert_allclose(
      embedding[new_ids], source['shared_embedding']['embedding'][old_ids], atol=1e-12
  )
  unshared = [i for i in range(len(new_pieces)) if new_pieces[i] not in old_pieces]
  assert not np.allclose(embedding[unshared[0]], 0.0)  # Fresh random rows.
  np.testing.assert_allclose(
      params['encoder']['layer_0']['feed_forward']['wi']['kernel'],
      source['encoder']['layer_0']['feed_forward']['wi']['kernel'],
      atol=1e-12,
  )


def test_a_checkpoint_older_than_a_field_counts_as_its_legacy_value():
  config = base_config()
  saved = checkpointing.config_to_json(config)
  # Written before they existed.
  del saved['dropout_rng_impl'], saved['lr_cooldown_steps'], saved['lr_schedule']
  assert checkpointing.config_differences(saved, config) == [
      'dropout_rng_impl: checkpoint="threefry2x32" now="rbg"'
  ]
  config.dropout_rng_impl = 'threefry2x32'
  assert checkpointing.config_differences(saved, config) == []


@pytest.mark.slow
def test_a_run_that_skips_every_update_stops_with_an_error(data_files, tmp_path):
  # A learning rate of 1e9 sends the parameters to infinity after the first update; from
  # then on every update is skipped and the parameters stay as they were.
  config = train_testlib.small_config(
      data_files,
      learning_rate_scale=1e9,
      num_train_steps=12,
      checkpoint_every_steps=1,
      max_skipped_steps_in_a_row=3,
  )
  with pytest.raises(train_loop.NonFiniteError, match='last 3 updates .* all skipped'):
    train_loop.train_and_evaluate(config, str(tmp_path))
  steps = checkpointing.list_steps(RunLayout.of(str(tmp_path)).checkpoints)
  assert steps and max(steps) < 12
  params, _ = checkpointing.restore_params(RunLayout.of(str(tmp_path)).checkpoints, max(steps))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(params)))


class SignalAt(multihost.StopSignal):
  """Sends this process a real signal when the loop reports step `at`."""

  def __init__(self, at, signum):
    super().__init__()
    self.at, self.signum = at, signum

  def should_stop(self, step):
    if step == self.at:
      os.kill(os.getpid(), self.signum)
    return super().should_stop(step)


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_save_that_step_and_stop(finished_run, tmp_path, signum):
  config, _, _ = finished_run
  workdir = str(tmp_path)
  stop = SignalAt(3, signum)
  try:
    stopped = train_loop.train_and_evaluate(config, workdir, stop_signal=stop)
  finally:
    stop.close()
  assert stopped.stopped_early and int(stopped.state.step) == 3
  assert stopped.interrupted == (signum == signal.SIGINT)  # train.py then exits 130, not 0.
  # Step 3 is not a regular save step (every 2), and it is complete on return.
  assert checkpointing.list_steps(RunLayout.of(workdir).checkpoints) == [3]
  logged = [m['step'] for m in read_metrics(workdir) if m['split'] == 'train']
  assert logged == [1, 2, 3]
  assert signal.getsignal(signum) is not stop._on_signal


@pytest.mark.slow
def test_ctrl_c_saves_exits_130_and_stops_the_script_and_a_rerun_resumes(data_files, tmp_path):
  """Ctrl-C in a terminal (SIGINT to the whole process group) while a `set -e` script runs
  train.py: it saves that step and exits 130, so the script stops before its next command
  (with exit 0 bash would go on, as scripts/main_job.sh went on to evaluate); the same
  command then resumes from that step."""
  config = train_testlib.write_config_file(
      str(tmp_path / 'config.py'),
      data_files,
      num_train_steps=100_000,
      checkpoint_every_steps=100_000,
  )
  workdir = tmp_path / 'run'
  train = [
      sys.executable,
      os.path.join(train_testlib.REPO, 'train.py'),
      f'--config={config}',
      f'--workdir={workdir}',
  ]
  script = tmp_path / 'job.sh'
  script.write_text('set -euo pipefail\n"$@"\necho NEXT\n')
  job = subprocess.Popen(
      ['bash', str(script), *train],
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      start_new_session=True,
  )
  try:
    metrics = workdir / 'metrics.jsonl'
    deadline = time.monotonic() + 300
    # A logged step: training runs, with the signal handler in place.
    while not (metrics.exists() and metrics.read_text().strip()):
      assert job.poll() is None, job.communicate()[1][-3000:]
      assert time.monotonic() < deadline, 'train.py logged no step in 300 s'
      time.sleep(0.2)
    os.killpg(job.pid, signal.SIGINT)
    out, err = job.communicate(timeout=300)
  finally:
    if job.poll() is None:
      os.killpg(job.pid, signal.SIGKILL)
  assert job.returncode == 130 and 'NEXT' not in out, (job.returncode, out, err[-3000:])
  assert 'interrupted by Ctrl-C' in err and 'Traceback' not in err, err[-3000:]
  saved = checkpointing.list_steps(RunLayout.of(str(workdir)).checkpoints)
  assert len(saved) == 1, saved
  # The rerun resumes; a scheduler's SIGTERM arriving as it ends (after its last step, while
  # it shuts down) leaves the documented exit 0, never 143.
  log = tmp_path / 'resumed.log'
  with open(log, 'w') as stderr:
    resumed = subprocess.Popen(
        [*train, f'--config.num_train_steps={saved[0] + 1}'],
        cwd=train_testlib.REPO,
        env=train_testlib.subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
  try:
    deadline = time.monotonic() + 300
    while 'Finished at step' not in log.read_text():
      assert resumed.poll() is None, log.read_text()[-3000:]
      assert time.monotonic() < deadline, 'no "Finished at step" in 300 s'
      time.sleep(0.05)
    # Shutting down takes a second or more: signals every 20 ms land while Python runs
    # (logged), in its atexit functions and as it finalizes (ignored; the default action
    # Python puts back there killed the process, exit -15).
    deadline = time.monotonic() + 120
    while resumed.poll() is None and time.monotonic() < deadline:
      resumed.send_signal(signal.SIGTERM)
      time.sleep(0.02)
    assert resumed.wait(timeout=1) == 0, log.read_text()[-3000:]
  finally:
    resumed.kill()
  assert checkpointing.list_steps(RunLayout.of(str(workdir)).checkpoints)[-1] == saved[0] + 1
  logged = [m['step'] for m in read_metrics(str(workdir)) if m['split'] == 'train']
  assert logged == list(range(1, saved[0] + 2)), logged  # Each step once: resumed, not redone.


def test_a_second_ctrl_c_interrupts_at_once():
  before = signal.getsignal(signal.SIGINT)
  stop = multihost.StopSignal()
  # Python runs a signal's handler at the next bytecode, which may be inside a callback of the
  # garbage collector (JAX has one), where a KeyboardInterrupt is lost: no collection here.
  gc.disable()
  try:
    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before the next line.
    assert stop.should_stop(1)
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    gc.enable()
    stop.close()
  assert signal.getsignal(signal.SIGINT) is before


# --- The moving average and early stopping, end to end (in-process, four steps each). ---


class StopAt(multihost.StopSignal):
  """Asks the loop to save and stop after step `at`, as SIGTERM would."""

  def __init__(self, at):
    super().__init__()
    self.at = at

  def should_stop(self, step):
    return step == self.at or super().should_stop(step)


def _train(config, workdir, stop_at=None):
  stop = StopAt(stop_at)
  try:
    return train_loop.train_and_evaluate(config, workdir, stop_signal=stop)
  finally:
    stop.close()


@pytest.fixture(scope='module')
def ema_runs(data_files, tmp_path_factory):
  """Four steps with dropout and ema_decay=0.5, checkpoints every 2, run through, and run
  again stopped after step 3 (as by SIGTERM) and resumed; the resumed part with
  ema_for_evaluation=True (a field a resume may change), the first part without."""
  root = tmp_path_factory.mktemp('ema')
  config = lambda **overrides: train_testlib.small_config(
      data_files, num_train_steps=4, ema_decay=0.5, dropout_rate=0.2, **overrides
  )
  reference = train_loop.train_and_evaluate(
      config(ema_for_evaluation=True), str(root / 'reference')
  )
  first = _train(config(), str(root / 'resumed'), stop_at=3)
  assert first.stopped_early and int(first.state.step) == 3
  resumed = train_loop.train_and_evaluate(config(ema_for_evaluation=True), str(root / 'resumed'))
  return root, reference, first.state, resumed


def test_a_resumed_run_with_a_moving_average_is_bitwise_the_uninterrupted_one(ema_runs):
  root, reference, _, resumed = ema_runs
  assert int(resumed.state.step) == int(reference.state.step) == 4
  for name in ('params', 'ema_params', 'opt_state'):
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(getattr(resumed.state, name)),
        jax.device_get(getattr(reference.state, name)),
    )
  # The average is its own item of every checkpoint, restored with the rest of the state.
  assert os.path.isdir(RunLayout.of(str(root / 'resumed')).checkpoints + '/3/ema')
  losses = lambda run: {m['step']: m['loss'] for m in read_metrics(str(root / run))}
  assert losses('resumed') == losses('reference')


def test_ema_for_evaluation_makes_the_average_what_checkpoints_are_read_for(ema_runs):
  root, reference, first, _ = ema_runs
  ema, params = (jax.device_get(x) for x in (reference.state.ema_params, reference.state.params))
  loaded = loading.load(str(root / 'reference'))
  assert loaded.step == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded.params), ema)
  assert not np.array_equal(
      loaded.params['shared_embedding']['embedding'], params['shared_embedding']['embedding']
  )
  # Step 3 of the resumed run was saved without ema_for_evaluation: read for its parameters.
  checkpoints = RunLayout.of(str(root / 'resumed')).checkpoints
  three, _ = checkpointing.restore_params(checkpoints, 3)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(three), jax.device_get(first.params))
  # Averaging the last two averages them; its checkpoint is read for its own parameters.
  averaged = loading.load(str(root / 'resumed'), average_last=2)
  four, _ = checkpointing.restore_params(checkpoints, 4)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, jax.device_get(three), jax.device_get(four))
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
      jax.device_get(averaged.params),
      mean,
  )
  directory, _ = averaging.average_checkpoints(str(root / 'resumed'), str(root / 'average'), 2)
  assert not os.path.exists(os.path.join(directory, 'ema'))
  jax.tree.map(
      np.testing.assert_array_equal,
      jax.device_get(loading.load(str(root / 'average')).params),
      jax.device_get(averaged.params),
  )


def test_early_stopping_stops_after_patience_and_a_rerun_trains_no_further(
    data_files, tmp_path, monkeypatch, caplog
):
  """Validation losses 3, 2, 2.5, 2 (a tie is no improvement) with patience 2: the run stops
  at step 4, though a restart after step 3 came between (the count is in the checkpoint)."""
  losses = [3.0, 2.0, 2.5, 2.0, 1.0]
  monkeypatch.setattr(
      train_loop,
      'evaluate',
      lambda *args, **kwargs: {'loss': losses.pop(0), 'perplexity': 1.0, 'accuracy': 0.0},
  )
  config = train_testlib.small_config(
      data_files,
      num_train_steps=8,
      eval_every_steps=1,
      eval_bleu_sentences=0,
      best_checkpoint_metric='loss',
      early_stopping_patience=2,
      log_every_steps=4,
  )
  workdir = str(tmp_path / 'run')
  assert int(_train(config, workdir, stop_at=3).state.step) == 3
  with caplog.at_level(logging.INFO):
    result = train_loop.train_and_evaluate(config, workdir)
  assert result.out_of_patience and not result.stopped_early and int(result.state.step) == 4
  line = (
      'Stopping early at step 4: validation loss did not improve on its best, 2.0000 (step 2), '
      'in 2 validations in a row (early_stopping_patience=2).'
  )
  assert line in caplog.text, caplog.text[-3000:]
  train_steps_logged = [m['step'] for m in read_metrics(workdir) if m['split'] == 'train']
  assert train_steps_logged == [1, 2, 3, 4]
  assert checkpointing.list_steps(RunLayout.of(workdir).checkpoints)[-1] == 4
  caplog.clear()
  with caplog.at_level(logging.INFO):
    again = train_loop.train_and_evaluate(config, workdir)
  assert again.out_of_patience and int(again.state.step) == 4 and losses == [1.0]
  assert 'the run already stopped early at step 4: validation loss did not improve' in caplog.text
  assert 'training steps' not in caplog.text
  assert [m['step'] for m in read_metrics(workdir) if m['split'] == 'train'] == [1, 2, 3, 4]
  # Patience without a metric to be patient about is refused before anything is built.
  with pytest.raises(ConfigError, match='early_stopping_patience=2 counts validations'):
    train_loop.train_and_evaluate(
        train_testlib.small_config(data_files, early_stopping_patience=2), str(tmp_path / 'bad')
    )
  assert not os.path.exists(tmp_path / 'bad')


# --- train.py's answers to bad setups: exit code 2, one paragraph, before compiling. ---


@pytest.fixture(scope='module')
def config_file(data_files, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('cfg') / 'small.py')
  return train_testlib.write_config_file(path, data_files)


@pytest.mark.slow
def test_train_py_rejects_bad_setups_before_compiling(config_file, tmp_path):
  cases = {
      'unknown field': (['--config.no_such_field=1'], 'no_such_field is not a field'),
      'misspelt field': (['--config.mesh.dta=2'], 'did you mean --config.mesh.data?'),
      'mesh': (['--config.mesh.fsdp=3'], 'do not divide the 1 devices'),
      'dropout prng': (
          ['--config.dropout_rng_impl=philox'],
          "dropout_rng_impl='philox' must be one of",
      ),
      'dataset': (
          ['--config.dataset=wmt14_translate/de-en', f'--config.tfds_data_dir={tmp_path}/none'],
          'is not prepared',
      ),
      'workdir': ([], 'a_file is a file, not a directory; choose another path'),
  }
  processes = {}
  for name, (flags, _) in cases.items():
    workdir = str(tmp_path / name)
    if name == 'workdir':  # Below a regular file: no directory can be made there.
      (tmp_path / 'a_file').write_text('')
      workdir = str(tmp_path / 'a_file' / 'run')
    processes[name] = subprocess.Popen(
        train_testlib.train_command(config_file, workdir, *flags),
        cwd=train_testlib.REPO,
        env=train_testlib.subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
  for name, process in processes.items():
    _, stderr = process.communicate(timeout=120)
    expected = cases[name][1]
    assert process.returncode == 2, (name, stderr[-3000:])
    assert 'Traceback' not in stderr, (name, stderr[-3000:])
    assert expected in stderr, (name, stderr[-3000:])
    assert 'First step' not in stderr
  # A dataset that is not there is found before the work directory is made.
  assert not os.path.exists(tmp_path / 'dataset')

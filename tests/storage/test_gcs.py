"""gs:// paths against a real Cloud Storage server on 127.0.0.1 (`gcs_testlib`): the checks
(`paths.py`) and atomic writes (`storage.py`), data and vocabularies read from a bucket,
training on a bucket (lock, checkpoints, metrics, vocabulary and token ids published there),
the commands that read a run and write results there, and clear errors for a missing bucket, an
unreachable endpoint, another scheme and the one path that must be local (the compilation
cache). Marian import and export on a bucket: test_marian.py. (The server checks no
credentials or permissions: a second server answers 403 for that error.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from etils import epath
import pytest

import gcs_testlib
import test_bible_corpus
import test_checkpointing
from test_translator import TRAIN_STEPS
import train_testlib
from transformer_jax.errors import PathError
from transformer_jax.storage import paths
from transformer_jax.storage import storage
from transformer_jax.storage import workdir_lock
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import train_loop

pytestmark = pytest.mark.slow  # a Cloud Storage server; commands and training through subprocesses.

REPO = train_testlib.REPO


def _client():
  """A gcsfs client of the test server (imported here: a second that only slow tests need)."""
  import gcsfs

  return gcsfs.GCSFileSystem()


def _command(
    script: str, *flags: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
  return train_testlib.run_command(
      [sys.executable, os.path.join(REPO, script), *flags],
      env=env or train_testlib.subprocess_env(),
      timeout=timeout,
  )


def _user_error(result: subprocess.CompletedProcess, *phrases: str) -> str:
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  message = result.stderr.strip().splitlines()[-1]
  for phrase in phrases:
    assert phrase in message, (phrase, message)
  return message


def test_checks_and_atomic_writes_on_a_bucket(bucket):
  run = f'{bucket}/run'
  paths.check_output_directory(run, '--output_dir')  # A prefix: nothing to create.
  storage.write_file(f'{run}/a.txt', 'a\n')
  paths.check_input_file(f'{run}/a.txt', '--input')
  paths.check_input_directory(run, '--workdir')
  with pytest.raises(PathError, match='is a directory; give a file'):
    paths.check_input_file(run, '--input')
  with pytest.raises(PathError, match='a.txt is a file; give a directory'):  # As locally.
    paths.check_input_directory(f'{run}/a.txt', '--workdir')
  with pytest.raises(PathError, match='does not exist'):
    paths.check_input_file(f'{run}/missing.txt', '--input')
  with pytest.raises(PathError, match='is also --input'):
    paths.check_output_file(f'{run}/a.txt', '--output', {'--input': f'{run}/a.txt'})
  # Under an object, as under a local file: refused (a prefix would take it).
  with pytest.raises(PathError, match=f'its directory {run}/a.txt is an object, not a dir'):
    paths.check_output_file(f'{run}/a.txt/out.txt', '--output')
  with pytest.raises(PathError, match=f'its directory {run}/a.txt is an object, not a dir'):
    paths.check_output_directory(f'{run}/a.txt/deeper/run', '--workdir')
  # A vocabulary path that is a folder of objects: refused before anything is built.
  config = train_testlib.small_config({'train': 'x.en,x.de'}, vocab_path=run)
  with pytest.raises(PathError, match=f'--config.vocab_path={run} is a directory'):
    train_loop.train_and_evaluate(config, f'{bucket}/other')

  # A failed write uploads nothing; a finished one replaces the object whole.
  with pytest.raises(RuntimeError):
    with storage.writing(f'{run}/a.txt') as f:
      f.write('half')
      raise RuntimeError('killed')
  assert epath.Path(f'{run}/a.txt').read_text() == 'a\n'
  with storage.writing(f'{run}/a.txt') as f:
    f.write('b\n')
  assert epath.Path(f'{run}/a.txt').read_text() == 'b\n'

  storage.write_files({f'{run}/test.hyp.txt': 'x\n', f'{run}/test.metrics.json': '{}\n'})
  assert sorted(p.name for p in epath.Path(run).iterdir()) == [
      'a.txt',
      'test.hyp.txt',
      'test.metrics.json',
  ]


def test_a_commit_killed_half_way_on_a_bucket_is_finished_by_the_next_check(bucket):
  """What a writer killed after its journal and one rename (a copy and a delete on Cloud
  Storage) leaves: the next check finishes it, and a dead writer's stray temporary goes."""
  run = f'{bucket}/eval'
  dead, host = train_testlib.dead_pid(), socket.gethostname()
  temp = lambda name: f'{run}/.{name}.tmp-{dead}-0123abcd-{host}'
  epath.Path(f'{run}/test.hyp.txt').write_text('new hypotheses\n')  # Renamed already.
  epath.Path(f'{run}/test.metrics.json').write_text('{"bleu": 1}\n')  # The old one.
  epath.Path(temp('test.metrics.json')).write_text('{"bleu": 2}\n')
  epath.Path(f'{run}/.test.hyp.txt.commit-{dead}-0123abcd-{host}').write_text(
      json.dumps(
          {
              os.path.basename(temp('test.hyp.txt')): 'test.hyp.txt',
              os.path.basename(temp('test.metrics.json')): 'test.metrics.json',
          }
      )
  )
  epath.Path(temp('stray.txt')).write_text('left by a killed upload')
  paths.check_output_directory(run, '--output_dir')
  assert sorted(p.name for p in epath.Path(run).iterdir()) == ['test.hyp.txt', 'test.metrics.json']
  assert epath.Path(f'{run}/test.metrics.json').read_text() == '{"bleu": 2}\n'


def test_commands_read_a_run_and_write_their_results_on_a_bucket(run_dir, bucket):
  """A run uploaded to a bucket: translate.py, evaluate.py and average_checkpoints.py read
  it there, with their inputs and outputs there too."""
  root = os.path.dirname(run_dir)
  fs = _client()
  fs.put(run_dir, f'{bucket}/run', recursive=True)
  for name in ('test.en', 'test.de'):
    fs.put(os.path.join(root, name), f'{bucket}/data/{name}')
  run, cache = f'{bucket}/run', os.path.join(root, 'jax_cache')

  result = _command(
      'translate.py',
      f'--workdir={run}',
      f'--input={bucket}/data/test.en',
      f'--output={bucket}/out/test.txt',
      f'--compilation_cache_dir={cache}',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = epath.Path(f'{bucket}/out/test.txt').read_text().splitlines()
  assert len(lines) == len(open(os.path.join(root, 'test.en'), encoding='utf-8').readlines())

  result = _command(
      'evaluate.py',
      f'--workdir={run}',
      f'--source_file={bucket}/data/test.en',
      f'--reference_file={bucket}/data/test.de',
      '--average_last=2',
      f'--compare_to={bucket}/out/test.txt',
      '--bootstrap_samples=10',
      f'--compilation_cache_dir={cache}',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  results = f'{run}/eval/avg2_step_{TRAIN_STEPS[-2]}-{TRAIN_STEPS[-1]}'
  # Named after the source file (test.en), not the test split.
  metrics = json.loads(epath.Path(f'{results}/test.en.metrics.json').read_text())
  hypotheses = epath.Path(f'{results}/test.en.hyp.txt').read_text().splitlines()
  assert len(hypotheses) == metrics['decoding']['sentences'] == len(lines)
  assert metrics['workdir'] == run and metrics['checkpoint_steps'] == list(TRAIN_STEPS[-2:])
  # The beam-search outputs of the average: the last checkpoint's own are the same lines
  # only by chance, so check the pairing instead.
  assert metrics['compared_to'] == f'{bucket}/out/test.txt'

  result = _command(
      'average_checkpoints.py',
      f'--workdir={run}',
      f'--output_workdir={bucket}/avg',
      '--num_checkpoints=2',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  from transformer_jax.checkpoints import checkpointing

  meta, step = checkpointing.read_meta(RunLayout.of(f'{bucket}/avg').checkpoints)
  assert step == TRAIN_STEPS[-1] and meta['averaged_steps'] == list(TRAIN_STEPS[-2:])
  assert meta['averaged_from'] == run


def test_bad_cloud_paths_get_one_paragraph_each(run_dir, gcs_server, tmp_path):
  missing = 'gs://no-such-bucket-here'
  _user_error(
      _command('translate.py', f'--workdir={run_dir}', '--text=hi', f'--output={missing}/out.txt'),
      'the bucket gs://no-such-bucket-here does not exist',
      'gcloud storage buckets create gs://no-such-bucket-here',
  )
  _user_error(
      _command('translate.py', f'--workdir={missing}/run', '--text=hi'),
      f'--workdir={missing}/run does not exist',
  )
  _user_error(
      _command('translate.py', f'--workdir={run_dir}', '--text=hi', '--output=s3://bucket/out.txt'),
      's3:// paths are not supported',
      'gs://BUCKET',
  )
  bucket = gcs_server.create_bucket()
  files = train_testlib.write_parallel_text(str(tmp_path))
  config = train_testlib.write_config_file(str(tmp_path / 'config.py'), files)
  _user_error(
      _command('train.py', f'--config={config}', f'--workdir={missing}/run'),
      f'--workdir={missing}/run',
      'the bucket gs://no-such-bucket-here does not exist',
  )
  _user_error(
      _command(
          'translate.py',
          f'--workdir={run_dir}',
          '--text=hi',
          f'--compilation_cache_dir={bucket}/cache',
      ),
      f'--compilation_cache_dir={bucket}/cache',
      'give a local path',
  )
  assert not os.path.exists(os.path.join(REPO, 'gs:'))  # No local folder named gs:.
  # Nothing listens at the endpoint: gcsfs retries, then the command says so.
  env = train_testlib.subprocess_env()
  env.update(gcs_testlib.environment(f'http://127.0.0.1:{gcs_testlib.free_port()}'))
  _user_error(
      _command(
          'translate.py', f'--workdir={run_dir}', '--text=hi', f'--output={bucket}/out.txt', env=env
      ),
      f'cannot reach Cloud Storage for {bucket}',
      'STORAGE_EMULATOR_HOST',
  )
  # A server that answers every request 403, with Cloud Storage's JSON error body: refused
  # access, not a network problem (gcsfs raises it as a plain OSError).
  with gcs_testlib.refusing_server(403) as url:
    env = train_testlib.subprocess_env()
    env.update(gcs_testlib.environment(url))
    _user_error(
        _command(
            'translate.py',
            f'--workdir={run_dir}',
            '--text=hi',
            f'--output={bucket}/out.txt',
            env=env,
        ),
        f'Cloud Storage refused access to {bucket}',
        'gcloud auth application-default login',
    )


# --- Data and vocabularies on a bucket. ---


def _run(
    config_path: str,
    workdir: str,
    cache: str,
    *flags: str,
    script: str = 'train.py',
    timeout: int = 300,
) -> subprocess.CompletedProcess:
  """A command run to its end as if on a host whose local cache is `cache`."""
  env = train_testlib.subprocess_env()
  env['TRANSFORMER_JAX_CACHE'] = cache
  return train_testlib.run_command(
      [
          sys.executable,
          os.path.join(REPO, script),
          f'--config={config_path}',
          f'--workdir={workdir}',
          *flags,
      ],
      env=env,
      timeout=timeout,
  )


def test_text_files_a_vocabulary_and_init_from_on_a_bucket(bucket, tmp_path):
  """A run whose text files and vocabulary path are gs:// objects (the vocabulary trained
  locally and uploaded), then a fine-tuning run with --config.init_from=gs://... on another
  "host" that downloads that vocabulary instead of training one; prepare_data.py publishes
  a work directory's vocabulary and token ids to a bucket."""
  fs = _client()
  files = {}
  for split, spec in train_testlib.write_parallel_text(str(tmp_path)).items():
    remote = []
    for path in spec.split(','):
      fs.put_file(path, f'{bucket}/data/{os.path.basename(path)}')
      remote.append(f'{bucket}/data/{os.path.basename(path)}')
    files[split] = ','.join(remote)
  vocab = f'{bucket}/vocab/shared.model'
  config = train_testlib.write_config_file(
      str(tmp_path / 'config.py'), files, vocab_path=vocab, num_train_steps=4
  )

  first = _run(config, f'{bucket}/run', str(tmp_path / 'host_a'))
  assert first.returncode == 0, first.stderr[-3000:]
  assert 'Trained a' in first.stderr
  assert epath.Path(vocab).exists()
  assert not os.path.exists(os.path.join(REPO, 'gs:'))

  tuned = _run(
      config,
      str(tmp_path / 'tuned'),
      str(tmp_path / 'host_b'),
      f'--config.init_from={bucket}/run',
      '--config.num_train_steps=6',
  )
  assert tuned.returncode == 0, tuned.stderr[-3000:]
  assert 'Trained a' not in tuned.stderr
  from transformer_jax.checkpoints import checkpointing

  meta, step = checkpointing.read_meta(RunLayout.of(str(tmp_path / 'tuned')).checkpoints)
  first_meta, _ = checkpointing.read_meta(RunLayout.of(f'{bucket}/run').checkpoints)
  assert step == 6 and meta['tokenizer']['sha256'] == first_meta['tokenizer']['sha256']

  prepared = _run(
      config,
      f'{bucket}/prep',
      str(tmp_path / 'host_c'),
      '--config.vocab_path=',
      script='prepare_data.py',
  )
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  assert f'published to {bucket}/prep' in prepared.stdout
  markers = [p for p in fs.find(f'{bucket}/prep') if p.endswith('.PUBLISHED.json')]
  assert len(markers) == 4, markers  # The vocabulary and three splits' token ids.
  _user_error(
      _run(
          config,
          f'{bucket}/prep',
          str(tmp_path / 'host_c'),
          '--num_hosts=2',
          script='prepare_data.py',
      ),
      'run the command once, on one host',
  )


@test_bible_corpus.needs_modules
def test_the_bible_corpus_is_prepared_once_on_a_bucket(bucket, tmp_path, monkeypatch):
  """--config.tfds_data_dir=gs://...: the offline corpus is built locally, uploaded with
  dataset_info.json (TFDS's sign of a prepared dataset) last, and read from the bucket
  through array_record; another host reads it there without building it."""
  from transformer_jax.config import base_config
  from transformer_jax.data import data_sources

  config = base_config()
  config.dataset, config.source_lang, config.target_lang = 'bible_en_es', 'en', 'es'
  config.tfds_data_dir = f'{bucket}/tfds'
  monkeypatch.setenv('TRANSFORMER_JAX_CACHE', str(tmp_path / 'host_a'))
  built = data_sources.open_split(config, 'test')
  assert len(built) == 1378
  objects = _client().find(f'{bucket}/tfds', detail=True)
  by_generation = sorted(objects, key=lambda name: int(objects[name]['generation']))
  assert by_generation[-1].endswith('/dataset_info.json'), by_generation
  assert any('.array_record' in name for name in objects)

  monkeypatch.setenv('TRANSFORMER_JAX_CACHE', str(tmp_path / 'host_b'))
  read = data_sources.open_split(config, 'test')
  assert not os.path.exists(tmp_path / 'host_b')  # Nothing built on this host.
  assert read.fingerprint == built.fingerprint
  assert read.range(0, 5) == built.range(0, 5) and read[-1] == built[-1]


# --- The one-writer lock on a bucket. ---


def _lock_object(bucket: str, **record) -> Any:
  from google.cloud import storage as gcs

  blob = (
      gcs.Client()
      .bucket(bucket[len('gs://') :])
      .blob(RunLayout.of(f'{bucket}/run').lock[len(bucket) + 1 :])
  )
  blob.upload_from_string(json.dumps(record))
  return blob


def test_the_lock_on_a_bucket_names_a_live_holder_and_takes_over_a_dead_one(bucket, caplog):
  run = f'{bucket}/run'
  with workdir_lock.WorkdirLock(RunLayout.of(run).lock, heartbeat_s=0.2):
    with pytest.raises(workdir_lock.WorkdirBusyError) as error:
      workdir_lock.WorkdirLock(RunLayout.of(run).lock).acquire()  # Created only if absent: refused.
    assert f'process {os.getpid()} on host {socket.gethostname()}' in str(error.value)
  assert not epath.Path(RunLayout.of(run).lock).exists()  # Released.

  _lock_object(
      bucket,
      host=socket.gethostname(),
      pid=train_testlib.dead_pid(),
      started=time.time(),
      token='old',
  )
  with workdir_lock.WorkdirLock(RunLayout.of(run).lock):
    assert 'is gone' in caplog.text
  caplog.clear()
  _lock_object(bucket)  # Parses, but no holder: taken over at once.
  with workdir_lock.WorkdirLock(RunLayout.of(run).lock):
    assert 'empty or cannot be parsed' in caplog.text


def test_another_hosts_lock_on_a_bucket_is_stale_when_its_generation_stops_changing(bucket, caplog):
  """Staleness by this process's clock: a lock whose generation changes (a heartbeat) is
  busy, one whose generation has not changed for stale_after_s is taken over."""
  record = dict(host='elsewhere', pid=1, started=time.time(), token='theirs')
  blob = _lock_object(bucket, **record)
  stop = threading.Event()

  def heartbeat():
    while not stop.wait(0.2):
      blob.upload_from_string(json.dumps(record))

  beating = threading.Thread(target=heartbeat)
  beating.start()
  try:
    with pytest.raises(workdir_lock.WorkdirBusyError, match='host elsewhere'):
      workdir_lock.WorkdirLock(
          RunLayout.of(f'{bucket}/run').lock, stale_after_s=3, heartbeat_s=0.4
      ).acquire()
  finally:
    stop.set()
    beating.join()
  lock = workdir_lock.WorkdirLock(
      RunLayout.of(f'{bucket}/run').lock, stale_after_s=1, heartbeat_s=0.2
  )
  lock.acquire()
  assert 'generation has not changed for 1 s' in caplog.text
  # Said once, before the wait: what it watches and for how long.
  assert caplog.text.count('held by a job on another host; watching it for up to 1 s') == 1
  generation = blob.bucket.get_blob(blob.name).generation
  time.sleep(0.6)
  assert blob.bucket.get_blob(blob.name).generation != generation  # Our heartbeat.
  lock.release()
  assert blob.bucket.get_blob(blob.name) is None


def test_metrics_on_a_bucket_keep_every_row_through_a_restart(bucket):
  """No append on Cloud Storage: each row rewrites the object with all rows so far. A
  restart at step 20 keeps the rows up to 20 and drops the later ones (trained again)."""
  from transformer_jax.training import metrics_writer

  run = f'{bucket}/run'
  row = lambda loss: {'loss': loss, 'perplexity': 2.0, 'accuracy': 0.5}
  layout = RunLayout.of(run)
  writer = metrics_writer.MetricsWriter(
      layout.metrics, layout.tensorboard, total_steps=40, start_step=0, enabled=True
  )
  for step in (10, 20, 30):
    writer.write(step, 'eval', row(step / 10))
  writer.close()
  writer = metrics_writer.MetricsWriter(
      layout.metrics, layout.tensorboard, total_steps=40, start_step=20, enabled=True
  )
  for step in (30, 40):
    writer.write(step, 'eval', row(step))
  writer.close()
  rows = [
      json.loads(line) for line in epath.Path(RunLayout.of(run).metrics).read_text().splitlines()
  ]
  assert [(r['step'], r['loss']) for r in rows] == [(10, 1.0), (20, 2.0), (30, 30), (40, 40)]
  events = list(epath.Path(RunLayout.of(run).tensorboard).iterdir())
  assert len(events) == 2 and all(e.stat().length > 0 for e in events)  # One a writer.


def test_a_damaged_checkpoint_on_a_bucket_is_set_aside_whole(bucket):
  """On Cloud Storage a rename is a copy and a delete: the damaged step is copied to
  `<step>.damaged` first (its commit marker last), then loses its commit marker (no step any
  more), then the rest; the other steps stay, and so does the copy when the next run opens
  the directory."""
  import numpy as np
  import orbax.checkpoint as ocp

  from transformer_jax.checkpoints import checkpointing

  checkpointer = checkpointing.Checkpointer(
      RunLayout.of(f'{bucket}/run').checkpoints, save_every=1, final_step=2
  )
  manager = ocp.CheckpointManager(
      checkpointer.directory, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  )
  for step in (1, 2):
    manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave({'w': np.full(4, step, np.float32)}),
            meta=ocp.args.JsonSave({'step': step}),
        ),
    )
  manager.wait_until_finished()
  checkpointer = checkpointing.Checkpointer(
      RunLayout.of(f'{bucket}/run').checkpoints, save_every=1, final_step=2
  )
  assert checkpointer.steps() == [1, 2]
  path = checkpointer.set_aside(2)
  assert path == f'{bucket}/run/checkpoints/2.damaged'
  assert checkpointer.steps() == [1]
  names = sorted(p.name for p in epath.Path(f'{bucket}/run/checkpoints').iterdir())
  assert names == ['1', '2.damaged']
  # Whole, orbax's commit marker included (copied last): a complete directory, as a local
  # rename leaves, which orbax's cleanup of unfinished saves does not take for one.
  assert sorted(p.name for p in epath.Path(path).iterdir()) == [
      '_CHECKPOINT_METADATA',
      'commit_success.txt',
      'meta',
      'params',
  ]
  restored = ocp.CheckpointManager(f'{bucket}/run/checkpoints').restore(
      1, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
  )
  assert restored['meta'] == {'step': 1}
  checkpointer.close()
  # The next train.py opens the directory again: the copy stays (issue 47 saw it deleted).
  checkpointing.Checkpointer(
      RunLayout.of(f'{bucket}/run').checkpoints, save_every=1, final_step=2
  ).close()
  names = sorted(p.name for p in epath.Path(f'{bucket}/run/checkpoints').iterdir())
  assert names == ['1', '2.damaged']


def test_readers_beside_rotation_on_a_bucket_take_what_exists_or_say_it_was_rotated(bucket):
  """test_checkpointing's readers beside a writer that keeps 2, on a bucket (issue 47 saw
  orbax's listing fail there with a traceback)."""
  test_checkpointing.read_beside_rotation(f'{bucket}/run', reads=4)


# --- Training on a bucket. ---

STEPS = 30  # More than the first run reaches: it is stopped at its third checkpoint.


@pytest.fixture(scope='module')
def config_and_reference(tmp_path_factory) -> tuple[str, str]:
  """A config of STEPS steps, a checkpoint every 5 and 2 kept, and its uninterrupted local
  run (what an interrupted run on a bucket must end equal to)."""
  return train_testlib.config_and_reference(
      tmp_path_factory.mktemp('reference'),
      num_train_steps=STEPS,
      checkpoint_every_steps=5,
      keep_checkpoints=2,
  )


def _train(config_path: str, workdir: str, cache: str, *flags: str) -> subprocess.Popen:
  env = train_testlib.subprocess_env()
  env['TRANSFORMER_JAX_CACHE'] = cache  # This "host's" local copies of vocabulary and ids.
  return subprocess.Popen(
      train_testlib.train_command(config_path, workdir, *flags),
      cwd=REPO,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
  )


def test_training_on_a_bucket_resumes_after_kill9_to_the_uninterrupted_result(
    bucket, config_and_reference, tmp_path
):
  """train.py --workdir=gs://...: frozen (SIGSTOP) as it saves its third checkpoint, killed
  with SIGKILL once a second job has been refused, then rerun as if on another host (an empty
  local cache): it takes over the dead job's lock, downloads the vocabulary and token ids
  published to the bucket instead of making them again, resumes, and ends with the
  parameters and the metrics rows of an uninterrupted local run, bitwise. A second job
  meanwhile is refused, naming the first."""
  import jax
  import numpy as np

  from transformer_jax.checkpoints import checkpointing

  config, reference = config_and_reference

  run = f'{bucket}/run'
  # Long enough to be killed (num_train_steps may change on resume; nothing else depends
  # on it here).
  first = _train(config, run, str(tmp_path / 'cache_a'), '--config.num_train_steps=100000')
  log = []
  for line in first.stderr:
    log.append(line)
    if 'Saving checkpoint 15 ' in line:
      break
  first.send_signal(signal.SIGSTOP)  # Alive, holding the lock, and no further than STEPS.
  second = train_testlib.run_train(config, run)
  first.kill()
  assert first.wait(timeout=60) == -9  # Killed, not finished.
  assert second.returncode == 2, second.stderr[-3000:]
  assert f'in use by another training job (process {first.pid}' in second.stderr
  # The first run made the vocabulary and the token ids (and published them).
  assert any('Trained a' in line for line in log) and any('Tokeniz' in line for line in log)

  final = _train(config, run, str(tmp_path / 'cache_b'))
  stderr = final.stderr.read()
  assert final.wait(timeout=300) == 0, stderr[-3000:]
  assert 'Took over the lock' in stderr and f'process {first.pid}' in stderr
  assert 'Resumed from the checkpoint at step' in stderr
  assert 'Trained a' not in stderr and 'Tokeniz' not in stderr, stderr[-3000:]
  assert not epath.Path(RunLayout.of(run).lock).exists()

  ours, step = checkpointing.restore_params(RunLayout.of(run).checkpoints)
  theirs, _ = checkpointing.restore_params(RunLayout.of(reference).checkpoints)
  assert step == STEPS
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ours), jax.device_get(theirs))

  def losses(text: str) -> dict[int, float]:
    return {
        m['step']: m['loss'] for m in map(json.loads, text.splitlines()) if m['split'] == 'train'
    }

  with open(os.path.join(reference, 'metrics.jsonl'), encoding='utf-8') as f:
    expected = losses(f.read())
  assert losses(epath.Path(f'{run}/metrics.jsonl').read_text()) == expected
  assert sorted(expected) == list(range(1, STEPS + 1))


def _checkpoint_folders(root: str) -> list[str]:
  """The checkpoint folders a filesystem-backed server keeps under `root`: each with its
  object count and whether orbax's commit mark is there."""
  folders = []
  for checkpoints, steps, _ in os.walk(root):
    if os.path.basename(checkpoints) == 'checkpoints':
      for step in sorted(steps):
        folder = os.path.join(checkpoints, step)
        count = sum(len(names) for _, _, names in os.walk(folder))
        marked = os.path.exists(os.path.join(folder, 'commit_success.txt'))
        folders.append(f'{os.path.relpath(folder, root)}: {count} objects, commit mark {marked}')
  return folders


def _not_resumed(folders: list[str], first: str, final: str) -> str:
  """A failed resume's report: the checkpoint folders before the resumed run, the first
  run's checkpoint and warning lines, and the end of the resumed run's log."""
  lines = [
      line
      for line in first.splitlines()
      if 'heckpoint' in line or line[:1] in 'WE' or 'error' in line
  ]
  return '\n'.join(
      ['before the resumed run:', *folders, 'the first run:', *lines[-40:], 'the resumed run:']
      + [final[-2000:]]
  )


def test_a_short_outage_is_ridden_out_and_a_long_one_stops_in_one_paragraph(
    config_and_reference, tmp_path
):
  """train.py on a bucket whose server goes down (--storage_timeout_seconds=15). Down for 4 s
  after checkpoint 5, restarted on its port over the same objects: the run goes on to save
  checkpoint 10. Down for good while it saves checkpoint 10: the run stops with exit code 2
  within the bound and some seconds, with one paragraph naming the bucket and the wait,
  nothing after it. The server back, the same command resumes from the last complete
  checkpoint and ends bitwise equal to an uninterrupted run."""
  config, reference = config_and_reference
  root = str(tmp_path / 'objects')
  os.makedirs(root)
  server = gcs_testlib.start(root=root)  # Its own: killed and restarted here.
  try:
    run = f'{server.create_bucket()}/run'
    env = dict(train_testlib.subprocess_env(), **gcs_testlib.environment(server.url))
    env['TRANSFORMER_JAX_CACHE'] = str(tmp_path / 'cache')
    bound = 15
    first = subprocess.Popen(
        train_testlib.train_command(
            config, run, '--config.num_train_steps=100000', f'--storage_timeout_seconds={bound}'
        ),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []  # The first run's log, for the report of a failure.
    for line in first.stderr:
      seen.append(line)
      if 'Saving checkpoint 5 ' in line:
        break
    server.stop()  # While it trains (every step's metrics row waits for the bucket).
    time.sleep(4)
    server.restart(root)
    for line in first.stderr:
      seen.append(line)
      if 'Saving checkpoint 10 ' in line:
        break
    assert first.poll() is None  # Ridden out.
    first.send_signal(signal.SIGSTOP)  # No further than STEPS while the server goes down.
    server.stop()
    began = time.time()
    first.send_signal(signal.SIGCONT)
    rest = first.stderr.read()
    seen.append(rest)
    assert first.wait(timeout=bound + 120) == 2, ''.join(seen)[-5000:]  # The whole log's end.
    assert time.time() - began < bound + 45, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert 'error: Cloud Storage did not answer for' in last, rest[-3000:]
    assert run.split('/')[2] in last and f'--storage_timeout_seconds={bound}' in last, last
    assert 'Traceback' not in rest and 'RuntimeWarning' not in rest, rest[-3000:]

    server.restart(root)
    folders = _checkpoint_folders(root)
    final = subprocess.run(
        train_testlib.train_command(config, run), env=env, capture_output=True, text=True
    )
    assert final.returncode == 0, final.stderr[-3000:]
    assert 'Resumed from the checkpoint at step' in final.stderr, _not_resumed(
        folders, ''.join(seen), final.stderr
    )
    # Compared in a process whose clients talk to this server (this one's talk to the
    # session's).
    compare = (
        'import jax, numpy as np, sys\n'
        'from transformer_jax.checkpoints import checkpointing\n'
        'from transformer_jax.storage.layout import RunLayout\n'
        'ours, step = checkpointing.restore_params(RunLayout.of(sys.argv[1]).checkpoints)\n'
        'theirs, _ = checkpointing.restore_params(RunLayout.of(sys.argv[2]).checkpoints)\n'
        f'assert step == {STEPS}, step\n'
        'jax.tree.map(np.testing.assert_array_equal, ours, theirs)\n'
    )
    same = subprocess.run(
        [sys.executable, '-c', compare, run, reference], env=env, capture_output=True, text=True
    )
    assert same.returncode == 0, same.stderr[-3000:]
  finally:
    server.stop()


def test_two_processes_train_on_one_bucket_as_one_process_does(
    bucket, multihost_config, multihost_reference, tmp_path
):
  """The 2-process x 4-device job (no shared disk: each process has its own local cache) on
  one gs:// work directory: process 0 makes and publishes the vocabulary and token ids,
  process 1 downloads them, and the losses are those of one 8-device process."""
  import numpy as np

  import test_multihost

  config, reference = multihost_config, multihost_reference
  run = f'{bucket}/pair'
  pair = test_multihost.start_pair(
      config, run, log_dir=str(tmp_path), caches=[str(tmp_path / 'host0'), str(tmp_path / 'host1')]
  )
  test_multihost.finish(pair)
  first, second = (test_multihost.read_log(p) for p in pair)
  assert 'Trained a' in first and 'Tokeniz' in first, first[-3000:]
  assert 'Trained a' not in second and 'Tokeniz' not in second, second[-3000:]
  with open(os.path.join(reference, 'metrics.jsonl'), encoding='utf-8') as f:
    theirs = {m['step']: m['loss'] for m in map(json.loads, f) if m['split'] == 'train'}
  ours = {
      m['step']: m['loss']
      for m in map(json.loads, epath.Path(f'{run}/metrics.jsonl').read_text().splitlines())
      if m['split'] == 'train'
  }
  assert sorted(ours) == sorted(theirs) == list(range(1, test_multihost.STEPS + 1))
  np.testing.assert_allclose(
      [ours[s] for s in sorted(ours)], [theirs[s] for s in sorted(theirs)], rtol=2e-5
  )

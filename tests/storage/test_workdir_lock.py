"""One training job per work directory: a second train.py refuses, a dead job's lock does not
block a restart, evaluation and translation ignore the lock."""

import json
import os
import pathlib
import socket
import subprocess
import time

import pytest

import train_testlib
from transformer_jax.storage.layout import RunLayout
from transformer_jax.storage.workdir_lock import WorkdirBusyError
from transformer_jax.storage.workdir_lock import WorkdirLock


def _write_lock(workdir, **record):
  path = RunLayout.of(str(workdir)).lock
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f)
  return path


def test_a_second_lock_on_a_live_holder_names_it(tmp_path):
  with WorkdirLock(RunLayout.of(str(tmp_path)).lock):
    with pytest.raises(WorkdirBusyError) as error:
      WorkdirLock(RunLayout.of(str(tmp_path)).lock).acquire()
    message = str(error.value)
    assert f'process {os.getpid()} on host {socket.gethostname()}' in message
    assert 'another --workdir' in message
  assert not os.path.exists(RunLayout.of(str(tmp_path)).lock)  # Released.
  WorkdirLock(RunLayout.of(str(tmp_path)).lock).acquire()  # Free again.


def test_the_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
  _write_lock(
      str(tmp_path),
      host=socket.gethostname(),
      pid=train_testlib.dead_pid(),
      started=time.time(),
      token='old',
  )
  lock = WorkdirLock(RunLayout.of(str(tmp_path)).lock)
  lock.acquire()
  with open(RunLayout.of(str(tmp_path)).lock, encoding='utf-8') as f:
    assert json.load(f)['pid'] == os.getpid()
  lock.release()


def test_a_reused_process_id_does_not_keep_a_lock(tmp_path):
  """The id is alive (this process) but started after the lock was written."""
  _write_lock(str(tmp_path), host=socket.gethostname(), pid=os.getpid(), started=1.0, token='old')
  WorkdirLock(RunLayout.of(str(tmp_path)).lock).acquire()


def test_another_hosts_lock_is_stale_only_without_heartbeat(tmp_path):
  path = _write_lock(str(tmp_path), host='elsewhere', pid=1, started=time.time(), token='old')
  with pytest.raises(WorkdirBusyError, match='host elsewhere'):
    WorkdirLock(RunLayout.of(str(tmp_path)).lock, stale_after_s=60).acquire()
  old = time.time() - 120
  os.utime(path, (old, old))
  WorkdirLock(RunLayout.of(str(tmp_path)).lock, stale_after_s=60).acquire()


def test_heartbeat_touches_and_release_spares_a_lock_taken_over(tmp_path):
  lock = WorkdirLock(RunLayout.of(str(tmp_path)).lock, heartbeat_s=0.05)
  lock.acquire()
  path = pathlib.Path(RunLayout.of(str(tmp_path)).lock)
  old = time.time() - 1000
  os.utime(path, (old, old))
  time.sleep(0.3)
  assert time.time() - os.stat(path).st_mtime < 10  # Touched by the heartbeat.
  _write_lock(str(tmp_path), host='elsewhere', pid=1, started=time.time(), token='new')
  lock.release()
  assert path.exists()  # Not ours any more: left alone.


@pytest.mark.slow
def test_two_train_py_on_one_workdir(tmp_path):
  """A real second process refuses while the first runs; after the first is killed with
  SIGKILL (its lock left behind), a restart takes the lock over and finishes."""
  files = train_testlib.write_parallel_text(str(tmp_path))
  config = train_testlib.write_config_file(str(tmp_path / 'config.py'), files)
  workdir = str(tmp_path / 'run')
  lock_path = RunLayout.of(str(workdir)).lock
  log = tmp_path / 'first.log'
  with open(log, 'w', encoding='utf-8') as out:
    first = subprocess.Popen(
        train_testlib.train_command(config, workdir, '--config.num_train_steps=100000'),
        cwd=train_testlib.REPO,
        env=train_testlib.subprocess_env(),
        stdout=out,
        stderr=out,
    )
  try:
    deadline = time.time() + 180
    while not os.path.exists(lock_path):
      assert first.poll() is None, log.read_text()[-3000:]
      assert time.time() < deadline, 'the first run never took the lock'
      time.sleep(0.5)
    second = train_testlib.run_train(config, workdir, timeout=180)
    assert second.returncode == 2, second.stderr[-3000:]
    assert 'Traceback' not in second.stderr
    assert f'in use by another training job (process {first.pid}' in second.stderr
    assert first.poll() is None  # The first run is undisturbed.
  finally:
    first.kill()
    first.wait()
  assert os.path.exists(lock_path)  # SIGKILL left it behind.
  third = train_testlib.run_train(config, workdir, '--config.num_train_steps=2', timeout=240)
  assert third.returncode == 0, third.stderr[-3000:]
  assert 'Took over the lock' in third.stderr and f'process {first.pid}' in third.stderr
  assert not os.path.exists(lock_path)  # Released at the end.

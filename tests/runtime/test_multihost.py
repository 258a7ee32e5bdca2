"""Two processes x 4 CPU devices through jax.distributed on a localhost coordinator given by
flags (gloo): SIGTERM to one process only (one preempted VM) makes both save the same step
and exit 0, and the pair resumes from it to the losses of one 8-device process. Launched by
SLURM and Open MPI, and a killed or hung process: tests/runtime/test_launchers.py."""

import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

import train_testlib

pytestmark = pytest.mark.slow  # two training processes on a coordinator.

STEPS = train_testlib.MULTIHOST_STEPS


def free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def start_pair(config_path, workdir, *flags, heartbeat=100, log_dir=None, caches=None):
  """Launches processes 0 and 1 of a two-process job; their logs go to files (beside a local
  `workdir`, else in `log_dir`); `caches`: each process's TRANSFORMER_JAX_CACHE (a host's
  local disk, for a gs:// work directory)."""
  port = free_port()
  processes = []
  for index in range(2):
    log = open(
        os.path.join(
            log_dir or os.path.dirname(workdir),
            f'{os.path.basename(workdir)}.{index}.{time.time_ns()}.log',
        ),
        'w',
    )
    command = train_testlib.train_command(
        config_path,
        workdir,
        '--distributed',
        f'--coordinator_address=localhost:{port}',
        '--num_processes=2',
        f'--process_id={index}',
        f'--heartbeat_timeout_seconds={heartbeat}',
        *flags,
    )
    env = train_testlib.subprocess_env(devices=4)
    if caches:
      env['TRANSFORMER_JAX_CACHE'] = caches[index]
    process = subprocess.Popen(
        command, cwd=train_testlib.REPO, env=env, stdout=subprocess.DEVNULL, stderr=log
    )
    process.log_path = log.name
    processes.append(process)
  return processes


def read_log(process):
  with open(process.log_path) as f:
    return f.read()


def wait_for_log(process, text, timeout=180):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if text in read_log(process):
      return
    if process.poll() is not None:
      raise AssertionError(
          f'exited {process.returncode} before {text!r}:\n' + read_log(process)[-3000:]
      )
    time.sleep(0.2)
  raise AssertionError(f'no {text!r} within {timeout}s:\n' + read_log(process)[-3000:])


def finish(processes, timeout=240):
  codes = [p.wait(timeout=timeout) for p in processes]
  for p, code in zip(processes, codes):
    assert code == 0, read_log(p)[-4000:]


def train_losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    lines = [json.loads(line) for line in f]
  return {m['step']: m['loss'] for m in lines if m['split'] == 'train'}


@pytest.fixture
def config_path(multihost_config):
  return multihost_config


def test_sigterm_to_one_process_stops_both_at_one_step_and_they_resume_to_the_same_losses(
    config_path, multihost_reference, tmp_path
):
  reference = multihost_reference
  workdir = str(tmp_path / 'two_processes')
  pair = start_pair(config_path, workdir)
  wait_for_log(pair[0], 'step 2/')
  pair[1].send_signal(signal.SIGTERM)
  finish(pair)
  stops = []
  for p in pair:
    stops += [
        int(line.split('saving step ')[1].split()[0])
        for line in read_log(p).splitlines()
        if 'Stop requested: saving step' in line
    ]
  assert len(stops) == 2 and stops[0] == stops[1] and stops[0] < STEPS, stops
  step_dir = os.path.join(workdir, 'checkpoints', str(stops[0]))
  assert {'process_0-of-2.json', 'process_1-of-2.json'} <= set(
      os.listdir(os.path.join(step_dir, 'data'))
  )  # Each host's iterator position.

  pair = start_pair(config_path, workdir)
  finish(pair)
  assert f'Resumed from the checkpoint at step {stops[0]}' in read_log(pair[1])
  ours, theirs = train_losses(workdir), train_losses(reference)
  assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
  np.testing.assert_allclose(
      [ours[s] for s in sorted(ours)], [theirs[s] for s in sorted(theirs)], rtol=2e-5
  )

"""kill -9 at random moments (one of them right after a save starts), restart, repeat: every
restart resumes from the latest complete checkpoint, and the final parameters are bitwise
equal to those of an uninterrupted run."""

import json
import os
import queue
import random
import re
import signal
import subprocess
import threading
import time

import jax
import numpy as np
import pytest

import train_testlib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.storage.layout import RunLayout

pytestmark = pytest.mark.slow  # training through subprocesses, killed and resumed.

STEPS = 12


def complete_steps(workdir):
  """Step directories under their final name: orbax renames a save there only when done."""
  directory = RunLayout.of(str(workdir)).checkpoints
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def leftover_tmp(workdir):
  directory = RunLayout.of(str(workdir)).checkpoints
  return os.path.isdir(directory) and any('tmp' in n for n in os.listdir(directory))


class Training:
  """train.py in a subprocess, its log lines read as they come."""

  def __init__(self, config_path, workdir):
    self.process = subprocess.Popen(
        train_testlib.train_command(config_path, workdir),
        cwd=train_testlib.REPO,
        env=train_testlib.subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    self.lines = queue.Queue()
    self.log = []
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.process.stderr:
      self.lines.put(line)
    self.lines.put(None)

  def wait_for(self, pattern, timeout=120):
    """Consumes lines until one matches; returns the match (None if the process ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      try:
        line = self.lines.get(timeout=1)
      except queue.Empty:
        continue
      if line is None:
        return None
      self.log.append(line)
      match = re.search(pattern, line)
      if match:
        return match
    raise AssertionError(f'no {pattern!r} within {timeout}s:\n' + ''.join(self.log[-30:]))

  def kill(self):
    self.process.send_signal(signal.SIGKILL)
    self.process.wait(timeout=30)


def test_kill9_repeatedly_then_finish_equals_the_uninterrupted_run(tmp_path):
  config_path, reference_dir = train_testlib.config_and_reference(
      tmp_path, num_train_steps=STEPS, checkpoint_every_steps=1, keep_checkpoints=2
  )

  workdir = str(tmp_path / 'interrupted')
  rng = random.Random(1234)
  resumed_from, hit_a_save = [], False
  for attempt in range(3):
    latest = complete_steps(workdir)
    hit_a_save |= leftover_tmp(workdir)
    run = Training(config_path, workdir)
    if latest:
      match = run.wait_for(r'Resumed from the checkpoint at step (\d+)')
      assert match, ''.join(run.log[-30:])
      assert int(match.group(1)) == latest[-1], (latest, match.group(0))
      resumed_from.append(latest[-1])
    if attempt == 0:
      run.wait_for(r'Saving checkpoint 3 ')  # Kill while that write is in flight.
    else:
      run.wait_for(r'step \d+/\d+')
      time.sleep(rng.uniform(0.0, 1.5))
    finished = run.process.poll() is not None
    run.kill()
    assert not finished, 'the run ended before it could be killed; make it longer'

  hit_a_save |= leftover_tmp(workdir)
  latest = complete_steps(workdir)
  final = Training(config_path, workdir)
  match = final.wait_for(r'Resumed from the checkpoint at step (\d+)')
  assert match and int(match.group(1)) == latest[-1]
  while final.wait_for(r'.') is not None:
    pass
  assert final.process.wait(timeout=120) == 0, ''.join(final.log[-30:])
  assert complete_steps(workdir)[-1] == STEPS and not leftover_tmp(workdir)

  ours, step = checkpointing.restore_params(RunLayout.of(workdir).checkpoints)
  theirs, _ = checkpointing.restore_params(RunLayout.of(reference_dir).checkpoints)
  assert step == STEPS
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ours), jax.device_get(theirs))

  def losses(directory):
    with open(os.path.join(directory, 'metrics.jsonl')) as f:
      return {m['step']: m['loss'] for m in map(json.loads, f) if m['split'] == 'train'}

  assert losses(workdir) == losses(reference_dir)
  assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
  print(f'resumed from {resumed_from}; a kill interrupted a save: {hit_a_save}')

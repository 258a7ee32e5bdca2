"""Reading checkpoints beside a training run that rotates them away (keep_checkpoints):
readers take the steps that exist, or say that rotation took the one they read; never a
traceback, never "damaged"."""

from __future__ import annotations

import os
import threading

import numpy as np
import orbax.checkpoint as ocp

from transformer_jax import checkpointing
from transformer_jax.errors import CheckpointGoneError


def test_readers_beside_rotation_take_what_exists_or_say_it_was_rotated(tmp_path):
  workdir = str(tmp_path)
  directory = os.path.join(workdir, checkpointing.CHECKPOINT_DIR)
  meta = {'config': {}, 'vocab_size': 8, 'tokenizer': {}}
  stop = threading.Event()

  def train():  # Saves every step and keeps the last 2, as keep_checkpoints=2 does.
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    with ocp.CheckpointManager(directory, options=options) as manager:
      step = 0
      while not stop.is_set():
        step += 1
        params = {f'w{i}': np.full((64,), step, np.float32) for i in range(8)}
        manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave({**meta, 'step': step})
            ),
        )

  writer = threading.Thread(target=train, daemon=True)
  writer.start()
  while not os.path.isdir(os.path.join(directory, '2')):
    pass
  read, rotated, wrong = 0, 0, []
  try:
    for _ in range(60):
      try:
        got, step = checkpointing.read_meta(workdir)
        assert got['step'] == step
        params, step = checkpointing.restore_params(workdir)  # The latest again.
        assert float(params['w0'][0]) == step
        assert checkpointing.list_steps(workdir)
        read += 1
      except CheckpointGoneError:
        rotated += 1
      except Exception as e:  # What the test is about: anything else is wrong.
        wrong.append(f'{type(e).__name__}: {e}'[:300])
  finally:
    stop.set()
    writer.join()
  assert not wrong, wrong
  assert read > 0, (read, rotated)

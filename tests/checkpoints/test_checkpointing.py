"""Reading checkpoints beside a training run that rotates them away (keep_checkpoints):
readers take the steps that exist, or say that rotation took the one they read; never a
traceback, never "damaged"."""

from __future__ import annotations

import threading
import time

import numpy as np
import orbax.checkpoint as ocp

from transformer_jax.checkpoints import checkpointing
from transformer_jax.errors import CheckpointGoneError
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout


def read_beside_rotation(workdir: str, reads: int = 60) -> None:
  """Reads the latest checkpoint's meta and parameters and lists the steps `reads` times
  beside a writer that saves every step and keeps 2 (local or gs://)."""
  directory = RunLayout.of(str(workdir)).checkpoints
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
  while not storage.is_directory(f'{directory}/2'):
    time.sleep(0.01)
  read, rotated, wrong = 0, 0, []
  try:
    for _ in range(reads):
      try:
        got, step = checkpointing.read_meta(RunLayout.of(workdir).checkpoints)
        assert got['step'] == step
        params, step = checkpointing.restore_params(
            RunLayout.of(workdir).checkpoints
        )  # The latest again.
        assert float(params['w0'][0]) == step
        assert checkpointing.list_steps(RunLayout.of(workdir).checkpoints)
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


def test_readers_beside_rotation_take_what_exists_or_say_it_was_rotated(tmp_path):
  read_beside_rotation(str(tmp_path))

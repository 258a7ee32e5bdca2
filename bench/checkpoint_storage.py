"""Checkpoints on Cloud Storage against a local directory, side by side.

  python -m bench.checkpoint_storage                    # the base model, 3 rounds
  python -m bench.checkpoint_storage --model=tiny --rounds=1 --steps=2   # plumbing

What it times, with the project's own code (`checkpointing.Checkpointer`, the train step of
`bench.jax_side.TrainTask`, a batch of 8 x 64 + 64 tokens):

* save: `Checkpointer.save` of the whole train state (parameters, Adam state, checksums, the
  data iterator) until the write is complete (`wait`), to a local directory and to gs://;
* restore: `Checkpointer.restore` of that step onto the same shardings, checksums verified;
* an asynchronous save as the training loop makes one: how long the `save` call blocks (it
  copies the state off the devices), then the train step while the write goes on, against
  steps with none (the median over `--steps` steps each), for a local and a gs:// save.

Local and gs:// alternate within each round (A B, then B A), and ratios are medians of the
per-round ratios. The gs:// side is fake-gcs-server on 127.0.0.1, in memory (the tests'
`gcs_testlib`): it measures the clients (tensorstore for orbax's arrays, gcsfs for the rest)
and the serialization, not a real bucket's network or latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tests')
)
import gcs_testlib


def _step_times(task, count: int) -> list[float]:
  times = []
  for _ in range(count):
    start = time.perf_counter()
    task.run()
    times.append(time.perf_counter() - start)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='base', choices=('base', 'tiny'))
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=5, help='Train steps timed per phase.')
  parser.add_argument('--json', help='Also write every timing here.')
  args = parser.parse_args()

  server = gcs_testlib.start()
  os.environ.update(gcs_testlib.environment(server.url))
  import grain
  import jax

  from bench import jax_side
  from transformer_jax.checkpoints import checkpointing
  from transformer_jax.storage.layout import RunLayout

  try:
    bucket = server.create_bucket()
    local_root = tempfile.mkdtemp(prefix='bench_checkpoints_')
    task = jax_side.TrainTask(args.model, vocab_size=37000 if args.model == 'base' else 1000)
    setup = task.setup()
    data = iter(grain.MapDataset.range(4).to_iter_dataset())
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((task.state.params, task.state.opt_state)))
    rows = []
    for r in range(args.rounds):
      order = ('local', 'gcs') if r % 2 == 0 else ('gcs', 'local')
      for where in order:
        workdir = f'{bucket}/r{r}' if where == 'gcs' else os.path.join(local_root, f'r{r}')
        checkpointer = checkpointing.Checkpointer(
            RunLayout.of(workdir).checkpoints, save_every=10**6, final_step=10**6
        )
        step = int(task.state.step)
        start = time.perf_counter()
        checkpointer.save(task.state, data, {'bench': True}, force=True)
        checkpointer.wait()
        save_s = time.perf_counter() - start
        checksums = checkpointer.restore_meta(step)['checksums']
        start = time.perf_counter()
        restored = checkpointer.restore(step, task.train.abstract, data, checksums)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - start
        del restored
        idle = _step_times(task, args.steps)
        start = time.perf_counter()
        checkpointer.save(task.state, data, {'bench': True}, force=True)  # In flight:
        call_s = time.perf_counter() - start  # What the training loop waits for.
        busy = _step_times(task, args.steps)
        start = time.perf_counter()
        checkpointer.wait()
        rest_s = time.perf_counter() - start
        checkpointer.close()
        rows.append(
            {
                'round': r,
                'where': where,
                'save_s': save_s,
                'restore_s': restore_s,
                'step_s_idle': statistics.median(idle),
                'async_save_call_s': call_s,
                'step_s_during_save': statistics.median(busy),
                'save_left_after_steps_s': rest_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
  finally:
    server.stop()

  def ratio(key: str) -> float:
    per_round = [
        next(x[key] for x in rows if x['round'] == r and x['where'] == 'gcs')
        / next(x[key] for x in rows if x['round'] == r and x['where'] == 'local')
        for r in range(args.rounds)
    ]
    return statistics.median(per_round)

  def median(where: str, key: str) -> float:
    return statistics.median(x[key] for x in rows if x['where'] == where)

  print(
      f'\n{args.model} model, {state_bytes / 2**20:,.0f} MiB of parameters and Adam state, '
      f'{setup["device"]}, {args.rounds} rounds:'
  )
  for key, what in (('save_s', 'save (to complete)'), ('restore_s', 'restore + checksums')):
    print(
        f'  {what:<24} local {median("local", key):6.2f} s   gs:// '
        f'{median("gcs", key):6.2f} s   gs:// / local {ratio(key):.2f}x'
    )
  for where in ('local', 'gcs'):
    slowdown = statistics.median(
        x['step_s_during_save'] / x['step_s_idle'] for x in rows if x['where'] == where
    )
    blocks = median(where, 'async_save_call_s')
    print(
        f'  asynchronous {where:<5} save: the call blocks {blocks:.2f} s; '
        f'the train step meanwhile {slowdown:.2f}x the step without one '
        f'({median(where, "step_s_idle"):.3f} s)'
    )
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(
          {'model': args.model, 'state_bytes': state_bytes, 'setup': setup, 'rows': rows},
          f,
          indent=1,
          default=str,
      )


if __name__ == '__main__':
  main()

r"""A fault campaign: a small training job run to its last step again and again, each time with
faults drawn at random from a seed, every run checked against the run without faults.

  python scripts/fault_campaign.py --out=/tmp/campaign --runs=20 --seed=0
  python scripts/fault_campaign.py --out=/tmp/campaign --replay=7   # run 7 again, exactly

Each run draws 1 to --max_faults faults. A fault is a signal to train.py at a moment drawn
uniformly over the first --window seconds of one of its starts (so it can land in start-up,
the vocabulary and token-store preparation, compilation, a step, a checkpoint save, the
validation, or the restart itself): SIGKILL, SIGTERM, or SIGSTOP for 0.5 to 3 s (then
SIGCONT). After a fault that ends the process the job is started again as the docs say (the
same command), until one start finishes with no fault left to inject.

What every run must show, or it is kept as failed (its seed, schedule and logs under
--out/runs/N, replayed exactly by --replay=N):
  * the last checkpoint's parameters and optimizer state equal the reference's, bitwise;
  * every checkpoint left behind reads back (restore_params);
  * metrics.jsonl has each training step once, with the reference's loss;
  * no lock left in the work directory and no train.py process left running;
  * every start ended with exit code 0, or -9 (SIGKILL), or 0 after SIGTERM (the docs: it
    saves and exits 0; -15 only when nothing was printed yet: Python's own start-up, before
    train.py's first line); none printed a traceback.

The summary (runs, faults survived by kind, the seconds each kind cost against the reference's
wall time) goes to --out/summary.json and stdout. One host and local disk: what this version
injects. Not yet: SLURM nodes, the link, the Cloud Storage server, a full disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))  # The tests' toy task and small config.

import train_testlib  # noqa: E402

KINDS = ('SIGKILL', 'SIGTERM', 'SIGSTOP')
# What train.py says when a SIGTERM stops it (or arrives as it ends).
_STOP_LINES = (
    'Stop requested: saved step',
    'stopped by signal 15 while starting',
    'after training ended',
    'Finished at step',
)


@dataclasses.dataclass
class Fault:
  kind: str
  at: float  # Seconds after the start it hits.
  stop_seconds: float = 0.0


def train_command(files: dict[str, str], workdir: str, steps: int, cache: str) -> list[str]:
  """train.py on the tests' small config (`train_testlib.small_config`, one compiled shape)."""
  config = train_testlib.write_config_file(
      os.path.join(os.path.dirname(files['train'].split(',')[0]), f'config_{steps}.py'),
      files,
      num_train_steps=steps,
      eval_every_steps=steps // 2,
      checkpoint_every_steps=2,
  )
  return [
      *train_testlib.train_command(config, workdir),
      f'--compilation_cache_dir={cache}',
      f'--config.num_train_steps={steps}',
  ]


def _start(command: list[str], log: str) -> tuple[subprocess.Popen, object]:
  out = open(log, 'w')
  process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
  return process, out


def run_job(command: list[str], faults: list[Fault], logs: str) -> list[dict]:
  """Starts the job, injects `faults` one a start, restarts until a start finishes; what
  each start did."""
  os.makedirs(logs, exist_ok=True)
  starts = []
  pending = list(faults)
  for number in range(len(faults) + 5):
    log = os.path.join(logs, f'start{number}.log')
    begun = time.perf_counter()
    process, out = _start(command, log)
    fault = pending.pop(0) if pending else None
    injected = None
    if fault is not None:
      try:
        process.wait(timeout=fault.at)
      except subprocess.TimeoutExpired:
        signum = getattr(signal, fault.kind)
        process.send_signal(signum)
        injected = fault.kind
        if fault.kind == 'SIGSTOP':
          time.sleep(fault.stop_seconds)
          process.send_signal(signal.SIGCONT)
    code = process.wait(timeout=600)
    out.close()
    with open(log) as f:
      text = f.read()
    starts.append(
        {
            'fault': dataclasses.asdict(fault) if fault else None,
            'injected': injected,
            'exit': code,
            'seconds': time.perf_counter() - begun,
            'traceback': 'Traceback' in text,
            'silent': not text.strip(),
            'said_why': any(line in text for line in _STOP_LINES),
        }
    )
    if code == 0 and not pending and injected in (None, 'SIGSTOP', 'SIGTERM'):
      if _finished(command):
        return starts
  return starts


def _workdir(command: list[str]) -> str:
  return next(a.split('=', 1)[1] for a in command if a.startswith('--workdir='))


def _finished(command: list[str]) -> bool:
  steps = int(next(a.split('=')[1] for a in command if 'num_train_steps' in a))
  directory = os.path.join(_workdir(command), 'checkpoints')
  return os.path.isdir(os.path.join(directory, str(steps)))


def _state(workdir: str, step: int) -> dict:
  import orbax.checkpoint as ocp

  checkpointer = ocp.PyTreeCheckpointer()
  root = os.path.join(workdir, 'checkpoints', str(step))
  return {item: checkpointer.restore(os.path.join(root, item)) for item in ('params', 'optimizer')}


def _losses(workdir: str) -> list[tuple[int, float]]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [(r['step'], r['loss']) for r in rows if r['split'] == 'train']


def check(workdir: str, reference: str, steps: int, starts: list[dict]) -> list[str]:
  """What the run got wrong ([] if nothing)."""
  from absl import logging
  import jax
  import numpy as np

  from transformer_jax.checkpoints import checkpointing

  logging.set_verbosity(logging.ERROR)  # Orbax's notes on every item it reads back.

  problems = []
  if not _finished(['x', f'--workdir={workdir}', f'--config.num_train_steps={steps}']):
    return [f'no checkpoint of step {steps} after {len(starts)} starts']
  ours, theirs = _state(workdir, steps), _state(reference, steps)
  for item in ours:
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), ours[item], theirs[item])
    if not all(jax.tree.leaves(same)):
      problems.append(f'the final {item} differ from the reference')
  directory = os.path.join(workdir, 'checkpoints')
  for step in checkpointing.list_steps(directory):
    try:
      checkpointing.restore_params(directory, step)
    except Exception as e:  # Any failure to read back is the finding.
      problems.append(f'checkpoint {step} does not read back: {type(e).__name__}: {e}')
  losses = _losses(workdir)
  steps_seen = [s for s, _ in losses]
  if sorted(steps_seen) != list(range(1, steps + 1)):
    problems.append(f'metrics.jsonl has training steps {steps_seen}, not 1..{steps} once each')
  elif dict(losses) != dict(_losses(reference)):
    problems.append('metrics.jsonl losses differ from the reference')
  if os.path.exists(os.path.join(workdir, 'train.lock')):
    problems.append('the lock is left in the work directory')
  alive = subprocess.run(['pgrep', '-f', f'--workdir={workdir}'], capture_output=True, text=True)
  if alive.stdout.strip():
    problems.append(f'train.py processes left running: {alive.stdout.split()}')
  for number, start in enumerate(starts):
    if start['traceback']:
      problems.append(f'start {number} printed a traceback ({start["injected"]})')
    allowed = {None: (0,), 'SIGSTOP': (0,), 'SIGTERM': (0,), 'SIGKILL': (-9,)}
    # Python's own start, before train.py's first line (nothing printed yet), ends -15.
    early = start['injected'] == 'SIGTERM' and start['exit'] == -15 and start['silent']
    if start['exit'] not in allowed[start['injected']] and not early:
      problems.append(f'start {number} exited {start["exit"]} after {start["injected"]}')
    if start['injected'] == 'SIGTERM' and start['exit'] == 0 and not start['said_why']:
      problems.append(f'start {number} stopped after SIGTERM without saying why')
  return problems


def schedule(seed: int, run: int, max_faults: int, window: float) -> list[Fault]:
  rng = random.Random(seed * 1_000_003 + run)
  faults = []
  for _ in range(rng.randint(1, max_faults)):
    kind = rng.choice(KINDS)
    faults.append(Fault(kind, round(rng.uniform(0.0, window), 3), round(rng.uniform(0.5, 3.0), 3)))
  return faults


def summarize(results: list[dict], seed: int, reference_seconds: float) -> dict:
  """Runs, failures, faults injected by kind, and the seconds lost to each kind (over the runs
  whose injected faults were all of that kind: their time beyond the reference's)."""
  injected = [s['injected'] for r in results for s in r['starts'] if s['injected']]
  lost: dict[str, list[float]] = {k: [] for k in KINDS}
  for r in results:
    kinds = {s['injected'] for s in r['starts'] if s['injected']}
    if len(kinds) == 1:
      lost[kinds.pop()].append(r['lost_seconds'])
  return {
      'seed': seed,
      'reference_seconds': reference_seconds,
      'runs': len(results),
      'failed_runs': [r['run'] for r in results if r['problems']],
      'faults_injected': {k: injected.count(k) for k in KINDS},
      'mean_lost_seconds_per_run': sum(r['lost_seconds'] for r in results) / max(1, len(results)),
      'mean_lost_seconds_one_kind': {
          k: (sum(v) / len(v) if v else None, len(v)) for k, v in lost.items()
      },
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--runs', type=int, default=10)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--max_faults', type=int, default=3)
  parser.add_argument(
      '--window',
      type=float,
      default=0.0,
      help='0: the reference wall time (timed on a second run, the compilation cache warm).',
  )
  parser.add_argument('--replay', type=int, default=None, help='Run this one run again.')
  args = parser.parse_args()
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  files = train_testlib.write_parallel_text(out)
  cache = os.path.join(out, 'jax_cache')
  reference = os.path.join(out, 'reference')
  timing = os.path.join(out, 'reference_seconds.json')
  if not (_finished(train_command(files, reference, args.steps, cache)) and os.path.exists(timing)):
    shutil.rmtree(reference, ignore_errors=True)
    command = train_command(files, reference, args.steps, cache)
    began = time.perf_counter()
    run_job(command, [], os.path.join(out, 'ref_logs'))  # Fills the compilation cache.
    if not args.window:  # Timed again with the cache warm, as the faulted runs are.
      shutil.rmtree(reference)
      began = time.perf_counter()
      run_job(command, [], os.path.join(out, 'ref_logs'))
    with open(timing, 'w') as f:
      json.dump(time.perf_counter() - began, f)
  with open(timing) as f:
    reference_seconds = json.load(f)
  window = args.window or reference_seconds
  numbers = [args.replay] if args.replay is not None else range(args.runs)
  results = []
  for number in numbers:
    faults = schedule(args.seed, number, args.max_faults, window)
    run_dir = os.path.join(out, 'runs', str(number))
    shutil.rmtree(run_dir, ignore_errors=True)
    workdir = os.path.join(run_dir, 'workdir')
    began = time.perf_counter()
    starts = run_job(train_command(files, workdir, args.steps, cache), faults, run_dir)
    seconds = time.perf_counter() - began
    problems = check(workdir, reference, args.steps, starts)
    result = {
        'run': number,
        'seed': args.seed,
        'faults': [dataclasses.asdict(f) for f in faults],
        'starts': starts,
        'seconds': seconds,
        'lost_seconds': seconds - reference_seconds,
        'problems': problems,
    }
    with open(os.path.join(run_dir, 'result.json'), 'w') as f:
      json.dump(result, f, indent=2)
    if not problems:
      shutil.rmtree(workdir)  # Kept only when the run failed.
    results.append(result)
    print(
        f'run {number}: {len(starts)} starts, faults '
        f'{[s["injected"] for s in starts if s["injected"]]}, {seconds:.0f} s: '
        f'{"OK" if not problems else "; ".join(problems)}',
        flush=True,
    )
  summary = summarize(results, args.seed, reference_seconds)
  with open(os.path.join(out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))
  sys.exit(1 if summary['failed_runs'] else 0)


if __name__ == '__main__':
  main()

"""The benchmark's process protocol: a worker sets measurements up once, then times rounds.

Every system under test (JAX, PyTorch, CTranslate2) runs in its own process, started by
`bench.run` with the thread settings in its environment. A worker is started as

    python -m bench.<side> '<JSON list of task specs>'

builds each task (compilation, model creation, conversion: timed, reported as setup), prints
one JSON line `{"ready": {task: info}}`, then answers JSON commands read from stdin:

    {"task": name, "iters": n}  ->  {"times": [seconds of each of the n iterations]}
    {"task": name, "iters": n, "chain": m}  ->  {"times": [seconds of each iteration / m]}, an
                                          iteration being m runs dispatched back to back
                                          (`task.dispatch()`) and waited for once at the end
                                          (`task.wait()`), as the training loop runs steps
    {"breakdown": name, "iters": n}  ->  {"breakdown": where n more iterations spent their
                                          time, by kind (`bench/breakdown.py`)}
    {"exit": true}              ->  {"peak_rss_bytes": ..., ...} and the process ends.

With `PROFILE_VAR` set to a directory in its environment (`bench.run --profile_dir`), a worker
that can trace (the JAX side) runs each task three more times at exit, after every timed
round, under its profiler, into <directory>/<task name>.

Each task's setup facts include `run_peak_extra_bytes`: the memory one more iteration adds
at its peak over what the process held before it (weights and caches kept between runs
excluded), measured alike for every system.

The protocol has its own file descriptor (a duplicate of the original stdout); stdout itself
is pointed at stderr, so that library chatter, even from C++, cannot corrupt it. Rounds of two
systems are interleaved by the parent, so that a noisy, shared machine slows both alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import json
import os
import resource
import sys
import time
import traceback
from typing import Any, Protocol

PROFILE_VAR = 'BENCH_PROFILE_DIR'


class Task(Protocol):
  """One measurement. `setup` returns facts to report (compile seconds, shapes, memory)."""

  def setup(self) -> dict[str, Any]:
    ...

  def run(self) -> None:
    """One timed iteration; returns when the work is finished (results blocked on)."""


def peak_rss_bytes() -> int:
  """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status_bytes(field: str) -> int | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def run_peak_extra_bytes(task: Task) -> int | None:
  """Resident memory one `task.run()` adds at its peak over what the process held before
  (Linux: the high-water mark is reset through /proc/self/clear_refs); None elsewhere."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError:
    return None
  before = _proc_status_bytes('VmRSS')
  task.run()
  peak = _proc_status_bytes('VmHWM')
  return None if before is None or peak is None else max(peak - before, 0)


def serve(
    factories: Mapping[str, Callable[..., Task]],
    extra_exit_info: Callable[[], dict[str, Any]] | None = None,
    profile: Callable[[Mapping[str, Task], str], None] | None = None,
) -> None:
  """Runs the worker side of the protocol for the task kinds in `factories`.

  Args:
    factories: task kind -> constructor taking the spec's other fields as keyword arguments.
    extra_exit_info: adds facts to the exit message (e.g. device memory peaks).
    profile: traces the tasks into a directory (called at exit when `PROFILE_VAR` is set).
  """
  channel = os.fdopen(os.dup(1), 'w', buffering=1)
  os.dup2(2, 1)
  sys.stdout = sys.stderr

  def send(message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + '\n')
    channel.flush()

  specs = json.loads(sys.argv[1])
  tasks: dict[str, Task] = {}
  ready: dict[str, Any] = {}
  for spec in specs:
    spec = dict(spec)
    name, kind = spec.pop('name'), spec.pop('kind')
    start = time.perf_counter()
    try:
      task = factories[kind](**spec)
      info = task.setup()
    except Exception as e:  # Reported, so that the other measurements still run.
      traceback.print_exc()
      ready[name] = {'error': f'{type(e).__name__}: {str(e)[:300]}'}
      continue
    info.setdefault('setup_s', time.perf_counter() - start)
    info['run_peak_extra_bytes'] = run_peak_extra_bytes(task)
    info['rss_after_setup_bytes'] = peak_rss_bytes()
    tasks[name] = task
    ready[name] = info
  send({'ready': ready})

  for line in sys.stdin:
    command = json.loads(line)
    if command.get('exit'):
      if profile is not None and os.environ.get(PROFILE_VAR):
        profile(tasks, os.environ[PROFILE_VAR])
      info = {'peak_rss_bytes': peak_rss_bytes()}
      if extra_exit_info is not None:
        info.update(extra_exit_info())
      send(info)
      return
    if command.get('breakdown'):  # Where a step's time goes (tasks with `breakdown`).
      send({'breakdown': tasks[command['breakdown']].breakdown(command['iters'])})
      continue
    task = tasks[command['task']]
    chain = command.get('chain', 0)
    times = []
    for _ in range(command['iters']):
      start = time.perf_counter()
      if chain:
        for _ in range(chain):
          task.dispatch()
        task.wait()
      else:
        task.run()
      times.append((time.perf_counter() - start) / max(chain, 1))
    send({'times': times})

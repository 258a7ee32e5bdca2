"""Several processes as one job, and stopping them all at the same step.

Multi-host runs use JAX's own distributed runtime (`jax.distributed.initialize`): on Cloud
TPU, SLURM and Open MPI it finds the coordinator itself; elsewhere it is given the
coordinator's address, the process count and this process's id. Its heartbeats make every
process exit when one dies, instead of waiting forever in a collective.

Stopping (preemptible VMs get SIGTERM and a short grace period): every process must save the
*same* step. With one process a Python signal handler sets a flag that the loop reads after
each step; Ctrl-C (SIGINT) does the same, and a second Ctrl-C interrupts at once. With
several, JAX's preemption service catches SIGTERM on whichever process got it, tells the
others through the coordinator and names a step that all of them reach;
`multihost_utils.reached_preemption_sync_point` returns True there, on every process.
"""

from __future__ import annotations

import signal
import sys
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_seconds: int = 100) -> None:
  """Joins this process to the job (call before anything touches a device).

  Args:
    coordinator_address: 'host:port' of process 0; None to detect (TPU, SLURM, Open MPI).
    num_processes: processes in the job; None to detect.
    process_id: this process's index; None to detect.
    heartbeat_timeout_seconds: a process silent this long is declared dead, and all others
      exit with an error rather than hang.
  """
  # CPU devices of different processes talk through gloo (unused on GPU and TPU).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  logging.info('Process %d of %d joined the job; %d local / %d global devices.',
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())


class StopSignal:
  """Tells the training loop, identically on every process, when to save and stop.

  Create it once, before training; call `should_stop(step)` after every step, with the
  same step numbers on every process.
  """

  def __init__(self):
    self._requested = threading.Event()
    self._multiprocess = jax.process_count() > 1
    self._previous_handlers = {}
    if not self._multiprocess and threading.current_thread() is threading.main_thread():
      # With several processes JAX's preemption notifier owns SIGTERM; a Python handler
      # here would replace it.
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

  def _on_signal(self, signum, frame) -> None:
    del frame
    if signum == signal.SIGINT:
      if self._requested.is_set():
        raise KeyboardInterrupt  # The second Ctrl-C: stop now, without saving.
      print('Ctrl-C: saving a checkpoint after this step, then stopping (press Ctrl-C again '
            'to stop at once, without saving).', file=sys.stderr, flush=True)
    logging.warning('Received signal %d: saving a checkpoint after this step, then '
                    'stopping.', signum)
    self._requested.set()

  def should_stop(self, step: int) -> bool:
    """True at the step where every process must save and stop."""
    if self._multiprocess:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested.is_set()

  def close(self) -> None:
    """Restores the previous SIGTERM and SIGINT handlers."""
    for signum, handler in self._previous_handlers.items():
      signal.signal(signum, handler)
    self._previous_handlers = {}

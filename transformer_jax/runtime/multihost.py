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

from collections.abc import Callable
import errno
import itertools
import json
import os
import signal
import socket
import sys
import threading
from typing import Any, NoReturn

from absl import logging
import jax
from jax._src import clusters as _clusters  # JAX's launcher detection: no public API has it.
from jax._src import distributed as _distributed  # The coordinator's key-value store, as orbax.
from jax.experimental import multihost_utils

from transformer_jax.errors import LaunchError


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_seconds: int = 100,
    exit_now: Callable[[str], NoReturn] | None = None,
) -> None:
  """Joins this process to the job (call before anything touches a device).

  Args:
    coordinator_address: 'host:port' of process 0; None to detect (TPU, SLURM, Open MPI).
    num_processes: processes in the job; None to detect.
    process_id: this process's index; None to detect.
    heartbeat_timeout_seconds: a process silent this long is declared dead, and all others
      exit with an error rather than hang; also how long a process waits for the others to
      join.
    exit_now: ends the process at once with a message (a command's error format); called
      from a watchdog thread when joining takes longer than the heartbeat timeout. None logs
      the message and ends the process with exit code 2 (`sys.exit` would end only the
      watchdog's thread).

  Raises:
    LaunchError: no launcher was found and the flags do not say it all, or process 0's
      coordinator port is in use.
  """
  launcher, coordinator_address, num_processes, process_id = _detect(
      coordinator_address, num_processes, process_id, heartbeat_timeout_seconds
  )
  if process_id == 0:
    _check_port_free(coordinator_address)
  # CPU devices of different processes talk through gloo (unused on GPU and TPU).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # jaxlib ends the process (a fatal C++ check, exit 134) when the coordinator does not
  # register every process in time; this watchdog says why first, with exit code 2.
  joined = threading.Event()

  def log_and_exit(message: str) -> NoReturn:
    logging.error(message)
    logging.flush()
    os._exit(2)

  def give_up_unless_joined():
    if not joined.wait(heartbeat_timeout_seconds):
      (exit_now or log_and_exit)(
          f'Process {process_id} of {num_processes} could not join the job within '
          f'{heartbeat_timeout_seconds} s: the coordinator at {coordinator_address} (started by '
          'process 0) did not answer, or not every process connected to it. If process 0 '
          'failed, its log says why; otherwise check that all processes were started and can '
          'reach that host and port, or give them longer with --heartbeat_timeout_seconds.'
      )

  threading.Thread(target=give_up_unless_joined, daemon=True, name='join_watchdog').start()
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=heartbeat_timeout_seconds + 60,
      heartbeat_timeout_seconds=heartbeat_timeout_seconds,
  )
  joined.set()
  # Its host too: when a process is lost, JAX names its index only ("The following tasks are
  # unhealthy (stopped sending heartbeats): 1"); these lines say which host that is.
  logging.info(
      'Process %d of %d joined the job on %s (%s, coordinator %s); %d local / %d global '
      'devices.',
      jax.process_index(),
      jax.process_count(),
      socket.gethostname(),
      launcher,
      coordinator_address,
      jax.local_device_count(),
      jax.device_count(),
  )


def _detect(coordinator_address, num_processes, process_id, timeout_s):
  """(launcher, coordinator address, process count, process id): the flags', else what
  JAX's own detection reads from the launcher's environment, as jax.distributed would."""
  coordinator_address = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')
  launcher = 'flags'
  if None in (coordinator_address, num_processes, process_id):
    found = [
        env
        for env in _clusters.ClusterEnv._cluster_types
        if not env.opt_in_only_method and env.is_env_present()
    ]
    if found:
      launcher = found[0].name
      # Local device ids are left to jax.distributed (JAX_LOCAL_DEVICE_IDS, else one GPU
      # per process under a launcher); a non-None value here keeps them out of this call.
      coordinator_address, num_processes, process_id, _ = (
          _clusters.ClusterEnv.auto_detect_unset_distributed_params(
              coordinator_address, num_processes, process_id, (), None, timeout_s
          )
      )
  missing = [
      flag
      for flag, value in (
          ('--coordinator_address', coordinator_address),
          ('--num_processes', num_processes),
          ('--process_id', process_id),
      )
      if value is None
  ]
  if missing:
    raise LaunchError(
        '--distributed found no launcher to learn the job from: this process was not started '
        'by SLURM (srun), Open MPI (mpirun) or on a Cloud TPU VM, and the flags do not say it '
        f'all ({", ".join(missing)} missing). Start every process with srun or mpirun, or '
        "give each one --coordinator_address=HOST:PORT (process 0's host) --num_processes=N "
        "--process_id=I; without --distributed, train.py uses this machine's devices alone."
    )
  if not 0 <= process_id < num_processes:
    raise LaunchError(
        f"--process_id={process_id} is not one of the job's {num_processes} "
        f'processes (0 to {num_processes - 1}).'
    )
  return launcher, coordinator_address, num_processes, process_id


def _check_port_free(coordinator_address: str) -> None:
  """Raises `LaunchError` if process 0 cannot bind the coordinator's port: jaxlib then
  crashes (a segmentation fault) and the other processes wait for it until they time out."""
  port = coordinator_address.rsplit(':', 1)[1]
  bind = os.environ.get('JAX_COORDINATOR_BIND_ADDRESS', f'[::]:{port}')
  host, bind_port = bind.rsplit(':', 1)
  host = host.strip('[]')
  family = socket.AF_INET6 if ':' in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((host, int(bind_port)))
  except OSError as e:
    if e.errno != errno.EADDRINUSE:
      return  # Not ours to judge (no IPv6, say): jax.distributed reports what it finds.
    raise LaunchError(
        f"Port {bind_port} on this host is in use, so process 0 cannot start the job's "
        f"coordinator there ({coordinator_address}): another job's coordinator, or a run that "
        'is still exiting, holds it. Wait for that one, or choose a free port for every process: '
        '--coordinator_address=HOST:PORT, or JAX_COORDINATOR_PORT=PORT in the environment '
        'under SLURM or Open MPI.'
    ) from e


def check_processes_agree(values: dict[str, str], timeout_s: int) -> None:
  """Raises `LaunchError` on every process unless all of them passed the same `values`.

  Process 0 compares every process's values with its own through the coordinator's key-value
  store (no device work), and tells all of them the verdict, so that all of them stop with
  the same paragraph instead of one stopping and the others waiting in a collective.
  """
  if jax.process_count() == 1:
    return
  client = _distributed.global_state.client
  me, timeout_ms = jax.process_index(), timeout_s * 1000
  client.key_value_set(f'transformer_jax/launch/{me}', json.dumps(values, sort_keys=True))
  if me == 0:
    differences = []
    for other in range(1, jax.process_count()):
      theirs = json.loads(
          client.blocking_key_value_get(f'transformer_jax/launch/{other}', timeout_ms)
      )
      fields = [k for k in sorted(set(values) | set(theirs)) if values.get(k) != theirs.get(k)]
      if fields:
        differences.append(
            f'process {other} has '
            + ', '.join(
                f'{k}={theirs.get(k, "(none)")} where process 0 has {values.get(k, "(none)")}'
                for k in fields[:4]
            )
            + (f' and {len(fields) - 4} more' if len(fields) > 4 else '')
        )
    client.key_value_set('transformer_jax/launch/verdict', json.dumps(differences))
  else:
    differences = json.loads(
        client.blocking_key_value_get('transformer_jax/launch/verdict', timeout_ms)
    )
  if differences:
    raise LaunchError(
        'The processes of this job were not started with the same config and work directory: '
        + '; '.join(differences[:3])
        + (f'; and {len(differences) - 3} more processes' if len(differences) > 3 else '')
        + '. Every process must get the same --config file, --config.* overrides and --workdir; '
        'check the launch line for a per-process variable or a file that differs between hosts.'
    )


def from_process_0(name: str, value: str, timeout_s: int = 3600) -> str:
  """Process 0's `value`, on every process, through the coordinator's key-value store (no
  device work: a first collective pays gloo's set-up, whose 30 s limit on the processes'
  arrival a loaded machine can pass; a process that dies ends the others by heartbeat).
  With one process, `value`."""
  if jax.process_count() == 1:
    return value
  client = _distributed.global_state.client
  key = f'transformer_jax/from_process_0/{name}'
  if jax.process_index() == 0:
    client.key_value_set(key, value)
    return value
  return client.blocking_key_value_get(key, timeout_s * 1000)


class StopSignal:
  """Tells the training loop, identically on every process, when to save and stop.

  Create it once, before training; call `should_stop(step)` after every step, with the
  same step numbers on every process.
  """

  # Set once training has listened for SIGTERM in this process: from then on a stop asked for
  # after `close` comes too late to save anything (`commands.starting`).
  listened = False

  def __init__(self):
    StopSignal.listened = True
    self._requested = threading.Event()
    self._signum = None
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
      print(
          'Ctrl-C: saving a checkpoint after this step, then stopping (press Ctrl-C again '
          'to stop at once, without saving).',
          file=sys.stderr,
          flush=True,
      )
    logging.warning(
        'Received signal %d: saving a checkpoint after this step, then stopping.', signum
    )
    if self._signum is None:
      self._signum = signum
    self._requested.set()

  @property
  def interrupted(self) -> bool:
    """True when the stop came from Ctrl-C (SIGINT), which the command reports as an
    interruption; a scheduler's SIGTERM is a normal end."""
    return self._signum == signal.SIGINT

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


def on_process_0_first(make: Callable[[], Any], what: str, wait: bool = True) -> Any:
  """`make()` on process 0 first, then (after a barrier) on the others, which find its
  result on a shared filesystem or the bucket (`wait`; else every process at once)."""
  wait = wait and jax.process_count() > 1
  if wait and jax.process_index() != 0:
    _barrier(f'{what}: process 0 prepared')
  made = make()
  if wait and jax.process_index() == 0:
    _barrier(f'{what}: process 0 prepared')
  return made


def _barrier(name: str, timeout_s: int = 24 * 3600) -> None:
  """Every process waits here for the others, at the coordinator (no device work: process 0
  may prepare for minutes, beyond the 30 s in which gloo's first collective wants every
  process; a process that dies ends the others by heartbeat)."""
  # Numbered: every process passes the same barriers in the same order, and an id is used once.
  number = next(_BARRIERS)
  _distributed.global_state.client.wait_at_barrier(
      f'transformer_jax/{number}/{name.replace(" ", "_")}', timeout_s * 1000
  )


_BARRIERS = itertools.count()

"""Starts the project's commands (`python train.py ...`) by forking a process that has imported
their libraries once, for the tests that run a command many times (bad input, small runs).

A command started as a new Python spends seconds of CPU importing jax, flax, optax, orbax, grain and
tfds before it reads its first flag; the suite starts a few hundred (bench/RESULTS.md, section "Test
suite"). This server imports them once and forks a child per command: the child takes
the request's standard streams, working directory, environment and argv, and runs the script as
`python script.py` would (`runpy`, as `__main__`), then exits through Python's normal shutdown.
Nothing of JAX's runtime exists before the fork (no backend, no thread of its): each child
initializes its own backend from its own environment, so XLA_FLAGS and PJRT_NPROC apply per command.
What JAX reads at import (JAX_* variables) is the server's: `train_testlib.run_command` sends a
command whose JAX_* variables differ to a real subprocess instead.

  python tests/command_server.py SOCKET    # prints "ready" once it listens

Protocol, one connection a command: the client sends a JSON request (argv, cwd, env) with its
stdin, stdout and stderr as file descriptors; the server answers the child's pid, then its
wait status, each a line.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import threading

# What every command imports (none of them initializes a JAX backend).
from absl import app  # noqa: F401
from absl import flags  # noqa: F401
from absl import logging  # noqa: F401
import flax.linen  # noqa: F401
import fsspec  # noqa: F401
import grain  # noqa: F401
import jax  # noqa: F401
import jax.experimental.pallas.triton  # noqa: F401
import ml_collections.config_flags  # noqa: F401
import optax  # noqa: F401
import orbax.checkpoint  # noqa: F401
import sacrebleu  # noqa: F401
import sentencepiece  # noqa: F401
import tensorflow_datasets  # noqa: F401


class _Child(Exception):
  """Raised in the forked child to leave the server's loop for the command."""

  def __init__(self, request: dict, fds: list[int]):
    super().__init__()
    self.request, self.fds = request, fds


def _wait_and_report(conn: socket.socket, pid: int) -> None:
  with conn:
    _, status = os.waitpid(pid, 0)
    try:
      conn.sendall(f'{status}\n'.encode())
    except OSError:
      pass  # The client gave up (its timeout killed the child).


def serve(path: str) -> None:
  # The server ends with the test process that started it.
  ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(16)
  print('ready', flush=True)
  while True:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      listener.close()
      conn.close()
      raise _Child(request, fds)
    for fd in fds:
      os.close(fd)
    conn.sendall(f'{pid}\n'.encode())
    threading.Thread(target=_wait_and_report, args=(conn, pid), daemon=True).start()


def run_child(request: dict, fds: list[int]) -> None:
  """Becomes `python argv[0] argv[1:]` in cwd with env and the given streams."""
  for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  script = request['argv'][0]
  sys.argv = list(request['argv'])
  sys.path[0] = os.path.dirname(os.path.abspath(script))
  runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
  try:
    serve(sys.argv[1])
  except _Child as child:
    run_child(child.request, child.fds)  # SystemExit from the command ends the child.

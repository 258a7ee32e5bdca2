"""A stop asked for while a command is still starting: one line and a clean exit.

A scheduler may send SIGTERM at any moment, the first second of a process included, and
Python's default for SIGTERM ends the process without a word (exit -15). train.py installs
`stop_on_sigterm` before it imports anything heavy; until training installs its own handler
(which saves and exits 0), a SIGTERM ends the process with one line and exit code 0: nothing
has happened yet that needs saving, and whatever was being prepared (the vocabulary, the
token stores) is written whole or not at all, so the rerun the line asks for starts cleanly.
"""

from __future__ import annotations

import os
import signal
import sys


def stop_on_sigterm() -> None:
  """SIGTERM from now on: `sys.exit(0)` with one line on stderr (the `finally` blocks run,
  so a lock taken meanwhile is released)."""

  def stopped(signum: int, frame: object) -> None:
    del frame
    print(
        f'{os.path.basename(sys.argv[0]) or "transformer_jax"}: stopped by signal {signum} '
        'while starting, before training began: nothing to save; rerun the same command to '
        'start.',
        file=sys.stderr,
        flush=True,
    )
    sys.exit(0)

  signal.signal(signal.SIGTERM, stopped)

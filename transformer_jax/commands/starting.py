"""A stop asked for while a command is still starting: one line and a clean exit.

A scheduler may send SIGTERM at any moment, the first second of a process included, and
Python's default for SIGTERM ends the process without a word (exit -15). train.py installs
`stop_on_sigterm` before it imports anything heavy; until training installs its own handler
(which saves and exits 0), a SIGTERM ends the process with one line and exit code 0: nothing
has happened yet that needs saving, and whatever was being prepared (the vocabulary, the
token stores) is written whole or not at all, so the rerun the line asks for starts cleanly.

The process ends at once (`os._exit`), as a kill would, not through `sys.exit`: a SIGTERM
that arrived while a garbage-collection callback of jaxlib ran raised SystemExit inside it,
where Python ignores exceptions, and the process went on to train (the fault campaign found
it). A lock taken meanwhile is left to its dead owner, which the next run takes over
(`workdir_lock`), as after a kill. Once training has listened for SIGTERM itself
(`multihost.StopSignal`), a SIGTERM that finds this handler again (training closed its own
and put this one back) comes as the process ends: it is noted and the process ends as
planned, its lock released (the fault campaign found the lock left behind when it ended the
process there).
"""

from __future__ import annotations

import os
import signal
import sys


def stop_on_sigterm() -> None:
  """SIGTERM from now on: one line on stderr, then the process ends with exit code 0."""

  def stopped(signum: int, frame: object) -> None:
    del frame
    multihost = sys.modules.get('transformer_jax.runtime.multihost')
    if multihost is not None and multihost.StopSignal.listened:
      # Training has run and closed its own handler, which put this one back: the stop
      # comes as the process ends (its lock being released); let it end as planned.
      print(
          f'{os.path.basename(sys.argv[0]) or "transformer_jax"}: received signal {signum} '
          'after training ended: exiting as planned.',
          file=sys.stderr,
          flush=True,
      )
      return
    print(
        f'{os.path.basename(sys.argv[0]) or "transformer_jax"}: stopped by signal {signum} '
        'while starting, before training began: nothing to save; rerun the same command to '
        'start.',
        file=sys.stderr,
        flush=True,
    )
    os._exit(0)  # pylint: disable=protected-access

  signal.signal(signal.SIGTERM, stopped)

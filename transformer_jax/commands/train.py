r"""Trains the Transformer; rerunning the same command resumes from the latest checkpoint.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/wmt14_ende_base.py --workdir=$HOME/runs/ende_base \
      --config.tfds_data_dir=$HOME/tensorflow_datasets --config.mesh.fsdp=8

Several hosts (one process each): add --distributed; on Cloud TPU, SLURM and Open MPI the
coordinator is found automatically, elsewhere pass --coordinator_address=HOST:PORT
--num_processes=N --process_id=I.

Exit codes: 0 finished or stopped by SIGTERM after saving; 1 an unexpected error or a
non-finite loss with nonfinite='stop'; 2 a config, flag, data, checkpoint, work-directory or
full-disk problem (explained in one paragraph; the traceback only with --verbose); 130
interrupted by Ctrl-C (after saving that step, so a script that runs train.py stops too).
"""

import atexit
import signal
import sys

from absl import flags
from absl import logging
from ml_collections import config_flags

from transformer_jax.checkpoints import checkpointing
from transformer_jax.commands import cli
from transformer_jax.commands import starting
from transformer_jax.training import train_loop

_CONFIG = config_flags.DEFINE_config_file(
    'config',
    None,
    'A config file (configs/*.py); override fields with --config.FIELD=VALUE.',
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, vocabulary and metrics go here.')
_JOB = cli.define_job_flags()
_COMPILATION_CACHE = cli.define_compilation_cache_flag()


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if _CONFIG.value is None:
    cli.fail('--config is required, e.g. --config=configs/tiny.py.')
  if not _WORKDIR.value:
    cli.fail('--workdir is required: the directory for checkpoints and metrics.')
  cli.use_compilation_cache(_COMPILATION_CACHE.value)
  cli.join_job(
      _JOB,
      {
          **{f'--config.{k}': v for k, v in checkpointing.flat_config(_CONFIG.value).items()},
          '--workdir': _WORKDIR.value,
      },
  )
  try:
    result = train_loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except train_loop.NonFiniteError as e:
    print(f'{cli.program()}: stopped: {e}', file=sys.stderr)
    sys.exit(1)
  # Training's own handlers are gone and its checkpoint is saved: a SIGTERM from here on (a
  # scheduler's stop arriving as the last step ends) asks for what happens anyway, and must
  # not turn the exit code into 143 while the process shuts down.
  signal.signal(signal.SIGTERM, _already_ending)
  # As the interpreter finalizes, after the atexit functions, Python puts the default action
  # back for every signal it handled, and a SIGTERM then killed the process (exit -15) as
  # XLA and Orbax shut down. Ignored from the first atexit function on, it cannot.
  atexit.register(signal.signal, signal.SIGTERM, signal.SIG_IGN)
  if result.interrupted:
    print(
        f'{cli.program()}: interrupted by Ctrl-C at step {int(result.state.step)}, after saving '
        'its checkpoint; rerun the same command to resume.',
        file=sys.stderr,
    )
    sys.exit(130)
  if result.stopped_early:
    logging.info(
        'Stopped at step %d on request; the checkpoint is complete.', int(result.state.step)
    )
  else:
    logging.info('Finished at step %d; its checkpoint is complete.', int(result.state.step))


def _already_ending(signum, frame) -> None:
  del frame
  logging.warning('Received signal %d after training ended: exiting as planned.', signum)


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  starting.stop_on_sigterm()  # (train.py did it before importing this module.)
  cli.run(main)


if __name__ == '__main__':
  run()

r"""Trains the Transformer; rerunning the same command resumes from the latest checkpoint.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python train.py --config=configs/wmt14_ende_base.py --workdir=$HOME/runs/ende_base \
      --config.tfds_data_dir=$HOME/tensorflow_datasets --config.mesh.fsdp=8

Several hosts (one process each): add --distributed; on Cloud TPU, SLURM and Open MPI the
coordinator is found automatically, elsewhere pass --coordinator_address=HOST:PORT
--num_processes=N --process_id=I.

Exit codes: 0 finished or stopped by SIGTERM after saving; 1 an unexpected error; 2 a config,
flag, data or work-directory problem (explained in one paragraph, no traceback).
"""

import logging as std_logging
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from transformer_jax import bible_en_es
from transformer_jax import multihost
from transformer_jax import trainer
from transformer_jax.config import ConfigError
from transformer_jax.input_pipeline import DatasetNotFoundError

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'A config file (configs/*.py); override fields with --config.FIELD=VALUE.',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, vocabulary and metrics go here.')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Join a multi-process job through jax.distributed.initialize.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'HOST:PORT of process 0 (autodetected on TPU/SLURM/MPI).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1.')
_HEARTBEAT = flags.DEFINE_integer(
    'heartbeat_timeout_seconds', 100,
    'A process silent this long counts as dead; the others then exit instead of hanging.')


def _fail(message: str) -> None:
  print(f'train.py: error: {message}', file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with bad flags reported in one paragraph and exit code 2."""
  try:
    remaining = flags.FLAGS(argv)
    if _CONFIG.value is not None:
      _CONFIG.value.keys()  # A config file that failed to load raises here.
  except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    text = ' '.join(str(e).replace('\\n', '\n').split())
    if isinstance(e, (AttributeError, KeyError)):
      bad = [a.split('=')[0] for a in argv if a.startswith('--config.')
             and a.split('=')[0].rsplit('.', 1)[-1] in text]
      suggestion = re.search(r'Did you mean "([\w.]+)"', text)
      _fail(f'{bad[0] if bad else "a --config flag"} is not a field of the config'
            + (f' (did you mean {bad[0].rsplit(".", 1)[0] if bad else "--config"}.'
               f'{suggestion.group(1)}?)' if suggestion else '')
            + '; the fields and their defaults are in transformer_jax/config.py '
            '(base_config).')
    _fail(f'invalid flags: {text[:600]}. Run with --helpfull for the flags.')
  if _CONFIG.value is None:
    _fail('--config is required, e.g. --config=configs/tiny.py.')
  if not _WORKDIR.value:
    _fail('--workdir is required: the directory for checkpoints and metrics.')
  return remaining


def _quiet_orbax(record) -> bool:
  """Drops orbax's INFO lines (dozens a save); its warnings and errors still show."""
  return record.levelno >= std_logging.WARNING or '/orbax/' not in record.pathname


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; every option is a --flag.')
  logging.get_absl_handler().addFilter(_quiet_orbax)
  if _DISTRIBUTED.value:
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         heartbeat_timeout_seconds=_HEARTBEAT.value)
  try:
    result = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, DatasetNotFoundError, bible_en_es.SwordModuleNotFoundError) as e:
    _fail(str(e))
  except trainer.NonFiniteError as e:
    print(f'train.py: stopped: {e}', file=sys.stderr)
    sys.exit(1)
  if result.stopped_early:
    logging.info('Stopped at step %d on request; the checkpoint is complete.',
                 int(result.state.step))


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)

"""The flags `evaluate.py` and `translate.py` share: which checkpoint, and how to search.

Defining them here, once, keeps the two commands' options and their checks identical.
Decoding options left unset fall back to the training run's config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

from absl import flags
from absl import logging

WORKDIR = flags.DEFINE_string('workdir', None, "A training run's work directory.")
STEP = flags.DEFINE_integer('step', None, 'The checkpoint step (default: the latest).')
AVERAGE_LAST = flags.DEFINE_integer(
    'average_last', 0, 'Average the parameters of the last N checkpoints (the paper: 5 for '
    'base, 20 for big); 0: no averaging.')
BEAM_SIZE = flags.DEFINE_integer('beam_size', None, 'Beam size; 1 is greedy search.')
LENGTH_PENALTY = flags.DEFINE_float('length_penalty', None, 'Length penalty alpha.')
LENGTH_PENALTY_FORM = flags.DEFINE_enum('length_penalty_form', None, ['gnmt', 'power'],
                                        'gnmt: ((5+|Y|)/6)^alpha; power: |Y|^alpha.')
EXTRA_LENGTH = flags.DEFINE_integer('max_decode_extra_length', None,
                                    'Output limit = source length + this.')
BATCH_SIZE = flags.DEFINE_integer('batch_size', None, 'Sentences decoded together.')
CACHE_DIR = flags.DEFINE_string('compilation_cache_dir', None,
                                'A persistent JAX compilation cache (reused across runs).')


def check(fail: Callable[[str], NoReturn]) -> None:
  """Checks the shared flags before anything heavy is imported; `fail` reports and exits.

  Unless --verbosity is given, logging is quiet (errors only) until `load_translator` has
  restored the checkpoint: orbax logs every restore at INFO and WARNING.
  """
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.ERROR)
  if not WORKDIR.value:
    fail('--workdir is required: the directory of a training run.')
  if not os.path.isdir(WORKDIR.value):
    fail(f'--workdir={WORKDIR.value} does not exist.')
  if STEP.value is not None and AVERAGE_LAST.value:
    fail('give --step or --average_last, not both.')
  if AVERAGE_LAST.value < 0:
    fail(f'--average_last={AVERAGE_LAST.value} must be >= 0.')


def load_translator(fail: Callable[[str], NoReturn]) -> tuple[Any, Any, list[int]]:
  """The translator of the chosen checkpoint (or average), with the flags' search options.

  Returns:
    (translator, checkpoint, steps), as `translator.load_translator`.
  """
  # Imported here so that flag errors are reported without loading JAX and TFDS.
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import translator  # pylint: disable=g-import-not-at-top
  from transformer_jax.config import ConfigError  # pylint: disable=g-import-not-at-top

  if CACHE_DIR.value:
    jax.config.update('jax_compilation_cache_dir', CACHE_DIR.value)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  try:
    loaded = translator.load_translator(
        WORKDIR.value, step=STEP.value, average_last=AVERAGE_LAST.value,
        beam_size=BEAM_SIZE.value, length_penalty=LENGTH_PENALTY.value,
        length_penalty_form=LENGTH_PENALTY_FORM.value,
        max_decode_extra_length=EXTRA_LENGTH.value, batch_size=BATCH_SIZE.value)
  except (FileNotFoundError, ValueError, ConfigError) as e:
    fail(str(e))
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  return loaded

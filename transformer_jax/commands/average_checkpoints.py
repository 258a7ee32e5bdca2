r"""Averages the parameters of the last N checkpoints into a new checkpoint.

  python average_checkpoints.py --workdir=$HOME/runs/ende_base \
      --output_workdir=$HOME/runs/ende_base_avg5 --num_checkpoints=5
  python evaluate.py --workdir=$HOME/runs/ende_base_avg5

The paper averages the last 5 checkpoints of the base model and the last 20 of the big one
(--num_checkpoints=0 takes the run's config.checkpoints_to_average). The result is
OUTPUT_WORKDIR/checkpoints/<last step>/ with the parameters and the run's config and
vocabulary, for evaluate.py and translate.py; it holds no optimizer state, so it cannot be
resumed and is never written into the training run's own directory.

Exit codes: 0 done; 1 an unexpected error; 2 a flag, work-directory or checkpoint problem
(explained in one paragraph; the traceback only with --verbose).
"""

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.storage import paths
from transformer_jax.storage.layout import RunLayout

_WORKDIR = flags.DEFINE_string('workdir', None, "The training run's work directory.")
_OUTPUT_WORKDIR = flags.DEFINE_string(
    'output_workdir', None, 'A new directory for the averaged checkpoint.'
)
_NUM = flags.DEFINE_integer(
    'num_checkpoints',
    0,
    "How many of the last checkpoints to average (0: the run's " 'config.checkpoints_to_average).',
)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if not _WORKDIR.value or not _OUTPUT_WORKDIR.value:
    cli.fail('--workdir and --output_workdir are required.')
  paths.check_input_directory(_WORKDIR.value, '--workdir', "a training run's work " 'directory')
  paths.check_output_directory(
      _OUTPUT_WORKDIR.value, '--output_workdir', {'--workdir': _WORKDIR.value}
  )
  if _NUM.value < 0:
    cli.fail(f'--num_checkpoints={_NUM.value} must be >= 1 (or 0 for the config default).')
  from transformer_jax.checkpoints import averaging
  from transformer_jax.checkpoints import checkpointing

  num = _NUM.value or int(
      checkpointing.read_meta(RunLayout.of(_WORKDIR.value).checkpoints)[0]['config'][
          'checkpoints_to_average'
      ]
  )
  path, steps = averaging.average_checkpoints(_WORKDIR.value, _OUTPUT_WORKDIR.value, num)
  print(f'Averaged steps {steps} into {path}')


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

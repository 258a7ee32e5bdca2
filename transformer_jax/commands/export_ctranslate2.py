r"""Exports a checkpoint as a CTranslate2 model directory.

  python export_ctranslate2.py --workdir=workdir/bible_en_es --step=best \
      --output_dir=bible-ct2 --quantization=int8
  python -c "import ctranslate2; t = ctranslate2.Translator('bible-ct2', device='cpu')"

OUTPUT_DIR gets model.bin, config.json and shared_vocabulary.json (what
`ctranslate2.Translator` loads), source.spm and target.spm (the SentencePiece models that
cut a text into its source pieces) and translate_options.json (how the run decodes, as
keyword arguments of `translate_batch`). Post- and pre-norm, sinusoidal, learned and rotary
positions and the target side's output vocabulary all export, and greedy translations are
this project's; ALiBi is refused, with the field named. --quantization stores the weights
as CTranslate2's int8, int8_float32, int8_float16, int8_bfloat16, int16, float16, bfloat16
or float32 (default: float32).

Exit codes: 0 done; 1 an unexpected error; 2 a flag, work directory or checkpoint problem
(explained in one paragraph; the traceback only with --verbose).
"""

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.storage import paths

_WORKDIR = flags.DEFINE_string('workdir', None, 'The run (or import) to export.')
_STEP = flags.DEFINE_string('step', None, "The checkpoint: a step, 'best', or the latest.")
_AVERAGE_LAST = flags.DEFINE_integer(
    'average_last', 0, 'Export the average of the last N checkpoints (0: one checkpoint).'
)
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'A new directory for the model.')
_QUANTIZATION = flags.DEFINE_string(
    'quantization',
    None,
    "The weights' type in CTranslate2: int8, int8_float32, int8_float16, int8_bfloat16, "
    'int16, float16, bfloat16 or float32 (default: float32).',
)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if not _WORKDIR.value or not _OUTPUT_DIR.value:
    cli.fail('--workdir and --output_dir are required.')
  paths.check_input_directory(
      _WORKDIR.value, '--workdir', 'the work directory of a run or an import'
  )
  paths.check_output_directory(
      _OUTPUT_DIR.value, '--output_dir', {'--workdir': _WORKDIR.value}, create=False
  )
  step = cli.parse_step(_STEP.value)
  if step is not None and _AVERAGE_LAST.value:
    cli.fail('give --step or --average_last, not both.')
  if _AVERAGE_LAST.value < 0:
    cli.fail(f'--average_last={_AVERAGE_LAST.value} must be >= 0.')
  from transformer_jax.checkpoints import loading
  from transformer_jax.interop import ctranslate2
  from transformer_jax.interop import marian

  marian.check_new_model_directory(_OUTPUT_DIR.value, 'model.bin')  # Before loading.
  ctranslate2.check_quantization(_QUANTIZATION.value)
  with cli.quiet_loading():  # Not the export's warnings, which come after.
    checkpoint = loading.load(_WORKDIR.value, step=step, average_last=_AVERAGE_LAST.value)
  path = ctranslate2.export_model(checkpoint, _OUTPUT_DIR.value, quantization=_QUANTIZATION.value)
  print(f'Exported {_WORKDIR.value} to {path}')


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

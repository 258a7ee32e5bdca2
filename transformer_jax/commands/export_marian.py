r"""Exports a checkpoint as a Hugging Face Marian model directory (and so to CTranslate2).

  python export_marian.py --workdir=workdir/bible_en_es --step=best --output_dir=bible-marian
  python -c "import transformers as t; m = t.MarianMTModel.from_pretrained('bible-marian')"
  ct2-transformers-converter --model bible-marian --output_dir bible-ct2

OUTPUT_DIR gets config.json, generation_config.json, model.safetensors, vocab.json,
source.spm, target.spm and tokenizer_config.json: what `MarianMTModel.from_pretrained`,
`MarianTokenizer.from_pretrained` and CTranslate2's converter read. Greedy translations are
this project's. Marian has no pre-norm and only sinusoidal positions: such a model is
refused, with the field named.

Exit codes: 0 done; 1 an unexpected error; 2 a flag, work directory or checkpoint problem
(explained in one paragraph; the traceback only with --verbose).
"""

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.storage import paths

_WORKDIR = flags.DEFINE_string('workdir', None, 'The run (or import) to export.')
_STEP = flags.DEFINE_string('step', None, "The checkpoint: a step, 'best', or the latest.")
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'A new directory for the model.')


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
  from transformer_jax.interop import marian

  path = marian.export_model(_WORKDIR.value, _OUTPUT_DIR.value, step=step)
  print(f'Exported {_WORKDIR.value} to {path}')


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

r"""Imports a Hugging Face Marian model (an OPUS-MT directory) as a checkpoint.

  python import_marian.py --model_dir=opus-mt-en-de --workdir=$HOME/runs/opus_en_de
  echo "Hello world." | python translate.py --workdir=$HOME/runs/opus_en_de
  python evaluate.py --workdir=$HOME/runs/opus_en_de --source_file=test.en \
      --reference_file=test.de
  python train.py --config=$HOME/runs/opus_en_de/finetune_config.py \
      --config.text_files.train=train.en,train.de --workdir=$HOME/runs/opus_en_de_tuned

MODEL_DIR is the directory Hugging Face's `save_pretrained` writes (what the Hub serves for
Helsinki-NLP/opus-mt-*): config.json, model.safetensors or pytorch_model.bin, source.spm,
target.spm, vocab.json. Nothing is downloaded. WORKDIR gets checkpoints/0/ (the parameters,
the config and the vocabulary, as any run's checkpoint), marian_vocab.json (the two
SentencePiece models and the id map) and finetune_config.py (train.py's config to fine-tune
it with `init_from`).

Exit codes: 0 done; 1 an unexpected error; 2 a flag, model directory or work directory
problem (explained in one paragraph; the traceback only with --verbose).
"""

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.storage import paths
from transformer_jax.storage import storage

_MODEL_DIR = flags.DEFINE_string(
    'model_dir', None, "A Hugging Face Marian model directory (save_pretrained's)."
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'A new work directory for the checkpoint.')


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if not _MODEL_DIR.value or not _WORKDIR.value:
    cli.fail('--model_dir and --workdir are required.')
  paths.check_input_directory(
      _MODEL_DIR.value, '--model_dir', "a Hugging Face Marian model directory (save_pretrained's)"
  )
  paths.check_output_directory(
      _WORKDIR.value, '--workdir', {'--model_dir': _MODEL_DIR.value}, create=False
  )
  from transformer_jax.interop import marian

  path = marian.import_model(_MODEL_DIR.value, _WORKDIR.value)
  config = f'{storage.resolve(_WORKDIR.value)}/{marian.FINETUNE_CONFIG_FILE}'
  if storage.is_remote(config):  # train.py reads config files from a local disk.
    print(
        f'Imported {_MODEL_DIR.value} as {path}; fine-tune it with the config file {config} '
        f'(copy it first: gcloud storage cp {config} .)'
    )
  else:
    print(f'Imported {_MODEL_DIR.value} as {path}; fine-tune it with --config={config}')


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

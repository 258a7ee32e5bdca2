"""`python import_marian.py --help`: the command is transformer_jax/commands/import_marian.py
(installed as `transformer-jax-import-marian`)."""

from transformer_jax.commands import import_marian

if __name__ == '__main__':
  import_marian.run()

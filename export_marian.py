"""`python export_marian.py --help`: the command is transformer_jax/commands/export_marian.py
(installed as `transformer-jax-export-marian`)."""

from transformer_jax.commands import export_marian

if __name__ == '__main__':
  export_marian.run()

"""`python prepare_data.py --help`: the command is transformer_jax/commands/prepare_data.py
(installed as `transformer-jax-prepare-data`)."""

from transformer_jax.commands import prepare_data

if __name__ == '__main__':
  prepare_data.run()

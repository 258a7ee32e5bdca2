"""`python average_checkpoints.py --help`: the command is
transformer_jax/commands/average_checkpoints.py (installed as
`transformer-jax-average-checkpoints`)."""

from transformer_jax.commands import average_checkpoints

if __name__ == '__main__':
  average_checkpoints.run()

"""`python train.py --help`: the command is transformer_jax/commands/train.py (installed as
`transformer-jax-train`)."""

from transformer_jax.commands import train

if __name__ == '__main__':
  train.run()

"""`python evaluate.py --help`: the command is transformer_jax/commands/evaluate.py (installed as
`transformer-jax-evaluate`)."""

from transformer_jax.commands import evaluate

if __name__ == '__main__':
  evaluate.run()

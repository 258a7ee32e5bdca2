"""`python score.py --help`: the command is transformer_jax/commands/score.py (installed as
`transformer-jax-score`)."""

from transformer_jax.commands import score

if __name__ == '__main__':
  score.run()

"""`python rerank.py --help`: the command is transformer_jax/commands/rerank.py (installed as
`transformer-jax-rerank`)."""

from transformer_jax.commands import rerank

if __name__ == '__main__':
  rerank.run()

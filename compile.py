"""`python compile.py --help`: the command is transformer_jax/commands/compile.py (installed as
`transformer-jax-compile`)."""

from transformer_jax.commands import compile

if __name__ == '__main__':
  compile.run()

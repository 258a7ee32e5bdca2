"""`python translate.py --help`: the command is transformer_jax/commands/translate.py (installed as
`transformer-jax-translate`)."""

from transformer_jax.commands import translate

if __name__ == '__main__':
  translate.run()

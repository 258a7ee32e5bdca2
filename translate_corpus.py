"""`python translate_corpus.py --help`: the command is transformer_jax/commands/translate_corpus.py
(installed as `transformer-jax-translate-corpus`)."""

from transformer_jax.commands import translate_corpus

if __name__ == '__main__':
  translate_corpus.run()

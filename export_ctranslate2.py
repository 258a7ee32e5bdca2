"""`python export_ctranslate2.py --help`: the command is
transformer_jax/commands/export_ctranslate2.py (installed as
`transformer-jax-export-ctranslate2`)."""

from transformer_jax.commands import export_ctranslate2

if __name__ == '__main__':
  export_ctranslate2.run()

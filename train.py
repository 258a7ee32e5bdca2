"""`python train.py --help`: the command is transformer_jax/commands/train.py (installed as
`transformer-jax-train`)."""

from transformer_jax.commands import starting

starting.stop_on_sigterm()  # Before the heavy imports: a SIGTERM while starting ends cleanly.

from transformer_jax.commands import train  # noqa: E402

if __name__ == '__main__':
  train.run()

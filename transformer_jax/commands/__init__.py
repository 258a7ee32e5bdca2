"""The commands, one module each: `train`, `evaluate`, `translate`, `prepare_data`,
`average_checkpoints`, `compile`.

Each defines its flags and `main(argv)`, and `run()` runs it under `cli.run`'s error policy.
They are installed as console scripts (`transformer-jax-train`, ...; see pyproject.toml) and
reached from a checkout through the top-level scripts (`python train.py`, ...).
"""

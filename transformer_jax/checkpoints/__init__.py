"""Orbax checkpoints of a run (`checkpointing`), their averages (`averaging`) and a checkpoint
made ready for inference (`loading`)."""

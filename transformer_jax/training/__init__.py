"""Training: a whole run config checked (`config_checks`), the optimizer and schedule
(`optimizer`), the jitted train and eval steps (`train_steps`), the loop (`train_loop`) and
its metrics (`metrics_writer`)."""

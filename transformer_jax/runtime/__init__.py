"""Where a program runs: the device mesh and shardings (`partitioning`), the processes of a
multi-host job (`multihost`) and the host memory XLA:CPU keeps (`host_memory`)."""

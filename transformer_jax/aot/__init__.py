"""Compiling for hardware this machine lacks: TPU slices and GPU hosts (`aot`, with the GPU
target configs in `gpu_targets/`), the environment that has their compilers (`aot_env`), and
a compiled program's HLO read by kind (`hlo_view`)."""

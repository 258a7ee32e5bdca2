"""Host memory: keep XLA:CPU's per-step scratch memory mapped from one step to the next.

XLA:CPU gives every call of a compiled step one temporary buffer (hundreds of MB for the main
job's train step, `compiled.memory_analysis().temp_size_in_bytes`), mallocs it from one of its
own threads and frees it when the call ends. glibc's malloc serves a block that large from a
thread's arena with a fresh `mmap` and returns it with `munmap`, so the kernel zero-fills it
page by page, on first touch, in every step: a page fault a page, a large share of the step's
time on a CPU (bench/RESULTS.md, section "CPU training: the main job's size and base"). PyTorch's
CPU steps reuse their
memory and pay nothing of the kind.

`retain_freed_memory` tells glibc to keep such blocks: one arena (the main one, which grows
with `brk` rather than fresh mappings), blocks up to 2 GiB from it rather than from `mmap`, and
no trimming of its top. The freed scratch buffer then stays mapped, and the next step reuses it
with no page fault. The process keeps its peak resident memory until it exits, which a training
or evaluation process reaches anyway in its first step.

It applies only where JAX will run on the CPU (no accelerator plugin installed, or
`JAX_PLATFORMS=cpu`), on glibc, and before JAX starts its threads (a thread keeps the arena of
its first allocation). `TRANSFORMER_JAX_MALLOC=system` leaves glibc's defaults (`retain`, or
unset, applies them). tcmalloc
(`LD_PRELOAD`) also removes the page faults, but only for processes started with it; this
needs nothing installed and works for every command and the bench alike.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform

from transformer_jax import errors

ENV_VAR = 'TRANSFORMER_JAX_MALLOC'

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1  # mallopt takes an int.

# JAX's accelerator plugins: where one is installed, JAX's default backend is not the CPU.
_ACCELERATOR_MODULES = (
    'libtpu',
    'jax_cuda12_plugin',
    'jax_cuda13_plugin',
    'jax_rocm60_plugin',
    'jax_rocm7_plugin',
    'jax_plugins.xla_cuda12',
    'jax_plugins.xla_cuda13',
)


def _runs_on_cpu() -> bool:
  platforms = os.environ.get('JAX_PLATFORMS', '').strip()
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  for name in _ACCELERATOR_MODULES:
    try:
      if importlib.util.find_spec(name) is not None:
        return False
    except (ImportError, ValueError):
      continue
  return True


def retain_freed_memory() -> bool:
  """Sets glibc's malloc to keep large freed blocks for reuse (see the module doc).

  Call it before JAX's first computation. Returns whether the settings were applied: False
  with `TRANSFORMER_JAX_MALLOC=system`, off glibc, or where JAX will run on an accelerator.

  Raises:
    errors.ConfigError: `TRANSFORMER_JAX_MALLOC` is neither unset, 'retain' nor 'system'.
  """
  choice = os.environ.get(ENV_VAR, '').strip().lower()
  if choice not in ('', 'retain', 'system'):
    raise errors.ConfigError(
        f'{ENV_VAR}={os.environ[ENV_VAR]!r} is not one of retain (the default: keep freed '
        "memory for reuse), system (glibc's defaults); set one or unset it."
    )
  if choice == 'system':
    return False
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc' or not _runs_on_cpu():
    return False
  try:
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  return all(
      mallopt(param, value) == 1
      for param, value in (
          (_M_ARENA_MAX, 1),
          (_M_MMAP_THRESHOLD, _INT_MAX),
          (_M_TRIM_THRESHOLD, _INT_MAX),
      )
  )

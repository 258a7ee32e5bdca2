r"""Makes the environment that compile.py needs to compile for a TPU slice or a GPU host.

  python -m transformer_jax.aot.aot_env ~/.venv-aot          # once (about 2 GB of wheels)
  ~/.venv-aot/bin/python -m transformer_jax.commands.compile --config=tiny --topology=v5e-8

The environment is a virtual environment that sees this Python's packages (this package
included, however it was installed) plus the compile-only wheels of the installed jax's exact
version: libtpu, the CUDA 12 PJRT plugin, and the cuDNN library, which JAX asks for its
version when it traces cuDNN attention even for an absent GPU (only that library: its cuBLAS
and NVRTC dependencies, about 1 GB, are not needed to compile). It is kept apart because with
libtpu installed every JAX program probes for a TPU when it starts. Running it again updates
the wheels in place. `bash scripts/setup.sh --aot` runs it for a checkout's .venv-aot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv

# Only the library JAX asks for, without its dependencies.
CUDNN = 'nvidia-cudnn-cu12>=9.8,<10'


def wheels(jax_version: str) -> list[str]:
  """The compile-only wheels for `jax_version` (they must match it exactly)."""
  return [
      f'jax[tpu]=={jax_version}',
      f'jax-cuda12-plugin=={jax_version}',
      f'jax-cuda12-pjrt=={jax_version}',
  ]


def python_of(directory: str) -> str:
  return os.path.join(directory, 'bin', 'python')


def make(directory: str, jax_version: str) -> str:
  """Makes (or updates) the environment in `directory`; returns its Python."""
  if not os.path.exists(python_of(directory)):
    venv.create(directory, system_site_packages=True, with_pip=True)
  pip = [python_of(directory), '-m', 'pip', 'install', '-q', '--disable-pip-version-check']
  subprocess.run([*pip, *wheels(jax_version)], check=True)
  subprocess.run([*pip, '--no-deps', CUDNN], check=True)
  return python_of(directory)


def main(argv: list[str]) -> int:
  if len(argv) != 2 or argv[1].startswith('-'):
    asked = len(argv) == 2 and argv[1] in ('-h', '--help')
    print(
        f'usage: python -m transformer_jax.aot.aot_env DIRECTORY\n\n{__doc__}',
        file=sys.stdout if asked else sys.stderr,
    )
    return 0 if asked else 2
  from importlib import metadata

  jax_version = metadata.version('jax')
  directory = os.path.abspath(os.path.expanduser(argv[1]))
  try:
    python = make(directory, jax_version)
  except (OSError, subprocess.CalledProcessError) as e:
    print(
        f'aot_env: could not make the compile environment in {directory} ({e}); pip '
        f'needs the network (PyPI) and about 2 GB of disk. Nothing else was changed.',
        file=sys.stderr,
    )
    return 1
  print(
      f'The compile environment for jax {jax_version} is ready: {python} -m '
      'transformer_jax.commands.compile --config=... --topology=...'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))

#!/usr/bin/env bash
# Sets up a fresh machine: the Debian packages of the offline Bible corpus and this package
# (pip install -e, see pyproject.toml) with its dependencies. `--test` also installs the
# test extra (pytest and a CPU build of PyTorch), the Debian packages of the local SLURM
# cluster the launcher tests start (scripts/local_slurm.sh), and
# does what `--aot` does. `--aot` makes .venv-aot, an environment that sees the installed
# packages plus the compile-only wheels of compile.py (libtpu, the CUDA PJRT plugin, and the
# cuDNN library, which JAX asks for its version when it traces cuDNN attention even for an
# absent GPU): kept apart because with libtpu installed every JAX program probes for a TPU
# when it starts.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
if [ "$mode" != "--aot" ]; then
  bash scripts/setup_bible.sh
  # The package itself (editable: the checkout is what runs) with TensorBoard's viewer, or
  # with the test extra; requirements.txt pins the versions CI tests.
  extras=tensorboard
  if [ "$mode" = "--test" ]; then
    extras=test,tensorboard
    # SLURM, munge and Open MPI: tests/test_launchers.py starts a one-node cluster of them.
    bash scripts/local_slurm.sh install
  fi
  python -m pip install -q --disable-pip-version-check -c requirements.txt -e ".[$extras]"
fi
if [ "$mode" = "--aot" ] || [ "$mode" = "--test" ]; then
  # The wheels must be of the installed jax's exact version.
  jax_version="$(python -c 'import jax; print(jax.__version__)')"
  if [ ! -x .venv-aot/bin/python ]; then
    python -m venv --system-site-packages .venv-aot
  fi
  .venv-aot/bin/python -m pip install -q --disable-pip-version-check \
    "jax[tpu]==$jax_version" "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version"
  # Only the library JAX asks for; its cuBLAS and NVRTC dependencies (1 GB) are not needed to
  # compile.
  .venv-aot/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    'nvidia-cudnn-cu12>=9.8,<10'
fi

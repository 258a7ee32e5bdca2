#!/usr/bin/env bash
# Sets up a fresh machine: the Debian packages of the offline Bible corpus and this package
# (pip install -e, see pyproject.toml) with its dependencies. `--test` also installs the
# test extra (pytest and a CPU build of PyTorch), the Debian packages of the local SLURM
# cluster the launcher tests start (scripts/local_slurm.sh), and
# does what `--aot` does. `--aot` makes .venv-aot, an environment that sees the installed
# packages plus the compile-only wheels of compile.py
# (`python -m transformer_jax.aot.aot_env`,
# the same way an installed package's user makes one).
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
    # SLURM, munge and Open MPI: tests/runtime/test_launchers.py starts a one-node cluster of them.
    bash scripts/local_slurm.sh install
  fi
  # pip resolves for about 10 s even when nothing is missing: ask first (scripts/installed.py).
  if python scripts/installed.py "$extras" 2>/dev/null; then
    echo "Python packages present: this checkout and requirements.txt's versions ($extras)"
  else
    python -m pip install -q --disable-pip-version-check -c requirements.txt -e ".[$extras]"
  fi
fi
if [ "$mode" = "--aot" ] || [ "$mode" = "--test" ]; then
  # The wheels of the installed jax's exact version (transformer_jax/aot/aot_env.py says which).
  python -m transformer_jax.aot.aot_env .venv-aot
fi

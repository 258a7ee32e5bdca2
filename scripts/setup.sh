#!/usr/bin/env bash
# Sets up a fresh machine: the Debian packages of the offline Bible corpus and the Python
# packages. `--test` also installs the test-only dependencies (a CPU build of PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_bible.sh
requirements=requirements.txt
if [ "${1:-}" = "--test" ]; then
  requirements=requirements-test.txt
fi
python -m pip install -q --disable-pip-version-check -r "$requirements"

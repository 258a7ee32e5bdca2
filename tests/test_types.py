"""The type check: mypy over the package, as pyproject.toml's [tool.mypy] configures it.

`python -m mypy` from the checkout checks every module of `transformer_jax/` against its
annotations and the annotations of the typed libraries it calls (jax, flax, numpy, ...); the
untyped ones (ml_collections, optax, orbax, grain, ...) are Any there. The modules that had
type errors when the check started are in one `ignore_errors` override of pyproject.toml, and
that list only shrinks: it must stay within `KNOWN_ERRORS` below, and each module on it must
still have an error. A new error is fixed where mypy reports it (`python -m mypy` shows it, with
its line), never held by adding its module to the list; fixing a listed module's last error
means taking it off both lists. The cache is mypy's own `.mypy_cache/` in the checkout (git
ignores it), shared with `python -m mypy` run by hand. The mypy run is in the slow tier: from
an empty cache (a fresh clone, as CI starts, or a new mypy) mypy first reads the libraries'
annotations, tens of seconds of one core, which the quick tier's budget has no room for; from
a warm cache it takes a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

import train_testlib

REPO = train_testlib.REPO

# The modules whose type errors are held (pyproject.toml, the `ignore_errors` override), as they
# were when the check started. Only take names off: never add one.
KNOWN_ERRORS = (
    'transformer_jax.aot.aot',
    'transformer_jax.aot.hlo_view',
    'transformer_jax.checkpoints.checkpointing',
    'transformer_jax.commands.cli',
    'transformer_jax.commands.evaluate',
    'transformer_jax.commands.prepare_data',
    'transformer_jax.commands.translate',
    'transformer_jax.data.bible_corpus',
    'transformer_jax.data.data_sources',
    'transformer_jax.data.prefetch',
    'transformer_jax.data.token_store',
    'transformer_jax.decoding.decode',
    'transformer_jax.decoding.evaluation',
    'transformer_jax.errors',
    'transformer_jax.interop.marian',
    'transformer_jax.model.attention',
    'transformer_jax.model.config',
    'transformer_jax.model.kernels.dot_product_attention',
    'transformer_jax.model.kernels.fused_norm',
    'transformer_jax.model.models',
    'transformer_jax.runtime.multihost',
    'transformer_jax.runtime.partitioning',
    'transformer_jax.storage.storage',
    'transformer_jax.storage.workdir_lock',
    'transformer_jax.training.metrics_writer',
    'transformer_jax.training.train_loop',
    'transformer_jax.training.train_steps',
)

_HOW_TO_FIX = (
    'Fix the error where mypy reports it (an annotation that says what the code does, a check'
    ' for None, a cast only where mypy cannot follow); `python -m mypy` from the checkout shows'
    ' each one with its line. Do not add its module to the ignore_errors list in pyproject.toml:'
    ' that list holds the errors the check started with and only shrinks.'
)


def _mypy_config() -> dict:
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    return tomllib.load(f)['tool']['mypy']


def _is_held(override: dict) -> bool:
  return override.get('ignore_errors') is True


def held_modules(config: dict) -> list[str]:
  """The modules of the `ignore_errors` override(s) of a [tool.mypy] table."""
  modules = []
  for override in config.get('overrides', []):
    if _is_held(override):
      module = override['module']
      modules += [module] if isinstance(module, str) else module
  return modules


def _toml(value) -> str:
  """A TOML value of the kinds [tool.mypy] holds (JSON's strings and lists are TOML's)."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  return json.dumps(value)


def config_without_held(config: dict) -> str:
  """A pyproject-style TOML text of `config` less its `ignore_errors` override(s)."""
  lines = ['[tool.mypy]']
  lines += [f'{key} = {_toml(v)}' for key, v in config.items() if key != 'overrides']
  for override in config.get('overrides', []):
    if not _is_held(override):
      lines += ['', '[[tool.mypy.overrides]]']
      lines += [f'{key} = {_toml(v)}' for key, v in override.items()]
  return '\n'.join(lines) + '\n'


def modules_with_errors(output: str) -> set[str]:
  """The package modules that mypy's output reports an error in."""
  found = set()
  for match in re.finditer(r'^(transformer_jax/[^:]+)\.py:\d+: error:', output, re.MULTILINE):
    module = match.group(1).replace('/', '.')
    found.add(module.removesuffix('.__init__'))
  return found


def _mypy(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, '-m', 'mypy', *args],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=900,
  )


def test_the_held_errors_only_shrink():
  held = held_modules(_mypy_config())
  assert held, 'no ignore_errors override in [tool.mypy] of pyproject.toml: read at all?'
  added = sorted(set(held) - set(KNOWN_ERRORS))
  assert not added, (
      f'pyproject.toml holds the type errors of {", ".join(added)}, which the check started'
      f' without. {_HOW_TO_FIX}'
  )


@pytest.mark.slow
def test_mypy_finds_no_error_and_each_held_module_still_has_one(tmp_path):
  result = _mypy()
  report = result.stdout[-5000:] + result.stderr[-2000:]
  assert result.returncode == 0, f'mypy found type errors:\n{report}\n{_HOW_TO_FIX}'
  # Again without the held modules' override, to see which of them still have errors: the
  # same cache, only those modules checked again.
  config = tmp_path / 'pyproject.toml'
  config.write_text(config_without_held(_mypy_config()), encoding='utf-8')
  unheld = _mypy('--config-file', str(config))
  assert unheld.returncode in (0, 1), unheld.stdout[-5000:] + unheld.stderr[-2000:]
  failing = modules_with_errors(unheld.stdout)
  held = held_modules(_mypy_config())
  assert failing <= set(
      held
  ), (  # The first run passed: mypy read another config.
      f'mypy without the override found errors in {sorted(failing - set(held))}'
  )
  clean = sorted(set(held) - failing)
  assert not clean, (
      f'{", ".join(clean)} now type-check: take them off the ignore_errors list in'
      ' pyproject.toml and off KNOWN_ERRORS in tests/test_types.py, so that they stay clean.'
  )


def test_the_reading_of_config_and_output():
  config = {
      'files': ['transformer_jax'],
      'check_untyped_defs': True,
      'overrides': [
          {'module': ['tqdm.*'], 'ignore_missing_imports': True},
          {'module': ['transformer_jax.a', 'transformer_jax.b.c'], 'ignore_errors': True},
          {'module': 'transformer_jax.d', 'ignore_errors': True},
      ],
  }
  assert held_modules(config) == ['transformer_jax.a', 'transformer_jax.b.c', 'transformer_jax.d']
  without = tomllib.loads(config_without_held(config))['tool']['mypy']
  assert without == {**config, 'overrides': config['overrides'][:1]}
  output = (
      'transformer_jax/b/c.py:3: error: Incompatible types  [assignment]\n'
      'transformer_jax/b/c.py:4: note: See https://mypy.readthedocs.io\n'
      'transformer_jax/e/__init__.py:9: error: Name "x" is not defined  [name-defined]\n'
      'transformer_jax/f.py:1: note: only a note\n'
      'Found 2 errors in 2 files (checked 3 source files)\n'
  )
  assert modules_with_errors(output) == {'transformer_jax.b.c', 'transformer_jax.e'}

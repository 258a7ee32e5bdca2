"""The style checks, over the whole checkout, so that the README's one test command checks the
style too: ruff (lint and import order, [tool.ruff] in pyproject.toml) and pyink (the
formatter, [tool.pyink])."""

import subprocess
import sys

import train_testlib


def test_ruff_finds_nothing():
  result = subprocess.run(
      [sys.executable, '-m', 'ruff', 'check', '--no-cache', '--output-format=concise', '.'],
      cwd=train_testlib.REPO,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, (
      'ruff check found style problems (fix them, or `ruff check --fix .`):\n'
      + result.stdout[-5000:]
      + result.stderr[-2000:]
  )


def test_pyink_leaves_every_file_as_it_is():
  result = subprocess.run(
      [sys.executable, '-m', 'pyink', '--check', '--quiet', '.'],
      cwd=train_testlib.REPO,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, (
      'pyink would reformat these files (run `pyink .`):\n'
      + result.stdout[-5000:]
      + result.stderr[-2000:]
  )

"""Fixtures shared by the test modules (pytest.ini puts this directory on sys.path)."""

from __future__ import annotations

import pytest

from test_translator import build_test_run


@pytest.fixture(scope='session')
def run_dir(tmp_path_factory) -> str:
  """The work directory of the tiny trained translation model (trained once a session)."""
  return build_test_run(str(tmp_path_factory.getbasetemp() / 'translator_test_run'))

"""Fixtures shared by the test modules (pytest.ini puts this directory on sys.path)."""

from __future__ import annotations

import os

import pytest

from test_translator import build_test_run


@pytest.fixture(scope='session')
def run_dir(tmp_path_factory) -> str:
  """The work directory of the tiny trained translation model (trained once a session)."""
  return build_test_run(str(tmp_path_factory.getbasetemp() / 'translator_test_run'))


@pytest.fixture(scope='session')
def gcs_server():
  """A real Cloud Storage server on 127.0.0.1 (`gcs_testlib`), for this session; every client
  here and in the commands the tests start talks to it. A server that cannot start fails the
  tests that need it (no skip)."""
  import gcs_testlib  # pylint: disable=g-import-not-at-top
  server = gcs_testlib.start()
  saved = {name: os.environ.get(name) for name in gcs_testlib.ENV_NAMES}
  os.environ.update(gcs_testlib.environment(server.url))
  try:
    yield server
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    server.stop()


@pytest.fixture
def bucket(gcs_server) -> str:
  """A new empty bucket of `gcs_server`: its gs:// URL."""
  return gcs_server.create_bucket()

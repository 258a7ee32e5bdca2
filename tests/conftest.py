"""Fixtures shared by the test modules (pytest.ini puts this directory on sys.path)."""

from __future__ import annotations

import os

import jax
import pytest

import train_testlib
from test_translator import build_test_run


# Fixtures that start a service or train a model: a test that uses one is slow (pytest.ini).
SLOW_FIXTURES = frozenset({'run_dir', 'gcs_server', 'bucket', 'cluster',
                           'multihost_reference'})


def pytest_configure(config):
  """Keeps what the tests compile in JAX's persistent compilation cache, in pytest's cache
  directory (`--cache-clear` empties it): a rerun after a change compiles only the programs
  the change touched, and parallel workers (`-n`) share what the other compiled. Programs
  are keyed by their HLO and compile options, so a changed program is never read back.
  Commands the tests run in subprocesses compile on their own."""
  cache = getattr(config, 'cache', None)  # None under -p no:cacheprovider.
  if cache is not None and jax.config.jax_compilation_cache_dir is None:
    jax.config.update('jax_compilation_cache_dir', str(cache.mkdir('jax_compilation_cache')))
    # An eager operation compiles in ~65 ms, below JAX's default threshold of 1 s.
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def pytest_collection_modifyitems(items):
  """Refuses a test that uses a slow fixture without the slow mark: the quick tier
  (-m "not slow") would start the service or train the model after all."""
  unmarked = [item.nodeid for item in items if SLOW_FIXTURES & set(item.fixturenames)
              and item.get_closest_marker('slow') is None]
  if unmarked:
    raise pytest.UsageError(
        'These tests use a fixture that starts a service or trains a model '
        f'({", ".join(sorted(SLOW_FIXTURES))}) but are not marked slow; add '
        '@pytest.mark.slow (docs/developing.md, the tiers):\n  ' + '\n  '.join(unmarked))


@pytest.fixture(scope='session')
def run_dir(tmp_path_factory) -> str:
  """The work directory of the tiny trained translation model (trained once a session)."""
  return build_test_run(str(tmp_path_factory.getbasetemp() / 'translator_test_run'))


@pytest.fixture(scope='session')
def multihost_config(tmp_path_factory) -> str:
  """The config file of the multi-process tests (test_multihost, test_launchers): 8 steps, a
  checkpoint every 4."""
  return train_testlib.multihost_config(tmp_path_factory.mktemp('multihost'),
                                        train_testlib.MULTIHOST_STEPS)


@pytest.fixture(scope='session')
def multihost_reference(multihost_config, tmp_path_factory) -> str:
  """The work directory of `multihost_config` trained by one process with 8 devices: what a
  job of several processes must reproduce."""
  workdir = str(tmp_path_factory.mktemp('one_process') / 'run')
  done = train_testlib.run_train(multihost_config, workdir, devices=8)
  assert done.returncode == 0, done.stderr[-3000:]
  return workdir


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

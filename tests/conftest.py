"""Fixtures shared by the test modules (pytest.ini puts this directory on sys.path)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import sys

import pytest

# Before anything compiles, for every program the tests compile, in this process and in the
# commands they start (which inherit XLA_FLAGS): LLVM's optimization off, XLA:CPU's elemental
# emitters instead of its MLIR fusion emitters, and each program's machine code made as one
# LLVM module (the cores are busy with other tests' work, so splitting it across threads
# only adds work). The HLO programs, and so what the tests check, are unchanged; the machine
# code is less tuned and compiles in much less CPU time (bench/RESULTS.md, section "Test suite").
# Both sides of every comparison are compiled alike, here or in a
# subprocess.
os.environ['XLA_FLAGS'] = ' '.join(
    [
        *os.environ.get('XLA_FLAGS', '').split(),
        '--xla_backend_optimization_level=0',
        '--xla_cpu_use_fusion_emitters=false',
        '--xla_cpu_parallel_codegen_split_count=1',
    ]
)


# Fixtures that start a service or train a model: a test that uses one is slow (pytest.ini).
SLOW_FIXTURES = frozenset(
    {'run_dir', 'finished_run', 'gcs_server', 'bucket', 'cluster', 'multihost_reference'}
)


def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pytest.ini): a worker a core for the quick tier, whose tests keep the cores
  busy compiling; one more for the whole suite, whose slow tests also wait (on SLURM's
  time-limit sweep, on Cloud Storage retries, on subprocesses starting), which a third
  worker fills on 2 cores (bench/RESULTS.md, section "Test suite")."""
  cores = (
      len(os.sched_getaffinity(0))
      if hasattr(os, 'sched_getaffinity')  # Linux
      else os.cpu_count() or 1
  )
  quick = 'not slow' in (config.option.markexpr or '')
  return cores if quick else cores + 1


def pytest_configure(config):
  """Keeps what the tests compile in JAX's persistent compilation cache, in pytest's cache
  directory (`--cache-clear` empties it): a rerun after a change compiles only the programs
  the change touched, and parallel workers (`-n`) share what the other compiled. Programs
  are keyed by their HLO and compile options, so a changed program is never read back.
  Commands the tests run in subprocesses compile on their own."""
  if getattr(config.option, 'dist', 'no') != 'no' and not hasattr(config, 'workerinput'):
    return  # xdist's controller, which runs no test: it starts the workers without JAX.
  import jax

  cache = getattr(config, 'cache', None)  # None under -p no:cacheprovider.
  if cache is not None and jax.config.jax_compilation_cache_dir is None:
    jax.config.update('jax_compilation_cache_dir', str(cache.mkdir('jax_compilation_cache')))
    # An eager operation compiles in well under JAX's default threshold of 1 s, and the tests
    # compile thousands (bench/RESULTS.md, section "Where the time goes, by file").
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


# The files that took longest in the last measured whole run (bench/RESULTS.md, section "Test
# suite"), longest first, except that the three files that mostly wait on a service (SLURM,
# Cloud Storage) do not all start together: test_bench, which keeps a core busy, starts beside two
# of them and test_two_hosts when a worker is free, so the cores do not idle while three workers
# wait at once. The workers take whole files (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`; xdist would otherwise start with the files of most tests, the quick
# ones), so these start first and no long file is left to run alone at the end. A file not named
# here runs after them, in name order; a stale order costs time, never a result. test_model_options
# and test_decode are placed for the quick tier, where they are longest; test_resume and
# test_multihost, which wait on the subprocesses they kill, before the quick files that end the run.
LONGEST_FIRST = (
    'test_launchers',
    'test_gcs',
    'test_bench',
    'test_two_hosts',
    'test_cli',
    'test_aot',
    'test_types',
    'test_docs',
    'test_marian',
    'test_models',
    'test_ctranslate2',
    'test_model_options',
    'test_translate_cli',
    'test_train',
    'test_translator',
    'test_translate_corpus',
    'test_resume',
    'test_fault_campaign',
    'test_multihost',
    'test_decode',
    'test_sharding',
)


def pytest_collection_modifyitems(items):
  """Puts the longest files first (LONGEST_FIRST). Refuses a test that uses a slow fixture
  without the slow mark: the quick tier (-m "not slow") would start the service or train the
  model after all."""

  def rank(item):
    name = item.path.stem
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

  items.sort(key=rank)  # Stable: a file's tests keep their order.
  unmarked = [
      item.nodeid
      for item in items
      if SLOW_FIXTURES & set(item.fixturenames) and item.get_closest_marker('slow') is None
  ]
  if unmarked:
    raise pytest.UsageError(
        'These tests use a fixture that starts a service or trains a model '
        f'({", ".join(sorted(SLOW_FIXTURES))}) but are not marked slow; add '
        '@pytest.mark.slow (docs/developing.md, the tiers):\n  ' + '\n  '.join(unmarked)
    )


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
  """An xdist worker leaves here without tearing down the interpreter. By now it has run
  every fixture's finalizer (services stopped, files released) and sent its results
  (pytest_sessionfinish), so all that is left is JAX's exit handler and the interpreter's
  teardown freeing every program the worker compiled: seconds of CPU a worker, which the
  controller waits for before it reports (bench/RESULTS.md, section "The quick tier")."""
  if hasattr(config, 'workerinput'):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access


@contextlib.contextmanager
def made_once(tmp_path_factory, name: str):
  """A directory `name` that every worker of this run (`-n`) shares, held under a lock while
  the caller makes its contents: the first worker makes them, the others wait and find them
  made (the caller checks for its own completion marker). Without xdist, this session's."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    base = base.parent  # pytest-N/, the parent of every worker's popen-gwN/.
  path = pathlib.Path(base, name)
  path.mkdir(exist_ok=True)
  with open(base / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield path


@pytest.fixture(scope='session')
def run_dir(tmp_path_factory) -> str:
  """The work directory of the tiny trained translation model (trained once a run)."""
  from test_translator import build_test_run

  with made_once(tmp_path_factory, 'translator_test_run') as root:
    return build_test_run(str(root))


@pytest.fixture(scope='session')
def multihost_config(tmp_path_factory) -> str:
  """The config file of the multi-process tests (test_multihost, test_launchers, test_gcs):
  8 steps, a checkpoint every 4."""
  import train_testlib

  with made_once(tmp_path_factory, 'multihost') as directory:
    path = directory / 'config.py'
    if not path.exists():
      train_testlib.multihost_config(directory, train_testlib.MULTIHOST_STEPS)
    return str(path)


@pytest.fixture(scope='session')
def multihost_reference(multihost_config, tmp_path_factory) -> str:
  """The work directory of `multihost_config` trained by one process with 8 devices: what a
  job of several processes must reproduce (trained once a run)."""
  import train_testlib

  with made_once(tmp_path_factory, 'one_process') as directory:
    workdir, done_marker = directory / 'run', directory / 'DONE'
    if not done_marker.exists():
      done = train_testlib.run_train(multihost_config, str(workdir), devices=8)
      assert done.returncode == 0, done.stderr[-3000:]
      done_marker.touch()
    return str(workdir)


@pytest.fixture(scope='session')
def gcs_server():
  """A real Cloud Storage server on 127.0.0.1 (`gcs_testlib`), for this session; every client
  here and in the commands the tests start talks to it. A server that cannot start fails the
  tests that need it (no skip)."""
  import gcs_testlib

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

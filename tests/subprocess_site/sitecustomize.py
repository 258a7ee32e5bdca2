"""Run at the start of every Python process the tests start (`train_testlib.subprocess_env`
puts this directory first on PYTHONPATH): lets every process of a multi-process job write
what it compiles to JAX's persistent compilation cache, not process 0 alone.

JAX writes cache entries from process 0 only, expecting every process of a job to look up
the same keys. On the CPU they do not: a key includes the fingerprint of the process's
device topology, which differs between processes, so process 1 of every two-process test
job missed every program and compiled them all again, with process 0 waiting at the first
collective (bench/RESULTS.md, section "Test suite"). With this, process 1's programs
are cached under its own keys and later jobs load them as process 0 does. What is compiled,
and so what the tests check, is the same; a JAX without the hook point is left as it is.
Another sitecustomize further along the path still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
_MODULE = 'jax._src.compiler'


def _write_from_every_process(compiler) -> None:
  """Replaces `compiler._cache_write` with a copy that sees process 0 where it checks."""
  original = getattr(compiler, '_cache_write', None)
  if (
      not isinstance(original, types.FunctionType)
      or 'distributed' not in original.__code__.co_names
  ):
    return
  names = dict(original.__globals__)
  names['distributed'] = types.SimpleNamespace(global_state=types.SimpleNamespace(process_id=0))
  compiler._cache_write = types.FunctionType(
      original.__code__, names, original.__name__, original.__defaults__, original.__closure__
  )


class _Finder(importlib.abc.MetaPathFinder):
  """Patches `jax._src.compiler` once it has been executed."""

  def find_spec(self, fullname, path, target=None):
    if fullname != _MODULE:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is None or spec.loader is None:
      return spec
    execute = spec.loader.exec_module

    def exec_module(module):
      execute(module)
      _write_from_every_process(module)

    spec.loader.exec_module = exec_module
    return spec


sys.meta_path.insert(0, _Finder())

# The sitecustomize this one shadows, if any.
_other = importlib.machinery.PathFinder.find_spec(
    'sitecustomize', [p for p in sys.path if os.path.abspath(p or '.') != _HERE]
)
if _other is not None and _other.loader is not None:
  _other.loader.exec_module(importlib.util.module_from_spec(_other))

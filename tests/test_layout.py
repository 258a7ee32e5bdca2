"""The package's layout: each folder imports only the folders below it (`LAYERS`), the public
API is importable from `transformer_jax`, and an NNX user can wrap the linen model."""

from __future__ import annotations

import ast
import configparser
import glob
import os
import tomllib

import flax
from flax import nnx
from flax.nnx import bridge
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models_testlib
import train_testlib
import transformer_jax

# Bottom first. A unit (a root module, or a sub-package with everything in it) may import
# the units before it, never one after it: no circle, and a reader finds a concern by its
# folder. `aot` and `interop` sit side by side and do not import each other.
LAYERS = (
    'errors',
    'config',
    'storage',
    'runtime',
    'data',
    'model',
    'checkpoints',
    'decoding',
    'training',
    'aot',
    'interop',
    'commands',
)
SIDE_BY_SIDE = {frozenset({'aot', 'interop'})}
PACKAGE = os.path.join(train_testlib.REPO, 'transformer_jax')


def _unit(module: str) -> str:
  """'transformer_jax.data.batching' -> 'data'; 'transformer_jax' -> ''."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else ''


def _package_imports(path: str) -> set[str]:
  """Every package module or name that `path` imports, at its top or inside a function."""
  imported = set()
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('transformer_jax'):
      imported |= {f'{node.module}.{alias.name}' for alias in node.names}
    elif isinstance(node, ast.Import):
      imported |= {a.name for a in node.names if a.name.startswith('transformer_jax')}
  return imported


def _module_paths() -> dict[str, str]:
  paths = glob.glob(os.path.join(PACKAGE, '**', '*.py'), recursive=True)
  return {
      os.path.relpath(p, train_testlib.REPO)[:-3].replace(os.sep, '.'): p
      for p in paths
      if not p.endswith(os.sep + '__init__.py') or os.path.dirname(p) != PACKAGE
  }


def _layering_errors(imports: dict[str, set[str]]) -> list[str]:
  errors = []
  for module, targets in sorted(imports.items()):
    unit = _unit(module)
    for target in sorted(targets):
      other = _unit(target)
      if other in ('', unit):
        continue
      if unit not in LAYERS or other not in LAYERS:
        errors.append(f'{module} -> {target}: add {unit or other!r} to LAYERS')
      elif frozenset({unit, other}) in SIDE_BY_SIDE or LAYERS.index(other) > LAYERS.index(unit):
        errors.append(f'{module} imports {target}, which is above it ({other} over {unit})')
  return errors


def test_each_folder_imports_only_the_folders_below_it():
  imports = {module: _package_imports(path) for module, path in _module_paths().items()}
  assert not _layering_errors(imports)
  # Every folder of the package is placed.
  folders = {
      name
      for name in os.listdir(PACKAGE)
      if os.path.isfile(os.path.join(PACKAGE, name, '__init__.py'))
  }
  roots = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith('.py')} - {'__init__'}
  assert folders | roots == set(LAYERS)


def test_the_layering_check_catches_an_import_upwards_and_sideways():
  assert _layering_errors(
      {
          'transformer_jax.data.vocab_cache': {'transformer_jax.checkpoints.checkpointing'},
          'transformer_jax.aot.aot': {'transformer_jax.interop.marian'},
          'transformer_jax.training.train_loop': {'transformer_jax.data.batching.Batch'},
      }
  ) == [
      'transformer_jax.aot.aot imports transformer_jax.interop.marian, which is above it '
      '(interop over aot)',
      'transformer_jax.data.vocab_cache imports transformer_jax.checkpoints.checkpointing, '
      'which is above it (checkpoints over data)',
  ]


def test_the_package_root_imports_nothing_until_a_name_is_used():
  with open(os.path.join(PACKAGE, '__init__.py'), encoding='utf-8') as f:
    tree = ast.parse(f.read())
  top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  assert {getattr(n, 'module', None) or n.names[0].name for n in top} <= {
      '__future__',
      'importlib',
      'typing',
  }


@pytest.mark.parametrize('name', transformer_jax.__all__)
def test_the_public_api_is_importable_from_the_package(name):
  value = getattr(transformer_jax, name)
  assert value.__name__ == name
  assert name in dir(transformer_jax)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match='no attribute'):
    transformer_jax.Transfomer  # noqa: B018


def test_nnx_bridge_wraps_the_linen_model_with_the_same_logits_and_gradients():
  """`flax.nnx.bridge.ToNNX` turns the linen model into an NNX module: its logits and its
  gradients equal linen's `apply` with the same parameters (to rounding: the two are compiled
  as different programs)."""
  # NNX shards a variable with a sharding annotation as it is made, which needs a mesh; the
  # logical axes of the linen model are resolved by this project's Partitioner instead.
  before = flax.config.flax_always_shard_variable
  flax.config.update('flax_always_shard_variable', False)
  try:
    cfg = models_testlib.TINY
    rng = np.random.default_rng(0)
    source = models_testlib.tokens(rng, *models_testlib.SOURCE)
    target = models_testlib.tokens(rng, *models_testlib.TARGET)
    model = bridge.ToNNX(transformer_jax.Transformer(cfg), rngs=nnx.Rngs(0))
    # Jitted, as a user would run it: eagerly each operation compiles on its own.
    nnx.jit(lambda m: bridge.lazy_init(m, source, target) and None)(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    # One program a side: the loss's gradient, with the logits as its auxiliary output.
    loss = lambda logits: jnp.mean(logits**2)
    nnx_grads, logits = nnx.jit(
        nnx.grad(lambda m: (loss(out := m(source, target)), out), has_aux=True)
    )(model)
    linen = transformer_jax.Transformer(cfg)
    linen_grads, expected = jax.jit(
        jax.grad(
            lambda p: (loss(out := linen.apply({'params': p}, source, target)), out),
            has_aux=True,
        )
    )(params)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-5, atol=1e-6)
    nnx_grads = nnx.to_pure_dict(nnx_grads)
    assert jax.tree.structure(nnx_grads) == jax.tree.structure(linen_grads)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
        nnx_grads,
        linen_grads,
    )
  finally:
    flax.config.update('flax_always_shard_variable', before)


def test_the_test_folders_mirror_the_package_and_are_on_the_path():
  """tests/ has a folder a sub-package, and each test folder is on pytest.ini's pythonpath and
  in ruff's `src`, so that a test file imports another's helpers by name from any folder and
  ruff sorts those imports as the project's own."""
  tests = os.path.join(train_testlib.REPO, 'tests')
  folders = {
      name for name in os.listdir(tests) if glob.glob(os.path.join(tests, name, 'test_*.py'))
  }
  assert folders <= set(LAYERS), f'tests/ folders without a package folder: {folders}'
  with open(os.path.join(train_testlib.REPO, 'pytest.ini'), encoding='utf-8') as f:
    ini = configparser.ConfigParser()
    ini.read_file(f)
  assert {f'tests/{name}' for name in folders} <= set(ini['pytest']['pythonpath'].split())
  with open(os.path.join(train_testlib.REPO, 'pyproject.toml'), 'rb') as f:
    src = tomllib.load(f)['tool']['ruff']['src']
  assert {f'tests/{name}' for name in folders} <= set(src)

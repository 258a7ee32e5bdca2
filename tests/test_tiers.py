"""The quick tier (-m "not slow") tests every module of the package: each module is used by
a test without the slow mark (docs/developing.md, the tiers).

Read from the test files' source: a quick test uses a module when its body, its decorators
or a function of its file that it calls name the module (or something imported from it); a
command counts as used where a quick test names its script (`train.py`).
"""

from __future__ import annotations

import ast
import glob
import os

import train_testlib

REPO = train_testlib.REPO


def package_modules() -> set[str]:
  paths = glob.glob(os.path.join(REPO, 'transformer_jax', '**', '*.py'), recursive=True)
  return {
      os.path.relpath(p, REPO)[:-3].replace(os.sep, '.')
      for p in paths
      if not p.endswith('__init__.py')
  }


def _is_slow_mark(node: ast.AST) -> bool:
  return ast.unparse(node).endswith('mark.slow')


def _imports(tree: ast.Module, modules: set[str]) -> dict[str, str]:
  """{name bound at the top of the file: the package module it is or comes from}."""
  names = {}
  for node in tree.body:
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in modules:
          names[alias.asname or alias.name.split('.')[0]] = alias.name
    elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('transformer_jax'):
      for alias in node.names:
        full = f'{node.module}.{alias.name}'
        names[alias.asname or alias.name] = full if full in modules else node.module
  return names


def _used(
    node: ast.AST,
    modules: set[str],
    imports: dict[str, str],
    functions: dict[str, ast.AST],
    seen: set[str],
) -> set[str]:
  """The package modules `node` uses, through the file's functions it calls."""
  used = set()
  for child in ast.walk(node):
    if (
        isinstance(child, ast.Attribute)
        and isinstance(child.value, ast.Name)
        and child.value.id in imports
        and f'{imports[child.value.id]}.{child.attr}' in modules
    ):  # data.token_store
      used.add(f'{imports[child.value.id]}.{child.attr}')
    if isinstance(child, ast.Name):
      if child.id in imports:
        used.add(imports[child.id])
      elif child.id in functions and child.id not in seen:
        seen.add(child.id)
        used |= _used(functions[child.id], modules, imports, functions, seen)
    elif isinstance(child, ast.Constant) and isinstance(child.value, str):
      script = os.path.basename(child.value)
      if script.endswith('.py') and os.path.exists(
          os.path.join(REPO, 'transformer_jax', 'commands', script)
      ):
        used.add(f'transformer_jax.commands.{script[:-3]}')
  return used


def quick_tier_modules() -> set[str]:
  """The package modules that the quick tier's tests use."""
  modules = package_modules()
  used = set()
  for path in glob.glob(os.path.join(REPO, 'tests', '**', 'test_*.py'), recursive=True):
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
    if any(
        isinstance(n, ast.Assign)
        and any(getattr(t, 'id', '') == 'pytestmark' for t in n.targets)
        and _is_slow_mark(n.value)
        for n in tree.body
    ):
      continue
    imports = _imports(tree, modules)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name, function in functions.items():
      if name.startswith('test_') and not any(map(_is_slow_mark, function.decorator_list)):
        used |= _used(function, modules, imports, functions, {name})
  return used


def test_every_module_of_the_package_has_quick_tests():
  missing = sorted(package_modules() - quick_tier_modules())
  assert not missing, (
      f'no test of the quick tier (-m "not slow") uses {", ".join(missing)}: add one that '
      'needs no service, no subprocess past --help and no training (docs/developing.md)'
  )


def test_the_reading_finds_what_a_quick_test_uses_and_skips_slow_ones():
  used = quick_tier_modules()
  assert 'transformer_jax.model.models' in used  # test_models, quick.
  assert 'transformer_jax.commands.train' in used  # train.py --help, quick.
  tree = ast.parse(
      'import pytest\n'
      'from transformer_jax.model import models\n'
      '@pytest.mark.slow\n'
      'def test_a():\n'
      '  models.Transformer\n'
  )
  assert _is_slow_mark(tree.body[2].decorator_list[0])
  assert _imports(tree, package_modules()) == {'models': 'transformer_jax.model.models'}

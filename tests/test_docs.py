"""The docs cannot lie about what exists: the config reference is the code's, every relative
link resolves, and every flag a command line in the docs shows is one that command has."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import test_bible_corpus
import train_testlib
from transformer_jax.config import base_config

REPO = train_testlib.REPO
DOCS = [
    *(os.path.join(REPO, name) for name in ('README.md', 'CONTRIBUTING.md', 'CHANGELOG.md')),
    *sorted(glob.glob(os.path.join(REPO, 'docs', '*.md'))),
]
COMMANDS = sorted(
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(REPO, 'transformer_jax', 'commands', '*.py'))
    if not p.endswith('__init__.py')
)


def _reference_module():
  spec = importlib.util.spec_from_file_location(
      'config_reference', os.path.join(REPO, 'scripts', 'config_reference.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_config_reference_is_the_codes_and_describes_every_field():
  reference = _reference_module()
  described = {name: text for _, name, text in reference.fields()}
  assert set(described) == set(base_config().keys())
  assert not [name for name, text in described.items() if not text], 'fields without a comment'
  with open(reference.PAGE, encoding='utf-8') as f:
    assert (
        f.read() == reference.render()
    ), 'docs/config.md is stale: run python scripts/config_reference.py'


def _read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


def _anchors(path: str) -> set[str]:
  """The anchors GitHub makes of a Markdown file's headings."""
  return {
      re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')
      for heading in re.findall(r'^#{1,6} (.+)$', _read(path), re.MULTILINE)
  }


@pytest.mark.parametrize('doc', DOCS, ids=os.path.basename)
def test_every_relative_link_resolves(doc):
  """To a file that exists and, after a '#', to one of its headings."""
  broken = []
  for target in re.findall(r'\]\(([^)\s]+)\)', _read(doc)):
    if re.match(r'^[a-z]+:', target):
      continue
    file, _, anchor = target.partition('#')
    path = os.path.normpath(os.path.join(os.path.dirname(doc), file)) if file else doc
    if not os.path.exists(path) or (
        anchor and path.endswith('.md') and anchor not in _anchors(path)
    ):
      broken.append(target)
  assert not broken, f'{os.path.basename(doc)} links to what does not exist: {broken}'


def _config_has(path: list[str]) -> bool:
  node = base_config()
  for part in path:
    if not hasattr(node, 'keys') or part not in node.keys():
      return False
    node = node[part]
  return True


@pytest.mark.parametrize('doc', DOCS, ids=os.path.basename)
def test_every_config_field_the_docs_name_exists(doc):
  named = re.findall(r'--config\.([a-z_][a-z0-9_.]*[a-z0-9_])', _read(doc))  # Not FIELD.
  missing = sorted({field for field in named if not _config_has(field.split('.'))})
  assert not missing, f'{os.path.basename(doc)} names config fields that do not exist: {missing}'


@functools.lru_cache(maxsize=None)
def _flags_of(command: str) -> frozenset[str]:
  """The flags `command`.py takes (its own, the shared ones and absl's)."""
  result = train_testlib.run_command(
      [sys.executable, os.path.join('tests', 'flag_names.py'), command],
      env=train_testlib.subprocess_env(),
      timeout=120,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  return frozenset(result.stdout.split())


def _command_lines(text: str) -> list[tuple[str, str]]:
  """(command, its arguments) for each `NAME.py ...` the text shows, continuation lines
  joined; the arguments end at a shell operator or the end of the code."""
  text = re.sub(r'\\\n\s*', ' ', text)
  found = []
  for match in re.finditer(r'\b(' + '|'.join(COMMANDS) + r')\.py\b([^\n`]*)', text):
    found.append((match[1], re.split(r'\s(?:&&|\|\||;|\||<|>)\s', match[2])[0]))
  return found


@pytest.mark.parametrize('doc', DOCS, ids=os.path.basename)
def test_every_flag_a_command_line_shows_is_that_commands(doc):
  wrong = []
  for command, arguments in _command_lines(_read(doc)):
    for flag in re.findall(r'(?:^|\s)--(?:no)?([a-z][a-z0-9_]*)\b(?!\.)', arguments):
      if flag not in _flags_of(command) and f'no{flag}' not in _flags_of(command):
        wrong.append(f'{command}.py --{flag}')
  assert not wrong, f'{os.path.basename(doc)} shows flags the commands lack: {sorted(set(wrong))}'


def _shown_line(doc: str, needle: str) -> str:
  """The one shell line of `doc`'s indented code that contains `needle`, continuations joined."""
  lines = re.sub(r'\\\n\s*', ' ', _read(os.path.join(REPO, doc))).splitlines()
  found = [line.strip() for line in lines if line.startswith('    ') and needle in line]
  assert len(found) == 1, f'{doc}: expected one code line with {needle!r}, found {found}'
  return found[0]


def _run_as_shown(line: str, cwd: str, **replace: str) -> subprocess.CompletedProcess:
  for old, new in replace.items():
    line = line.replace(old, new)
  line = re.sub(r'\bpython (\w+\.py)\b', rf'{sys.executable} {REPO}/\1', line)
  line = line.replace(' configs/', f' {REPO}/configs/').replace('=configs/', f'={REPO}/configs/')
  env = train_testlib.subprocess_env()
  env['TFDS_DATA_DIR'] = os.path.join(cwd, 'tensorflow_datasets')  # the Bible is prepared here
  return subprocess.run(
      ['bash', '-c', line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
  )


@pytest.mark.slow
@test_bible_corpus.needs_modules
def test_the_guides_tiny_run_and_translate_lines_run_as_shown(tmp_path):
  """The training guide's tiny run (the Bible, prepared from nothing) and the evaluating
  guide's translate lines, run through bash as the guides print them, paths aside."""
  workdir = str(tmp_path / 'tiny')
  train = _run_as_shown(
      _shown_line('docs/training.md', 'configs/tiny.py'), str(tmp_path), **{'/tmp/tiny': workdir}
  )
  assert train.returncode == 0, train.stderr[-3000:]
  assert 'step 20/20' in train.stderr

  plot = _run_as_shown(
      _shown_line('docs/evaluating.md', '--attention_plot'), str(tmp_path), DIR=workdir
  )
  assert plot.returncode == 0, plot.stderr[-3000:]
  assert plot.stdout.strip() and (tmp_path / 'attention.png').stat().st_size > 1000

  (tmp_path / 'mono.txt').write_text('In the beginning was the Word.\n\nAnd God said.\n')
  samples = _run_as_shown(
      _shown_line('docs/evaluating.md', '--sampling'), str(tmp_path), DIR=workdir
  )
  assert samples.returncode == 0, samples.stderr[-3000:]
  rows = [line.split(' ||| ') for line in (tmp_path / 'samples.txt').read_text().splitlines()]
  assert [int(row[0]) for row in rows] == [0] * 5 + [1] * 5 + [2] * 5  # the blank line too

"""The style checks, over the whole checkout, so that the README's one test command checks the
style too: ruff (lint and import order, [tool.ruff] in pyproject.toml), pyink (the
formatter, [tool.pyink]), and no measured figure in the Python files (CONTRIBUTING.md: dated
measurements go to bench/RESULTS.md; the code keeps the reason and cites the section)."""

import os
import re
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


# --- Figures: measured on some machine, some day, they go to bench/RESULTS.md, not the code. ---

# An ISO date (`'%Y-%m-%d'`, a format, is not one).
_DATE = re.compile(r'\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b')
# A speed-up or slow-down as a number (`Nx faster`, `N.N% slower`, `faster by N%`, digits for
# N). A ratio the code computes and prints (`f'{ratio:.2f}x'`) has no digit before its `x`.
_SPEED = re.compile(
    r'\d+(?:\.\d+)?\s*(?:x|×|%|\s+times)\s+(?:faster|slower)\b|\b(?:faster|slower)\s+by\s+\d',
    re.IGNORECASE,
)
# A citation of a section: bench/RESULTS.md, section and in double quotes a part of its heading
# that no other heading has, without the date or commit the heading may carry (it may go on over
# the next lines of a comment or a docstring); or bench/RESULTS.md# and the heading's anchor.
_SECTION = re.compile(r'RESULTS\.md,[\s#]+section[\s#]+"([^"]*)"')
_ANCHOR = re.compile(r'RESULTS\.md#([\w-]+)')
_RESULTS = os.path.join(train_testlib.REPO, 'bench', 'RESULTS.md')
_FIGURE_ADVICE = (
    'A measured figure in the code: dated measurements go to bench/RESULTS.md (CONTRIBUTING.md).'
    ' Keep the reason in the comment, drop the figure, the date and the machine, and cite where'
    ' the measurement is: bench/RESULTS.md, section and, in double quotes, a part of its heading'
    ' that names it alone, without its date.'
)


def _blank(match: re.Match) -> str:
  return re.sub(r'[^\n]', ' ', match.group(0))


def _without_citations(text: str) -> str:
  """`text` with each RESULTS.md section cited blanked out, line numbers kept."""
  return _ANCHOR.sub(_blank, _SECTION.sub(_blank, text))


def figures_in(text: str) -> list[tuple[int, str]]:
  """(line number, the figure) for each dated figure or speed ratio in a Python file's text."""
  found = []
  for number, line in enumerate(_without_citations(text).splitlines(), 1):
    found += [(number, m.group(0)) for m in (*_DATE.finditer(line), *_SPEED.finditer(line))]
  return found


def cited_sections(text: str) -> list[tuple[int, str, str]]:
  """(line, 'section' or 'anchor', the heading or anchor) for each RESULTS.md citation."""
  line = lambda m: text.count('\n', 0, m.start()) + 1
  # A heading that goes on over lines: the comment marks and indents between are one space.
  heading = lambda m: re.sub(r'\s*\n\s*(?:#\s*)?', ' ', m.group(1)).strip()
  return [(line(m), 'section', heading(m)) for m in _SECTION.finditer(text)] + [
      (line(m), 'anchor', m.group(1)) for m in _ANCHOR.finditer(text)
  ]


def anchor(heading: str) -> str:
  """A Markdown heading's anchor as GitHub makes it."""
  return re.sub(r'[^\w\- ]', '', heading.lower()).replace(' ', '-')


def results_headings() -> set[str]:
  """bench/RESULTS.md's headings."""
  with open(_RESULTS, encoding='utf-8') as f:
    return {row.lstrip('#').strip() for row in f if re.match(r'#+ ', row)}


def _names_one_section(name: str, headings: set[str]) -> bool:
  """Whether `name` is part of exactly one heading, and carries no date or commit."""
  dated = _DATE.search(name) or re.search(r'\b[0-9a-f]{7}\b', name)
  return not dated and sum(name in heading for heading in headings) == 1


def dangling_citations(text: str, headings: set[str]) -> list[tuple[int, str, str]]:
  """The citations in `text` that name no section of `headings`, or more than one."""
  anchors = {anchor(h) for h in headings}
  return [
      (line, kind, name)
      for line, kind, name in cited_sections(text)
      if not (_names_one_section(name, headings) if kind == 'section' else name in anchors)
  ]


def _tracked_python() -> dict[str, str]:
  """Each tracked *.py of the checkout that exists: its path and text (outside a git checkout,
  an unpacked source tree, every *.py but those of hidden folders such as .venv-aot)."""
  if os.path.isdir(os.path.join(train_testlib.REPO, '.git')):
    paths = subprocess.run(
        ['git', 'ls-files', '-z', '*.py'],
        cwd=train_testlib.REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split('\0')
  else:
    paths = []
    for folder, subfolders, names in os.walk(train_testlib.REPO):
      subfolders[:] = [d for d in subfolders if not d.startswith('.')]
      paths += [
          os.path.relpath(os.path.join(folder, n), train_testlib.REPO)
          for n in names
          if n.endswith('.py')
      ]
  texts = {}
  for path in filter(None, paths):
    full = os.path.join(train_testlib.REPO, path)
    if os.path.isfile(full):
      with open(full, encoding='utf-8') as f:
        texts[path] = f.read()
  return texts


def test_no_dated_figure_or_speed_ratio_in_python():
  found = [
      f'{path}:{line}: {figure}'
      for path, text in sorted(_tracked_python().items())
      for line, figure in figures_in(text)
  ]
  assert not found, _FIGURE_ADVICE + '\n' + '\n'.join(found)


def test_each_results_section_cited_in_python_exists():
  headings = results_headings()
  assert 'Test suite: 2 CPU cores' in headings  # Read at all.
  missing = [
      f'{path}:{line}: {kind} {name!r}'
      for path, text in sorted(_tracked_python().items())
      for line, kind, name in dangling_citations(text, headings)
  ]
  assert not missing, (
      'bench/RESULTS.md has no heading, or several, with that part (cite a section as'
      ' bench/RESULTS.md, section and, in double quotes, a part of its heading that no other'
      ' heading has, without its date; or bench/RESULTS.md# and its anchor):\n' + '\n'.join(missing)
  )


def test_the_figure_check_catches_figures_and_passes_code():
  # Built from pieces, so that this file holds no figure and no citation of its own.
  day = '-'.join(('2026', '11', '27'))
  results = 'RESULTS' + '.md'
  bad = [
      f'  # On one H200 it made the step 2.7% {"faster"} ({day}).',
      f'  # The whole step 1.01-1.02x {"slower"} with it.',
      f'"""A batch about 3x {"faster"} than one record at a time."""',
      f'  # The loss {"faster"} by 4% on a Zen 3.',
  ]
  good = [
      "  print(f'{ratio:.2f}x faster than PyTorch')",
      "  stamp = time.strftime('%Y-%m-%d')",
      f'  # XLA:CPU does not vectorise this argmax (bench/{results}, section "Test suite").',
      '  TIMEOUT_S = 300  # A design choice, not a measurement: 2x the budget.',
      f'  # Why (bench/{results}, section "one change at\n  # a time").',
      f'  # Why (bench/{results}#gpu-one-nvidia-h200-{day}).',
  ]
  assert [figures_in(line) != [] for line in bad] == [True] * len(bad)
  assert [figures_in(line) for line in good] == [[]] * len(good)
  mixed = '\n'.join(good + bad[:1])
  last = mixed.count('\n') + 1
  assert figures_in(mixed) == [(last, day), (last, f'2.7% {"faster"}')]
  assert cited_sections(mixed) == [
      (3, 'section', 'Test suite'),
      (5, 'section', 'one change at a time'),
      (7, 'anchor', f'gpu-one-nvidia-h200-{day}'),
  ]
  # Each citation resolves against the headings it names, and only against them.
  assert (
      anchor(f'GPU: one NVIDIA H200, {day} (`jnp.argmax`)')
      == f'gpu-one-nvidia-h200-{day}-jnpargmax'
  )
  headings = {'Test suite: 2 CPU cores', f'GPU: one NVIDIA H200, {day}, one change at a time'}
  assert dangling_citations(mixed, headings) == [(7, 'anchor', f'gpu-one-nvidia-h200-{day}')]
  assert dangling_citations(mixed, headings | {f'GPU: one NVIDIA H200, {day}'}) == []
  assert len(dangling_citations(mixed, set())) == 3
  # A part that two headings have names neither; a citation with its heading's date is refused.
  assert dangling_citations(mixed, headings | {'Test suite: 8 cores'}) == [
      (3, 'section', 'Test suite'),
      (7, 'anchor', f'gpu-one-nvidia-h200-{day}'),
  ]
  dated = f'  # (bench/{results}, section "GPU: one NVIDIA H200, {day}, one change at a time").'
  assert dangling_citations(dated, headings) == [
      (1, 'section', f'GPU: one NVIDIA H200, {day}, one change at a time')
  ]

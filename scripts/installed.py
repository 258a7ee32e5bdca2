"""Whether this checkout is already installed as scripts/setup.sh installs it: exit 0 if so.

setup.sh asks before it runs `pip install -c requirements.txt -e .[EXTRAS]`, which spends
seconds of a 2-core machine resolving dependencies even when nothing is missing: a share of the
main job's ten minutes, spent on every run (bench/RESULTS.md, section "CPU: the main job's fixed
costs and its step"). Installed means all of:

  * transformer-jax is installed editable from this checkout, with pyproject.toml's version
    and console scripts;
  * every requirement of pyproject.toml (the dependencies and the EXTRAS' lists) is installed
    at a version its range allows, and at requirements.txt's pin where it has one;
  * `pip check` finds every installed package's own requirements met (the transitive ones).

Anything else (a missing or different package, another checkout, a changed pyproject.toml,
no `packaging` module yet) answers no, and setup.sh lets pip do the work.

  python scripts/installed.py tensorboard        # exit 0: installed; 1: not (says why)
  python scripts/installed.py test,tensorboard
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import pathlib
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parent.parent


def pins(requirements_text: str) -> dict[str, str]:
  """requirements.txt's `name==version` lines, by canonical name."""
  from packaging.utils import canonicalize_name

  found = {}
  for line in requirements_text.splitlines():
    line = line.split('#', 1)[0].strip()
    if '==' in line:
      name, version = line.split('==', 1)
      found[canonicalize_name(name.strip())] = version.strip()
  return found


def problems(extras: list[str], pyproject_text: str, requirements_text: str) -> list[str]:
  """What differs between the environment and what setup.sh would install ([]: nothing)."""
  from packaging.requirements import Requirement
  from packaging.utils import canonicalize_name

  project = tomllib.loads(pyproject_text)['project']
  try:
    dist = metadata.distribution(project['name'])
  except metadata.PackageNotFoundError:
    return [f"{project['name']} is not installed"]
  found = []
  direct_url = json.loads(dist.read_text('direct_url.json') or '{}')
  if not direct_url.get('dir_info', {}).get('editable') or direct_url.get('url') != REPO.as_uri():
    found.append(f"{project['name']} is not installed editable from {REPO}")
  if dist.version != project['version']:
    found.append(
        f"{project['name']} {dist.version} is installed, pyproject.toml says {project['version']}"
    )
  scripts = {e.name: e.value for e in dist.entry_points if e.group == 'console_scripts'}
  if scripts != project.get('scripts', {}):
    found.append('the console scripts differ from pyproject.toml')

  pinned = pins(requirements_text)
  wanted = list(project['dependencies'])
  for extra in extras:
    if extra not in project['optional-dependencies']:
      found.append(f'no extra {extra!r} in pyproject.toml')
      continue
    wanted += project['optional-dependencies'][extra]
  for text in wanted:
    requirement = Requirement(text)
    if requirement.marker is not None and not requirement.marker.evaluate():
      continue
    name = canonicalize_name(requirement.name)
    try:
      version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
      found.append(f'{requirement.name} is not installed')
      continue
    if not requirement.specifier.contains(version, prereleases=True):
      found.append(f'{requirement.name} {version} is outside {requirement.specifier}')
    elif name in pinned and version.split('+')[0] != pinned[name]:
      found.append(
          f'{requirement.name} {version} is installed, requirements.txt pins {pinned[name]}'
      )
  return found


def main() -> int:
  extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else '').split(',') if e]
  try:
    found = problems(
        extras,
        (REPO / 'pyproject.toml').read_text(),
        (REPO / 'requirements.txt').read_text(),
    )
  except ImportError as e:  # No `packaging` yet: a fresh machine.
    found = [str(e)]
  if not found:
    check = subprocess.run(
        [sys.executable, '-m', 'pip', 'check', '--disable-pip-version-check'],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
      found.append('pip check: ' + ' / '.join(check.stdout.strip().splitlines()[:3]))
  for line in found:
    print(f'installed.py: {line}', file=sys.stderr)
  return 1 if found else 0


if __name__ == '__main__':
  sys.exit(main())

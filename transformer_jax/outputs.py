"""The paths a command is given: checked before any work starts, written atomically.

Every command takes its paths through here, so that one rule holds for all of them:

* Before any work (loading a model, training a vocabulary, compiling), `check_input_file`,
  `check_input_directory`, `check_output_file` and `check_output_directory` check each path
  the command was given: an input exists and is of the right kind; an output's directory
  exists (a directory output is created with its parents: the nearest existing ancestor must
  be a directory this process can write in, probed by creating a file there, which holds for
  root and read-only mounts alike); a file is not a directory and vice versa; and an output
  is never one of the command's inputs (same resolved path or same inode, so a hard link or
  a symlink is caught too). A failure is a `PathError`: one paragraph naming the flag, the
  path and the fix.
* Outputs are written to a temporary name beside them and renamed into place (`write_file`,
  `writing`; a directory of files that go together: `writing_directory`), so a reader sees
  the old file or the new one, never half of one, and a killed command never destroys what
  was there. Files that belong together (hypotheses and their
  metrics) are committed together by `write_files`: once all are written, a journal naming
  them is renamed into place (the commit point), then each is renamed, then the journal is
  removed.
* The checks also clean up after a killed command (`clean_directory`): a journal left by a
  dead process is finished (its files renamed into place), and the temporaries of dead
  processes are removed. A process is dead when no process has its id on this host, or, for
  another host's files (a shared disk), when they are older than `STALE_AFTER_S`.

Temporary names: `.NAME.tmp-PID-RANDOM-HOST` (journals: `.NAME.commit-PID-RANDOM-HOST`),
hidden, in the output's own directory (a rename never crosses file systems).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import IO, Any

from transformer_jax.errors import OutputExistsError, PathError, from_os_error

STALE_AFTER_S = 3600.0  # Another host's temporaries older than this belong to a dead run.

_TEMPORARY = re.compile(r'^\.(?P<name>.+)\.(?P<kind>tmp|commit)-(?P<pid>\d+)-[0-9a-f]{8}-'
                        r'(?P<host>.*)$')
Inputs = Mapping[str, 'str | None']  # A flag (or a description) -> the path it names.


def _host() -> str:
  return socket.gethostname().replace('/', '_')


def temporary_path(path: str, kind: str = 'tmp') -> str:
  """A fresh temporary name beside `path`, which `clean_directory` recognises."""
  directory, name = os.path.split(os.path.abspath(path))
  return os.path.join(directory,
                      f'.{name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{_host()}')


def process_alive(pid: int) -> bool:
  """Whether a process with id `pid` runs on this host."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Alive, another user's.
    return True
  return True


def _owner_dead(path: str, pid: int, host: str) -> bool:
  if host == _host():
    return pid != os.getpid() and not process_alive(pid)
  try:
    return time.time() - os.stat(path).st_mtime > STALE_AFTER_S
  except FileNotFoundError:
    return False


# --- Checks, before any work. ---


def _describe(flag: str, path: str) -> str:
  return f'{flag}={path}' if flag.startswith('--') else f'{flag} {path}'


def _same(a: str, b: str) -> bool:
  """Whether two paths name the same file or directory (resolved path, or inode)."""
  if os.path.realpath(a) == os.path.realpath(b):
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:
    return False


def check_not_input(path: str, flag: str, inputs: Inputs) -> None:
  """Raises `PathError` if the output `path` is one of `inputs` (flag -> path)."""
  for input_flag, input_path in inputs.items():
    if input_path and _same(path, input_path):
      raise PathError(
          f'{_describe(flag, path)} is also {_describe(input_flag, input_path)}: writing the '
          'output would destroy the input before it is read. Write the output to another '
          'path.')


def _probe(directory: str, flag: str, path: str) -> None:
  """Creates and removes a file in `directory`: the one test of writability that holds for
  root, ACLs and read-only mounts alike."""
  probe = temporary_path(os.path.join(directory, 'write-probe'))
  try:
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
      raise from_os_error(e) from None
    raise PathError(
        f'{_describe(flag, path)}: cannot create files in {directory} ({e.strerror}); '
        'choose a directory you can write to.') from None


def check_input_file(path: str, flag: str) -> str:
  """Checks that the input `path` is a readable file; returns it."""
  if os.path.isdir(path):
    raise PathError(f'{_describe(flag, path)} is a directory; give a file.')
  if not os.path.exists(path):
    raise PathError(f'{_describe(flag, path)} does not exist.')
  if not os.access(path, os.R_OK):
    raise PathError(f'{_describe(flag, path)} is not readable (permission denied).')
  return path


def check_input_directory(path: str, flag: str, what: str = 'a directory') -> str:
  """Checks that the input `path` is a directory (`what` says which, for the message)."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise PathError(f'{_describe(flag, path)} is a file; give {what}.')
  if not os.path.isdir(path):
    raise PathError(f'{_describe(flag, path)} does not exist; give {what}.')
  return path


def check_output_file(path: str, flag: str, inputs: Inputs | None = None) -> str:
  """Checks that the file `path` can be written, and cleans up after a killed writer there.

  Its directory must exist (as for a shell's `>`): a typo in it should not create a tree
  of directories.

  Returns:
    `path`.

  Raises:
    PathError: `path` is a directory, its directory is missing or not writable, or it is
      one of `inputs`.
  """
  if os.path.isdir(path):
    raise PathError(f'{_describe(flag, path)} is a directory; give a file name.')
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    what = 'is not a directory' if os.path.exists(directory) else 'does not exist'
    raise PathError(f'{_describe(flag, path)}: its directory {directory} {what}; create it '
                    f'first (mkdir -p {directory}) or choose another path.')
  check_not_input(path, flag, inputs or {})
  _probe(directory, flag, path)
  clean_directory(directory)
  return path


def check_output_directory(path: str, flag: str, inputs: Inputs | None = None, *,
                           create: bool = True) -> str:
  """Checks that the directory `path` can be written (creating it and its parents, unless
  `create` is False), and cleans up after a killed writer there.

  Returns:
    `path`.

  Raises:
    PathError: `path` is a file, the nearest existing directory above it is not writable,
      or it is one of `inputs`.
  """
  if os.path.exists(path) and not os.path.isdir(path):
    raise PathError(f'{_describe(flag, path)} is a file; give a directory (it is created if '
                    'missing).')
  check_not_input(path, flag, inputs or {})
  existing = os.path.abspath(path)
  while not os.path.isdir(existing):
    parent = os.path.dirname(existing)
    if os.path.exists(existing) or parent == existing:
      raise PathError(f'{_describe(flag, path)}: {existing} is a file, not a directory; '
                      'choose another path.')
    existing = parent
  _probe(existing, flag, path)
  if create:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise from_os_error(e) or PathError(
          f'{_describe(flag, path)}: cannot create it ({e.strerror}).') from None
  if os.path.isdir(path):
    clean_directory(path)
  return path


# --- Atomic writes. ---


@contextlib.contextmanager
def writing(path: str, mode: str = 'w') -> Iterator[IO[Any]]:
  """Opens a temporary file beside `path`; renames it to `path` when the block ends without
  an error, and removes it otherwise (the old `path`, if any, is untouched)."""
  tmp = temporary_path(path)
  try:
    with open(tmp, mode, **({} if 'b' in mode else {'encoding': 'utf-8', 'newline': '\n'})
              ) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


@contextlib.contextmanager
def writing_directory(path: str) -> Iterator[str]:
  """A temporary directory beside `path` to write a set of files in; renamed to `path` when
  the block ends without an error (so they appear together), removed otherwise.

  Raises:
    OutputExistsError: `path` exists and is not empty (checked again at the rename).
  """
  _check_empty(path)
  tmp = temporary_path(path)
  os.makedirs(tmp)
  try:
    yield tmp
    if os.path.isdir(path):
      os.rmdir(path)  # Empty (checked above); a file written there meanwhile stops this.
    os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _check_empty(path: str) -> None:
  if os.path.isdir(path) and os.listdir(path):
    raise OutputExistsError(f'{path} is not empty; give a new or empty directory.')


def write_file(path: str, data: str | bytes) -> None:
  """Writes `data` to `path` atomically (a temporary file renamed into place)."""
  with writing(path, 'wb' if isinstance(data, bytes) else 'w') as f:
    f.write(data)


def write_files(files: Mapping[str, str | bytes]) -> None:
  """Writes several files of one directory so that they are replaced together or not at all.

  Each is written to a temporary name; then a journal listing them is renamed into place
  (the commit: from here on `clean_directory` finishes the job if this process dies); then
  each file is renamed; then the journal is removed.
  """
  paths = [os.path.abspath(p) for p in files]
  directory = os.path.dirname(paths[0])
  if any(os.path.dirname(p) != directory for p in paths):
    raise ValueError(f'write_files writes into one directory, not {paths}.')
  temporaries = {}
  try:
    for path, data in zip(paths, files.values()):
      temporaries[path] = temporary_path(path)
      with open(temporaries[path], 'wb') as f:
        f.write(data if isinstance(data, bytes) else data.encode('utf-8'))
        f.flush()
        os.fsync(f.fileno())
    journal = temporary_path(paths[0], 'commit')
    write_file(journal, json.dumps({os.path.basename(t): os.path.basename(p)
                                    for p, t in temporaries.items()}))
  except BaseException:
    for tmp in temporaries.values():
      with contextlib.suppress(OSError):
        os.remove(tmp)
    raise
  _finish_commit(journal)


def _finish_commit(journal: str) -> None:
  """Renames every file a journal lists into place (those still there), then removes it."""
  directory = os.path.dirname(journal)
  with open(journal, encoding='utf-8') as f:
    renames = json.load(f)
  for tmp, final in renames.items():
    if os.path.exists(os.path.join(directory, tmp)):
      os.replace(os.path.join(directory, tmp), os.path.join(directory, final))
  os.remove(journal)


def clean_directory(directory: str) -> list[str]:
  """Finishes the commits and removes the temporaries that dead processes left in
  `directory` (see the module doc); returns what it removed or finished."""
  done = []
  try:
    names = os.listdir(directory)
  except OSError:
    return done
  found = [(name, m) for name in names if (m := _TEMPORARY.match(name))]
  # Journals first: the temporaries they name are finished, not removed.
  for name, match in sorted(found, key=lambda item: item[1]['kind'] != 'commit'):
    path = os.path.join(directory, name)
    if not _owner_dead(path, int(match['pid']), match['host']):
      continue
    try:
      if match['kind'] == 'commit':
        _finish_commit(path)
      elif os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # Of `writing_directory`.
      else:
        os.remove(path)
    except FileNotFoundError:
      continue  # Another process cleaned it up meanwhile.
    except (OSError, ValueError):
      continue  # Unreadable: left for a person to look at.
    done.append(path)
  return done

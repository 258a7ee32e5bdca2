"""The paths a command is given, checked before any work starts.

Before any work (loading a model, training a vocabulary, compiling), `check_input_file`,
`check_input_directory`, `check_output_file` and `check_output_directory` check each path the
command was given: an input exists and is of the right kind; an output's directory exists (a
directory output is created with its parents: the nearest existing ancestor must be a
directory this process can write in, probed by creating a file there, which holds for root and
read-only mounts alike); a file is not a directory and vice versa; and an output is never one
of the command's inputs (same resolved path or same inode, so a hard link or a symlink is
caught too). A failure is a `PathError`: one paragraph naming the flag, the path and the fix.
An output's check also cleans up after a killed command there (`storage.clean_directory`).

A `gs://BUCKET/...` path passes the same checks: a directory is a prefix, so only the bucket
must exist, and writability is probed by writing and deleting an object. Other schemes
(`s3://`, ...) are refused (`check_scheme`). Reading and writing are `storage`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import re

from transformer_jax.errors import from_os_error
from transformer_jax.errors import PathError
from transformer_jax.storage import storage

Inputs = Mapping[str, 'str | None']  # A flag (or a description) -> the path it names.


# Cloud Storage's bucket names: 3-63 characters (up to 222 with dots), lowercase letters,
# digits, '-', '_' and '.', starting and ending with a letter or a digit.
_BUCKET_NAME = re.compile(r'^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$')


def check_scheme(path: str, flag: str) -> None:
  """Refuses URLs of schemes other than gs:// (their writes are untested here), and gs://
  paths whose bucket name Cloud Storage would refuse."""
  match = storage.SCHEME.match(path)
  if match and match['scheme'] == 'gs':
    bucket = storage.bucket_of(path)[len('gs://') :]
    if not bucket:
      raise PathError(f'{storage.describe(flag, path)} names no bucket; give gs://BUCKET/PATH.')
    if not _BUCKET_NAME.match(bucket) or ('.' not in bucket and len(bucket) > 63):
      raise PathError(
          f'{storage.describe(flag, path)}: {bucket!r} is not a valid bucket name (3-63 '
          "lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or "
          'a digit); correct it.'
      )
  if match and match['scheme'] != 'gs':
    raise PathError(
        f'{storage.describe(flag, path)}: {match["scheme"]}:// paths are not '
        'supported; give a local path or a Cloud Storage path (gs://BUCKET/...).'
    )


def require_local(path: str, flag: str, what: str) -> None:
  """Refuses a gs:// `path` where `what` must be on a local disk."""
  check_scheme(path, flag)
  if storage.is_remote(path):
    raise PathError(
        f'{storage.describe(flag, path)}: {what} cannot be on Cloud Storage; give a local path.'
    )


def same_path(a: str, b: str) -> bool:
  """Whether two paths name the same file or directory (resolved path, or inode)."""
  if storage.is_remote(a) or storage.is_remote(b):
    return storage.resolve(a) == storage.resolve(b)
  if os.path.realpath(a) == os.path.realpath(b):
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:
    return False


def check_not_input(path: str, flag: str, inputs: Inputs) -> None:
  """Raises `PathError` if the output `path` is one of `inputs` (flag -> path)."""
  for input_flag, input_path in inputs.items():
    if input_path and same_path(path, input_path):
      raise PathError(
          f'{storage.describe(flag, path)} is also {storage.describe(input_flag, input_path)}: '
          'writing the output would destroy the input before it is read. Write the output to '
          'another path.'
      )


def check_input_file(path: str, flag: str) -> str:
  """Checks that the input `path` is a readable file; returns it."""
  check_scheme(path, flag)
  kind = storage.kind_of(path, flag)
  if kind == 'directory':
    raise PathError(f'{storage.describe(flag, path)} is a directory; give a file.')
  if kind is None:
    raise PathError(f'{storage.describe(flag, path)} does not exist.')
  if not storage.is_remote(path) and not os.access(path, os.R_OK):
    raise PathError(f'{storage.describe(flag, path)} is not readable (permission denied).')
  return path


def check_input_directory(path: str, flag: str, what: str = 'a directory') -> str:
  """Checks that the input `path` is a directory (`what` says which, for the message)."""
  check_scheme(path, flag)
  kind = storage.kind_of(path, flag)
  if kind == 'file':
    raise PathError(f'{storage.describe(flag, path)} is a file; give {what}.')
  if kind is None:
    raise PathError(f'{storage.describe(flag, path)} does not exist; give {what}.')
  return path


def _check_no_object_above(path: str, flag: str) -> None:
  """On Cloud Storage, where a directory is only a prefix: refuses `path` when a folder of it
  is an object (gs://b/a.txt/out.txt beside the object gs://b/a.txt), as a local path whose
  directory is a file is refused."""
  bucket = storage.bucket_of(path)
  folder = storage.split_path(path)[0]
  while len(folder) > len(bucket):
    if storage.kind_of(folder, flag) == 'file':
      raise PathError(
          f'{storage.describe(flag, path)}: its directory {folder} is an object, not a '
          'directory; choose another path.'
      )
    folder = storage.split_path(folder)[0]


def check_output_file(path: str, flag: str, inputs: Inputs | None = None) -> str:
  """Checks that the file `path` can be written, and cleans up after a killed writer there.

  Its directory must exist (as for a shell's `>`): a typo in it should not create a tree
  of directories. (On Cloud Storage only the bucket must.)

  Returns:
    `path`.

  Raises:
    PathError: `path` is a directory, its directory is missing or not writable, or it is
      one of `inputs`.
  """
  check_scheme(path, flag)
  if storage.is_remote(path):
    if storage.kind_of(path, flag) == 'directory':
      raise PathError(f'{storage.describe(flag, path)} is a directory; give a file name.')
    _check_no_object_above(path, flag)
    check_not_input(path, flag, inputs or {})
    storage.probe_writable(storage.split_path(path)[0], flag, path)
    storage.clean_directory(storage.split_path(path)[0])
    return path
  if os.path.isdir(path):
    raise PathError(f'{storage.describe(flag, path)} is a directory; give a file name.')
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    what = 'is not a directory' if os.path.exists(directory) else 'does not exist'
    raise PathError(
        f'{storage.describe(flag, path)}: its directory {directory} {what}; create it '
        f'first (mkdir -p {directory}) or choose another path.'
    )
  check_not_input(path, flag, inputs or {})
  storage.probe_writable(directory, flag, path)
  storage.clean_directory(directory)
  return path


def check_output_directory(
    path: str, flag: str, inputs: Inputs | None = None, *, create: bool = True
) -> str:
  """Checks that the directory `path` can be written (creating it and its parents, unless
  `create` is False), and cleans up after a killed writer there.

  Returns:
    `path`.

  Raises:
    PathError: `path` is a file, the nearest existing directory above it is not writable,
      or it is one of `inputs`.
  """
  check_scheme(path, flag)
  if storage.is_remote(path):
    if storage.kind_of(path, flag) == 'file':
      raise PathError(f'{storage.describe(flag, path)} is a file; give a directory.')
    _check_no_object_above(storage.resolve(path), flag)
    check_not_input(path, flag, inputs or {})
    storage.probe_writable(storage.resolve(path), flag, path)
    storage.clean_directory(storage.resolve(path))
    return path
  if os.path.exists(path) and not os.path.isdir(path):
    raise PathError(
        f'{storage.describe(flag, path)} is a file; give a directory (it is created if missing).'
    )
  check_not_input(path, flag, inputs or {})
  existing = os.path.abspath(path)
  while not os.path.isdir(existing):
    parent = os.path.dirname(existing)
    # isdir again: another process of the job may have made it since (not a file then).
    if (os.path.exists(existing) and not os.path.isdir(existing)) or parent == existing:
      raise PathError(
          f'{storage.describe(flag, path)}: {existing} is a file, not a directory; '
          'choose another path.'
      )
    existing = parent
  storage.probe_writable(existing, flag, path)
  if create:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise from_os_error(e) or PathError(
          f'{storage.describe(flag, path)}: cannot create it ({e.strerror}).'
      ) from None
  if os.path.isdir(path):
    storage.clean_directory(path)
  return path

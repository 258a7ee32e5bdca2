"""The project's user-facing errors: one base type, `UserError`, for everything a user can fix.

A `UserError`'s message is one paragraph that names the problem and the fix. The commands
(`cli.py`) report it with exit code 2 and no traceback; anything else is a bug and keeps its
traceback. The subclasses say where the problem is, and keep the built-in type they refine
(a `DataError` is still a `ValueError`), so code that catches those still works.
"""

from __future__ import annotations

import errno


class UserError(Exception):
  """A problem with the user's input that the user can fix; the message says how."""


class ConfigError(UserError, ValueError):
  """A config value that cannot work; the message names the field and the fix."""


class EnsembleError(UserError, ValueError):
  """Models that cannot be decoded as one ensemble, or weights that do not fit them."""


class DatasetNotFoundError(UserError, FileNotFoundError):
  """The dataset is not there (not prepared, no such file); the message says how to get it."""


class DataError(UserError, ValueError):
  """The data is there but unusable (unequal line counts, not UTF-8, empty, binary)."""


class CheckpointError(UserError):
  """A checkpoint is missing, damaged or not what the command needs."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """No such work directory, checkpoint or step."""


class CheckpointGoneError(CheckpointNotFoundError):
  """A checkpoint deleted while it was being read: a training run writing to the same work
  directory rotated it away (it keeps only its latest `keep_checkpoints`)."""


class OutputExistsError(UserError, FileExistsError):
  """A command would overwrite an output that already exists."""


class PathError(UserError, OSError):
  """A path a command was given cannot serve: missing, of the wrong kind, not writable, or
  both an input and an output of the command."""


class LaunchError(UserError):
  """A multi-process launch that cannot work: no launcher to find the job's processes, a
  coordinator port in use, processes started with different configs."""


class DiskFullError(UserError, OSError):
  """The disk holding the work directory is full."""


def from_os_error(error: OSError) -> UserError | None:
  """The `UserError` an operating-system error stands for, if it is the user's to fix.

  A full disk is reported as one line naming the file, whatever layer (orbax, TensorStore,
  SentencePiece, Python's own I/O) ran into it first.
  """
  where = f' writing {error.filename}' if error.filename else ''
  if error.errno in (errno.ENOSPC, errno.EDQUOT):
    return DiskFullError(
        f'No space left on the device{where}: free some space there or '
        'point --workdir at a disk with room, then rerun the same command '
        '(a training run resumes from its last complete checkpoint).'
    )
  if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
    return UserError(
        f'Permission denied{where} ({error.strerror}); choose a directory you can write to.'
    )
  return None


def find_user_error(error: BaseException) -> UserError | None:
  """The user error behind `error`: itself, or one in its chain of causes and contexts.

  Libraries wrap what they catch (orbax re-raises a full disk as a ValueError of another
  thread, say); the first `UserError` or full-disk `OSError` in the chain is what the user
  must hear about.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, UserError):
      return error
    if isinstance(error, OSError):
      found = from_os_error(error)
      if found is not None:
        return found
    if 'No space left on device' in str(error):
      return DiskFullError(
          'No space left on the device of the work directory: free some '
          'space or point --workdir at a disk with room, then rerun the '
          'same command (a training run resumes from its last complete '
          'checkpoint).'
      )
    error = error.__cause__ or error.__context__
  return None

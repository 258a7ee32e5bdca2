"""Every read and write of a file or an object, local or on Cloud Storage (`gs://`).

The package moves bytes only through here, so that one rule holds everywhere and another object
store would touch this module alone:

* Outputs are written to a temporary name beside them and renamed into place (`write_file`,
  `writing`; a directory of files that go together: `writing_directory`), so a reader sees
  the old file or the new one, never half of one, and a killed command never destroys what
  was there. Files that belong together (hypotheses and their metrics) are committed together
  by `write_files`: once all are written, a journal naming them is renamed into place (the
  commit point), then each is renamed, then the journal is removed.
* `clean_directory` cleans up after a killed command: a journal left by a dead process is
  finished (its files renamed into place), and the temporaries of dead processes are
  removed. A process is dead when no process has its id on this host, or, for another host's
  files (a shared disk), when they are older than `STALE_AFTER_S`.
* Whole directories go up and down with `upload` and `download`; `publish` uploads and then
  writes a marker that says the upload is complete (`published` reads it, `fetch` brings it
  back); `local_cache` is where a gs:// path's files are kept on this host.
* A cache that any process may make again (a token store) is rebuilt in a temporary
  directory and renamed into place (`rebuilding_directory`); a log grows by lines
  (`LineLog`); a library that writes only local files (TensorBoard) writes to a `LocalMirror`.

Temporary names: `.NAME.tmp-PID-RANDOM-HOST` (journals: `.NAME.commit-PID-RANDOM-HOST`),
hidden, in the output's own directory (a rename never crosses file systems).

Cloud Storage goes through `etils.epath` and gcsfs: a directory is a prefix; an object appears
whole when its upload ends, so a file is written locally and uploaded once complete;
`write_files`' renames are copies and deletes there, which the journal makes safe to repeat. A
missing bucket, an unreachable endpoint and a refused permission are `PathError`s that name
the bucket and the fix (`cloud_errors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
import contextlib
import errno
import hashlib
import json
import os
import posixpath
import re
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, IO
import urllib.error
import urllib.request
import uuid

from transformer_jax.errors import from_os_error
from transformer_jax.errors import OutputExistsError
from transformer_jax.errors import PathError

STALE_AFTER_S = 3600.0  # Another host's temporaries older than this belong to a dead run.


_TEMPORARY = re.compile(
    r'^\.(?P<name>.+)\.(?P<kind>tmp|commit)-(?P<pid>\d+)-[0-9a-f]{8}-(?P<host>.*)$'
)


SCHEME = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://')


def _no_listings_cache() -> None:
  """gcsfs keeps directory listings per process by default, so one process would not see
  what another wrote or deleted (a checkpoint set aside, a lock, a temporary): off, for
  every gcsfs filesystem of this process (epath's and orbax's alike). Set before any is
  made, hence at import."""
  try:
    from fsspec import config
  except ImportError:
    return
  for protocol in ('gs', 'gcs'):
    config.conf.setdefault(protocol, {}).setdefault('use_listings_cache', False)


_no_listings_cache()


def is_remote(path: str) -> bool:
  """Whether `path` is a URL (`gs://...`) rather than a local path."""
  return bool(SCHEME.match(os.fspath(path)))


def resolve(path: str) -> str:
  """An absolute local path, or the URL as given (without a trailing '/')."""
  return path.rstrip('/') if is_remote(path) else os.path.abspath(path)


def split_path(path: str) -> tuple[str, str]:
  return posixpath.split(path) if is_remote(path) else os.path.split(os.path.abspath(path))


def as_epath(path: str) -> Any:
  from etils import epath

  return epath.Path(path)


def _host() -> str:
  return socket.gethostname().replace('/', '_')


def temporary_path(path: str, kind: str = 'tmp') -> str:
  """A fresh temporary name beside `path`, which `clean_directory` recognises."""
  directory, name = split_path(path)
  name = f'.{name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{_host()}'
  return posixpath.join(directory, name) if is_remote(path) else os.path.join(directory, name)


def local_cache(url: str) -> str:
  """A local directory for the local copies of what lies at the gs:// `url` (SentencePiece
  reads files, token stores are memory-mapped, datasets are prepared on a local disk):
  $TRANSFORMER_JAX_CACHE (default ~/.cache/transformer_jax)/<a hash of the URL>."""
  root = os.environ.get('TRANSFORMER_JAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'transformer_jax'
  )
  return os.path.join(root, hashlib.sha256(resolve(url).encode()).hexdigest()[:16])


def _gcsfs() -> Any:
  import gcsfs

  return gcsfs.GCSFileSystem()


def _relative_files(local: str) -> list[str]:
  """The files below the local directory `local`, as sorted '/'-separated relative names."""
  return sorted(
      os.path.relpath(os.path.join(root, name), local).replace(os.sep, '/')
      for root, _, names in os.walk(local)
      for name in names
  )


def upload(local: str, remote: str, flag: str, *, last: tuple[str, ...] = ()) -> None:
  """Uploads the file or directory `local` to the gs:// `remote`, one object per file; the
  files named in `last` go last, so that a reader who waits for them (a marker) finds every
  other file complete."""
  if os.path.isdir(local):
    files = sorted(_relative_files(local), key=lambda rel: posixpath.basename(rel) in last)
    pairs = [(os.path.join(local, rel), f'{resolve(remote)}/{rel}') for rel in files]
  else:
    pairs = [(local, resolve(remote))]
  with cloud_errors(remote, flag):
    fs = _gcsfs()
    for source, target in pairs:
      fs.put_file(source, target)


def rename_directory(
    source: str, target: str, *, mark: str | None = None, flag: str = 'the path'
) -> None:
  """Renames the directory `source` to `target`. Locally one rename. On Cloud Storage, where a
  rename is a copy and a delete of every object, safe to kill at any point, with `mark` (a
  name under the directory whose presence tells its reader the directory is complete) moved
  so that one complete copy exists throughout: every other object is copied to `target`, then
  `mark` (a copy killed before it is incomplete, and `source` is still whole: a rerun copies
  again), then `source`'s `mark` is deleted (no longer complete there), then the rest."""
  if not is_remote(source):
    os.rename(source, target)
    return
  fs = _gcsfs()
  with cloud_errors(source, flag):
    objects = fs.find(source)
    marker = f'{source.removeprefix("gs://")}/{mark}' if mark else None
    copy = lambda name: fs.copy(
        name, target.removeprefix('gs://') + name[len(source) - len('gs://') :]
    )
    for name in objects:
      if name != marker:
        copy(name)
    if marker in objects:
      copy(marker)
      fs.rm(marker)
    fs.rm(source, recursive=True)


def download(remote: str, local: str, flag: str) -> None:
  """Downloads the gs:// file or directory `remote` to `local` (replacing it, through a
  temporary beside it)."""
  os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
  tmp = temporary_path(local)
  try:
    with cloud_errors(remote, flag):
      fs = _gcsfs()
      if fs.isdir(remote):
        fs.get(resolve(remote) + '/', tmp + '/', recursive=True)
      else:
        fs.get(remote, tmp)
    if os.path.isdir(local):
      shutil.rmtree(local)
    os.replace(tmp, local)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def bucket_of(path: str) -> str:
  """The bucket of a gs:// path, as gs://BUCKET."""
  return 'gs://' + path[len('gs://') :].split('/', 1)[0]


# --- One bound for every wait on Cloud Storage. ---

_limit: dict[str, Any] = {'seconds': None, 'stop': None}
_waits: dict[Any, tuple[float, str, str]] = {}  # A token: (since, path, what).
_waits_lock = threading.Lock()
_watchdog: list[threading.Thread] = []


def limit_waits(seconds: float | None, stop: Callable[[str], Any]) -> None:
  """Bounds every wait on Cloud Storage in this process (`waiting`): one still waiting after
  `seconds`, or a repeated one (the lock's heartbeat) failing for that long since it last
  succeeded, calls `stop(message)` from a watchdog thread; the commands print the message
  and exit 2 at once (`cli.fail_now`). Shorter outages are ridden out by the clients'
  retries. None: no bound."""
  _limit.update(seconds=seconds, stop=stop)


@contextlib.contextmanager
def waiting(path: str, what: str, *, key: str | None = None) -> Iterator[None]:
  """Counts the block as a wait on the Cloud Storage of `path`, doing `what` (words such as
  'saving checkpoint 60'), against the bound of `limit_waits`. With `key`, a failed block
  leaves its start in place, so that the next block of that key (a retry) is bounded from
  the first failure; a block that succeeds clears it. Local paths are not bounded."""
  if not is_remote(path) or _limit['seconds'] is None:
    yield
    return
  token = key if key is not None else object()
  with _waits_lock:
    since = _waits[token][0] if token in _waits else time.monotonic()
    _waits[token] = (since, path, what)
    if not _watchdog:
      _watchdog.append(threading.Thread(target=_watch, name='storage-watchdog', daemon=True))
      _watchdog[0].start()
  done = False
  try:
    yield
    done = True
  finally:
    if key is None or done:
      with _waits_lock:
        _waits.pop(token, None)


def _watch() -> None:
  while True:
    seconds = _limit['seconds']
    time.sleep(max(0.1, min(2.0, (seconds or 10.0) / 20)))
    if seconds is None:
      continue
    with _waits_lock:
      late = [
          (token, wait) for token, wait in _waits.items() if time.monotonic() - wait[0] >= seconds
      ]
      late.sort(key=lambda item: item[1][0])  # The oldest first.
      for token, _ in late:
        del _waits[token]  # Reported once (the commands' `stop` does not return).
    for _, (since, path, what) in late[:1]:
      bucket = bucket_of(path)
      _limit['stop'](
          f'Cloud Storage did not answer for {time.monotonic() - since:.0f} s while {what}: '
          f'{bucket} is unreachable or failing, and waits on it end after '
          f'--storage_timeout_seconds={seconds:g}. Nothing unfinished is read back: once '
          f'{bucket} answers again, rerun the same command (training resumes from its last '
          'complete checkpoint).'
      )


def _answers(bucket: str) -> bool:
  """Whether Cloud Storage (STORAGE_EMULATOR_HOST where set, as gcsfs) gives any HTTP answer
  about `bucket` (gs://NAME) within 5 s: "no such bucket" and "not allowed" are answers."""
  endpoint = os.environ.get('STORAGE_EMULATOR_HOST') or 'https://storage.googleapis.com'
  if '://' not in endpoint:
    endpoint = 'http://' + endpoint
  url = f'{endpoint.rstrip("/")}/storage/v1/b/{bucket[len("gs://") :]}'
  try:
    urllib.request.urlopen(url, timeout=5).close()
  except urllib.error.HTTPError:
    return True
  except (OSError, ValueError):
    return False
  return True


def wait_for_answer(path: str, what: str) -> None:
  """After a failure at the gs:// `path`: returns once its bucket answers again (at once, if
  it does), or, while it stays silent, waits as any wait does (`waiting`), so that an outage
  past the bound of `limit_waits` is reported as one. Some failures are an outage in
  disguise: gcsfs answers "does not exist" when it cannot ask, and orbax raises
  "Checkpoint directory does not exist" for a checkpoint it has just written. The caller
  re-raises its error if this returns. Local paths, and no bound: returns at once."""
  if not is_remote(path) or _limit['seconds'] is None:
    return
  key = object()
  with waiting(path, what, key=key):
    while key in _waits and not _answers(bucket_of(path)):  # Reported: the stop came.
      time.sleep(0.5)


def cloud_error(error: BaseException, path: str, flag: str = 'the path') -> PathError:
  """The `PathError` for a failure of Cloud Storage at `path`: one paragraph naming the bucket
  and the fix."""
  bucket = bucket_of(path)
  where = describe(flag, path)
  detail = ' '.join(f'{type(error).__name__}: {error}'.split())[:300]
  code = getattr(error, 'code', None)
  if isinstance(error, ImportError):
    return PathError(f'{where}: gs:// paths need gcsfs; pip install "transformer-jax[gcs]".')
  # gcsfs raises a 403 as a plain OSError('Forbidden: ...'), without a code.
  refused = re.search(r'\b(Forbidden|Unauthorized|does not have storage\.)', str(error))
  if isinstance(error, PermissionError) or code in (401, 403) or refused:
    return PathError(
        f'{where}: Cloud Storage refused access to {bucket} ({detail}); sign in '
        'with `gcloud auth application-default login` (or set '
        'GOOGLE_APPLICATION_CREDENTIALS), and make sure this account may write '
        f'objects there (roles/storage.objectAdmin on {bucket}).'
    )
  if isinstance(error, FileNotFoundError) or code == 404:
    return PathError(
        f'{where}: the bucket {bucket} does not exist (or this account cannot see '
        f'it); create it (gcloud storage buckets create {bucket}) or correct the '
        'name.'
    )
  if isinstance(error, (OSError, ConnectionError, TimeoutError)) or 'connect' in detail.lower():
    return PathError(
        f'{where}: cannot reach Cloud Storage for {bucket} ({detail}); check the '
        'network (and STORAGE_EMULATOR_HOST, if it is set).'
    )
  return PathError(f'{where}: Cloud Storage failed for {bucket} ({detail}).')


@contextlib.contextmanager
def cloud_errors(path: str, flag: str = 'the path') -> Iterator[None]:
  """Turns a Cloud Storage failure at `path` into `cloud_error`'s `PathError`; the block is
  a wait on Cloud Storage (`waiting`), bounded by `limit_waits`."""
  try:
    with waiting(path, f'using {describe(flag, path)}'):
      yield
  except (PathError, OutputExistsError):
    raise
  except Exception as e:  # gcsfs, aiohttp and auth raise many.
    raise cloud_error(e, path, flag) from e


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
    mtime = as_epath(path).stat().mtime if is_remote(path) else os.stat(path).st_mtime
  except FileNotFoundError:
    return False
  return time.time() - mtime > STALE_AFTER_S


def describe(flag: str, path: str) -> str:
  return f'{flag}={path}' if flag.startswith('--') else f'{flag} {path}'


def open_file(path: str, mode: str = 'rb') -> IO[Any]:
  """Opens a local or gs:// file for reading."""
  if is_remote(path):
    with cloud_errors(path):
      return as_epath(path).open(mode)
  return open(path, mode)  # Binary, as callers ask.


def is_directory(path: str, flag: str = 'the path') -> bool:
  """Whether a local or gs:// directory exists (on Cloud Storage: any object below it)."""
  if is_remote(path):
    with cloud_errors(path, flag):
      return as_epath(path).is_dir()
  return os.path.isdir(path)


def kind_of(path: str, flag: str = 'the path') -> str | None:
  """'file', 'directory' or None (nothing there) for a local or gs:// path. On Cloud Storage
  a directory is any object below the prefix; an object and a prefix of the same name (which
  Cloud Storage allows) read as a file."""
  if is_remote(path):
    with cloud_errors(path, flag):
      target = as_epath(path)
      return 'file' if target.is_file() else 'directory' if target.is_dir() else None
  return 'directory' if os.path.isdir(path) else 'file' if os.path.exists(path) else None


def probe_writable(directory: str, flag: str, path: str) -> None:
  """Creates and removes a file in `directory`: the one test of writability that holds for
  root, ACLs and read-only mounts alike (and, on Cloud Storage, for a missing bucket, which
  `mkdir` there would not notice)."""
  if is_remote(directory):
    probe = temporary_path(posixpath.join(directory, 'write-probe'))
    with cloud_errors(path, flag):
      as_epath(probe).write_bytes(b'')
      as_epath(probe).unlink()
    return
  probe = temporary_path(os.path.join(directory, 'write-probe'))
  try:
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
      raise from_os_error(e) from None
    raise PathError(
        f'{describe(flag, path)}: cannot create files in {directory} ({e.strerror}); '
        'choose a directory you can write to.'
    ) from None


@contextlib.contextmanager
def writing(path: str, mode: str = 'w') -> Iterator[IO[Any]]:
  """Opens a temporary file beside `path`; renames it to `path` when the block ends without
  an error, and removes it otherwise (the old `path`, if any, is untouched). On Cloud
  Storage the file is written locally and uploaded when complete."""
  if is_remote(path):
    with tempfile.TemporaryDirectory() as local:
      with writing(os.path.join(local, 'output'), mode) as f:
        yield f
      with cloud_errors(path, 'the output'), open(os.path.join(local, 'output'), 'rb') as f:
        as_epath(path).write_bytes(f.read())
    return
  tmp = temporary_path(path)
  try:
    with open(tmp, mode, **({} if 'b' in mode else {'encoding': 'utf-8', 'newline': '\n'})) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


@contextlib.contextmanager
def writing_directory(path: str, *, last: tuple[str, ...] = ()) -> Iterator[str]:
  """A temporary directory beside `path` to write a set of files in; renamed to `path` when
  the block ends without an error (so they appear together), removed otherwise.

  On Cloud Storage, which renames nothing at once, the directory is a local temporary one,
  uploaded one object at a time when the block ends, the files named in `last` last (a
  reader's sign that the rest is complete); what a killed upload of the same files left
  there is overwritten by the next.

  Raises:
    OutputExistsError: `path` exists and is not empty (checked again at the rename; on
      Cloud Storage, holds objects other than these files).
  """
  if is_remote(path):
    with tempfile.TemporaryDirectory() as local:
      yield local
      _check_only(path, local)
      upload(local, path, 'the output directory', last=last)
    return
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


@contextlib.contextmanager
def rebuilding_directory(path: str, *, still_good: Callable[[], bool]) -> Iterator[str]:
  """A temporary directory beside the local `path` to rebuild a cache in (a directory that
  any process may make again from the same inputs, such as a token store); renamed into
  place when the block ends without an error, replacing a stale one there, and removed
  otherwise. Where `still_good()` says that `path` is already what this block made (another
  process finished first), or another process renames its own in first, theirs is kept and
  this one is removed."""
  tmp = temporary_path(path)
  os.makedirs(tmp)
  try:
    yield tmp
    if still_good():
      return
    if os.path.exists(path):  # Stale: made from other inputs.
      shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # Another process got there between the two.
      os.replace(tmp, path)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _check_empty(path: str) -> None:
  if os.path.isdir(path) and os.listdir(path):
    raise OutputExistsError(f'{path} is not empty; give a new or empty directory.')


def _check_only(remote: str, local: str) -> None:
  """Raises `OutputExistsError` if the gs:// directory `remote` holds objects other than
  the files of `local` (those are a killed upload's, which this one replaces)."""
  mine = set(_relative_files(local))
  prefix = resolve(remote)[len('gs://') :] + '/'
  with cloud_errors(remote, 'the output directory'):
    found = {
        name[len(prefix) :] for name in _gcsfs().find(resolve(remote)) if name.startswith(prefix)
    }
  if found - mine:
    raise OutputExistsError(
        f'{remote} is not empty (it holds {sorted(found - mine)[0]}); give a new or empty '
        f'directory, or delete it: gcloud storage rm -r {resolve(remote)}'
    )


def write_file(path: str, data: str | bytes) -> None:
  """Writes `data` to `path` atomically (a temporary file renamed into place; on Cloud
  Storage one upload)."""
  if is_remote(path):
    with cloud_errors(path, 'the output'):
      as_epath(path).write_bytes(data if isinstance(data, bytes) else data.encode('utf-8'))
    return
  with writing(path, 'wb' if isinstance(data, bytes) else 'w') as f:
    f.write(data)


def create_new(path: str, data: str) -> bool:
  """Creates the local file `path` with `data` in it, in one step (a reader never sees it
  empty or half written); False if a file is there already. For a lock: of several
  processes creating the same path at once, exactly one succeeds."""
  tmp = temporary_path(path)
  try:
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    try:
      os.link(tmp, path)
      return True
    except FileExistsError:
      return False
    except OSError as e:
      if e.errno not in (
          errno.EPERM,
          errno.ENOTSUP,
          errno.EOPNOTSUPP,
          errno.EXDEV,
          errno.ENOSYS,
          errno.EMLINK,
      ):
        raise
    # No hard links here (gcsfuse, some FUSE file systems): create, then write.
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    try:
      with os.fdopen(fd, 'w', encoding='utf-8') as f:
        f.write(data)
    except BaseException:
      os.remove(path)
      raise
    return True
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)


def remove_once(path: str) -> bool:
  """Removes the local file `path`; of several processes removing it at once (each having
  judged the same file stale), exactly one gets True, and a file created there meanwhile is
  not removed by the others. False if it was gone."""
  aside = temporary_path(path)
  try:
    os.rename(path, aside)
  except FileNotFoundError:
    return False
  os.remove(aside)
  return True


def _replace(source: str, target: str) -> None:
  if is_remote(source):
    with cloud_errors(target, 'the output'):
      as_epath(source).replace(target)  # A copy, then a delete.
  else:
    os.replace(source, target)


def _remove(path: str) -> None:
  if is_remote(path):
    with cloud_errors(path, 'the output'):
      as_epath(path).unlink()
  else:
    os.remove(path)


def exists(path: str) -> bool:
  if is_remote(path):
    with cloud_errors(path):
      return as_epath(path).exists()
  return os.path.exists(path)


def file_stats(directory: str) -> list[tuple[str, int, int]]:
  """(name, size, modification time in ns) of each file directly in a local or gs://
  directory, sorted by name; [] if there is no such directory."""
  if is_remote(directory):
    with cloud_errors(directory):
      entries = (
          [p for p in as_epath(directory).iterdir() if p.is_file()]
          if as_epath(directory).is_dir()
          else []
      )
      stats = [(p.name, p.stat()) for p in entries]
    return sorted((name, stat.length, int(stat.mtime * 1e9)) for name, stat in stats)
  if not os.path.isdir(directory):
    return []
  return sorted(
      (e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory) if e.is_file()
  )


def _join(directory: str, name: str) -> str:
  return posixpath.join(directory, name) if is_remote(directory) else os.path.join(directory, name)


def write_files(files: Mapping[str, str | bytes]) -> None:
  """Writes several files of one directory so that they are replaced together or not at all.

  Each is written to a temporary name; then a journal listing them is renamed into place
  (the commit: from here on `clean_directory` finishes the job if this process dies); then
  each file is renamed; then the journal is removed.
  """
  paths = [resolve(p) for p in files]
  directory = split_path(paths[0])[0]
  if any(split_path(p)[0] != directory for p in paths):
    raise ValueError(f'write_files writes into one directory, not {paths}.')
  temporaries = {}
  try:
    for path, data in zip(paths, files.values()):
      temporaries[path] = temporary_path(path)
      if is_remote(path):
        write_file(temporaries[path], data)
        continue
      with open(temporaries[path], 'wb') as f:
        f.write(data if isinstance(data, bytes) else data.encode('utf-8'))
        f.flush()
        os.fsync(f.fileno())
    journal = temporary_path(paths[0], 'commit')
    write_file(
        journal, json.dumps({split_path(t)[1]: split_path(p)[1] for p, t in temporaries.items()})
    )
  except BaseException:
    for tmp in temporaries.values():
      with contextlib.suppress(OSError):
        _remove(tmp)
    raise
  _finish_commit(journal)


def _finish_commit(journal: str) -> None:
  """Renames every file a journal lists into place (those still there), then removes it.
  Safe to repeat after a kill at any point (on Cloud Storage a rename is a copy, then a
  delete: a file copied but not deleted is copied again)."""
  directory = split_path(journal)[0]
  if is_remote(journal):
    with cloud_errors(journal):
      renames = json.loads(as_epath(journal).read_text())
  else:
    with open(journal, encoding='utf-8') as f:
      renames = json.load(f)
  for tmp, final in renames.items():
    if exists(_join(directory, tmp)):
      _replace(_join(directory, tmp), _join(directory, final))
  _remove(journal)


def clean_directory(directory: str) -> list[str]:
  """Finishes the commits and removes the temporaries that dead processes left in
  `directory` (see the module doc); returns what it removed or finished."""
  done = []
  try:
    if is_remote(directory):
      with cloud_errors(directory):
        names = [p.name for p in as_epath(directory).iterdir()]
    else:
      names = os.listdir(directory)
  except (OSError, PathError):
    return done
  found = [(name, m) for name in names if (m := _TEMPORARY.match(name))]
  # Journals first: the temporaries they name are finished, not removed.
  for name, match in sorted(found, key=lambda item: item[1]['kind'] != 'commit'):
    path = _join(directory, name)
    if not _owner_dead(path, int(match['pid']), match['host']):
      continue
    try:
      if match['kind'] == 'commit':
        _finish_commit(path)
      elif not is_remote(path) and os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # Of `writing_directory`.
      else:
        _remove(path)
    except FileNotFoundError:
      continue  # Another process cleaned it up meanwhile.
    except (OSError, ValueError, PathError):
      continue  # Unreadable: left for a person to look at.
    done.append(path)
  return done


_PUBLISHED = 'PUBLISHED.json'  # Written last: what the files beside it are (their meta).


def publish(local: str, remote: str, meta: dict[str, Any]) -> None:
  """Uploads the file or directory `local` to `remote`, then the marker that says it is
  complete, with `meta` in it (a reader trusts nothing without it)."""
  upload(local, remote, '--workdir')
  write_file(f'{remote}.{_PUBLISHED}', json.dumps(meta, sort_keys=True))


def published(remote: str) -> dict[str, Any] | None:
  """The meta of what `publish` finished at `remote`, or None."""
  marker = f'{remote}.{_PUBLISHED}'
  if not exists(marker):
    return None
  with open_file(marker) as f:
    return json.loads(f.read())


def fetch(remote: str, local: str) -> None:
  """Downloads a published file or directory (replacing `local`, through a temporary)."""
  download(remote, local, '--workdir')


class LineLog:
  """A text file that grows a line at a time (a run's metrics.jsonl). Locally, each line is
  appended in one write. Cloud Storage has no append (gcsfs's append mode replaces the
  object), so there the object is rewritten with every line so far, one upload each."""

  def __init__(self, path: str, keep: Callable[[str], bool] = lambda line: True):
    """Opens the log at `path`, keeping only its lines for which `keep(line)` holds (the file
    is rewritten without the others, atomically)."""
    self.path = path
    self._lines: list[str] = []
    if exists(path):
      with open_file(path) as f:
        text = f.read().decode('utf-8', errors='replace')
      self._lines = [line for line in text.splitlines(keepends=True) if keep(line)]
      write_file(path, ''.join(self._lines))
    if not is_remote(path):
      self._lines = []  # Appended in place, never held.

  def append(self, line: str) -> None:
    """Adds `line` (ending with a newline) at the end of the file."""
    if is_remote(self.path):
      self._lines.append(line)
      write_file(self.path, ''.join(self._lines))
    else:
      with open(self.path, 'a', encoding='utf-8') as f:
        f.write(line)


class LocalMirror:
  """A directory that a library writes to with local file operations (TensorBoard's event
  writer): `local` is the directory itself, or, for a gs:// one, a local temporary directory
  whose files `sync` uploads whole (each file's newest contents replacing its object)."""

  def __init__(self, path: str, flag: str):
    self.path, self._flag = resolve(path), flag
    self._remote = is_remote(path)
    self.local = tempfile.mkdtemp(prefix='transformer_jax_mirror_') if self._remote else path

  def sync(self) -> None:
    if self._remote:
      upload(self.local, self.path, self._flag)

  def close(self) -> None:
    """Syncs a last time and removes the local copy of a gs:// directory."""
    if self._remote:
      self.sync()
      shutil.rmtree(self.local, ignore_errors=True)


class GenerationObject:
  """One Cloud Storage object written only by compare-and-swap on its generation (Cloud
  Storage's version number of an object, which every write changes): what needs one writer
  at a time, such as the work directory's lock. Errors come as `cloud_errors(url, flag)`."""

  def __init__(self, url: str, flag: str):
    try:
      from google.cloud import storage as gcs
    except ImportError as e:
      raise cloud_error(e, url, flag) from e
    self.url, self.flag = url, flag
    bucket, name = url[len('gs://') :].split('/', 1)
    with cloud_errors(url, flag):
      self._blob = gcs.Client().bucket(bucket).blob(name)

  def newest_generation(self) -> int | None:
    """The object's generation now, or None if there is no object."""
    with cloud_errors(self.url, self.flag):
      current = self._blob.bucket.get_blob(self._blob.name)
    return None if current is None else current.generation

  def read(self) -> tuple[bytes, int] | None:
    """The newest generation's bytes and number, or None if there is no object (also when it
    is replaced between the two requests: the caller looks again)."""
    from google.api_core import exceptions

    with cloud_errors(self.url, self.flag):
      current = self._blob.bucket.get_blob(self._blob.name)
      if current is None:
        return None
      try:  # A `Blob` with a generation reads that generation.
        return current.download_as_bytes(), current.generation
      except exceptions.NotFound:
        return None

  def write(self, data: bytes, if_generation: int) -> int | None:
    """Writes `data` if the object's generation is `if_generation` (0: if there is no
    object); the new generation, or None if it was not."""
    from google.api_core import exceptions

    with cloud_errors(self.url, self.flag):
      try:
        # A small upload is a multipart upload, which carries the precondition.
        self._blob.upload_from_string(
            data, content_type='application/json', if_generation_match=if_generation
        )
      except exceptions.PreconditionFailed:
        return None
    return self._blob.generation

  def delete(self, if_generation: int) -> None:
    """Deletes the object if its generation is `if_generation` (else leaves it)."""
    from google.api_core import exceptions

    try:
      self._blob.delete(if_generation_match=if_generation)
    except (exceptions.NotFound, exceptions.PreconditionFailed):
      pass

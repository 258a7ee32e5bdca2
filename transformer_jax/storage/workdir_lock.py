"""One training job per work directory: `WORKDIR/train.lock`.

Two `train.py` on one work directory would delete each other's checkpoints in progress and
interleave their metrics. The first to start creates `train.lock` with its host, process id
and start time in one step: it writes them to a temporary file and hard-links that to
`train.lock`, which fails if the lock exists (atomic on local disks and NFS alike); so a lock
file never exists without its contents, and a full disk leaves no lock behind. The holder
touches it every `HEARTBEAT_S` seconds while it runs; a second job finds it and stops with an
error that names the holder. Only process 0 of a multi-host job takes the lock: the job's
other processes write to the same directory by design. (On a file system without hard links,
such as gcsfuse, the lock is created with `O_EXCL` and then written.)

A lock is stale, and a new run takes it over with a warning, when its process is gone: on
the same host, when no process has its id (or the id belongs to a process started after the
lock); on another host, which cannot be asked, when the lock has not been touched for
`STALE_AFTER_S` seconds. A lock that is empty or cannot be parsed belongs to no live holder
(one was never created that way) and is taken over at once. Evaluation and translation only
read, and ignore the lock.

On Cloud Storage (a gs:// work directory) the lock is an object, and every change of it is
conditional on its generation (google-cloud-storage's `if_generation_match`): it is created
only if absent (generation 0), the heartbeat rewrites it only if it is still the generation
this job wrote, a stale lock is taken over by rewriting the generation judged stale (of two
racing takers one wins), and release deletes only this job's generation. Another host's lock
is stale when its generation has not changed for `STALE_AFTER_S` seconds of this process's
own clock, so clock skew between hosts does not matter; a second job therefore waits up to a
heartbeat before it can call a live lock busy.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from absl import logging

from transformer_jax.errors import UserError
from transformer_jax.storage import storage

_RELEASED = 'it was just released'
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


class WorkdirBusyError(UserError):
  """Another live training job holds the work directory."""


def _process_start_time(pid: int) -> float | None:
  """When `pid` started (seconds since the epoch), where /proc says; else None."""
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/stat', encoding='utf-8') as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith('btime'))
    return boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, StopIteration, IndexError):
    return None


class WorkdirLock:
  """The lock of one training job on a work directory (a context manager), a file or object
  at `path` (`RunLayout.lock`)."""

  def __init__(
      self, path: str, *, stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S
  ):
    self.path = path
    self._stale_after_s = stale_after_s
    self._heartbeat_s = heartbeat_s
    self._token = uuid.uuid4().hex
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._object = (
        storage.GenerationObject(self.path, '--workdir') if storage.is_remote(path) else None
    )
    self._generation = 0  # Of the lock object as last seen or written (Cloud Storage).

  def _read(self) -> bytes | None:
    """The lock's bytes (remembering the object's generation), or None if there is none."""
    if self._object is None:
      try:
        with open(self.path, 'rb') as f:
          return f.read()
      except FileNotFoundError:
        return None
    read = self._object.read()
    if read is None:
      return None
    data, self._generation = read
    return data

  def _holder(self) -> dict | None:
    """The lock's record; {} if it is empty or damaged (a lock is never seen before its
    contents); None if there is no lock."""
    try:
      data = self._read()
      if data is None:
        return None
      holder = json.loads(data)
    except (OSError, ValueError):
      return {}
    if not isinstance(holder, dict) or not {'host', 'pid', 'started', 'token'} <= set(holder):
      return {}
    return holder

  def _stale_reason(self, holder: dict) -> str | None:
    """Why the lock's holder is gone, or None if it may be alive."""
    if not holder:
      return 'it is empty or cannot be parsed, so no live job holds it'
    try:
      age = 0.0 if self._object is not None else time.time() - os.stat(self.path).st_mtime
    except FileNotFoundError:
      return _RELEASED
    if holder.get('host') == socket.gethostname() and isinstance(holder.get('pid'), int):
      pid = holder['pid']
      if not storage.process_alive(pid):
        return f'process {pid} is gone'
      started = _process_start_time(pid)
      if started is not None and started > holder.get('started', 0) + 5:
        return f'process id {pid} now belongs to a newer process'
      return None
    if self._object is not None:
      return self._remote_stale_reason()
    if age > self._stale_after_s:
      return f'it was last touched {age:.0f} s ago'
    return None

  def acquire(self) -> None:
    """Takes the lock, or raises `WorkdirBusyError` naming the job that holds it."""
    self._started = time.time()
    record = self._record()
    for _ in range(5):
      if self._create(record):
        self._start_heartbeat()
        return
      holder = self._holder()
      if holder is None:
        continue  # Released meanwhile.
      reason = self._stale_reason(holder)
      if reason is None:
        raise WorkdirBusyError(
            f'{os.path.dirname(self.path)} is in use by another training job '
            f'(process {holder["pid"]} on host {holder["host"]}, started '
            f'{time.ctime(holder["started"])}); wait for it or stop it, or use another '
            '--workdir. (evaluate.py and translate.py may read it meanwhile.) A lock left by '
            f'a crashed job on another host is taken over {self._stale_after_s:.0f} s after '
            'its last heartbeat.'
        )
      if self._object is not None:
        # Replace the very generation judged stale (one of several racing takers wins).
        if reason == _RELEASED or not self._write(record, self._generation):
          continue
        self._start_heartbeat()
      else:
        # Move the stale lock aside (one of several racing takers wins), then retry.
        if not storage.remove_once(self.path):
          continue
      if holder:
        logging.warning(
            'Took over the lock of %s from process %s on %s: %s.',
            os.path.dirname(self.path),
            holder['pid'],
            holder['host'],
            reason,
        )
      else:
        logging.warning('Took over the lock %s: %s.', self.path, reason)
      if self._thread is not None:  # Taken over in place (Cloud Storage).
        return
    raise WorkdirBusyError(
        f'Could not take {self.path}: other jobs keep taking it; start one job per --workdir.'
    )

  def _start_heartbeat(self) -> None:
    self._thread = threading.Thread(target=self._beat, name='workdir-lock', daemon=True)
    self._thread.start()

  def _remote_stale_reason(self) -> str | None:
    """Watches the lock object: None (alive) once its generation changes, a reason once it
    has not for `stale_after_s` seconds of this clock."""
    seen, start = self._generation, time.monotonic()
    logging.warning(
        '%s is held by a job on another host; watching it for up to %.0f s: a heartbeat there '
        'means that job is alive (this run then stops), none means it is gone (this run '
        'takes the lock over).',
        self.path,
        self._stale_after_s,
    )
    while (waited := time.monotonic() - start) < self._stale_after_s:
      time.sleep(min(self._heartbeat_s / 4, self._stale_after_s - waited, 5.0))
      generation = self._object.newest_generation()
      if generation is None:
        return _RELEASED
      if generation != seen:
        return None
    return (
        f'its generation has not changed for {self._stale_after_s:.0f} s (no heartbeat) '
        "by this host's clock"
    )

  def _write(self, record: str, generation: int) -> bool:
    """Writes the lock object if its generation is `generation` (0: if there is none);
    False if it is not."""
    written = self._object.write(record.encode('utf-8'), if_generation=generation)
    if written is None:
      return False
    self._generation = written
    return True

  def _create(self, record: str) -> bool:
    """Creates the lock with `record` in it in one step; False if it exists."""
    if self._object is not None:
      return self._write(record, 0)
    return storage.create_new(self.path, record)

  def _beat(self) -> None:
    while not self._stop.wait(self._heartbeat_s):
      if self._object is None:
        try:
          os.utime(self.path)
        except OSError:
          pass
        continue
      try:
        # Bounded from the first failed heartbeat, not from each retry (storage.waiting).
        with storage.waiting(self.path, f'renewing the lock {self.path}', key=self.path):
          written = self._write(self._record(), self._generation)
        if not written:
          logging.error(
              'Lost the lock %s: another job took it over (no heartbeat reached it '
              'for %.0f s?); stop one of them.',
              self.path,
              self._stale_after_s,
          )
          return
      except Exception as e:  # Retried at the next beat.
        logging.warning('The heartbeat of %s failed: %s', self.path, e)

  def _record(self) -> str:
    """This job's lock record (the same at every heartbeat)."""
    return json.dumps(
        {
            'host': socket.gethostname(),
            'pid': os.getpid(),
            'started': self._started,
            'token': self._token,
        }
    )

  def release(self) -> None:
    """Removes the lock if it is still this job's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
      if self._object is not None:
        self._object.delete(if_generation=self._generation)  # Only the one this job wrote.
        return
      if (self._holder() or {}).get('token') == self._token:
        try:
          os.remove(self.path)
        except FileNotFoundError:
          pass

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()

"""Shared by the training tests: a tiny parallel corpus, configs over it, subprocess runs."""

from __future__ import annotations

import json
import locale
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Compiled programs are reused across the tests' subprocesses (keys are content hashes).
JAX_CACHE = os.path.join(tempfile.gettempdir(), 'transformer_jax_test_jax_cache')
# Its sitecustomize lets every process of a multi-process job write to that cache (see there).
TESTS = os.path.join(REPO, 'tests')  # The helper modules (train_testlib, ...), for scripts.
SUBPROCESS_SITE = os.path.join(TESTS, 'subprocess_site')


def write_parallel_text(directory: str, seed: int = 0) -> dict[str, str]:
  """A toy translation task (reverse and upper-case each word) as 'text' dataset files.

  Returns:
    {split: 'source_path,target_path'} for train (400 pairs), validation and test.
  """
  rng = random.Random(seed)
  words = [
      ''.join(rng.choice('abcdefghijklmnop') for _ in range(rng.randint(2, 6))) for _ in range(60)
  ]
  files = {}
  for split, count in (('train', 400), ('validation', 40), ('test', 20)):
    paths = [os.path.join(directory, f'{split}.{side}') for side in ('src', 'tgt')]
    with open(paths[0], 'w') as src, open(paths[1], 'w') as tgt:
      for _ in range(count):
        sentence = [rng.choice(words) for _ in range(rng.randint(1, 8))]
        src.write(' '.join(sentence) + '\n')
        tgt.write(' '.join(w[::-1].upper() for w in sentence) + '\n')
    files[split] = ','.join(paths)
  return files


def write_case_text(directory: str, seed: int = 0) -> dict[str, str]:
  """Two "languages" of one toy corpus as 'text' dataset files: 'lo', words in lower case,
  and 'up', the same words in upper case, so that an output's case says its language.

  Returns:
    {split: 'lo_path,up_path'} for train (600 pairs), validation and test (40 each).
  """
  rng = random.Random(seed)
  words = [''.join(rng.choice('abcdefghij') for _ in range(rng.randint(2, 5))) for _ in range(30)]
  files = {}
  for split, count in (('train', 600), ('validation', 40), ('test', 40)):
    paths = [os.path.join(directory, f'{split}.{side}') for side in ('lo', 'up')]
    with open(paths[0], 'w') as lo, open(paths[1], 'w') as up:
      for _ in range(count):
        sentence = ' '.join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        lo.write(sentence + '\n')
        up.write(sentence.upper() + '\n')
    files[split] = ','.join(paths)
  return files


def small_config(files: dict[str, str], **overrides) -> ml_collections.ConfigDict:
  """configs/tiny.py shrunk to one layer and one bucket (one compiled shape), over `files`."""
  from configs import tiny

  config = tiny.get_config()
  config.dataset = 'text'
  for split, spec in files.items():
    config.text_files[split] = spec
  config.update(
      dict(
          num_encoder_layers=1,
          num_decoder_layers=1,
          max_len=32,
          max_source_length=32,
          max_target_length=32,
          bucket_boundaries=(),
          tokens_per_batch=256,
          vocab_size_target=128,
          num_train_steps=6,
          eval_every_steps=0,
          log_every_steps=1,
          checkpoint_every_steps=2,
      )
  )
  config.update(overrides)
  return config


def write_config_file(path: str, files: dict[str, str], **overrides) -> str:
  """A config file for train.py that returns `small_config(files, **overrides)`."""
  with open(path, 'w') as f:
    f.write(
        'import sys\n'
        f'sys.path.insert(0, {os.path.join(REPO, "tests")!r})\n'
        'import train_testlib\n\n\n'
        'def get_config():\n'
        f'  return train_testlib.small_config({files!r}, **{overrides!r})\n'
    )
  return path


def subprocess_env(devices: int = 1) -> dict[str, str]:
  """The environment for a command run as a subprocess, on `devices` simulated CPU devices.

  The caller's XLA_FLAGS are kept: under pytest, conftest's LLVM setting, so a subprocess
  compiles as the test process does and their numbers can be compared.
  """
  env = dict(os.environ)
  xla_flags = [
      env.get('XLA_FLAGS', ''),
      f'--xla_force_host_platform_device_count={devices}',
      # 8 simulated devices on 2 busy cores: a collective's threads can wait longer
      # than XLA:CPU's 40 s before it aborts the process.
      '--xla_cpu_collective_call_terminate_timeout_seconds=600',
      '--xla_cpu_collective_call_warn_stuck_timeout_seconds=120',
  ]
  if devices > 1:
    # XLA:CPU runs the simulated devices' work on max(cores, devices) threads (PJRT_NPROC
    # stands in for the core count): one thread a device on 2 cores. There, test_sharding's
    # checkpoint checksums (small programs with chained all-reduces) could deadlock, more
    # often beside a busy core: threads waited in all-reduces for partner devices that never
    # ran, until XLA aborted. With 4 threads a device the runs pass, quiet or loaded, in the
    # same time.
    env['PJRT_NPROC'] = str(4 * devices)
  env.update(
      {
          'XLA_FLAGS': ' '.join(f for f in xla_flags if f),
          'JAX_PLATFORMS': 'cpu',
          'JAX_COMPILATION_CACHE_DIR': JAX_CACHE,
          'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
          'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '-1',
          'PYTHONPATH': os.pathsep.join([SUBPROCESS_SITE, REPO, TESTS, env.get('PYTHONPATH', '')]),
          'PYTHONUNBUFFERED': '1',
      }
  )
  return env


MULTIHOST_STEPS = 8  # Steps of the multi-process tests' runs (conftest.multihost_config).


def multihost_config(directory, steps: int) -> str:
  """The config file of the multi-process tests: `steps` steps, a checkpoint every 4."""
  files = write_parallel_text(str(directory))
  return write_config_file(
      os.path.join(str(directory), 'config.py'),
      files,
      num_train_steps=steps,
      checkpoint_every_steps=4,
  )


def train_command(config_path: str, workdir: str, *flags: str) -> list[str]:
  return [
      sys.executable,
      os.path.join(REPO, 'train.py'),
      f'--config={config_path}',
      f'--workdir={workdir}',
      *flags,
  ]


def run_train(
    config_path: str, workdir: str, *flags: str, devices: int = 1, timeout: float = 240
) -> subprocess.CompletedProcess:
  """Runs train.py to the end; returns the completed process (output in .stderr)."""
  return run_command(
      train_command(config_path, workdir, *flags), env=subprocess_env(devices), timeout=timeout
  )


class _CommandServer:
  """tests/command_server.py, started once a test process: see its docstring."""

  def __init__(self):
    self.directory = tempfile.mkdtemp(prefix='command_server')
    self.socket = os.path.join(self.directory, 'socket')
    self.env = subprocess_env()
    self.process = subprocess.Popen(
        [sys.executable, os.path.join(REPO, 'tests', 'command_server.py'), self.socket],
        env=self.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = self.process.stdout.readline()
    assert ready == 'ready\n', f'tests/command_server.py did not start: {ready!r}'

  def serves(self, argv: list[str], cwd: str, env: dict[str, str]) -> bool:
    """Whether the server can run `argv` as a new Python would: a script of the checkout,
    under an environment whose JAX_* variables (read at import) are the server's."""
    jax_vars = lambda e: {k: v for k, v in e.items() if k.startswith('JAX_')}
    return (
        self.process.poll() is None
        and len(argv) >= 2
        and argv[0] == sys.executable
        and argv[1].endswith('.py')
        and os.path.isfile(os.path.join(cwd, argv[1]))
        and jax_vars(env) == jax_vars(self.env)
    )

  def run(
      self, argv: list[str], cwd: str, env: dict[str, str], stdin, stdout, stderr, timeout: float
  ) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
      conn.connect(self.socket)
      request = json.dumps({'argv': argv[1:], 'cwd': cwd, 'env': env}).encode()
      socket.send_fds(conn, [request], [stdin.fileno(), stdout.fileno(), stderr.fileno()])
      replies = conn.makefile('r')
      pid = int(replies.readline())
      conn.settimeout(timeout)
      try:
        status = replies.readline()
      except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        raise subprocess.TimeoutExpired(argv, timeout) from None
    return os.waitstatus_to_exitcode(int(status))


_server: _CommandServer | None = None


def run_command(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str = REPO,
    input: str | bytes | None = None,
    text: bool = True,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
  """`subprocess.run(argv, capture_output=True, ...)` for `python SCRIPT.py ...`, started by
  tests/command_server.py (a fork, not a new Python) where it can be."""
  global _server
  if _server is None or _server.process.poll() is not None:
    _server = _CommandServer()
  if not _server.serves(argv, cwd, env):
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        input=input,
        capture_output=True,
        text=text,
        timeout=timeout,
        check=False,
    )
  with (
      tempfile.TemporaryFile() as stdin,
      tempfile.TemporaryFile() as stdout,
      tempfile.TemporaryFile() as stderr,
  ):
    if input is not None:
      stdin.write(input.encode() if isinstance(input, str) else input)
      stdin.seek(0)
    returncode = _server.run(argv, cwd, env, stdin, stdout, stderr, timeout)
    outputs = []
    for stream in (stdout, stderr):
      stream.seek(0)
      output = stream.read()
      if text:  # Decoded as subprocess.run(text=True) decodes.
        output = output.decode(locale.getpreferredencoding(False))
        output = output.replace('\r\n', '\n').replace('\r', '\n')
      outputs.append(output)
  return subprocess.CompletedProcess(argv, returncode, *outputs)


def dead_pid() -> int:
  """The id of a process that has exited (until the system reuses it)."""
  process = subprocess.Popen(['true'])
  process.wait()
  return process.pid


def fill_disk(path: str) -> None:
  """Writes zeros to the file `path` until its disk is full, to the last byte."""
  try:
    with open(path, 'wb') as f:
      while True:
        f.write(b'\0' * 1024)
        f.flush()
  except OSError:
    pass


def config_and_reference(directory, **overrides) -> tuple[str, str]:
  """A config file (`small_config(**overrides)` over fresh parallel text in `directory`) and
  the work directory of its uninterrupted run, to compare an interrupted one with."""
  files = write_parallel_text(str(directory))
  config_path = write_config_file(os.path.join(str(directory), 'config.py'), files, **overrides)
  reference = os.path.join(str(directory), 'reference')
  done = run_train(config_path, reference)
  assert done.returncode == 0, done.stderr[-3000:]
  return config_path, reference

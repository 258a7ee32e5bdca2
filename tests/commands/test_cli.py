"""Bad input to the commands: exit code 2, one paragraph that names the problem and the fix,
no traceback (unless --verbose). One test per kind of bad input; `cli.py` is the one handler."""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import train_testlib
from transformer_jax import errors
from transformer_jax.checkpoints import checkpointing
from transformer_jax.commands import cli
from transformer_jax.commands import line_io
from transformer_jax.commands import starting
from transformer_jax.storage.layout import RunLayout

REPO = train_testlib.REPO


def _command(script: str, *flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return train_testlib.run_command(
      [sys.executable, os.path.join(REPO, script), *flags],
      env=train_testlib.subprocess_env(),
      timeout=timeout,
  )


def _assert_user_error(result: subprocess.CompletedProcess, *phrases: str) -> None:
  """Exit code 2, and stderr's last line is the one-paragraph error with every phrase."""
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  message = result.stderr.strip().splitlines()[-1]
  assert message.startswith(f'{os.path.basename(result.args[1])}: error: '), message
  for phrase in phrases:
    assert phrase in message, (phrase, message)


@pytest.fixture(scope='module')
def data_files(tmp_path_factory):
  return train_testlib.write_parallel_text(str(tmp_path_factory.mktemp('data')))


def _train(tmp_path, files, *flags, **overrides):
  config = train_testlib.write_config_file(str(tmp_path / 'config.py'), files, **overrides)
  return _command('train.py', f'--config={config}', f'--workdir={tmp_path / "run"}', *flags)


@pytest.mark.slow
def test_config_file_with_a_syntax_error(tmp_path):
  path = tmp_path / 'broken.py'
  path.write_text('def get_config(:\n  pass\n')
  _assert_user_error(
      _command('train.py', f'--config={path}', f'--workdir={tmp_path}/w'),
      str(path),
      'not valid Python',
      'line 1',
  )


@pytest.mark.slow
def test_config_file_without_get_config(tmp_path):
  path = tmp_path / 'empty.py'
  path.write_text('x = 1\n')
  _assert_user_error(
      _command('train.py', f'--config={path}', f'--workdir={tmp_path}/w'),
      str(path),
      'no get_config()',
  )


def _write(path, data: bytes) -> str:
  path.write_bytes(data)
  return str(path)


@pytest.mark.parametrize(
    'target,phrases',
    [
        (b'ONE\nTWO\nTHREE\n', ('2 lines', '3')),  # Unequal line counts.
        (b'', ('is empty',)),
        (b'\x00\x01\x02binary\x00\n\x00\n', ('NUL bytes', 'binary')),
        (b'ok\n\xff\xfe latin-1 \xe9\n', ('not UTF-8', 'line 2', 'iconv')),
    ],
)
@pytest.mark.slow
def test_unusable_text_files(tmp_path, data_files, target, phrases):
  source = _write(tmp_path / 'train.src', b'one\ntwo\n')
  files = dict(data_files, train=f'{source},{_write(tmp_path / "train.tgt", target)}')
  _assert_user_error(_train(tmp_path, files), *phrases)


@pytest.mark.parametrize(
    'overrides,phrases',
    [
        ({'vocab_size_target': 2}, ('vocab_size_target=2', 'must be an int >= 8')),
        (
            {'positional_encoding': 'learned', 'max_len': 16},
            ('max_len=16', 'learned positions', '--config.max_len=32'),
        ),
        ({'bucket_boundaries': (16, 8)}, ('bucket_boundaries', 'increasing order')),
        ({'bucket_boundaries': (0, 8)}, ('bucket_boundaries', 'positive')),
        ({'max_source_length': 0}, ('max_source_length=0', 'must be an int >= 1')),
    ],
)
@pytest.mark.slow
def test_config_values_that_cannot_work_fail_before_anything_runs(
    tmp_path, data_files, overrides, phrases
):
  result = _train(tmp_path, data_files, **overrides)
  _assert_user_error(result, *phrases)
  assert not os.path.exists(tmp_path / 'run' / 'vocab')  # Stopped before the data.


@pytest.mark.slow
def test_train_keeps_its_compiled_programs_in_the_compilation_cache(tmp_path, data_files):
  cache = tmp_path / 'cache'
  result = _train(
      tmp_path,
      data_files,
      f'--compilation_cache_dir={cache}',
      num_train_steps=2,
      checkpoint_every_steps=2,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert cache.is_dir() and any(cache.iterdir())
  not_a_directory = tmp_path / 'file'
  not_a_directory.write_text('')
  _assert_user_error(
      _train(tmp_path, data_files, f'--compilation_cache_dir={not_a_directory}'),
      'is a file',
      'give a directory',
  )


@pytest.mark.slow
def test_verbose_adds_the_traceback(tmp_path, data_files):
  result = _train(tmp_path, data_files, '--verbose', vocab_size_target=2)
  assert result.returncode == 2
  assert 'Traceback' in result.stderr and 'vocab_size_target=2' in result.stderr


def _damage(directory: str, item: str, how: str) -> None:
  """Truncates (or empties) every file of a checkpoint item."""
  for root, _, names in os.walk(os.path.join(directory, item)):
    for name in names:
      path = os.path.join(root, name)
      size = os.path.getsize(path)
      with open(path, 'r+b') as f:
        f.truncate(size // 2 if how == 'truncate' else 0)


@pytest.mark.slow
@pytest.mark.parametrize('item,how', [('params', 'truncate'), ('meta', 'empty')])
def test_damaged_checkpoint_names_the_step_and_suggests_another(run_dir, tmp_path, item, how):
  workdir = str(tmp_path / 'run')
  shutil.copytree(run_dir, workdir)
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')) if s.isdigit())
  _damage(os.path.join(workdir, 'checkpoints', str(steps[-1])), item, how)
  result = _command('evaluate.py', f'--workdir={workdir}', '--max_sentences=2')
  _assert_user_error(result, f'Checkpoint {steps[-1]}', 'damaged', '--step', str(steps[0]))


@pytest.mark.slow
def test_damaged_checkpoint_stops_a_resume_with_the_way_out(tmp_path, data_files):
  assert _train(tmp_path, data_files, num_train_steps=2).returncode == 0
  checkpoints = tmp_path / 'run' / 'checkpoints'
  _damage(str(checkpoints / '2'), 'params', 'truncate')
  result = _train(tmp_path, data_files, num_train_steps=4)
  _assert_user_error(result, 'Checkpoint 2', 'damaged', f'mv {checkpoints}/2')
  assert os.path.isdir(checkpoints / '2')  # Never deleted.


def test_full_disk_is_one_line_naming_the_file(tmp_path):
  """A full disk as orbax reports it: an OSError wrapped in another exception."""
  script = tmp_path / 'full_disk.py'
  script.write_text(textwrap.dedent(f"""
      import errno, sys
      sys.path.insert(0, {REPO!r})
      from transformer_jax.commands import cli

      def main(argv):
        try:
          raise OSError(errno.ENOSPC, 'No space left on device', '/work/run/checkpoints/7')
        except OSError as e:
          raise ValueError('Checkpoint save failed') from e

      cli.run(main)
  """))
  result = subprocess.run(
      [sys.executable, str(script)], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr
  assert result.stderr.count('\n') == 1
  assert 'No space left' in result.stderr and '/work/run/checkpoints/7' in result.stderr


def test_user_errors_are_found_through_wrapping_exceptions():
  full = OSError(errno.ENOSPC, 'No space left on device', 'f')
  try:
    try:
      raise full
    except OSError as e:
      raise RuntimeError('save failed') from e
  except RuntimeError as wrapped:
    assert isinstance(errors.find_user_error(wrapped), errors.DiskFullError)
  assert errors.find_user_error(RuntimeError('a bug')) is None
  config_error = errors.ConfigError('x')
  assert errors.find_user_error(config_error) is config_error
  assert isinstance(config_error, ValueError)  # Callers catching ValueError still work.


@pytest.mark.parametrize(
    'script,own_flags',
    [
        (
            'evaluate.py',
            ('--workdir', '--step', '--average_last', '--beam_size', '--split', '--verbose'),
        ),
        (
            'translate.py',
            (
                '--workdir',
                '--weights',
                '--beam_size',
                '--length_penalty',
                '--input',
                '--prefix',
                '--prefixes',
                '--verbose',
            ),
        ),
        ('score.py', ('--workdir', '--weights', '--source', '--target', '--input', '--per_token')),
        ('rerank.py', ('--n_best', '--forward', '--reverse', '--weights', '--tune_reference')),
        (
            'translate_corpus.py',
            (
                '--workdir',
                '--kind',
                '--input',
                '--split',
                '--output_dir',
                '--chunk_lines',
                '--distributed',
            ),
        ),
        ('train.py', ('--config', '--workdir', '--compilation_cache_dir', '--verbose')),
        ('average_checkpoints.py', ('--workdir', '--output_workdir', '--verbose')),
        ('import_marian.py', ('--model_dir', '--workdir', '--verbose')),
        ('export_marian.py', ('--workdir', '--step', '--output_dir', '--verbose')),
        (
            'export_ctranslate2.py',
            (
                '--workdir',
                '--step',
                '--average_last',
                '--output_dir',
                '--quantization',
                '--verbose',
            ),
        ),
        ('compile.py', ('--config', '--topology', '--json', '--search_batch', '--[no]verbose')),
        ('prepare_data.py', ('--config', '--workdir', '--splits', '--num_hosts', '--[no]verbose')),
    ],
)
def test_help_lists_each_commands_own_flags(script, own_flags):
  result = _command(script, '--help', timeout=120)
  # Help given is a success (absl's own exit code is 1), so `command --help && ...` goes on.
  assert result.returncode == 0 and 'Traceback' not in result.stderr, result.stderr[-2000:]
  for flag in own_flags:
    assert flag in result.stdout, (flag, result.stdout[-2000:])


def _flip_bytes(directory: str, item: str, count: int = 64) -> str:
  """Inverts `count` bytes in the middle of the item's largest file (what a bad disk or a
  bad copy does); returns the file."""
  files = [
      os.path.join(root, name)
      for root, _, names in os.walk(os.path.join(directory, item))
      for name in names
  ]
  path = max(files, key=os.path.getsize)
  with open(path, 'r+b') as f:
    data = bytearray(f.read())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(255 - b for b in data[middle : middle + count])
    f.seek(0)
    f.write(data)
  return path


@pytest.mark.slow
def test_flipped_bytes_in_parameters_are_caught_by_evaluation(run_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(run_dir, workdir)
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')) if s.isdigit())
  _flip_bytes(os.path.join(workdir, 'checkpoints', str(steps[-1])), 'params')
  result = _command('evaluate.py', f'--workdir={workdir}', '--max_sentences=2')
  _assert_user_error(result, f'Checkpoint {steps[-1]}', 'damaged', '--step', str(steps[0]))
  assert 'checksums' in result.stderr or 'cannot be read' in result.stderr


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, data_files):
  """Steps 2 and 4 saved; 4's parameters get flipped bytes; resuming to 6 warns, names both
  steps, keeps 4 as 4.damaged and trains on from 2 (now validating with BLEU every 3 steps,
  so checkpoints with and without metrics alternate)."""
  assert _train(tmp_path, data_files, num_train_steps=4).returncode == 0
  checkpoints = tmp_path / 'run' / 'checkpoints'
  _flip_bytes(str(checkpoints / '4'), 'params')
  result = _train(
      tmp_path, data_files, num_train_steps=6, eval_every_steps=3, eval_bleu_sentences=4
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Checkpoint 4 is damaged, so training resumes from 2' in result.stderr
  # It says what it did; not to move aside what it has set aside, nor a page of repr.
  warning = next(line for line in result.stderr.splitlines() if 'Checkpoint 4 is damaged' in line)
  assert 'move this one aside' not in warning and len(warning) < 700, warning
  assert 'sacreBLEU' in result.stderr  # The evaluation's log line.
  assert 'did not provide metrics' not in result.stderr  # Orbax's warning at every save.
  assert (checkpoints / '4.damaged').is_dir()  # Kept, renamed.
  assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit())[-1] == '6'


def test_a_folder_named_like_a_shipped_config_does_not_shadow_it(tmp_path, monkeypatch):
  """`--config=tiny` from a directory that holds `tiny/` (left by `--workdir=tiny`) is still
  configs/tiny.py; a folder given as the config file is named as one."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'tiny').mkdir()
  assert cli._shipped_config(['train.py', '--config=tiny']) == [
      'train.py',
      f'--config={os.path.join(cli.configs_directory(), "tiny.py")}',
  ]
  (tmp_path / 'mine').mkdir()
  argv = ['train.py', '--config=mine']
  assert cli._shipped_config(argv) == argv
  message = cli._config_file_error(argv, IsADirectoryError(21, 'Is a directory'))
  assert message.startswith('--config=mine is a directory; pass a config file'), message
  assert 'tiny' in message


def test_orbax_warnings_about_what_the_commands_mean_to_do_are_dropped():
  """Read-only opens and partial restores (24 lines of average_checkpoints.py) go; orbax's
  other warnings stay; nothing of another library is touched."""
  quiet = functools.partial(checkpointing.quiet_orbax, verbose=False)  # No --verbose.

  def record(path, level, message):
    return logging.LogRecord('absl', level, path, 1, message, None, None)

  orbax = '/site-packages/orbax/checkpoint/checkpoint_manager.py'
  for message in (
      'Given directory is read only=/runs/x/checkpoints',
      'CheckpointManagerOptions.read_only=True, setting save_interval_steps=0.',
      'Item "params" was found in the checkpoint, but could not be restored. '
      'Please provide a `CheckpointHandlerRegistry`',
  ):
    assert not quiet(record(orbax, logging.WARNING, message)), message
  assert quiet(record(orbax, logging.WARNING, 'Something else went wrong'))
  assert not quiet(record(orbax, logging.INFO, 'Saving checkpoint'))
  assert quiet(record('/site-packages/jax/x.py', logging.WARNING, 'Given directory is read only'))


def test_an_input_line_loses_its_ending_and_bad_bytes_are_replaced_and_flagged():
  assert line_io.decode_line(b'hola\r\n') == ('hola', False)
  assert line_io.decode_line(b'sin final') == ('sin final', False)
  assert line_io.decode_line('a\u00f1o\n'.encode()) == ('a\u00f1o', False)
  # Latin-1, not UTF-8: still one line of text, with what could not be read marked.
  assert line_io.decode_line(b'a\xf1o\n') == ('a\ufffdo', True)


def test_checksums_catch_a_flipped_bit_and_swapped_words():
  import jax.numpy as jnp
  import numpy as np

  from transformer_jax.checkpoints import checkpointing

  rng = np.random.default_rng(0)
  tree = {
      'w': rng.normal(size=(64, 48)).astype(np.float32),
      'step': np.int32(7),
      'h': jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
  }
  saved = checkpointing.checksums(tree)
  checkpointing.verify_checksums(saved, tree)
  checkpointing.verify_checksums(None, tree)  # Saved before checksums existed: passes.
  flipped = dict(tree, w=tree['w'].copy())
  flipped['w'].view(np.uint32)[10, 3] ^= 1 << 7
  swapped = dict(tree, w=tree['w'].copy())
  swapped['w'][[0, 1]] = swapped['w'][[1, 0]]
  for bad in (flipped, swapped):
    with pytest.raises(ValueError, match=r"1 of 3 arrays differ .*\['w'\]"):
      checkpointing.verify_checksums(saved, bad)


@pytest.mark.slow
def test_a_real_full_disk_stops_training_with_the_checkpoint_size(tmp_path, data_files):
  """Training on a 32 MB tmpfs that fills up after checkpoint 5: exit 2 with one paragraph
  naming the work directory and a checkpoint's size; the last complete checkpoint stays
  loadable."""
  mount = tmp_path / 'small'
  mount.mkdir()
  mounted = subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', 'size=32m', 'tmpfs', str(mount)],
      capture_output=True,
      text=True,
      check=False,
  )
  if mounted.returncode:
    pytest.skip(f'cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}')
  try:
    workdir = mount / 'run'
    config = train_testlib.write_config_file(
        str(tmp_path / 'config.py'),
        data_files,
        num_train_steps=100000,
        checkpoint_every_steps=5,
        log_every_steps=100000,
        keep_checkpoints=2,
    )
    log = tmp_path / 'train.log'
    with open(log, 'w', encoding='utf-8') as out:
      process = subprocess.Popen(
          train_testlib.train_command(config, str(workdir)),
          cwd=REPO,
          env=train_testlib.subprocess_env(),
          stdout=out,
          stderr=out,
      )
    deadline = time.time() + 240
    while not (workdir / 'checkpoints' / '5').is_dir():
      assert process.poll() is None, log.read_text()[-3000:]
      assert time.time() < deadline, 'no checkpoint 5'
      time.sleep(0.2)
    train_testlib.fill_disk(str(mount / 'filler'))
    process.wait(timeout=240)
    stderr = log.read_text()
    assert process.returncode == 2, stderr[-3000:]
    assert 'Traceback' not in stderr, stderr[-3000:]  # Not buried in the writers' traces.
    errors = [line for line in stderr.splitlines() if line.startswith('train.py: error: ')]
    assert len(errors) == 1, stderr[-3000:]
    message = errors[0]
    assert f'No space left on the disk of {workdir}' in message, message
    assert 'MB there' in message and 'rerun the same command' in message, message
    os.remove(mount / 'filler')
    from transformer_jax.checkpoints import checkpointing

    steps = checkpointing.list_steps(RunLayout.of(str(workdir)).checkpoints)
    _, step = checkpointing.restore_params(
        RunLayout.of(str(workdir)).checkpoints, steps[-1]
    )  # Intact, verified.
    assert step >= 5
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)


def _installed_script(name: str) -> str:
  """The console script `name` of the installed package (pip install -e . puts it beside
  the Python that runs the tests; scripts/setup.sh always installs it)."""
  import importlib.metadata

  try:
    importlib.metadata.distribution('transformer-jax')
  except importlib.metadata.PackageNotFoundError:
    pytest.skip('the package is not installed: pip install -e .[test]')
  path = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
  assert path, f'{name} is not installed beside {sys.executable}'
  return path


@pytest.mark.slow
def test_console_scripts_take_shipped_config_names(tmp_path):
  """transformer-jax-train finds configs/tiny.py by name from any directory, and its config
  errors come before anything compiles, as train.py's do."""
  script = _installed_script('transformer-jax-train')
  result = subprocess.run(
      [script, '--config=tiny', f'--workdir={tmp_path / "run"}', '--config.num_train_steps=0'],
      cwd=str(tmp_path),
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  message = result.stderr.strip().splitlines()[-1]
  assert message.startswith('transformer-jax-train: error: num_train_steps=0'), message
  help_text = subprocess.run(
      [_installed_script('transformer-jax-translate'), '--help'],
      cwd=str(tmp_path),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert '--n_best' in help_text.stdout and '--sampling' in help_text.stdout
  missing = _command('train.py', '--config=no_such_config', f'--workdir={tmp_path}/w')
  _assert_user_error(missing, 'does not exist', 'bible_en_es', 'tiny')
  installed = subprocess.run(
      [
          sys.executable,
          '-c',
          'import transformer_jax.configs.tiny as t; print(t.get_config().d_model)',
      ],
      cwd=str(tmp_path),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert installed.stdout.strip() == '32', installed.stderr[-2000:]


def _installed_module():
  import importlib.util

  path = os.path.join(train_testlib.REPO, 'scripts', 'installed.py')
  spec = importlib.util.spec_from_file_location('installed', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_setup_skips_pip_only_when_the_environment_is_what_it_would_install():
  """scripts/installed.py (setup.sh asks it before pip): yes for the environment the tests run
  in (set up by setup.sh --test), no with a reason for anything that differs."""
  installed = _installed_module()
  root = train_testlib.REPO
  with open(os.path.join(root, 'pyproject.toml')) as f:
    pyproject = f.read()
  with open(os.path.join(root, 'requirements.txt')) as f:
    requirements = f.read()
  # Installed editable from another checkout (a developer's second clone) is a difference too,
  # but not one this environment's packages have.
  found = [
      p
      for p in installed.problems(['test', 'tensorboard'], pyproject, requirements)
      if 'not installed editable from' not in p
  ]
  assert found == []

  cases = {
      'requirements.txt pins 0.0.1': (
          pyproject,
          requirements.replace('\njax==', '\njax==0.0.1\n#'),
      ),
      'not-a-package is not installed': (
          pyproject.replace('dependencies = [\n', 'dependencies = [\n  "not-a-package>=1",\n'),
          requirements,
      ),
      '99.0': (pyproject.replace('version = "0.1.0"', 'version = "99.0"'), requirements),
      "no extra 'nope'": (pyproject, requirements),
  }
  for phrase, (project_text, requirements_text) in cases.items():
    extras = ['nope'] if 'nope' in phrase else ['tensorboard']
    found = installed.problems(extras, project_text, requirements_text)
    assert any(phrase in p for p in found), (phrase, found)


@pytest.mark.parametrize('data', [b'', b'a', b'a\n', b'a\nb', b'\n\n', b'a\r\nb\n\xff'])
def test_count_lines_counts_what_read_lines_reads(tmp_path, data):
  path = tmp_path / 'lines.txt'
  path.write_bytes(data)
  assert line_io.count_lines(str(path), 'input') == len(line_io.read_lines(str(path), 'input'))


def _sigterm_under_the_start_up_handler(*lines: str) -> subprocess.CompletedProcess:
  """A Python process as train.py starts one (`starting.stop_on_sigterm`), then `lines`."""
  code = [
      'import os, signal, sys; sys.argv = ["train.py"]',
      f'import {starting.__name__} as starting',
      'starting.stop_on_sigterm()',
      *lines,
  ]
  return subprocess.run(
      [sys.executable, '-c', '\n'.join(code) + '\n'],
      cwd=train_testlib.REPO,
      capture_output=True,
      text=True,
      timeout=60,
  )


def test_a_sigterm_while_a_command_starts_is_one_line_and_exit_0():
  """A scheduler's stop in train.py's first second (before training's own handler, which
  saves) used to end it silently with -15, as the fault campaign found."""
  result = _sigterm_under_the_start_up_handler(
      'os.kill(os.getpid(), signal.SIGTERM)', 'import time; time.sleep(30)'
  )
  assert result.returncode == 0, result.stderr
  assert result.stderr.count('\n') == 1 and 'train.py: stopped by signal 15 while starting' in (
      result.stderr
  )


def test_a_sigterm_after_training_closed_its_handler_lets_the_process_end_as_planned():
  """Training's handler puts the start-up one back when it closes; a SIGTERM then (as the
  lock is released) must not end the process on the spot, which left the lock behind."""
  result = _sigterm_under_the_start_up_handler(
      'from transformer_jax.runtime import multihost',
      'multihost.StopSignal.listened = True',
      'os.kill(os.getpid(), signal.SIGTERM)',
      'print("released the lock")',
  )
  assert result.returncode == 0 and result.stdout == 'released the lock\n', result
  assert 'after training ended: exiting as planned' in result.stderr

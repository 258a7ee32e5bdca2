"""What the commands (`transformer_jax.commands`: train, evaluate, translate, prepare_data,
average_checkpoints, compile) share.

* `run(main)`: absl's `app.run` with one error policy for every command. A bad flag, config,
  dataset, checkpoint or a full disk (anything that is or wraps an `errors.UserError`) prints
  one paragraph, `PROGRAM: error: ...`, and exits with code 2; the traceback only with
  `--verbose`. Anything else is a bug: traceback, exit code 1.
* `fail(message)`: the same exit, for the commands' own checks.
* `define_checkpoint_flags()`: the flags of evaluate.py and translate.py that pick a
  checkpoint and the search, defined once so the two commands agree.
(Text lines in and out, the same for evaluation and translation: `line_io`.)

Importing this module defines `--verbose` and `--storage_timeout_seconds` (every command
waits on Cloud Storage for at most that long: `storage.limit_waits`) and nothing else; JAX
is imported only when a command needs it, so flag errors come back at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import functools
import importlib.util
import logging as std_logging
import os
import re
import sys
import threading
import traceback
from typing import Any, NoReturn, TypeVar

from absl import app
from absl import flags
from absl import logging

from transformer_jax import errors
from transformer_jax.config import LENGTH_PENALTY_FORMS
from transformer_jax.runtime import host_memory
from transformer_jax.storage import paths

VERBOSE = flags.DEFINE_bool(
    'verbose', False, 'On an error, print the traceback as well as the message.'
)
STORAGE_TIMEOUT = flags.DEFINE_float(
    'storage_timeout_seconds',
    300.0,
    'On Cloud Storage (gs://), how long any read, write or checkpoint may wait for the '
    'bucket to answer before the command stops with exit code 2 (shorter outages are '
    'ridden out).',
)


def program() -> str:
  return os.path.basename(sys.argv[0]) or 'transformer_jax'


def fail(message: str) -> NoReturn:
  """Prints `PROGRAM: error: message` and exits with code 2."""
  _print_error(message)
  sys.exit(2)


def _print_error(message: str) -> None:
  print(f'{program()}: error: {message.strip()}', file=sys.stderr, flush=True)


_T = TypeVar('_T')


def given(flag: flags.FlagHolder[_T | None]) -> _T:
  """The value of a flag that must be given here (`fail` names it when it is not)."""
  if flag.value is None:
    fail(f'--{flag.name} is required here.')
  return flag.value


def fail_now(message: str) -> NoReturn:
  """`fail` from any thread: prints the message and ends the process at once (exit code 2),
  without waiting for other threads (a blocked one would never let `sys.exit` finish)."""
  _print_error(message)
  logging.flush()
  os._exit(2)


def warn(message: str) -> None:
  print(f'{program()}: warning: {message}', file=sys.stderr, flush=True)


def _config_file_error(argv: list[str], error: BaseException) -> str | None:
  """The message for a --config file that does not load, or None if `error` is not that."""
  path = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  if path is None:
    return None
  if isinstance(error, SyntaxError) or isinstance(error.__cause__, SyntaxError):
    syntax = error if isinstance(error, SyntaxError) else error.__cause__
    return (
        f'--config={path} is not valid Python: {syntax.msg} at line {syntax.lineno}; '
        'fix the file (configs/*.py are examples).'
    )
  text = str(error)
  if 'get_config' in text:
    return (
        f'--config={path} has no get_config() function; a config file defines '
        '`def get_config():` returning an ml_collections.ConfigDict (see configs/tiny.py).'
    )
  if isinstance(error, (FileNotFoundError, IOError)) and not os.path.isfile(path):
    shipped = configs_directory()
    names = (
        sorted(n[:-3] for n in os.listdir(shipped) if n.endswith('.py') and not n.startswith('_'))
        if shipped
        else []
    )
    problem = 'is a directory' if os.path.isdir(path) else 'does not exist'
    return (
        f'--config={path} {problem}; pass a config file, or the name of a shipped '
        f'one: {", ".join(names)}.'
    )
  return None


def configs_directory() -> str | None:
  """The shipped config files: the installed `transformer_jax.configs`, or a checkout's
  `configs/` beside the package."""
  spec = importlib.util.find_spec('transformer_jax.configs')
  if spec is not None and spec.submodule_search_locations:
    return list(spec.submodule_search_locations)[0]
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  checkout = os.path.join(os.path.dirname(package), 'configs')
  return checkout if os.path.isdir(checkout) else None


def _shipped_config(argv: list[str]) -> list[str]:
  """`--config=NAME` (no such file, no directory part) names a shipped config file:
  `--config=bible_en_es` is configs/bible_en_es.py wherever the package is installed, even
  where the current directory holds a folder of that name (a work directory, say)."""
  directory = configs_directory()
  out = []
  for arg in argv:
    if arg.startswith('--config='):
      value = arg.split('=', 1)[1]
      name = value if value.endswith('.py') else value + '.py'
      if (
          directory
          and not os.path.isfile(value)
          and os.sep not in value
          and os.path.isfile(os.path.join(directory, name))
      ):
        arg = f'--config={os.path.join(directory, name)}'
    out.append(arg)
  return out


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with every problem reported by `fail` (exit code 2)."""
  argv = _shipped_config(argv)
  try:
    remaining = flags.FLAGS(argv)
    if 'config' in flags.FLAGS and flags.FLAGS.config is not None:
      flags.FLAGS.config.keys()  # A config file that failed to load raises here.
    return remaining
  except Exception as e:  # Any failure here is the user's.
    message = _config_file_error(argv, e)
    if message:
      fail(message)
    text = ' '.join(str(e).replace('\\n', '\n').split())
    if isinstance(e, (AttributeError, KeyError)) and any(a.startswith('--config.') for a in argv):
      bad = [
          a.split('=')[0]
          for a in argv
          if a.startswith('--config.') and a.split('=')[0].rsplit('.', 1)[-1] in text
      ]
      suggestion = re.search(r'Did you mean "([\w.]+)"', text)
      fail(
          f'{bad[0] if bad else "a --config flag"} is not a field of the config'
          + (
              f' (did you mean {bad[0].rsplit(".", 1)[0] if bad else "--config"}.'
              f'{suggestion.group(1)}?)'
              if suggestion
              else ''
          )
          + '; the fields and their defaults are in transformer_jax/config.py '
          '(base_config).'
      )
    fail(f'invalid flags: {text[:600]}. Run with --help for the flags.')


def run(main: Callable[[list[str]], Any]) -> None:
  """Runs `main` as a command under the project's error policy (see the module doc)."""

  # The command's module is not __main__ (that is train.py or a console script): lend
  # `--help` its docstring and its key flags, which absl looks up under sys.argv[0].
  command = sys.modules[main.__module__]
  main_module = sys.modules['__main__']
  if main_module is not command:
    main_module.__doc__ = command.__doc__
    for flag in flags.FLAGS.get_key_flags_for_module(command):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)

  def guarded(argv: list[str]) -> None:
    if len(argv) > 1:
      fail(f'unexpected arguments {argv[1:]}; every option is a --flag.')
    if not STORAGE_TIMEOUT.value > 0:
      fail(f'--storage_timeout_seconds={STORAGE_TIMEOUT.value:g} must be positive.')
    from transformer_jax.checkpoints import checkpointing  # Not for --help: orbax loads slowly.
    from transformer_jax.storage import storage

    storage.limit_waits(STORAGE_TIMEOUT.value, fail_now)

    logging.get_absl_handler().addFilter(
        functools.partial(checkpointing.quiet_orbax, verbose=VERBOSE.value)
    )
    if not VERBOSE.value:
      # gcsfs logs each retry and its final failure with a traceback; the failure reaches
      # the command, which reports it in one paragraph (storage.cloud_error).
      std_logging.getLogger('gcsfs').setLevel(std_logging.CRITICAL)
    if not VERBOSE.value:
      # Checkpoint writers' threads report their failures to the main thread, which reports
      # them once (a full disk: one paragraph); their own tracebacks go to the debug log.
      threading.excepthook = _thread_failure_to_debug_log
      sys.unraisablehook = _thread_failure_to_debug_log
    try:
      # Before JAX starts its threads: XLA:CPU's step scratch memory is then reused, not
      # page-faulted in afresh each step.
      host_memory.retain_freed_memory()
      main(argv)
    except SystemExit:
      raise
    except KeyboardInterrupt:
      print(f'{program()}: interrupted.', file=sys.stderr, flush=True)
      sys.exit(130)
    except BaseException as e:
      user_error = errors.find_user_error(e)
      if user_error is None:
        raise
      if VERBOSE.value:
        traceback.print_exc()
      fail(str(user_error))

  try:
    app.run(guarded, flags_parser=parse_flags)
  except SystemExit as e:
    # absl prints the help asked for (--help, -?, --helpshort, --helpfull, --helpxml) and
    # exits 1; help given is a success, so `command --help && ...` goes on.
    if e.code == 1 and _asks_for_help(sys.argv[1:]):
      sys.exit(0)
    raise


HELP_FLAGS = (
    '--help',
    '-help',
    '-?',
    '--helpshort',
    '-helpshort',
    '--helpfull',
    '-helpfull',
    '--helpxml',
    '-helpxml',
)


def _asks_for_help(args: list[str]) -> bool:
  """Whether absl reads one of `args` (before any `--`) as a help flag."""
  options = args[: args.index('--')] if '--' in args else args
  return any(arg in HELP_FLAGS for arg in options)


def _thread_failure_to_debug_log(args: Any) -> None:
  error = getattr(args, 'exc_value', None)
  logging.debug('A background thread failed: %r', error)


# --- The checkpoint and search flags of evaluate.py and translate.py. ---


@dataclasses.dataclass(frozen=True)
class CheckpointFlags:
  workdir: Any
  weights: Any
  step: Any
  average_last: Any
  beam_size: Any
  length_penalty: Any
  length_penalty_form: Any
  no_repeat_ngram_size: Any
  no_adjacent_repeat_size: Any
  max_decode_extra_length: Any
  batch_size: Any
  sampling: Any
  temperature: Any
  top_k: Any
  top_p: Any
  seed: Any
  target_lang: Any
  compilation_cache_dir: Any


@dataclasses.dataclass(frozen=True)
class JobFlags:
  distributed: Any
  coordinator_address: Any
  num_processes: Any
  process_id: Any
  heartbeat_timeout_seconds: Any


def define_job_flags() -> JobFlags:
  """The flags that join a multi-process job (once per command; `join_job`)."""
  return JobFlags(
      distributed=flags.DEFINE_bool(
          'distributed', False, 'Join a multi-process job through jax.distributed.initialize.'
      ),
      coordinator_address=flags.DEFINE_string(
          'coordinator_address', None, 'HOST:PORT of process 0 (autodetected on TPU/SLURM/MPI).'
      ),
      num_processes=flags.DEFINE_integer('num_processes', None, 'Processes in the job.'),
      process_id=flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1.'),
      heartbeat_timeout_seconds=flags.DEFINE_integer(
          'heartbeat_timeout_seconds',
          100,
          'A process silent this long counts as dead; the others then exit instead of hanging.',
      ),
  )


def join_job(job: JobFlags, agree: dict[str, str]) -> None:
  """With --distributed, joins the job (`multihost.initialize`) and checks that every
  process was given the same `agree` values (flags, config fields); else nothing."""
  if not job.distributed.value:
    return
  import signal

  from transformer_jax.runtime import multihost

  # JAX's preemption notifier takes SIGTERM from here on (`multihost`); the start-up handler
  # of `starting` must not run beside it.
  signal.signal(signal.SIGTERM, signal.SIG_DFL)

  multihost.initialize(
      job.coordinator_address.value,
      job.num_processes.value,
      job.process_id.value,
      heartbeat_timeout_seconds=job.heartbeat_timeout_seconds.value,
      exit_now=fail_now,
  )
  multihost.check_processes_agree(agree, timeout_s=job.heartbeat_timeout_seconds.value)


def define_compilation_cache_flag() -> flags.FlagHolder:
  """--compilation_cache_dir, for every command that compiles (once per command)."""
  return flags.DEFINE_string(
      'compilation_cache_dir',
      None,
      'A persistent JAX compilation cache: a directory where compiled programs are kept, so '
      'that a rerun (a resume, another evaluation) loads them instead of compiling.',
  )


def use_compilation_cache(directory: str | None) -> None:
  """Points JAX's persistent compilation cache at `directory` (nothing for None); fails
  with a clear error when the path exists and is not a directory."""
  if not directory:
    return
  paths.require_local(directory, '--compilation_cache_dir', 'the compilation cache')
  paths.check_output_directory(directory, '--compilation_cache_dir')
  import jax

  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def define_checkpoint_flags() -> CheckpointFlags:
  """Defines the flags that pick a checkpoint and the search (once per command).

  The calling command should also call `flags.adopt_module_key_flags(cli)` so that its
  `--help` lists them. Decoding options left unset fall back to the training run's config.
  """
  return CheckpointFlags(
      workdir=flags.DEFINE_multi_string(
          'workdir',
          None,
          "A training run's work directory; given several times, the runs decode as one "
          'ensemble (their log-probabilities averaged at every step; one vocabulary).',
      ),
      weights=flags.DEFINE_list(
          'weights',
          None,
          "With several --workdir: each model's weight in the ensemble, in their order, "
          'comma-separated (default: equal).',
      ),
      step=flags.DEFINE_string(
          'step',
          None,
          "The checkpoint step (default: the latest), or 'best': the best by "
          "the run's best_checkpoint_metric (validation BLEU by default).",
      ),
      average_last=flags.DEFINE_integer(
          'average_last',
          0,
          'Average the parameters of the last N checkpoints (the paper: 5 '
          'for base, 20 for big); 0: no averaging.',
      ),
      beam_size=flags.DEFINE_integer('beam_size', None, 'Beam size; 1 is greedy search.'),
      length_penalty=flags.DEFINE_float('length_penalty', None, 'Length penalty alpha.'),
      length_penalty_form=flags.DEFINE_enum(
          'length_penalty_form',
          None,
          list(LENGTH_PENALTY_FORMS),
          'gnmt: ((5+|Y|)/6)^alpha; power: |Y|^alpha.',
      ),
      no_repeat_ngram_size=flags.DEFINE_integer(
          'no_repeat_ngram_size',
          None,
          'n > 0: no output repeats an n-gram of its own tokens (as fairseq and Hugging '
          "Face's option of that name); 0: off. Default: the run's config (0 unless set).",
      ),
      no_adjacent_repeat_size=flags.DEFINE_integer(
          'no_adjacent_repeat_size',
          None,
          'n > 0: no output says a span of up to n tokens twice in a row (a piece doubled '
          "inside a word, a phrase back to back); 0: off. Default: the run's config (0 "
          'unless set).',
      ),
      max_decode_extra_length=flags.DEFINE_integer(
          'max_decode_extra_length',
          None,
          "Each sentence's output limit = its source length "
          '(in tokens, EOS included) + this, at most max_len with learned positions (the '
          'paper: 50).',
      ),
      batch_size=flags.DEFINE_integer('batch_size', None, 'Sentences decoded together.'),
      sampling=flags.DEFINE_bool(
          'sampling',
          False,
          'Sample each output token instead of '
          'beam search (--temperature, --top_k, --top_p, --seed).',
      ),
      temperature=flags.DEFINE_float(
          'temperature',
          None,
          'With --sampling: divide the logits by this (1: the model; 0: greedy).',
      ),
      top_k=flags.DEFINE_integer(
          'top_k', None, 'With --sampling: only the k most probable tokens (0: all).'
      ),
      top_p=flags.DEFINE_float(
          'top_p', None, 'With --sampling: only the nucleus of this probability (1: all).'
      ),
      seed=flags.DEFINE_integer(
          'seed',
          None,
          'With --sampling: the random seed (the same '
          'seed, input and --batch_size give the same samples).',
      ),
      target_lang=flags.DEFINE_string(
          'target_lang',
          None,
          'The language to translate into, for a model of several target languages (its '
          "config's directions); its tag starts every source. Default: the model's only one.",
      ),
      compilation_cache_dir=define_compilation_cache_flag(),
  )


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
  """Errors only while checkpoints load and JAX starts (orbax logs every restore at INFO and
  WARNING, JAX each platform it does not find), warnings after; unless --verbosity is given."""
  if flags.FLAGS['verbosity'].present:
    yield
    return
  logging.set_verbosity(logging.ERROR)
  try:
    yield
  finally:
    logging.set_verbosity(logging.WARNING)


def check_checkpoint_flags(f: CheckpointFlags) -> None:
  """Checks the checkpoint flags before anything heavy is imported.

  Unless --verbosity is given, logging is quiet (errors only) until `load_translator` has
  restored the checkpoint: orbax logs every restore at INFO and WARNING.
  """
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.ERROR)
  if not f.workdir.value:
    fail('--workdir is required: the directory of a training run.')
  for workdir in f.workdir.value:
    paths.check_input_directory(workdir, '--workdir', "a training run's work directory")
  if len(set(f.workdir.value)) < len(f.workdir.value):
    fail(
        f'--workdir names a directory twice ({", ".join(f.workdir.value)}); to weigh a '
        'model more, give --weights.'
    )
  if f.weights.value is not None:
    try:
      weights = [float(w) for w in f.weights.value]
    except ValueError:
      fail(f'--weights={",".join(f.weights.value)} must be numbers, comma-separated.')
    from transformer_jax.decoding.ensembles import ensemble_weights

    try:
      ensemble_weights(weights, len(f.workdir.value))
    except errors.UserError as e:
      fail(f'--weights: {e}')
  parse_step(f.step.value)
  if f.step.value is not None and f.average_last.value:
    fail('give --step or --average_last, not both.')
  if f.average_last.value < 0:
    fail(f'--average_last={f.average_last.value} must be >= 0.')
  if not f.sampling.value:
    given = [
        name
        for name in ('temperature', 'top_k', 'top_p', 'seed')
        if getattr(f, name).value is not None
    ]
    if given:
      fail(f'--{given[0]} is a sampling option; add --sampling (or drop it for beam search).')


def workdir_inputs(f: CheckpointFlags) -> dict[str, str]:
  """The --workdir directories, named for `paths.check_output_file`'s inputs (an output is
  never one of them)."""
  workdirs = f.workdir.value or []
  return {
      '--workdir' if i == 0 else f'--workdir ({i + 1})': workdir
      for i, workdir in enumerate(workdirs)
  }


def parse_step(value: str | None) -> int | str | None:
  """A --step value as `loading.load` takes it: an int, 'best', or None (the latest); any
  other value `fail`s."""
  if value is None or value == 'best':
    return value
  if not value.isdigit():
    fail(f"--step={value} must be a step number or 'best'.")
  return int(value)


def checkpoint_step(f: CheckpointFlags) -> int | str | None:
  """--step as `loading.load` takes it (`parse_step`)."""
  return parse_step(f.step.value)


def load_translator(
    f: CheckpointFlags, n_best: int = 1, *, untagged: bool = False
) -> tuple[Any, Any]:
  """The translator of the chosen checkpoint (or average), with the flags' search options,
  returning `n_best` hypotheses a sentence (`untagged`: see `translator.load_translator`).

  Returns:
    (translator, checkpoint), as `translator.load_translator`.
  """
  # Imported here so that flag errors are reported without loading JAX and TFDS.
  from transformer_jax.decoding import translator

  use_compilation_cache(f.compilation_cache_dir.value)
  workdirs = f.workdir.value
  with quiet_loading():
    return translator.load_translator(
        workdirs[0] if len(workdirs) == 1 else workdirs,
        step=checkpoint_step(f),
        average_last=f.average_last.value,
        weights=None if f.weights.value is None else [float(w) for w in f.weights.value],
        beam_size=f.beam_size.value,
        length_penalty=f.length_penalty.value,
        length_penalty_form=f.length_penalty_form.value,
        no_repeat_ngram_size=f.no_repeat_ngram_size.value,
        no_adjacent_repeat_size=f.no_adjacent_repeat_size.value,
        max_decode_extra_length=f.max_decode_extra_length.value,
        batch_size=f.batch_size.value,
        n_best=n_best,
        sampling=f.sampling.value,
        temperature=f.temperature.value,
        top_k=f.top_k.value,
        top_p=f.top_p.value,
        seed=f.seed.value,
        target_lang=f.target_lang.value,
        untagged=untagged,
    )

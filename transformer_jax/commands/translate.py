r"""Translates text with a trained checkpoint: one output line for every input line, always.

  python translate.py --workdir=/tmp/tiny < input.en > output.de
  python translate.py --workdir=DIR --input=input.en --output=output.de --average_last=5
  python translate.py --workdir=DIR --text='The cat sat on the mat.' \
      --attention_plot=attention.png --attention_layer=-1 --attention_heads=mean
  python translate.py --workdir=DIR --n_best=4 < input.en > nbest.txt       # 4 of the beam
  python translate.py --workdir=DIR --sampling --top_p=0.9 --n_best=5 \
      --input=mono.en --output=samples.txt                  # back-translation: 5 samples a line
  python translate.py --workdir=BOTH_WAYS --target_lang=en < input.es    # a multilingual model

An empty line gives an empty line; a line longer than the model's max_len tokens is cut and
a warning names its line number on stderr; invalid UTF-8 is replaced (U+FFFD) and warned about.
Lines are split on '\n' only. --prefix=TEXT starts every output with TEXT, --prefixes=FILE
each line's with that file's line (forced decoding, as fairseq's --prefix-size and Marian's
--force-decode; every search honours it, and the output includes it); a prefix that leaves no
room within the line's output limit gives that line an empty output and a warning. Several
--workdir decode as one ensemble (--weights=W1,W2,...: each model's weight). A model of
several target languages (its config's `directions`) needs --target_lang: its tag starts
every source. Reading from a terminal translates each line as it is typed.
Each sentence's output is at most its source length (tokens, EOS included) +
--max_decode_extra_length tokens (the paper: 50); with learned positions also at most max_len,
and a warning names the lines that cap cuts.

With --n_best=K > 1 or --print_scores, every input line gives exactly K lines (K=1 by default)
in the n-best format of Moses and Marian, best first:

  INDEX ||| TRANSLATION ||| LogProb= LOG_P ||| SCORE

INDEX is the 0-based input line, LOG_P = log P(translation | source) under the model, SCORE =
LOG_P / lp(|Y|), the length-penalized score beam search ranks by (|Y| counts the EOS). Beam
search gives its K best (K <= --beam_size); --sampling draws K samples a line (--temperature,
--top_k, --top_p, --seed), sorted by SCORE; LOG_P is under the model itself, not the sampling
distribution. A blank or untokenizable line gives K lines with an empty translation and 0.
--attention_plot draws the encoder-decoder attention of the --text sentence as a heatmap
labelled with its subword pieces ('mean' over heads, 'all' heads, or one head's index).

A closed standard input is no input (no output); when the reader of standard output goes
away (`translate.py | head -1`) it ends quietly, as a Unix filter does.

Exit codes: 0 done; 1 an unexpected error; 2 a flag, work directory or checkpoint problem
(explained in one paragraph; the traceback only with --verbose); 141 the output pipe closed.
"""

import contextlib
import io
import itertools
import os
import signal
import sys

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.commands import line_io
from transformer_jax.storage import paths
from transformer_jax.storage import storage

_CHECKPOINT = cli.define_checkpoint_flags()

_INPUT = flags.DEFINE_string('input', '-', "Input file, one sentence a line ('-': stdin).")
_OUTPUT = flags.DEFINE_string('output', '-', "Output file ('-': stdout).")
_TEXT = flags.DEFINE_string('text', None, 'Translate this one sentence instead of --input.')
_CHUNK_LINES = flags.DEFINE_integer(
    'chunk_lines',
    0,
    'Lines read and sorted by length together (0: 16 batches; 1 from a terminal).',
)
_ATTENTION_PLOT = flags.DEFINE_string(
    'attention_plot',
    None,
    'With --text: save its encoder-decoder attention heatmap here (.png, .pdf, .svg).',
)
_ATTENTION_LAYER = flags.DEFINE_integer(
    'attention_layer', -1, 'Decoder layer to draw (0-based; -1: the last).'
)
_ATTENTION_HEADS = flags.DEFINE_string(
    'attention_heads', 'mean', "'mean' over heads, 'all' (one panel each) or an index."
)
_PREFIX = flags.DEFINE_string(
    'prefix',
    None,
    'Start every output with this text (forced decoding: e.g. a language tag, or the words '
    'a translator has typed); the output includes it.',
)
_PREFIXES = flags.DEFINE_string(
    'prefixes',
    None,
    'A file of one output prefix a line of --input (an empty line: none); the outputs '
    'start with them.',
)
_QUIET = flags.DEFINE_bool('quiet', False, 'No speed summary on stderr.')
_N_BEST = flags.DEFINE_integer(
    'n_best',
    1,
    'Hypotheses a line: the best K of the beam (K <= --beam_size) or K samples '
    'with --sampling; K > 1 writes the n-best format (see the module doc).',
)
_PRINT_SCORES = flags.DEFINE_bool(
    'print_scores',
    False,
    'Write the n-best format (index, translation, log-probability, '
    'score) even for one hypothesis a line.',
)


def _check_flags() -> None:
  cli.check_checkpoint_flags(_CHECKPOINT)
  if _CHUNK_LINES.value < 0:
    cli.fail('--chunk_lines must be >= 0.')
  if _N_BEST.value < 1:
    cli.fail(f'--n_best={_N_BEST.value} must be >= 1.')
  if (
      _N_BEST.value > 1
      and not _CHECKPOINT.sampling.value
      and _CHECKPOINT.beam_size.value is not None
      and _N_BEST.value > _CHECKPOINT.beam_size.value
  ):
    cli.fail(
        f'--n_best={_N_BEST.value} is more than --beam_size={_CHECKPOINT.beam_size.value}'
        f'; beam search keeps beam_size hypotheses: raise --beam_size to at least '
        f'{_N_BEST.value}, or add --sampling.'
    )
  if _ATTENTION_PLOT.value and (_N_BEST.value > 1 or _CHECKPOINT.sampling.value):
    cli.fail('--attention_plot draws the best beam-search output; drop --n_best/--sampling.')
  if _TEXT.value is not None and _INPUT.value != '-':
    cli.fail('give --text or --input, not both.')
  if _ATTENTION_PLOT.value and _TEXT.value is None:
    cli.fail('--attention_plot draws one sentence: give it as --text.')
  heads = _ATTENTION_HEADS.value
  if heads not in ('mean', 'all') and not heads.isdigit():
    cli.fail(f"--attention_heads={heads!r} must be 'mean', 'all' or a head index.")
  # The paths, before the model loads: an output is never an input, and never half written.
  inputs = {
      '--input': None if _INPUT.value == '-' else _INPUT.value,
      '--prefixes': _PREFIXES.value,
      **cli.workdir_inputs(_CHECKPOINT),
  }
  if inputs['--input']:
    paths.check_input_file(_INPUT.value, '--input')
  if _PREFIX.value is not None and _PREFIXES.value:
    cli.fail('give --prefix (one for every line) or --prefixes (one a line), not both.')
  if _PREFIXES.value:
    paths.check_input_file(_PREFIXES.value, '--prefixes')
    if _TEXT.value is not None:
      cli.fail('--prefixes gives one prefix a line of --input; with --text, give --prefix.')
    if inputs['--input']:
      counts = [
          line_io.count_lines(p, f)
          for p, f in ((_INPUT.value, 'input'), (_PREFIXES.value, 'prefixes'))
      ]
      if counts[0] != counts[1]:
        cli.fail(
            f'--input={_INPUT.value} has {counts[0]} lines but --prefixes={_PREFIXES.value} '
            f'has {counts[1]}: give one prefix a line (an empty line for none).'
        )
  if _OUTPUT.value != '-':
    paths.check_output_file(_OUTPUT.value, '--output', inputs)
    inputs['--output'] = _OUTPUT.value
  if _ATTENTION_PLOT.value:
    paths.check_output_file(_ATTENTION_PLOT.value, '--attention_plot', inputs)
    from matplotlib import backend_bases

    formats = backend_bases.FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(_ATTENTION_PLOT.value)[1].lstrip('.').lower()
    if suffix not in formats:
      cli.fail(
          f'--attention_plot={_ATTENTION_PLOT.value} does not end with the suffix of an '
          f'image format: {", ".join("." + f for f in sorted(formats))}.'
      )


def _end_on_closed_pipe() -> None:
  """The reader of our stdout went away (`translate.py | head -1`): end quietly, as a Unix
  filter killed by SIGPIPE does (exit status 141)."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, sys.stdout.fileno())  # Python's final flush must not fail again.
  sys.exit(128 + signal.SIGPIPE)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  _check_flags()
  if _OUTPUT.value == '-' and sys.stdout is None:
    cli.fail('standard output is closed; give --output=FILE.')
  translator, checkpoint = cli.load_translator(_CHECKPOINT, n_best=_N_BEST.value)
  steps = checkpoint.steps

  with contextlib.ExitStack() as stack:
    # A file is renamed into place once every line is written; the old one stays until then.
    output = line_io.open_output(stack, _OUTPUT.value)
    stats = _translate(translator, output, stack)
  if not _QUIET.value:
    lines = f'{stats.sentences} line{"" if stats.sentences == 1 else "s"}'
    print(
        f'{cli.program()}: {lines} (checkpoint steps {steps}) in '
        f'{stats.decode_seconds:.1f}s (+{stats.compile_seconds:.1f}s compiling): '
        f'{stats.sentences_per_second:.1f} sentences/s, {stats.tokens_per_second:.1f} '
        'output tokens/s.',
        file=sys.stderr,
    )

  if _ATTENTION_PLOT.value:
    from transformer_jax.decoding import attention_plot

    source_ids, _ = translator.encode_source(_TEXT.value)
    [(hypothesis, *_)], _ = translator.translate_ids([source_ids])
    heads = _ATTENTION_HEADS.value
    try:
      attention_plot.draw(
          translator.model_config,
          translator.params,
          translator.tokenizer,
          source_ids,
          hypothesis.tokens,
          _ATTENTION_PLOT.value,
          layer=_ATTENTION_LAYER.value,
          heads=int(heads) if heads.isdigit() else heads,
      )
    except ValueError as e:
      cli.fail(str(e))
    print(f'{cli.program()}: wrote {_ATTENTION_PLOT.value}', file=sys.stderr)


def _translate(translator, output, stack: contextlib.ExitStack):
  """Translates the input (--text, --input or stdin) into `output`; the statistics."""
  if _TEXT.value is not None:
    source = io.BytesIO((_TEXT.value + '\n').encode('utf-8', errors='replace'))
  elif _INPUT.value == '-':
    # A closed stdin (`translate.py <&-`) is no input: no output.
    source = sys.stdin.buffer if sys.stdin is not None else io.BytesIO(b'')
  else:
    source = storage.open_file(_INPUT.value)
  interactive = (
      _TEXT.value is None and _INPUT.value == '-' and sys.stdin is not None and sys.stdin.isatty()
  )
  chunk_lines = 1 if interactive else (_CHUNK_LINES.value or 16 * translator.options.batch_size)

  def write(line: str) -> None:
    output.write(line)
    if interactive:
      output.flush()

  if sys.stdin is None or source is not sys.stdin.buffer:
    stack.callback(source.close)
  prefixes = None
  if _PREFIXES.value:
    prefixes = line_io.read_lines(_PREFIXES.value, 'prefixes')
  elif _PREFIX.value is not None:
    prefixes = itertools.repeat(_PREFIX.value)
  try:
    stats = line_io.translate_lines(
        translator,
        source,
        write,
        cli.warn,
        chunk_lines,
        n_best_format=_N_BEST.value > 1 or _PRINT_SCORES.value,
        prefixes=prefixes,
    )
    output.flush()
  except BrokenPipeError:
    _end_on_closed_pipe()
  return stats


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

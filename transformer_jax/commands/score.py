r"""Scores given translations with a trained checkpoint (or an ensemble): one line a pair.

  python score.py --workdir=DIR --source=test.en --target=test.es > scores.tsv
  python score.py --workdir=DIR --input=pairs.tsv --per_token          # SOURCE<TAB>TARGET lines
  python score.py --workdir=RUN1 --workdir=RUN2 --weights=0.5,0.5 --source=S --target=T

Each pair gets one output line, in input order, tab-separated:

  LOG_P    SCORE    TOKENS    [TOKEN_LOG_PS]

LOG_P = log P(target | source) under the model (ensemble: the renormalized weighted average
of the models' log-probabilities at each token, as translate.py's search uses), the EOS
included; SCORE = LOG_P / lp(TOKENS), the length-penalized score beam search ranks by
(--length_penalty, --length_penalty_form, default the run's); TOKENS = |Y|, the target's
tokens with the EOS; with --per_token, each token's log-probability, space-separated. So a
translation written by translate.py --n_best scores here as it does there. Dual
cross-entropy filtering takes LOG_P / TOKENS of two directions; rerank.py combines scores.

A pair that cannot be scored (no tab in an --input line, a side the tokenizer fails on, a side
longer than the model's max_len tokens) gets `nan nan 0` and a warning naming its line. A blank
side is scored as EOS alone.

Exit codes: 0 done; 1 an unexpected error; 2 a flag, work directory, checkpoint or input problem
(explained in one paragraph; the traceback only with --verbose).
"""

import contextlib
import sys

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.commands import line_io
from transformer_jax.storage import paths

_CHECKPOINT = cli.define_checkpoint_flags()

_SOURCE = flags.DEFINE_string('source', None, 'Source sentences, one a line (with --target).')
_TARGET = flags.DEFINE_string('target', None, 'Their translations, line by line.')
_INPUT = flags.DEFINE_string('input', None, "Instead: SOURCE<TAB>TARGET lines ('-': stdin).")
_OUTPUT = flags.DEFINE_string('output', '-', "Output file ('-': stdout).")
_PER_TOKEN = flags.DEFINE_bool(
    'per_token', False, "Add a column of each target token's log-probability."
)
_QUIET = flags.DEFINE_bool('quiet', False, 'No speed summary on stderr.')


def _read_pairs() -> list[tuple[str, str] | str]:
  """Each input pair, or for a malformed line the reason it cannot be scored."""
  if _INPUT.value is not None:
    if _INPUT.value == '-':
      raw = sys.stdin.buffer.read() if sys.stdin is not None else b''
      lines = raw.split(b'\n')
      if lines and lines[-1] == b'':
        lines.pop()
      texts = [line_io.decode_line(line)[0] for line in lines]
    else:
      texts = line_io.read_lines(_INPUT.value, 'input')
    pairs: list[tuple[str, str] | str] = []
    for text in texts:
      columns = text.split('\t')
      if len(columns) != 2:
        pairs.append(f'{len(columns)} tab-separated column(s), not the two of SOURCE<TAB>TARGET')
      else:
        pairs.append((columns[0], columns[1]))
    return pairs
  sources = line_io.read_lines(cli.given(_SOURCE), 'source')
  targets = line_io.read_lines(cli.given(_TARGET), 'target')
  if len(sources) != len(targets):
    cli.fail(
        f'--source={_SOURCE.value} has {len(sources)} lines but --target={_TARGET.value} has '
        f'{len(targets)}: they must be line-aligned pairs.'
    )
  return list(zip(sources, targets))


def _check_flags() -> None:
  cli.check_checkpoint_flags(_CHECKPOINT)
  if _INPUT.value is not None and (_SOURCE.value or _TARGET.value):
    cli.fail('give --input (SOURCE<TAB>TARGET lines) or --source and --target, not both.')
  if _INPUT.value is None and not (_SOURCE.value and _TARGET.value):
    cli.fail('give --source and --target (line-aligned files), or --input=SOURCE<TAB>TARGET file.')
  inputs = {
      '--input': None if _INPUT.value in (None, '-') else _INPUT.value,
      '--source': _SOURCE.value,
      '--target': _TARGET.value,
      **cli.workdir_inputs(_CHECKPOINT),
  }
  for flag in ('--input', '--source', '--target'):
    path = inputs[flag]
    if path:
      paths.check_input_file(path, flag)
  if _OUTPUT.value != '-':
    paths.check_output_file(_OUTPUT.value, '--output', inputs)


def format_score(score, per_token: bool) -> str:
  """One output line (without its newline)."""
  columns = [f'{score.log_prob:.6g}', f'{score.score:.6g}', str(score.length)]
  if per_token:
    columns.append(' '.join(f'{v:.4g}' for v in score.token_log_probs))
  return '\t'.join(columns)


def main(argv: list[str]) -> None:
  del argv  # Unused.
  _check_flags()
  pairs = _read_pairs()
  translator, checkpoint = cli.load_translator(_CHECKPOINT)
  from transformer_jax.decoding import scoring

  scorer = scoring.Scorer(translator)
  kept = [(i, p) for i, p in enumerate(pairs) if isinstance(p, tuple)]
  scores, stats = scorer.score([p[0] for _, p in kept], [p[1] for _, p in kept])
  results = [scoring.failed(p) if isinstance(p, str) else None for p in pairs]
  for (i, _), score in zip(kept, scores):
    results[i] = score
  with contextlib.ExitStack() as stack:
    output = line_io.open_output(stack, _OUTPUT.value)
    for number, result in enumerate(results, 1):
      assert result is not None  # Each pair scored or failed.
      if result.error:
        cli.warn(f'line {number}: not scored: {result.error}; writing nan.')
      output.write(format_score(result, _PER_TOKEN.value) + '\n')
    output.flush()
  if not _QUIET.value:
    print(
        f'{cli.program()}: {len(pairs)} pairs (checkpoint steps {checkpoint.steps}) in '
        f'{stats.score_seconds:.1f}s (+{stats.compile_seconds:.1f}s compiling): '
        f'{stats.target_tokens / max(stats.score_seconds, 1e-9):.0f} target tokens/s.',
        file=sys.stderr,
    )


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

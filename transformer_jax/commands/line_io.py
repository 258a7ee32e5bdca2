"""Input lines in, one output line for each: how translate.py and evaluate.py read text.

Lines are split on b'\\n' only, decoded as UTF-8 (invalid bytes replaced and warned about), and
every input line gets exactly one output line (or `n_best` lines in the n-best format), in
order, whatever is wrong with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from transformer_jax.storage import paths
from transformer_jax.storage import storage


def decode_line(raw: bytes) -> tuple[str, bool]:
  """One input line as text, without its line ending; and whether invalid UTF-8 was replaced
  (by U+FFFD)."""
  if raw.endswith(b'\n'):
    raw = raw[:-1]
  if raw.endswith(b'\r'):
    raw = raw[:-1]
  try:
    return raw.decode('utf-8'), False
  except UnicodeDecodeError:
    return raw.decode('utf-8', errors='replace'), True


def read_lines(path: str, flag: str) -> list[str]:
  """A text file's lines, as `decode_line` reads them (`path` checked by
  `paths.check_input_file`)."""
  paths.check_input_file(path, f'--{flag}')
  with storage.open_file(path) as f:
    lines = f.read().split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  return [decode_line(line)[0] for line in lines]


def n_best_line(index: int, hypothesis: Any) -> str:
  """One line of the n-best format (Moses' and Marian's):
  `INDEX ||| TRANSLATION ||| LogProb= LOG_P ||| SCORE`, with INDEX the 0-based input line,
  LOG_P = log P(Y | X) and SCORE = LOG_P / lp(|Y|), what beam search ranks by."""
  return (
      f'{index} ||| {hypothesis.text} ||| LogProb= {hypothesis.log_prob:.6g} ||| '
      f'{hypothesis.score:.6g}'
  )


def translate_lines(
    translator: Any,
    lines: Iterable[bytes],
    write: Callable[[str], None],
    warn: Callable[[str], None],
    chunk_lines: int = 512,
    n_best_format: bool = False,
) -> Any:
  """Translates raw input lines, writing exactly one output line for each, in order (with
  `n_best_format`: exactly `n_best` lines each, as `n_best_line` writes them).

  Lines are split on b'\\n' only (iterate a binary file), so no other character (form feed,
  U+2028, ...) ever splits or shifts a line. A blank line gives an empty line; invalid UTF-8
  is replaced and warned about; a line longer than `max_len` tokens is cut and warned about;
  a line that cannot be encoded at all gives an empty line and a warning; a line whose output
  limit `max_len` cuts (learned positions) is warned about.

  Args:
    translator: a `translator.Translator`.
    lines: raw lines, e.g. a file opened in binary mode; read `chunk_lines` at a time.
    write: receives each output line, newline included.
    warn: receives one message per problem, starting with 'line N: ' (1-based).
    chunk_lines: lines translated together (sorted by length within the chunk); 1 for
      interactive use.

  Returns:
    A `translator.DecodeStats` of totals over all lines (`truncated` holds 0-based line
    indices).
  """
  from transformer_jax.decoding.translator import DecodeStats

  total = DecodeStats()
  truncated: list[int] = []

  def flush(first: int, texts: list[str]) -> None:
    outputs, stats = translator.translate_n_best(texts)
    for index in stats.truncated:
      warn(
          f'line {first + index + 1}: longer than max_len={translator.max_source_length} '
          f'tokens; translating its first {translator.max_source_length - 1} tokens only.'
      )
      truncated.append(first + index)
    for index in stats.capped:
      warn(
          f'line {first + index + 1}: its output is limited to max_len='
          f'{translator.max_source_length} tokens, less than its source length + '
          f'{translator.options.max_decode_extra_length} (learned positions end there).'
      )
    for index, error in stats.failed:
      warn(f'line {first + index + 1}: {error}; writing an empty line.')
    for index, hypotheses in enumerate(outputs, first):
      if n_best_format:
        for hypothesis in hypotheses:
          write(n_best_line(index, hypothesis) + '\n')
      else:
        write(hypotheses[0].text + '\n')
    for name in (
        'sentences',
        'source_tokens',
        'output_tokens',
        'batches',
        'compile_seconds',
        'decode_seconds',
    ):
      setattr(total, name, getattr(total, name) + getattr(stats, name))

  chunk: list[str] = []
  first = 0
  for number, raw in enumerate(lines, 1):
    text, replaced = decode_line(raw)
    if replaced:
      warn(f'line {number}: invalid UTF-8, replaced by U+FFFD.')
    chunk.append(text)
    if len(chunk) >= max(chunk_lines, 1):
      flush(first, chunk)
      first, chunk = number, []
  if chunk:
    flush(first, chunk)
  total.truncated = tuple(truncated)
  return total

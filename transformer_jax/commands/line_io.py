"""Input lines in, one output line for each: how translate.py and evaluate.py read text.

Lines are split on b'\\n' only, decoded as UTF-8 (invalid bytes replaced and warned about), and
every input line gets exactly one output line (or `n_best` lines in the n-best format), in
order, whatever is wrong with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import contextlib
import io
import sys
from typing import Any, IO

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


def open_output(stack: contextlib.ExitStack, path: str) -> IO[str]:
  """The text output `path` names, open until `stack` closes: '-' is standard output (UTF-8,
  '\n' line endings, each write passed through at once, left open afterwards); a file is
  written beside its final name and renamed into place once complete (`storage.writing`)."""
  if path != '-':
    return stack.enter_context(storage.writing(path))
  output = io.TextIOWrapper(
      sys.stdout.buffer, encoding='utf-8', errors='replace', newline='\n', write_through=True
  )
  stack.callback(output.detach)  # Leave sys.stdout open.
  return output


def read_lines(path: str, flag: str) -> list[str]:
  """A text file's lines, as `decode_line` reads them (`path` checked by
  `paths.check_input_file`)."""
  paths.check_input_file(path, f'--{flag}')
  with storage.open_file(path) as f:
    lines = f.read().split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  return [decode_line(line)[0] for line in lines]


def count_lines(path: str, flag: str) -> int:
  """How many lines `read_lines` gives of a file, read a block at a time (nothing kept)."""
  paths.check_input_file(path, f'--{flag}')
  count, last = 0, b'\n'
  with storage.open_file(path) as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      count, last = count + block.count(b'\n'), block[-1:]
  return count + (last != b'\n')


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
    prefixes: Iterable[str] | None = None,
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
    n_best_format: write `n_best` lines a line, as `n_best_line` does.
    prefixes: the forced start of each line's output, in order ('' for none); a line past
      their end is warned about and translated without one.

  Returns:
    A `translator.DecodeStats` of totals over all lines (`truncated` holds 0-based line
    indices).
  """
  from transformer_jax.decoding.translator import DecodeStats

  total = DecodeStats()
  truncated: list[int] = []

  prefix_lines = None if prefixes is None else iter(prefixes)

  def flush(first: int, texts: list[str], forced: list[str] | None) -> None:
    # Each chunk's batches go on numbering from the last's (each samples with its own key).
    outputs, stats = translator.translate_n_best(texts, prefixes=forced, first_batch=total.batches)
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
  forced: list[str] | None = None if prefix_lines is None else []
  first = 0
  for number, raw in enumerate(lines, 1):
    text, replaced = decode_line(raw)
    if replaced:
      warn(f'line {number}: invalid UTF-8, replaced by U+FFFD.')
    chunk.append(text)
    if forced is not None:
      prefix = next(prefix_lines, None)  # type: ignore[arg-type]
      if prefix is None:
        warn(f'line {number}: no prefix (the prefixes have ended); translating it without one.')
      forced.append(prefix or '')
    if len(chunk) >= max(chunk_lines, 1):
      flush(first, chunk, forced)
      first, chunk = number, []
      forced = None if forced is None else []
  if chunk:
    flush(first, chunk, forced)
  total.truncated = tuple(truncated)
  return total

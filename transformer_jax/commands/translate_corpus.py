r"""Translates a monolingual file or a split into a training corpus: back-translation and
sequence-level distillation.

  # Back-translation (Sennrich et al. 2016): an es->en model translates Spanish text; the
  # corpus's sources are its English outputs, its targets the Spanish lines.
  python translate_corpus.py --workdir=runs/es_en --input=mono.es --output_dir=bt_es \
      --kind=back_translation --sampling --top_k=10        # or beam search (the default)
  # Distillation (Kim and Rush 2016): a teacher's translations of its training split.
  python translate_corpus.py --workdir=runs/teacher --split=train --output_dir=distilled \
      --kind=distillation
  # Then train on it beside the bitext (or alone, --config.train_on_directions=False):
  python train.py --config=... --config.extra_corpora="('bt_es',)" \
      --config.back_translation_tag=True --config.corpus_weights="(1, 1)"

The output directory gets `corpus.<src>` and `corpus.<tgt>` (line i of one translating line
i of the other), `vocab.model` (the model's vocabulary, which a run training on the corpus
reads) and, last, `corpus.json`: the direction, the kind, which side is synthetic, the
model, checkpoint and search that wrote it, and the input's fingerprint.

The work goes a chunk of --chunk_lines lines at a time, each chunk's translations written as
one file once done (`chunks/`). Killed at any moment, the same command resumes at the first
chunk not written; the corpus it ends with is the one an uninterrupted run writes (sampling
too: each chunk samples with its own keys). Rerun with other settings (another model,
checkpoint, search or input), it refuses and says what differs. Several processes (add
--distributed, as for train.py) decode each chunk as one job, its batch split over every
device of every host; process 0 writes.

A blank input line gives a blank pair, and a line the model cannot translate (a source cut at
max_len is translated cut, with a warning) an empty output; training skips pairs with an
empty side. An input file that is empty, binary or not UTF-8 is refused before the model
loads.

Exit codes: 0 done (or already done); 1 an unexpected error; 2 a flag, input, work directory,
checkpoint or output-directory problem (explained in one paragraph; the traceback only with
--verbose).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import posixpath
import sys
import time
from typing import Any

from absl import flags

from transformer_jax.commands import cli
from transformer_jax.storage import paths
from transformer_jax.storage import storage

_CHECKPOINT = cli.define_checkpoint_flags()
_JOB = cli.define_job_flags()

_KIND = flags.DEFINE_enum(
    'kind',
    None,
    ['back_translation', 'distillation'],
    "back_translation: the outputs are the corpus's sources and the input its targets; "
    "distillation: the input is the corpus's sources and the outputs its targets.",
)
_INPUT = flags.DEFINE_string(
    'input', None, "A UTF-8 text file of sentences in the model's source language, one a line."
)
_SPLIT = flags.DEFINE_string(
    'split', None, "Instead of --input: the sources of this split of the model's dataset."
)
_SOURCE_LANG = flags.DEFINE_string(
    'source_lang',
    None,
    "The language of --input (default: the model's only source language into --target_lang).",
)
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where the corpus is written.')
_CHUNK_LINES = flags.DEFINE_integer(
    'chunk_lines', 4096, 'Lines translated and written together (what a resume redoes at most).'
)
_QUIET = flags.DEFINE_bool('quiet', False, 'No progress lines on stderr.')

_CHUNKS = 'chunks'
_PROGRESS = 'progress.json'


def _check_flags() -> list[str] | None:
  """Checks the flags and reads --input (before the model loads); its lines or None."""
  cli.check_checkpoint_flags(_CHECKPOINT)
  if _KIND.value is None:
    cli.fail('--kind is required: back_translation or distillation.')
  if (_INPUT.value is None) == (_SPLIT.value is None):
    cli.fail("give --input (a monolingual file) or --split (of the model's dataset), one.")
  if _CHUNK_LINES.value < 1:
    cli.fail(f'--chunk_lines={_CHUNK_LINES.value} must be >= 1.')
  output_dir = cli.given(_OUTPUT_DIR)
  texts = None
  if _INPUT.value is not None:
    from transformer_jax.data import data_sources

    paths.check_input_file(_INPUT.value, '--input')
    texts = data_sources.read_text_lines(
        _INPUT.value, '--input', 'give a UTF-8 text file of one sentence a line as --input'
    )
  inputs = {'--input': _INPUT.value, **cli.workdir_inputs(_CHECKPOINT)}
  paths.check_output_directory(output_dir, '--output_dir', inputs)
  return texts


def _languages(config, target: str) -> str:
  """The model's source language into `target` (the input's), checked against --source_lang."""
  from transformer_jax.data import languages

  sources = sorted({d.source for d in languages.directions(config) if d.target == target})
  if _SOURCE_LANG.value is not None:
    if _SOURCE_LANG.value not in sources:
      cli.fail(
          f'--source_lang={_SOURCE_LANG.value}: this model translates into {target} from '
          f'{", ".join(sources)} only.'
      )
    return _SOURCE_LANG.value
  if len(sources) > 1:
    cli.fail(
        f'this model translates into {target} from {len(sources)} languages '
        f'({", ".join(sources)}); say which --input is in with --source_lang.'
    )
  return sources[0]


def _split_sources(config, source: str, target: str) -> list[str]:
  from transformer_jax.data import data_sources
  from transformer_jax.data import languages

  split = cli.given(_SPLIT)
  [direction] = [
      d for d in languages.directions(config) if (d.source, d.target) == (source, target)
  ]
  try:
    pairs = data_sources.open_split(config, split, direction, tagged=False)
  except KeyError as e:  # TFDS: no such split.
    cli.fail(f'cannot read split {split!r} of {direction.dataset}: {e}; pass --split.')
  return [pairs[i][0] for i in range(len(pairs))]


def _settings(translator, checkpoint, texts, source, target) -> dict[str, Any]:
  """What the corpus depends on: a resumed run must have the same."""
  digest = hashlib.sha256('\n'.join(texts).encode('utf-8')).hexdigest()[:16]
  settings = {
      'kind': _KIND.value,
      'input': {
          'file': storage.resolve(_INPUT.value) if _INPUT.value else None,
          'split': _SPLIT.value,
          'language': source,
          'lines': len(texts),
          'sha256': digest,
      },
      'model': {
          'workdirs': [storage.resolve(w) for w in _CHECKPOINT.workdir.value],
          'weights': list(translator.weights) if translator.weights else None,
          'checkpoint_steps': list(checkpoint.steps),
          'translates': f'{source}-{target}',
          'source_prefix': translator.source_prefix,
      },
      'search': dataclasses.asdict(translator.options),
      'chunk_lines': _CHUNK_LINES.value,
      'vocab_sha256': translator.tokenizer.fingerprint,
  }
  return json.loads(json.dumps(settings))  # As read back (lists, not tuples).


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = '') -> list[str]:
  found = []
  for key in sorted(set(a) | set(b)):
    x, y = a.get(key), b.get(key)
    if isinstance(x, dict) and isinstance(y, dict):
      found += _differences(x, y, f'{prefix}{key}.')
    elif x != y:
      found.append(f'{prefix}{key}: {json.dumps(x)} then, {json.dumps(y)} now')
  return found


def _read_json(path: str) -> dict[str, Any]:
  with storage.open_file(path) as f:
    return json.loads(f.read())


def _begin(output_dir: str, settings: dict[str, Any]) -> tuple[bool, str]:
  """Records the settings, or checks them against a started or finished corpus: whether the
  corpus is finished already, and why the directory cannot be used ('' if it can)."""
  from transformer_jax.data import corpora

  for name in (corpora.MANIFEST, _PROGRESS):
    path = posixpath.join(output_dir, name)
    if not storage.exists(path):
      continue
    try:
      recorded = _read_json(path)['settings']
    except (ValueError, KeyError, TypeError):
      return False, f'{path} is damaged; delete {output_dir} (or give another --output_dir).'
    differences = _differences(recorded, settings)
    if differences:
      return False, (
          f'--output_dir={output_dir} holds a corpus '
          f'{"written" if name == corpora.MANIFEST else "being written"} with other settings '
          f'({"; ".join(differences[:4])}); give another --output_dir, delete it, or rerun '
          'with the same flags (--step for the same checkpoint).'
      )
    return name == corpora.MANIFEST, ''
  storage.write_file(posixpath.join(output_dir, _PROGRESS), json.dumps({'settings': settings}))
  storage.as_epath(posixpath.join(output_dir, _CHUNKS)).mkdir(parents=True, exist_ok=True)
  return False, ''


def _chunk_path(output_dir: str, chunk: int) -> str:
  return posixpath.join(output_dir, _CHUNKS, f'{chunk:06d}.txt')


def _written_chunks(output_dir: str, texts: list[str], chunk_lines: int) -> list[bool]:
  """Which chunks have their translations written (whole: a file of the wrong line count,
  which an atomic write never leaves, is done again)."""
  count = -(-len(texts) // chunk_lines)
  names = set()
  directory = storage.as_epath(posixpath.join(output_dir, _CHUNKS))
  if directory.exists():
    names = {p.name for p in directory.iterdir()}
  done = []
  for chunk in range(count):
    path = _chunk_path(output_dir, chunk)
    ok = posixpath.basename(path) in names
    if ok:
      expected = len(texts[chunk * chunk_lines : (chunk + 1) * chunk_lines])
      with storage.open_file(path) as f:
        ok = f.read().count(b'\n') == expected
    done.append(ok)
  return done


def _agreed(done: list[bool]) -> list[bool]:
  """Process 0's view of the written chunks, on every process (a local disk per host sees
  only its own)."""
  import jax

  if jax.process_count() == 1:
    return done
  from jax.experimental import multihost_utils
  import numpy as np

  return [bool(x) for x in multihost_utils.broadcast_one_to_all(np.asarray(done, np.bool_))]


def _translate_chunk(translator, texts: list[str], chunk: int, first_line: int) -> list[str]:
  outputs, stats = translator.translate_n_best(texts, first_batch=first_line)
  for index in stats.truncated:
    cli.warn(
        f'line {first_line + index + 1}: longer than max_len={translator.max_source_length} '
        f'tokens; translating its first {translator.max_source_length - 1} tokens only.'
    )
  for index, error in stats.failed:
    cli.warn(f'line {first_line + index + 1}: {error}; its output is empty (training skips it).')
  return [hypotheses[0].text for hypotheses in outputs]


def _finish(output_dir, texts, settings, translator, source, target) -> dict[str, Any]:
  """Writes the corpus files, the vocabulary and, last, the manifest; removes the chunks."""
  from transformer_jax.data import corpora

  chunk_lines = settings['chunk_lines']
  outputs: list[str] = []
  for chunk in range(-(-len(texts) // chunk_lines)):
    with storage.open_file(_chunk_path(output_dir, chunk)) as f:
      outputs += f.read().decode('utf-8').split('\n')[:-1]
  assert len(outputs) == len(texts), (len(outputs), len(texts))
  if settings['kind'] == 'back_translation':
    languages, sides = (target, source), (outputs, texts)
  else:
    languages, sides = (source, target), (texts, outputs)
  with open(translator.tokenizer.model_path, 'rb') as f:
    vocabulary = f.read()
  manifest = corpora.write(
      output_dir, settings['kind'], languages, sides, vocabulary, settings=settings
  )
  for chunk in range(-(-len(texts) // chunk_lines)):
    storage.remove_once(_chunk_path(output_dir, chunk))
  storage.remove_once(posixpath.join(output_dir, _PROGRESS))
  with contextlib.suppress(OSError):  # Empty now; a bucket has no directories to remove.
    storage.as_epath(posixpath.join(output_dir, _CHUNKS)).rmdir()
  return manifest


def main(argv: list[str]) -> None:
  del argv  # Unused.
  texts = _check_flags()
  output_dir = storage.resolve(cli.given(_OUTPUT_DIR))
  cli.join_job(
      _JOB,
      {
          f'--{name}': str(flags.FLAGS[name].value)
          for name in ('workdir', 'kind', 'input', 'split', 'output_dir', 'chunk_lines')
      },
  )
  import jax

  from transformer_jax.data import languages

  translator, checkpoint = cli.load_translator(_CHECKPOINT)
  target = languages.chosen_target(checkpoint.config, _CHECKPOINT.target_lang.value)
  source = _languages(checkpoint.config, target)
  if texts is None:
    texts = _split_sources(checkpoint.config, source, target)
  writer = jax.process_index() == 0
  settings = _settings(translator, checkpoint, texts, source, target)
  finished, problem = _begin(output_dir, settings) if writer else (False, '')
  # Every process learns process 0's answer (a refusal ends them all, not process 0 alone).
  finished, refused = _agreed([finished, bool(problem)])
  if refused:
    cli.fail(problem or 'process 0 refused --output_dir (its message says why).')
  if finished:
    print(f'{cli.program()}: {output_dir} is complete already (the same settings).')
    return
  chunk_lines = _CHUNK_LINES.value
  count = -(-len(texts) // chunk_lines)
  done = _agreed(_written_chunks(output_dir, texts, chunk_lines) if writer else [False] * count)
  if any(done) and writer and not _QUIET.value:
    print(f'{cli.program()}: resuming: {sum(done)} of {count} chunks are written.', file=sys.stderr)
  start = time.perf_counter()
  for chunk in (c for c in range(count) if not done[c]):
    first = chunk * chunk_lines
    lines = texts[first : first + chunk_lines]
    chunk_start = time.perf_counter()
    outputs = _translate_chunk(translator, lines, chunk, first)
    if writer:
      # One line each: a translation never holds a line break (`Translator.translate`).
      storage.write_file(_chunk_path(output_dir, chunk), ''.join(o + '\n' for o in outputs))
      if not _QUIET.value:
        print(
            f'{cli.program()}: chunk {chunk + 1}/{count} (lines {first + 1}-'
            f'{first + len(lines)}): {len(lines) / (time.perf_counter() - chunk_start):.1f} '
            'lines/s',
            file=sys.stderr,
        )
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices('translate_corpus: every chunk written')
  if writer:
    manifest = _finish(output_dir, texts, settings, translator, source, target)
    print(
        f'{cli.program()}: wrote {output_dir}: {manifest["pairs"]} pairs '
        f'{manifest["source_lang"]}-{manifest["target_lang"]} ({manifest["kind"]}, the '
        f'{manifest["synthetic_side"]} side synthetic; {manifest["empty_outputs"]} empty '
        f'outputs) in {time.perf_counter() - start:.0f} s.'
    )


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

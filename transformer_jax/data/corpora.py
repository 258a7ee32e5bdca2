"""What a run trains on: its directions' training splits and further corpora, mixed by weight.

A run trains on each direction's `config.train_split` (`languages`) and on each entry of
`config.extra_corpora`, one of:

  * a corpus directory written by `translate_corpus.py`: back-translation (a model's
    translations of monolingual target-language text, as sources) or distillation (a
    teacher's translations of a split, as targets). Its `corpus.json` names the direction,
    the kind, the two text files and the vocabulary the model that wrote it read;
  * 'SRC-TGT:SOURCE_FILE,TARGET_FILE', two plain text files of parallel sentences, one a line;
  * 'DATASET:SRC-TGT', the training split of a TFDS dataset (or 'bible_en_es'), its fields SRC
    and TGT: more bitext for training only (validation and test stay the directions').

Each extra corpus translates one of the run's directions. With `config.train_on_directions`
False the run trains on the extra corpora alone (a student on its teacher's translations);
the directions' validation and test splits still score it. The training sources are read
one after the other (their sizes weigh them), or, with `config.corpus_weights` or
`config.sampling_temperature`, drawn from by weight through Grain's mixing
(`batching.Mixture`).

A back-translated corpus's sources start with '<BT>' when `config.back_translation_tag` is
set (tagged back-translation, Caswell et al. 2019), so that the model can tell the
synthetic sources from real ones; a translation's source never has it. The vocabulary then
keeps '<BT>' as one piece. A run with a corpus of `translate_corpus.py` reads the
vocabulary that corpus was written in (its pieces are that model's), unless
`config.vocab_path` names the same file.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import posixpath
import re
from typing import Any

import ml_collections

from transformer_jax.data import languages
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DataError
from transformer_jax.storage import storage

BT_TAG = '<BT>'
MANIFEST = 'corpus.json'
FORMAT = 'transformer_jax corpus 1'
KINDS = ('back_translation', 'distillation')
_TEXT_ENTRY = re.compile(r'([A-Za-z][A-Za-z0-9_]*)-([A-Za-z][A-Za-z0-9_]*):(.+)')
_DATASET_ENTRY = re.compile(r'([A-Za-z0-9_.]+(?:/[A-Za-z0-9_.-]+)*):([A-Za-z]\w*)-([A-Za-z]\w*)')


@dataclasses.dataclass(frozen=True)
class Corpus:
  """One entry of `config.extra_corpora`.

  Attributes:
    name: short and unique among the run's training sources (the metrics' examples_drawn/).
    entry: the config entry, as given.
    kind: 'bitext' (plain text files), 'dataset' (a dataset's training split), or one of
      `KINDS`.
    source: the source language.
    target: the target language.
    source_file: the source side's text file ('' for 'dataset').
    target_file: the target side's text file ('' for 'dataset').
    vocab_path: the vocabulary the corpus's model read ('' for 'bitext').
    vocab_sha256: its fingerprint (`Tokenizer.fingerprint`; '' for 'bitext').
  """

  name: str
  entry: str
  kind: str
  source: str
  target: str
  source_file: str
  target_file: str
  vocab_path: str = ''
  vocab_sha256: str = ''
  dataset: str = ''

  @property
  def direction(self) -> str:
    return f'{self.source}-{self.target}'


@dataclasses.dataclass(frozen=True)
class Source:
  """One of the run's training sources: a direction's training split, or a `Corpus`."""

  name: str
  direction: languages.Direction | None = None
  corpus: Corpus | None = None


def _fix() -> str:
  return (
      '; each entry of --config.extra_corpora is a directory written by translate_corpus.py '
      "or 'SRC-TGT:SOURCE_FILE,TARGET_FILE'."
  )


def entries(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  found = tuple(config.get('extra_corpora', ()) or ())
  for entry in found:
    if not isinstance(entry, str) or not entry.strip():
      raise ConfigError(f'extra_corpora holds {entry!r}, not a path{_fix()}')
  return found


def _dataset_entry(entry: str) -> Corpus | None:
  """'DATASET:SRC-TGT' -> a 'dataset' Corpus; None for anything else (or a directory)."""
  match = _DATASET_ENTRY.fullmatch(entry)
  if not match or storage.exists(entry):
    return None
  dataset, source, target = match.groups()
  name = re.sub(r'[^A-Za-z0-9_.-]+', '_', dataset)
  return Corpus(name, entry, 'dataset', source, target, '', '', dataset=dataset)


def _text_entry(entry: str) -> Corpus | None:
  """'SRC-TGT:SOURCE_FILE,TARGET_FILE' -> a 'bitext' Corpus; None for a directory."""
  match = _TEXT_ENTRY.fullmatch(entry)
  if not match:
    return None
  source, target, files = match.groups()
  paths = [p.strip() for p in files.split(',')]
  if len(paths) != 2 or not all(paths):
    raise ConfigError(f'extra_corpora entry {entry!r} does not name two files{_fix()}')
  stem = posixpath.basename(paths[0].rstrip('/')).rsplit('.', 1)[0] or 'text'
  return Corpus(stem, entry, 'bitext', source, target, paths[0], paths[1])


def read_manifest(directory: str) -> dict[str, Any]:
  """The `corpus.json` of a corpus directory.

  Raises:
    DataError: there is none (the corpus is unfinished, or the path is not one) or it is
      not a manifest this code wrote.
  """
  path = posixpath.join(directory.rstrip('/'), MANIFEST)
  if not storage.exists(path):
    unfinished = storage.exists(posixpath.join(directory.rstrip('/'), 'progress.json'))
    raise DataError(
        f'{directory} is not a finished corpus of translate_corpus.py (it has no {MANIFEST}'
        + (
            '; its translation has not finished: rerun the translate_corpus.py command that '
            'writes it, which resumes where it stopped)'
            if unfinished
            else "); give a directory translate_corpus.py wrote, or 'SRC-TGT:SOURCE_FILE,"
            "TARGET_FILE' for plain text files (--config.extra_corpora)"
        )
        + '.'
    )
  with storage.open_file(path) as f:
    try:
      manifest = json.loads(f.read())
    except ValueError as e:
      raise DataError(
          f'{path} is not JSON ({e}); rerun translate_corpus.py to rewrite it.'
      ) from None
  if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
    raise DataError(f'{path} is not a manifest of translate_corpus.py (format {FORMAT!r}).')
  return manifest


def write(
    directory: str,
    kind: str,
    pair: tuple[str, str],
    sides: tuple[Sequence[str], Sequence[str]],
    vocabulary: bytes,
    *,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Writes a corpus directory: 'corpus.<src>' and 'corpus.<tgt>', 'vocab.model' (the
  vocabulary its model read, whose bytes are `vocabulary`) and, last, `MANIFEST`, which
  makes it a corpus (a reader never sees half of one).

  Args:
    directory: where (local or gs://; it exists).
    kind: one of `KINDS`; back_translation's sources are synthetic, distillation's targets.
    pair: (source language, target language).
    sides: the source lines and the target lines, as many of each, none with a line break.
    vocabulary: the SentencePiece model's bytes.
    settings: what made it (`translate_corpus.py` records its model, search and input).

  Returns:
    The manifest written.
  """
  if kind not in KINDS:
    raise ValueError(f'kind={kind!r} is not one of {KINDS}.')
  if len(sides[0]) != len(sides[1]):
    raise ValueError(f'{len(sides[0])} source lines but {len(sides[1])} target lines.')
  files = [f'corpus.{language}' for language in pair]
  for name, lines in zip(files, sides):
    storage.write_file(posixpath.join(directory, name), ''.join(line + '\n' for line in lines))
  storage.write_file(posixpath.join(directory, 'vocab.model'), vocabulary)
  synthetic = 0 if kind == 'back_translation' else 1
  manifest = {
      'format': FORMAT,
      'kind': kind,
      'source_lang': pair[0],
      'target_lang': pair[1],
      'synthetic_side': ('source', 'target')[synthetic],
      'source_file': files[0],
      'target_file': files[1],
      'pairs': len(sides[0]),
      'empty_outputs': sum(
          1
          for real, made in zip(sides[1 - synthetic], sides[synthetic])
          if real.strip() and not made.strip()
      ),
      'vocab': {'file': 'vocab.model', 'sha256': hashlib.sha256(vocabulary).hexdigest()[:16]},
      'settings': settings or {},
  }
  storage.write_file(posixpath.join(directory, MANIFEST), json.dumps(manifest, indent=2) + '\n')
  return manifest


def _directory_entry(entry: str) -> Corpus:
  manifest = read_manifest(entry)
  root = entry.rstrip('/')
  vocab = manifest.get('vocab') or {}
  return Corpus(
      name=posixpath.basename(root),
      entry=entry,
      kind=manifest['kind'],
      source=manifest['source_lang'],
      target=manifest['target_lang'],
      source_file=posixpath.join(root, manifest['source_file']),
      target_file=posixpath.join(root, manifest['target_file']),
      vocab_path=posixpath.join(root, vocab['file']) if vocab.get('file') else '',
      vocab_sha256=vocab.get('sha256', ''),
  )


def extra_corpora(config: ml_collections.ConfigDict) -> tuple[Corpus, ...]:
  """The run's `extra_corpora`, their manifests read (files are read when training opens
  them).

  Raises:
    ConfigError: a malformed entry, or one whose direction the run does not have.
    DataError: a directory that is not a finished corpus.
  """
  found = []
  pairs = {(d.source, d.target) for d in languages.directions(config)}
  for entry in entries(config):
    corpus = _dataset_entry(entry) or _text_entry(entry) or _directory_entry(entry)
    if (corpus.source, corpus.target) not in pairs:
      raise ConfigError(
          f'extra_corpora entry {entry!r} translates {corpus.direction}, which is not a '
          f'direction of this run ({", ".join(sorted(f"{s}-{t}" for s, t in pairs))}); add it '
          'to --config.directions, or drop the entry.'
      )
    found.append(corpus)
  return tuple(found)


def sources(config: ml_collections.ConfigDict, *, read: bool = True) -> tuple[Source, ...]:
  """The run's training sources, in order: each direction's training split (unless
  `train_on_directions` is False), then each extra corpus (`read`: with their manifests;
  else named by their entries only, for the checks that need no files).

  Raises:
    ConfigError: no source is left, names collide, or the weights do not fit them.
    DataError: see `extra_corpora`.
  """
  found = []
  if config.get('train_on_directions', True):
    found = [Source(d.name, direction=d) for d in languages.directions(config)]
  if read:
    found += [Source(c.name, corpus=c) for c in extra_corpora(config)]
  else:
    found += [Source(entry) for entry in entries(config)]
  if not found:
    raise ConfigError(
        'train_on_directions=False trains on --config.extra_corpora alone, but there are '
        'none; list the corpora to train on, or set train_on_directions=True.'
    )
  names = [s.name for s in found]
  if read and len(set(names)) < len(names):
    repeated = sorted({n for n in names if names.count(n) > 1})
    raise ConfigError(
        f'Two training sources are both named {repeated[0]!r} (a direction and a corpus '
        "directory's name, or two directories'); rename a corpus directory so that the "
        'metrics can tell them apart.'
    )
  _check_weights(config, names)
  return tuple(found)


def check(config: ml_collections.ConfigDict) -> None:
  """Checks, before a training run makes anything, that its extra corpora are there: each
  entry's manifest and files, and the vocabulary they were written in (`vocabulary`).

  Raises:
    ConfigError, DataError: the first entry that cannot be read, saying what to do.
  """
  extra = extra_corpora(config)
  sources(config)
  for corpus in extra:
    for path in (corpus.source_file, corpus.target_file) if corpus.kind != 'dataset' else ():
      if not storage.exists(path):
        raise DataError(
            f'{path} (extra_corpora entry {corpus.entry!r}) does not exist; fix or drop '
            'the entry.'
        )
  vocabulary(config, extra)


def source_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  return tuple(s.name for s in sources(config))


def _check_weights(config: ml_collections.ConfigDict, names: Sequence[str]) -> None:
  weights = tuple(config.get('corpus_weights', ()) or ())
  temperature = config.get('sampling_temperature', 1.0)
  if weights and (
      len(weights) != len(names)
      or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
      or not all(w > 0 for w in weights)
  ):
    raise ConfigError(
        f'corpus_weights={weights!r} must be {len(names)} positive numbers, one a training '
        f'source in this order: {", ".join(names)} (the directions, then extra_corpora); () '
        'samples them by size.'
    )
  if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature <= 0:
    raise ConfigError(
        f'sampling_temperature={temperature!r} must be a number > 0 (1: by size; e.g. 5 '
        'flattens toward uniform).'
    )
  if is_mixture(config) and not config.get('packing', False):
    raise ConfigError(
        f'corpus_weights={weights!r} / sampling_temperature={temperature!r} draw the '
        'training examples one at a time from each source, which packed rows take and '
        'length buckets (a fixed plan per epoch) do not; set --config.packing=True, or drop '
        'the weights.'
    )


def is_mixture(config: ml_collections.ConfigDict) -> bool:
  """Whether the training examples are drawn from the sources by weight (a Grain mixture)
  rather than read as their concatenation."""
  return bool(config.get('corpus_weights', ())) or config.get('sampling_temperature', 1.0) != 1


def mixture_weights(config: ml_collections.ConfigDict, sizes: Sequence[int]) -> tuple[float, ...]:
  """Each source's share of the examples drawn: `corpus_weights`, or size^(1/T),
  normalized to sum 1."""
  weights = tuple(config.get('corpus_weights', ()) or ()) or tuple(
      float(n) ** (1.0 / config.get('sampling_temperature', 1.0)) for n in sizes
  )
  total = float(sum(weights))
  return tuple(float(w) / total for w in weights)


def reserved_pieces(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The pieces the run's vocabulary keeps whole: the language tags, and '<BT>' with
  `back_translation_tag`."""
  return languages.tags(config) + ((BT_TAG,) if config.get('back_translation_tag', False) else ())


def source_prefix(config: ml_collections.ConfigDict, corpus: Corpus | None, target: str) -> str:
  """What starts each training source of `corpus` (None: a direction's split) into
  `target`: the language tag, then '<BT>' for a back-translation with
  `back_translation_tag`."""
  prefix = languages.source_prefix(config, target)
  if corpus is not None and corpus.kind == 'back_translation':
    if config.get('back_translation_tag', False):
      prefix += BT_TAG + ' '
  return prefix


def vocabulary(config: ml_collections.ConfigDict, corpora: Sequence[Corpus]) -> str:
  """The vocabulary the run must read because its corpora were written in it ('' if
  none of them was).

  Raises:
    ConfigError: two corpora of different vocabularies, or `config.vocab_path` another one.
  """
  written = [c for c in corpora if c.vocab_sha256]
  for corpus in written[1:]:
    if corpus.vocab_sha256 != written[0].vocab_sha256:
      raise ConfigError(
          f'extra_corpora {written[0].entry!r} and {corpus.entry!r} were written in '
          f'different vocabularies ({written[0].vocab_path} and {corpus.vocab_path}); a run '
          'reads one. Write them with models of one vocabulary, or train on one of them.'
      )
  if not written:
    return ''
  first = written[0]
  if config.vocab_path and not storage.is_remote(config.vocab_path):
    if not storage.exists(config.vocab_path):
      raise ConfigError(
          f'--config.vocab_path={config.vocab_path} does not exist, but extra_corpora '
          f'{first.entry!r} was written in {first.vocab_path}; leave vocab_path empty to read '
          'that one.'
      )
    with storage.open_file(config.vocab_path) as f:
      sha = hashlib.sha256(f.read()).hexdigest()[:16]
    if sha != first.vocab_sha256:
      raise ConfigError(
          f'extra_corpora {first.entry!r} was written in the vocabulary {first.vocab_path} '
          f'(sha256 {first.vocab_sha256}), but --config.vocab_path={config.vocab_path} is '
          f"another (sha256 {sha}); its synthetic side is that model's output. Leave "
          "vocab_path empty to read the corpus's vocabulary, or write the corpus again with "
          'a model of this one.'
      )
    return config.vocab_path
  if not storage.exists(first.vocab_path):
    raise ConfigError(
        f'extra_corpora {first.entry!r} was written in the vocabulary {first.vocab_path}, '
        'which is not there any more; set --config.vocab_path to a copy of it.'
    )
  return config.vocab_path or first.vocab_path

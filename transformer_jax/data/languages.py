"""Which directions a run translates, and how the model is told the target language.

A run translates one direction, `config.source_lang` -> `config.target_lang` of
`config.dataset`, or several: `config.directions`, each 'SRC-TGT' (over `config.dataset`) or
'DATASET:SRC-TGT' (the dataset named), e.g.

    c.directions = ('en-es', 'es-en')  # Both ways over one corpus.
    c.directions = ('wmt14_translate/de-en:en-de', 'wmt14_translate/fr-en:en-fr')

SRC and TGT are the dataset's fields (for dataset='text', `source_lang` names the first file
of each `text_files` pair and `target_lang` the second). The training and validation
splits are those of every direction, one after the other; the vocabulary is trained over all
of them.

With more than one target language the model must be told which to produce:
`config.language_tag='source'` makes '<2xx>', a reserved piece per target language xx, the
first token of every source (Johnson et al. 2017, Google's multilingual NMT). The tag rides
on the source text, so every path that reads a source (training, validation translations,
`translate.py --target_lang`, `evaluate.py`, scoring, reranking, ensembles, the Marian and
CTranslate2 exports) carries it without a change to the model or the search. (M2M100's
alternative, the tag as the decoder's first token, needs a forced target prefix in every
search and scorer and a decoder start that CTranslate2's exported models do not take per
sentence; it is not offered.)
"""

from __future__ import annotations

import dataclasses
import re

import ml_collections

from transformer_jax.errors import ConfigError

LANGUAGE_TAGS = ('', 'source')
_LANGUAGE = re.compile(r'[A-Za-z][A-Za-z0-9_]*')


@dataclasses.dataclass(frozen=True)
class Direction:
  """One direction: `source` -> `target` of `dataset` (their fields in it)."""

  dataset: str
  source: str
  target: str

  @property
  def name(self) -> str:
    return f'{self.source}-{self.target}'


def tag(language: str) -> str:
  """The reserved piece that asks for `language`: '<2xx>'."""
  return f'<2{language}>'


def _parse(entry: str, dataset: str) -> Direction:
  """'SRC-TGT' or 'DATASET:SRC-TGT' -> Direction (ConfigError when malformed)."""
  fix = (
      "; each entry of --config.directions is 'SRC-TGT' (over --config.dataset) or "
      "'DATASET:SRC-TGT', e.g. ('en-es', 'es-en')."
  )
  if not isinstance(entry, str):
    raise ConfigError(f'directions holds {entry!r}, not a string{fix}')
  named, _, pair = entry.rpartition(':')
  languages = pair.split('-')
  if len(languages) != 2 or not all(_LANGUAGE.fullmatch(x) for x in languages):
    raise ConfigError(f'directions entry {entry!r} does not name two languages{fix}')
  if languages[0] == languages[1]:
    raise ConfigError(f'directions entry {entry!r} translates a language into itself{fix}')
  return Direction(named or dataset, languages[0], languages[1])


def directions(config: ml_collections.ConfigDict) -> tuple[Direction, ...]:
  """The run's directions: `config.directions`, or the one of source_lang/target_lang.

  Raises:
    ConfigError: a malformed or repeated entry, or a language tag the run cannot use.
  """
  entries = tuple(config.get('directions', ()) or ())
  found: tuple[Direction, ...]
  if not entries:
    found = (Direction(config.dataset, config.source_lang, config.target_lang),)
  else:
    found = tuple(_parse(entry, config.dataset) for entry in entries)
  if len(set(found)) < len(found):
    raise ConfigError(f'directions={entries!r} names a direction twice; list each once.')
  mode = config.get('language_tag', '')
  if mode not in LANGUAGE_TAGS:
    raise ConfigError(
        f"language_tag={mode!r} must be one of {LANGUAGE_TAGS}: 'source' starts every "
        "source with the target language's tag, '' adds none."
    )
  targets = {d.target for d in found}
  if len(targets) > 1 and not mode:
    raise ConfigError(
        f'directions={entries!r} translate into {len(targets)} languages '
        f'({", ".join(sorted(targets))}), but language_tag is empty, so the model could not '
        'tell which to produce; set --config.language_tag=source.'
    )
  return found


def target_languages(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The run's target languages, sorted."""
  return tuple(sorted({d.target for d in directions(config)}))


def tags(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The reserved pieces the run's vocabulary needs: a tag per target language with
  `language_tag='source'`, else none."""
  if not config.get('language_tag', ''):
    return ()
  return tuple(tag(language) for language in target_languages(config))


def source_prefix(config: ml_collections.ConfigDict, target: str) -> str:
  """What goes before each source asking for `target` ('' without tags)."""
  return tag(target) + ' ' if config.get('language_tag', '') else ''


def is_multilingual(config: ml_collections.ConfigDict) -> bool:
  """Whether the run has more than one direction (or tags): its splits are read per
  direction and its evaluation reports each."""
  return len(directions(config)) > 1 or bool(config.get('language_tag', ''))


def chosen_target(config: ml_collections.ConfigDict, target_lang: str | None) -> str:
  """The target language a translation of this run's model asks for (`--target_lang`).

  Raises:
    ConfigError: none given for a model of several target languages, or one it lacks.
  """
  targets = target_languages(config)
  if target_lang is None:
    if len(targets) > 1:
      raise ConfigError(
          f'This model translates into {len(targets)} languages ({", ".join(targets)}); '
          'choose one with --target_lang.'
      )
    return targets[0]
  if target_lang not in targets:
    raise ConfigError(
        f'--target_lang={target_lang}: this model translates into '
        f'{", ".join(targets)} only ({_listed(config)}).'
    )
  return target_lang


def direction_into(config: ml_collections.ConfigDict, target: str) -> tuple[str, str]:
  """(the source languages translated into `target`, joined by '/', `target`)."""
  sources = sorted({d.source for d in directions(config) if d.target == target})
  return '/'.join(sources), target


def _listed(config: ml_collections.ConfigDict) -> str:
  return 'directions ' + ', '.join(d.name for d in directions(config))

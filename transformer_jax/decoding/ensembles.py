"""Which models can be decoded as one ensemble, and with what weights.

Without JAX, so that the commands check `--weights` before anything heavy is imported; the
ensemble's step is `translator.ensemble_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any, TYPE_CHECKING

from transformer_jax.errors import EnsembleError

if TYPE_CHECKING:
  from transformer_jax.data.tokenizer import Tokenizer
  from transformer_jax.model.config import TransformerConfig


def ensemble_weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
  """`count` models' weights normalized to sum 1 (None: equal weights).

  Raises:
    EnsembleError: not one weight a model, or one that is not a positive number.
  """
  if weights is None:
    return (1.0 / count,) * count
  weights = [float(w) for w in weights]
  if len(weights) != count:
    raise EnsembleError(
        f'{len(weights)} weight(s) {weights} for {count} model(s): give one weight a model, '
        'in the order of the models, or none for equal weights.'
    )
  bad = [w for w in weights if not math.isfinite(w) or w <= 0]
  if bad:
    raise EnsembleError(
        f'ensemble weights must be positive numbers; got {bad}. Leave a model out '
        'instead of giving it weight 0.'
    )
  total = sum(weights)
  return tuple(w / total for w in weights)


def _tokenizations(tokenizer: Tokenizer) -> dict[str, bytes]:
  """What decides how each side's SentencePiece model cuts text (not where it was trained)."""
  from transformer_jax.data.tokenizer import tokenization

  return {side: tokenization(m) for side, m in tokenizer.sentencepiece_models().items()}


def check_ensemble(
    model_configs: Sequence[TransformerConfig],
    tokenizers: Sequence[Tokenizer | None],
    weights: Sequence[float] | None,
    names: Sequence[str] | None = None,
    directions: Sequence[tuple[str, str]] | None = None,
    source_prefixes: Sequence[str] | None = None,
) -> tuple[float, ...]:
  """Checks that models can be decoded as one ensemble; their weights, summing to 1.

  They need one vocabulary (the same SentencePiece model(s), so the same ids mean the same
  pieces), the same decoder start token and, where `directions` are given, one direction (a
  shared vocabulary serves both directions of a pair). Sizes, depths, positions and output
  shortlists may differ.

  Args:
    model_configs: each model's config.
    tokenizers: each model's tokenizer (None: not checked, as in compile-only use).
    weights: one positive weight a model (normalized here), or None for equal weights.
    names: what to call each model in errors (e.g. its work directory).
    directions: each model's (source, target) language, where known: one for all.
    source_prefixes: what each model reads before a source (a multilingual model's tag for
      the chosen target language), where known: one for all.

  Raises:
    EnsembleError: naming the models that differ and how, or the weights' problem.
  """
  normalized = ensemble_weights(weights, len(model_configs))
  names = list(names or [f'model {i + 1}' for i in range(len(model_configs))])
  first = model_configs[0]
  for name, config, tokenizer in zip(names[1:], model_configs[1:], tokenizers[1:]):
    if config.vocab_size != first.vocab_size or (
        tokenizer is not None
        and tokenizers[0] is not None
        and _tokenizations(tokenizer) != _tokenizations(tokenizers[0])
    ):
      raise EnsembleError(
          f'{name} has another vocabulary than {names[0]} ({config.vocab_size} and '
          f'{first.vocab_size} pieces, or other pieces): an ensemble averages each token '
          "id's probability, so every model must use the same SentencePiece model. Train "
          "the runs with the same vocabulary (copy the first run's vocabulary file, see "
          'docs/data.md) or decode them separately.'
      )
    if config.decoder_start_id != first.decoder_start_id:
      raise EnsembleError(
          f'{name} starts decoding with token {config.decoder_start_id}, {names[0]} with '
          f'{first.decoder_start_id} (decoder_start_token): every model of an ensemble '
          'is fed the same first token; decode them separately.'
      )
  _same_for_all(
      names,
      list(directions or []),
      lambda name, value, first: (
          f'{name} translates {"->".join(value)}, {names[0]} {"->".join(first)}: the models '
          'of an ensemble translate one direction. Decode them separately; a '
          'reverse-direction model reranks with rerank.py --reverse.'
      ),
  )
  _same_for_all(
      names,
      list(source_prefixes or []),
      lambda name, value, first: (
          f'{names[0]} reads sources {_prefixed(first)}, {name} {_prefixed(value)}: the '
          'models of an ensemble read one input. Decode them separately.'
      ),
  )
  return normalized


def _same_for_all(names: Sequence[str], values: Sequence[Any], message: Any) -> None:
  """Raises EnsembleError(message(name, value, first value)) for the first model whose
  value differs from the first model's."""
  for name, value in zip(names[1:], values[1:]):
    if value != values[0]:
      raise EnsembleError(message(name, value, values[0]))


def _prefixed(prefix: str) -> str:
  return f'starting with {prefix.strip()}' if prefix else 'without a language tag'

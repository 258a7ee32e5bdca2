"""Scoring given pairs: the log-probability of a target under a model or an ensemble.

What `sockeye-score`, `marian-scorer` and CTranslate2's `score_batch` give, and what corpus
filtering (dual cross-entropy), reranking (`rerank.py`) and forced decoding need: for each
(source, target) pair, log P(target | source) token by token, by one teacher-forced forward
pass of every model, in float32.

A `Scorer` uses a `translator.Translator`'s models, weights, vocabulary, length penalty,
batch size, buckets and mesh, so a pair's score is what that translator's search would give
the same output: an ensemble's token distribution is the log-softmax of the models' weighted
log-probabilities (`translator.ensemble_step`), and the length-penalized score is
log P(Y) / lp(|Y|) with |Y| counting the EOS, as in the n-best format.

Shapes stay few: pairs are sorted by length, sources and targets padded to the translator's
buckets, and each (rows, source bucket, target bucket) shape is compiled once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import time
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.decoding import decode
from transformer_jax.decoding.translator import Translator
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer

PyTree = Any


@dataclasses.dataclass(frozen=True)
class PairScore:
  """One pair's score.

  Attributes:
    log_prob: log P(Y | X), summed over Y's tokens, the EOS included.
    score: log_prob / lp(|Y|), the length-penalized score beam search ranks by.
    length: |Y|, the target's tokens, the EOS included.
    token_log_probs: each of Y's tokens' log-probability, the EOS's last.
    error: why the pair was not scored ('' when it was); the numbers are then NaN and 0.
  """

  log_prob: float
  score: float
  length: int
  token_log_probs: tuple[float, ...] = ()
  error: str = ''

  @property
  def mean_log_prob(self) -> float:
    """log_prob / |Y|: the per-token average (the negative cross-entropy)."""
    return self.log_prob / self.length if self.length else float('nan')


def failed(error: str) -> PairScore:
  """The score of a pair that could not be scored."""
  return PairScore(float('nan'), float('nan'), 0, (), error)


def token_log_probs(
    models: Sequence[tuple[TransformerConfig, PyTree]],
    weights: Sequence[float],
    inputs: jax.Array,
    targets: jax.Array,
) -> jax.Array:
  """float32 [batch, target_length]: each target token's log-probability under the
  (ensemble of) models, by one forward pass each; 0 on padding (traceable under jit).

  Args:
    models: (config, parameters) of each model.
    weights: each model's weight, summing to 1.
    inputs: int32 [batch, source_length], ids ending with EOS, then PAD.
    targets: int32 [batch, target_length], ids ending with EOS, then PAD.
  """
  summands = []
  for (config, params), weight in zip(models, weights):
    config = dataclasses.replace(config, decode=False, deterministic=True)
    logits = cast(jax.Array, Transformer(config).apply({'params': params}, inputs, targets))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))  # [batch, length, output_size]
    if len(models) == 1:
      indices = jnp.asarray(config.output_positions())[targets]
      picked = jnp.take_along_axis(log_probs, indices[..., None], axis=-1)[..., 0]
      return jnp.where(targets != PAD_ID, picked, 0.0)
    if config.output_ids is not None:  # The whole vocabulary, as the search sees it.
      full = jnp.full(log_probs.shape[:-1] + (config.vocab_size,), -jnp.inf, jnp.float32)
      log_probs = full.at[..., np.asarray(config.output_ids)].set(log_probs)
    summands.append(weight * log_probs)
  log_probs = jax.nn.log_softmax(sum(summands[1:], summands[0]))
  picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  return jnp.where(targets != PAD_ID, picked, 0.0)


@dataclasses.dataclass
class ScoreStats:
  """What one `Scorer.score_ids` call did."""

  pairs: int = 0
  target_tokens: int = 0
  batches: int = 0
  compile_seconds: float = 0.0
  score_seconds: float = 0.0


class Scorer:
  """Scores (source, target) pairs with a translator's models, one compiled forward pass
  per (rows, source bucket, target bucket) shape."""

  def __init__(self, translator: Translator):
    self.translator = translator
    self._compiled: dict[tuple[int, int, int], Callable] = {}

  @property
  def max_length(self) -> int:
    """The longest source or target, EOS included (`max_len`)."""
    return self.translator.max_source_length

  def _compile(self, rows: int, source_bucket: int, target_bucket: int) -> Callable:
    key = (rows, source_bucket, target_bucket)
    if key not in self._compiled:
      t = self.translator

      def fn(params, inputs, targets):
        return token_log_probs(list(zip(t.model_configs, params)), t.weights, inputs, targets)

      p = t.partitioner
      batch = None if p is None else p.batch_sharding
      specs = [
          jax.ShapeDtypeStruct((rows, source_bucket), jnp.int32, sharding=batch),
          jax.ShapeDtypeStruct((rows, target_bucket), jnp.int32, sharding=batch),
      ]
      if p is None:
        self._compiled[key] = jax.jit(fn).lower(t.all_params, *specs).compile()
      else:
        with p.activate():
          jitted = jax.jit(fn, out_shardings=p.replicated)
          self._compiled[key] = jitted.lower(t.all_params, *specs).compile()
    return self._compiled[key]

  def score_ids(
      self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]
  ) -> tuple[list[PairScore], ScoreStats]:
    """Scores id pairs (each side ending with EOS, at most `max_length` long), in input
    order."""
    if len(sources) != len(targets):
      raise ValueError(f'{len(sources)} sources for {len(targets)} targets.')
    t = self.translator
    stats = ScoreStats(pairs=len(sources), target_tokens=sum(len(y) for y in targets))
    if not sources:
      return [], stats
    rows = t.rows_for(len(sources))
    order = sorted(range(len(sources)), key=lambda i: (len(targets[i]), len(sources[i])))
    batches: list[tuple[int, int, list[int]]] = []
    for i in order:
      shape = (t.bucket_for(len(sources[i])), t.bucket_for(len(targets[i])))
      if not batches or batches[-1][:2] != shape or len(batches[-1][2]) == rows:
        batches.append((*shape, []))
      batches[-1][2].append(i)
    start = time.perf_counter()
    compiled = {(s, y): self._compile(rows, s, y) for s, y, _ in batches}
    stats.compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    results: list[PairScore] = [failed('')] * len(sources)
    lp_alpha, lp_form = t.options.length_penalty, t.options.length_penalty_form
    for source_bucket, target_bucket, indices in batches:
      inputs = np.full((rows, source_bucket), PAD_ID, np.int32)
      outputs = np.full((rows, target_bucket), PAD_ID, np.int32)
      inputs[:, 0] = outputs[:, 0] = EOS_ID  # Dummy rows: EOS alone.
      for row, i in enumerate(indices):
        inputs[row, :] = PAD_ID
        outputs[row, :] = PAD_ID
        inputs[row, : len(sources[i])] = sources[i]
        outputs[row, : len(targets[i])] = targets[i]
      per_token = jax.device_get(
          compiled[source_bucket, target_bucket](
              t.all_params, t.place_batch(inputs), t.place_batch(outputs)
          )
      )
      for row, i in enumerate(indices):
        length = len(targets[i])
        values = per_token[row, :length].astype(np.float64)
        log_prob = float(np.sum(values))
        penalty = float(decode.length_penalty(length, lp_alpha, lp_form))
        results[i] = PairScore(
            log_prob, log_prob / penalty, length, tuple(float(v) for v in values)
        )
      stats.batches += 1
    stats.score_seconds = time.perf_counter() - start
    return results, stats

  def score(
      self, sources: Sequence[str], targets: Sequence[str]
  ) -> tuple[list[PairScore], ScoreStats]:
    """Scores text pairs; each gets a `PairScore`, in input order, whatever is wrong with it.

    A blank side is EOS alone (an empty translation is scored as one). Sources start with
    the translator's `source_prefix` (a multilingual model's target-language tag). A pair
    with a side the tokenizer fails on, or one longer than `max_length` tokens (EOS
    included), is not scored: its `error` says why.
    """
    if len(sources) != len(targets):
      raise ValueError(f'{len(sources)} sources for {len(targets)} targets.')
    tokenizer = self.translator.tokenizer
    kept, source_ids, target_ids = [], [], []
    results = [failed('')] * len(sources)
    for i, (source, target) in enumerate(zip(sources, targets)):
      try:
        x = tokenizer.encode(self.translator.source_prefix + source)
        y = tokenizer.encode(target, side='target')
      except Exception as e:  # One pair must not stop all.
        results[i] = failed(f'could not be tokenized ({type(e).__name__}: {e})')
        continue
      if max(len(x), len(y)) > self.max_length:
        results[i] = failed(
            f'{len(x)} source and {len(y)} target tokens (EOS included): more than '
            f'max_len={self.max_length}; a cut pair would be scored as another pair'
        )
        continue
      kept.append(i)
      source_ids.append(x)
      target_ids.append(y)
    scores, stats = self.score_ids(source_ids, target_ids)
    for i, s in zip(kept, scores):
      results[i] = s
    stats.pairs = len(sources)
    return results, stats

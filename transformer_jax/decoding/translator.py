"""Batched translation with a fixed set of compiled shapes: `Translator`.

A `Translator` turns source ids into output ids with the search of `decode.py`. For every
batch it runs one compiled function, encode -> create the key/value caches -> the whole search
loop; the encoder runs once, its encoder-decoder attention keys and values are projected once
and shared by a sentence's beams (`start_decoding`), and every decoder step feeds one token
through the self-attention cache.

Shapes stay few, so a test set never recompiles per sentence:

  * sources are sorted by length and each goes to the shortest length bucket that holds it
    (the config's `bucket_boundaries` below `max_len`, then `max_len`); outputs come back in
    input order;
  * every batch has the same number of rows, `batch_size` (a call with fewer sentences uses
    the next power of two instead, so one sentence is not decoded 32 times over), rounded up
    to a multiple of the data-parallel shards; rows past the sentences are dummies;
  * the output limit is each sentence's own: its source length (EOS included) +
    `max_decode_extra_length` (the paper: source length + 50), at most `max_len` with learned
    positions, whose table ends there (`DecodeStats.capped` names the sentences the cap cut).
    A batch's search is compiled for its bucket's limit; each row stops at its own;
  * a full batch's search grows the self-attention caches in phases, one loop each
    (`decode.cache_lengths`), which pays over many batches; fewer rows (a call that fills
    less than one batch) search in one loop, which compiles in half the time
    (`Translator.grows_cache`).

Each (rows, bucket) shape is compiled ahead of time, once, when first needed; the number of
compiled functions is `Translator.num_compiled`. Given a `Partitioner`, the rows are split
over its batch mesh axes and the parameters over its rules, as in training.

Sources longer than `max_len` tokens (EOS included) are cut to their first `max_len - 1`
tokens plus EOS by `encode_source`; callers report which (see `DecodeStats.truncated`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax.checkpoints import loading
from transformer_jax.config import ConfigError
from transformer_jax.config import EOS_ID
from transformer_jax.config import LENGTH_PENALTY_FORMS
from transformer_jax.config import PAD_ID
from transformer_jax.data import languages
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.decoding import decode
from transformer_jax.decoding.ensembles import check_ensemble
from transformer_jax.decoding.ensembles import ensemble_weights
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer
from transformer_jax.runtime.partitioning import Partitioner

PyTree = Any
# Called with (0, 0) once the shapes are compiled, then after each batch with (sentences in
# it, output tokens generated for them).
ProgressFn = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to search. Defaults are the paper's (beam 4, alpha 0.6, source length + 50).

  Attributes:
    beam_size: hypotheses kept per sentence; 1 is greedy search.
    length_penalty: alpha of the length penalty (0: none).
    length_penalty_form: 'gnmt', ((5 + |Y|) / 6)^alpha, or 'power', |Y|^alpha.
    no_repeat_ngram_size: n > 0: no output repeats an n-gram of its tokens (every search
      and sampling leave out the tokens that would); 0: off.
    no_adjacent_repeat_size: n > 0: no output says a span of up to n tokens twice in a row
      (a piece doubled, a phrase back to back; `decode.ban_adjacent_repeats`); 0: off.
    max_decode_extra_length: each sentence's output limit = its source length + this.
    batch_size: sentences decoded together (each takes `beam_size` rows of the search, or
      `n_best` rows when sampling).
    buckets: source lengths compiled for; sources are padded to the shortest that fits.
    n_best: hypotheses returned per sentence, best first: the best `n_best` of the beam
      (at most `beam_size`), or `n_best` independent samples.
    sampling: sample each token (`decode.sample`) instead of searching; `beam_size` is then
      unused.
    temperature: sampling: logits are divided by it (0: greedy).
    top_k: sampling: only the k most probable tokens (0: all).
    top_p: sampling: only the nucleus of probability p (1: all).
    seed: sampling: the same seed, input and batch size give the same samples.
  """

  beam_size: int = 4
  length_penalty: float = 0.6
  length_penalty_form: str = 'gnmt'
  no_repeat_ngram_size: int = 0
  no_adjacent_repeat_size: int = 0
  max_decode_extra_length: int = 50
  batch_size: int = 32
  buckets: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
  n_best: int = 1
  sampling: bool = False
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    for name in ('beam_size', 'batch_size', 'n_best'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f'{name}={value!r} must be an int >= 1.')
    if not self.sampling and self.n_best > self.beam_size:
      raise ConfigError(
          f'n_best={self.n_best} is more than beam_size={self.beam_size}: beam '
          f'search keeps beam_size hypotheses; raise beam_size to at least '
          f'{self.n_best}, or sample.'
      )
    if self.temperature < 0:
      raise ConfigError(f'temperature={self.temperature!r} must be >= 0 (0: greedy).')
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ConfigError(f'top_k={self.top_k!r} must be an int >= 0 (0 keeps every token).')
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f'top_p={self.top_p!r} must be in (0, 1] (1 keeps every token).')
    if not isinstance(self.no_repeat_ngram_size, int) or self.no_repeat_ngram_size < 0:
      raise ConfigError(
          f'no_repeat_ngram_size={self.no_repeat_ngram_size!r} must be an int >= 0 (0 turns '
          'it off; 3 or 4 keep phrases from repeating).'
      )
    if (
        not isinstance(self.no_adjacent_repeat_size, int)
        or isinstance(self.no_adjacent_repeat_size, bool)
        or self.no_adjacent_repeat_size < 0
    ):
      raise ConfigError(
          f'no_adjacent_repeat_size={self.no_adjacent_repeat_size!r} must be an int >= 0 (0 '
          'turns it off; 8 keeps spans of up to 8 tokens from being said twice in a row).'
      )
    if not isinstance(self.max_decode_extra_length, int) or self.max_decode_extra_length < 1:
      raise ConfigError(
          f'max_decode_extra_length={self.max_decode_extra_length!r} must be '
          'an int >= 1 (the paper: 50).'
      )
    if self.length_penalty < 0:
      raise ConfigError(
          f'length_penalty={self.length_penalty!r} must be >= 0 (the paper: '
          '0.6; 0 turns it off).'
      )
    if self.length_penalty_form not in LENGTH_PENALTY_FORMS:
      raise ConfigError(
          f'length_penalty_form={self.length_penalty_form!r} is not one of '
          f'{LENGTH_PENALTY_FORMS}.'
      )
    if any(not isinstance(b, int) or b < 1 for b in self.buckets):
      raise ConfigError(
          f'buckets={self.buckets!r} must be positive ints (max_len is always a bucket too).'
      )

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, **overrides: Any) -> 'DecodeOptions':
    """The decoding fields of a run config; `overrides` that are None are ignored."""
    fields = dict(
        beam_size=config.beam_size,
        length_penalty=float(config.length_penalty),
        length_penalty_form=config.length_penalty_form,
        no_repeat_ngram_size=config.no_repeat_ngram_size,
        no_adjacent_repeat_size=config.no_adjacent_repeat_size,
        max_decode_extra_length=config.max_decode_extra_length,
        batch_size=config.decode_batch_size,
        buckets=tuple(int(b) for b in config.bucket_boundaries),
    )
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Hypothesis:
  """One output of a sentence.

  Attributes:
    tokens: the output ids, without EOS and padding.
    score: log P(Y) / lp(|Y|), what beam search ranks by (greedy search and sampling: the
      same, with their own |Y|).
    length: |Y|, the output tokens the model produced, the EOS included if it came.
    log_prob: log P(Y | X) under the model (temperature 1, no top-k/top-p).
    text: the detokenized output (`Translator.translate_n_best` fills it).
  """

  tokens: tuple[int, ...]
  score: float
  length: int
  log_prob: float = 0.0
  text: str = ''


@dataclasses.dataclass
class DecodeStats:
  """What one `translate_ids`/`translate` call did.

  Attributes:
    sentences: sentences translated (blank ones included).
    source_tokens: their source tokens, EOS included.
    output_tokens: output tokens produced, |Y| summed (EOS included where generated).
    batches: batches run.
    compile_seconds: time spent compiling shapes not seen before.
    decode_seconds: time spent searching, compilation excluded.
    truncated: indices of the sources cut to `max_len` tokens.
    capped: indices of the sources whose output limit `max_len` cut (learned positions).
    failed: (index, reason) of the sentences not translated (given ''): the tokenizer
      failed on them, or their forced prefix did not fit.
  """

  sentences: int = 0
  source_tokens: int = 0
  output_tokens: int = 0
  batches: int = 0
  compile_seconds: float = 0.0
  decode_seconds: float = 0.0
  truncated: tuple[int, ...] = ()
  capped: tuple[int, ...] = ()
  failed: tuple[tuple[int, str], ...] = ()

  @property
  def sentences_per_second(self) -> float:
    return self.sentences / max(self.decode_seconds, 1e-9)

  @property
  def tokens_per_second(self) -> float:
    """Output tokens a second."""
    return self.output_tokens / max(self.decode_seconds, 1e-9)


def grow_cache(cache: PyTree, length: int) -> PyTree:
  """The decoder's 'cache' with room for `length` positions (`decode.GrowCache`): the
  self-attention keys and values [rows, heads, positions, head_dim] padded at the end."""

  def grow(x):
    if jnp.ndim(x) < 2:
      return x  # The cache_index counters.
    return jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)])

  return jax.tree.map(grow, cache)


def start_decoding(
    model_config: TransformerConfig, params: PyTree, inputs: jax.Array, max_decode_len: int
) -> tuple[decode.TokensToLogits, PyTree]:
  """Runs the encoder once and creates the decode caches (traceable under jit).

  Of the two collections `Transformer.init_cache` creates, only 'cache' (self-attention keys
  and values, the cache index) changes per step; it is returned for the search to carry and,
  in beam search, to tile and reorder with the beams. 'encoder_cache' (encoder-decoder
  attention keys, values and source mask) is the same at every step and for every beam of a
  sentence: it stays one row a sentence, closed over by the step, which only reads it. The
  step takes `batch * n` rows for any n (row b * n + j is beam or sample j of sentence b, the
  layout of `decode.tile_beams`); they attend to row b of it as n query positions (see
  `MultiHeadAttention`), so a step reads the source's keys and values once a sentence.

  Args:
    model_config: the model's config (decode mode and no dropout are set here).
    params: the parameters.
    inputs: int32 [batch, source_length], ids ending with EOS, then PAD.
    max_decode_len: room in the self-attention caches, in output tokens: pass
      `decode.cache_lengths(n)[0]` to search up to n tokens with `grow_cache` in the
      `decode.SearchOptions`.

  Returns:
    `tokens_to_logits(tokens [batch * n, 1], cache) -> (logits [batch * n, vocab], cache)`,
    one decoder step for `decode.py`, and the 'cache' for `batch` rows (not tiled:
    `decode.beam_search` tiles it, as `decode.tile_beams` does for sampling).
  """
  model = Transformer(dataclasses.replace(model_config, decode=True, deterministic=True))
  encoded = model.apply({'params': params}, inputs, method=Transformer.encode)
  _, variables = model.apply(
      {'params': params},
      encoded,
      inputs,
      max_decode_len,
      method=Transformer.init_cache,
      mutable=['cache', 'encoder_cache'],
  )
  encoder_cache = variables['encoder_cache']

  def tokens_to_logits(tokens: jax.Array, cache: PyTree) -> tuple[jax.Array, PyTree]:
    logits, new_variables = model.apply(
        {'params': params, 'encoder_cache': encoder_cache, 'cache': cache},
        None,
        None,
        tokens,
        method=Transformer.decode,
        mutable=['cache'],
    )
    return logits[:, 0], new_variables['cache']  # [batch * n, vocab]

  return tokens_to_logits, variables['cache']


def ensemble_step(
    steps: Sequence[decode.TokensToLogits], weights: Sequence[float]
) -> decode.TokensToLogits:
  """One decoder step of several models decoded as one: each model's step over its own
  cache (the cache is the tuple of theirs), and as logits the weighted sum of the models'
  log-probabilities.

  The searches take a log-softmax of what a step returns, so the ensemble's distribution
  is the weighted geometric mean of the models' distributions, renormalized (weights
  summing to 1 keep it a mean): a token any model rules out (-inf) is ruled out.
  One model is its own step, unchanged.
  """
  if len(steps) == 1:
    return steps[0]

  def tokens_to_logits(tokens: jax.Array, caches: PyTree) -> tuple[jax.Array, PyTree]:
    summands = []
    new_caches = []
    for step, cache, weight in zip(steps, caches, weights):
      logits, cache = step(tokens, cache)
      summands.append(weight * jax.nn.log_softmax(logits.astype(jnp.float32)))
      new_caches.append(cache)
    return sum(summands[1:], summands[0]), tuple(new_caches)

  return tokens_to_logits


def search(
    model_config: TransformerConfig,
    params: PyTree,
    inputs: jax.Array,
    options: DecodeOptions,
    max_decode_len: int,
    batch_index: jax.Array | int = 0,
    grow: bool = True,
    prefixes: jax.Array | None = None,
    ensemble: Sequence[tuple[TransformerConfig, PyTree]] = (),
    weights: Sequence[float] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Encodes `inputs`, creates the caches and runs the whole search (traceable under jit).

  Beam size 1 is greedy search (`decode.greedy_search`); `options.sampling` samples
  `n_best` outputs a sentence (`decode.sample`, key `fold_in(key(seed), batch_index)`).
  Greedy and sampled outputs get the same length-penalized score as beam search's. Several
  models are searched as one ensemble (`ensemble_step`), each encoding the source itself
  and keeping its own caches.

  Args:
    model_config: the (first) model's config.
    params: its parameters.
    inputs: int32 [batch, source_length], ids ending with EOS, then PAD.
    options: the search options.
    max_decode_len: the most output tokens, EOS included, of any row (the compiled size);
      each row stops at its source length + `options.max_decode_extra_length` if sooner.
    batch_index: int32 [], folded into the sampling key (unused by the searches).
    grow: grow the self-attention caches in phases (`decode.cache_lengths`), each phase one
      more loop to compile; False: one loop over caches of `max_decode_len` positions.
    prefixes: int32 [batch, prefix_length], each sentence's forced first output tokens,
      then PAD (see `decode.greedy_search`); None: none.
    ensemble: further models, (config, parameters) each, searched with the first as one
      ensemble (the same vocabulary and decoder start token, see `check_ensemble`).
    weights: each model's weight, the first's first (None: equal), normalized to sum 1.

  Returns:
    sequences: int32 [batch, n_best, max_decode_len], best first, PAD after the end.
    scores: float32 [batch, n_best], log P(Y) / lp(|Y|), descending.
    log_probs: float32 [batch, n_best], log P(Y).
  """
  n = options.n_best if options.sampling else options.beam_size
  cache_length = decode.cache_lengths(max_decode_len)[0] if grow else max_decode_len
  models = [(model_config, params), *ensemble]
  started = [start_decoding(config, p, inputs, cache_length) for config, p in models]
  tokens_to_logits = ensemble_step(
      [step for step, _ in started], ensemble_weights(weights, len(models))
  )
  cache = started[0][1] if len(started) == 1 else tuple(c for _, c in started)
  search_options = decode.SearchOptions(
      max_decode_len,
      bos_id=model_config.decoder_start_id,
      grow_cache=grow_cache if grow else None,
      no_repeat_ngram_size=options.no_repeat_ngram_size,
      no_adjacent_repeat_size=options.no_adjacent_repeat_size,
  )
  batch_size = inputs.shape[0]
  # Each row's own limit: its source length + the extra length, within the compiled one.
  max_lengths = jnp.minimum(
      jnp.sum(inputs != PAD_ID, axis=1) + options.max_decode_extra_length, max_decode_len
  )

  def penalty(sequences):
    return decode.length_penalty(
        jnp.sum(sequences != PAD_ID, axis=-1), options.length_penalty, options.length_penalty_form
    )

  if options.sampling or options.beam_size == 1:
    if options.sampling:
      rng = jax.random.fold_in(jax.random.key(options.seed), batch_index)
      sequences, log_probs = decode.sample(
          tokens_to_logits,
          decode.tile_beams(cache, n),
          rng,
          batch_size * n,
          search_options,
          decode.tile_beams(max_lengths, n),
          None if prefixes is None else decode.tile_beams(prefixes, n),
          temperature=options.temperature,
          top_k=options.top_k,
          top_p=options.top_p,
      )
    else:
      sequences, log_probs = decode.greedy_search(
          tokens_to_logits, cache, batch_size, search_options, max_lengths, prefixes
      )
    sequences = sequences.reshape(batch_size, n, max_decode_len)
    log_probs = log_probs.reshape(batch_size, n)
    scores = log_probs / penalty(sequences)
    order = jnp.argsort(-scores, axis=1, stable=True)  # Samples best first.
    return (
        jnp.take_along_axis(sequences, order[:, :, None], axis=1),
        jnp.take_along_axis(scores, order, axis=1),
        jnp.take_along_axis(log_probs, order, axis=1),
    )
  sequences, scores = decode.beam_search(
      tokens_to_logits,
      cache,
      batch_size,
      options.beam_size,
      search_options,
      max_lengths,
      prefixes,
      alpha=options.length_penalty,
      length_penalty_form=options.length_penalty_form,
  )
  sequences, scores = sequences[:, : options.n_best], scores[:, : options.n_best]
  return sequences, scores, scores * penalty(sequences)


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


class Translator:
  """Translates batches of sentences with one compiled search per (rows, bucket, prefix
  width) shape, with one model or an ensemble."""

  def __init__(
      self,
      model_config: TransformerConfig,
      params: PyTree,
      tokenizer: Tokenizer,
      options: DecodeOptions | None = None,
      partitioner: Partitioner | None = None,
      *,
      ensemble: Sequence[tuple[TransformerConfig, PyTree]] = (),
      weights: Sequence[float] | None = None,
      source_prefix: str = '',
  ):
    """Prepares the translator; nothing compiles until the first batch of a shape.

    Args:
      model_config: the (first) model's config.
      params: its parameters, placed as `loading.param_shardings` says when `partitioner` is given.
      tokenizer: the model's vocabulary.
      options: the search; defaults to the paper's.
      partitioner: splits the batch rows over its batch mesh axes; None: one device.
      ensemble: further models (config, parameters placed on the same mesh), searched
        with the first as one ensemble (`ensemble_step`); the models must pass
        `check_ensemble` (their vocabularies are the caller's to compare).
      weights: each model's weight, the first's first (None: equal); normalized to sum 1.
      source_prefix: text put before every source `encode_source` reads (the target
        language's tag of a multilingual model, `languages.source_prefix`).

    Raises:
      EnsembleError: the models cannot be decoded together or the weights do not fit.
    """
    self.model_config = model_config
    self.params = params
    self.tokenizer = tokenizer
    self.options = options or DecodeOptions()
    self.partitioner = partitioner
    self.source_prefix = source_prefix
    self.ensemble = tuple(ensemble)
    configs = [model_config] + [config for config, _ in self.ensemble]
    self.weights = check_ensemble(configs, [None] * len(configs), weights)
    max_len = min(config.max_len for config in configs)
    self._max_len = max_len
    self._learned_positions = any(c.positional_encoding == 'learned' for c in configs)
    self.buckets = tuple(sorted({b for b in self.options.buckets if b < max_len} | {max_len}))
    self._row_multiple = partitioner.num_batch_shards if partitioner else 1
    self._compiled: dict[tuple[int, int, int], Callable] = {}

  @property
  def model_configs(self) -> tuple[TransformerConfig, ...]:
    """Every model's config, the first's first."""
    return (self.model_config,) + tuple(config for config, _ in self.ensemble)

  @property
  def all_params(self) -> tuple[PyTree, ...]:
    """Every model's parameters, the first's first."""
    return (self.params,) + tuple(params for _, params in self.ensemble)

  @property
  def num_compiled(self) -> int:
    """How many (rows, bucket, prefix width) shapes have been compiled so far."""
    return len(self._compiled)

  @property
  def max_source_length(self) -> int:
    """The longest source, EOS included (`max_len`; an ensemble's smallest)."""
    return self._max_len

  def output_limit(self, source_length: int) -> int:
    """The most output tokens (EOS included) for a source of `source_length` tokens (EOS
    included): source length + the extra length, at most `max_len` with learned positions."""
    limit = source_length + self.options.max_decode_extra_length
    if self._learned_positions:
      limit = min(limit, self._max_len)
    return limit

  def is_capped(self, source_length: int) -> bool:
    """Whether `max_len` (learned positions) cuts this source's output limit."""
    return self.output_limit(source_length) < (source_length + self.options.max_decode_extra_length)

  def max_decode_len(self, bucket: int) -> int:
    """The output size a bucket is compiled for: the limit of its longest source."""
    return self.output_limit(bucket)

  def bucket_for(self, length: int) -> int:
    """The shortest bucket holding a source of `length` tokens."""
    for bucket in self.buckets:
      if length <= bucket:
        return bucket
    raise ValueError(
        f'A source of {length} tokens is longer than max_len={self.buckets[-1]}; '
        'cut it first (Translator.encode_source does).'
    )

  def rows_for(self, num_sentences: int) -> int:
    """Batch rows for a call translating `num_sentences` sentences."""
    rows = min(self.options.batch_size, _next_power_of_two(max(num_sentences, 1)))
    return -(-rows // self._row_multiple) * self._row_multiple

  def encode_source(self, text: str) -> tuple[list[int], bool]:
    """Source ids (after `source_prefix`) ending with EOS, cut to `max_len` tokens; and
    whether it was cut."""
    ids = self.tokenizer.encode(self.source_prefix + text)
    if len(ids) <= self.max_source_length:
      return ids, False
    return ids[: self.max_source_length - 1] + [EOS_ID], True

  def encode_prefix(self, text: str) -> list[int]:
    """A forced output prefix's ids (target side, no EOS): the output starts with them."""
    ids = self.tokenizer.encode(text, side='target')
    return ids[:-1] if ids and ids[-1] == EOS_ID else ids

  def check_prefix(self, source_length: int, prefix: Sequence[int]) -> str | None:
    """Why `prefix` cannot start the output of a source of `source_length` tokens (EOS
    included), or None: it must leave room for at least the EOS within the output limit."""
    limit = self.output_limit(source_length)
    if len(prefix) >= limit:
      return (
          f'its prefix has {len(prefix)} tokens, and its output may have at most {limit} '
          f'(EOS included: the source length + max_decode_extra_length'
          f'{", within max_len" if self._learned_positions else ""}); shorten the prefix or '
          'raise --max_decode_extra_length'
      )
    if any(t in (PAD_ID, EOS_ID) for t in prefix):
      return 'its prefix holds a padding or end-of-sentence id'
    return None

  def prefix_width(self, longest: int, bucket: int) -> int:
    """The prefix columns compiled for a batch whose longest prefix has `longest` tokens:
    0 for none, else a power of two >= 4 (few shapes), within the bucket's output size."""
    if longest == 0:
      return 0
    return min(max(4, _next_power_of_two(longest)), self.max_decode_len(bucket) - 1)

  # --- Compilation. ---

  def grows_cache(self, rows: int) -> bool:
    """Whether the search for `rows` rows grows its caches in phases: a full batch's does.
    Fewer rows come from a call that fills less than one batch, whose one search would not
    win back the phases' compile: one loop compiles in about half the time, and the phases'
    faster search pays that back only over hundreds of sentences ("A search of fewer rows
    than a batch in one loop" in bench/RESULTS.md, section "CPU: the main job's fixed costs on a Zen
    3")."""
    return rows >= self.rows_for(self.options.batch_size)

  def compile(self, rows: int, bucket: int, prefix_width: int = 0) -> Callable:
    """The search compiled for [rows, bucket] sources (once per shape; `params` may be
    `jax.ShapeDtypeStruct`s with shardings, to compile without any weights), taking
    (all parameters, inputs, batch index) and, with `prefix_width` > 0, int32 [rows,
    prefix_width] forced prefixes."""
    key = (rows, bucket, prefix_width)
    if key not in self._compiled:
      max_decode_len = self.max_decode_len(bucket)
      grow = self.grows_cache(rows)

      def fn(params, inputs, batch_index, prefixes=None):
        first, *others = params
        return search(
            self.model_config,
            first,
            inputs,
            self.options,
            max_decode_len,
            batch_index,
            grow,
            prefixes,
            ensemble=[(config, p) for (config, _), p in zip(self.ensemble, others)],
            weights=self.weights,
        )

      p = self.partitioner
      batch = None if p is None else p.batch_sharding
      replicated = None if p is None else p.replicated
      specs = [
          jax.ShapeDtypeStruct((rows, bucket), jnp.int32, sharding=batch),
          jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
      ]
      if prefix_width:
        specs.append(jax.ShapeDtypeStruct((rows, prefix_width), jnp.int32, sharding=batch))
      if p is None:
        self._compiled[key] = jax.jit(fn).lower(self.all_params, *specs).compile()
      else:
        jitted = jax.jit(fn, out_shardings=p.replicated)
        with p.activate():
          self._compiled[key] = jitted.lower(self.all_params, *specs).compile()
    return self._compiled[key]

  def _place_index(self, number: int) -> jax.Array:
    index = np.int32(number)
    if self.partitioner is None:
      return jnp.asarray(index)
    return jax.make_array_from_callback((), self.partitioner.replicated, lambda _: index)

  def place_batch(self, inputs: np.ndarray) -> jax.Array:
    """A [rows, ...] host array on the devices, its rows split as the compiled searches
    take them."""
    if self.partitioner is None:
      return jnp.asarray(inputs)
    # Every process holds the whole batch; each device takes its rows.
    return jax.make_array_from_callback(
        inputs.shape, self.partitioner.batch_sharding, lambda index: inputs[index]
    )

  # --- Translation. ---

  def translate_ids(
      self,
      sources: Sequence[Sequence[int]],
      progress: ProgressFn | None = None,
      prefixes: Sequence[Sequence[int]] | None = None,
      first_batch: int = 0,
  ) -> tuple[list[tuple[Hypothesis, ...]], DecodeStats]:
    """Translates source ids (each ending with EOS, at most `max_len` long).

    Args:
      sources: one id list per sentence.
      progress: called with (0, 0) once compilation is done, then after each batch with
        (sentences, output tokens of their best hypotheses) of that batch.
      prefixes: one id list per sentence (empty: none), the first output tokens, forced
        in every search (see `decode.greedy_search`); each must pass `check_prefix`.
        The hypotheses' tokens, scores and log-probabilities include them.
      first_batch: the number of this call's first batch (each batch's is folded into the
        sampling key): calls that go on from one another (chunks of one input) pass the
        batches done so far, so that no two batches sample with the same key.

    Returns:
      The `n_best` hypotheses of each source (best first), in input order, and what the
      call did.

    Raises:
      ValueError: a prefix `check_prefix` refuses (`translate_n_best` reports those per
        sentence instead).
    """
    if prefixes is not None:
      if len(prefixes) != len(sources):
        raise ValueError(f'{len(prefixes)} prefixes for {len(sources)} sources.')
      for i, (source, prefix) in enumerate(zip(sources, prefixes)):
        problem = self.check_prefix(len(source), prefix)
        if problem:
          raise ValueError(f'source {i}: {problem}.')
    stats = DecodeStats(
        sentences=len(sources),
        source_tokens=sum(len(s) for s in sources),
        capped=tuple(i for i, s in enumerate(sources) if self.is_capped(len(s))),
    )
    if not sources:
      if progress is not None:
        progress(0, 0)
      return [], stats
    rows = self.rows_for(len(sources))
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    batches: list[tuple[int, list[int]]] = []  # (bucket, source indices)
    for i in order:
      bucket = self.bucket_for(len(sources[i]))
      if not batches or batches[-1][0] != bucket or len(batches[-1][1]) == rows:
        batches.append((bucket, []))
      batches[-1][1].append(i)

    widths = [
        self.prefix_width(max((len(prefixes[i]) for i in indices), default=0) if prefixes else 0, b)
        for b, indices in batches
    ]
    start = time.perf_counter()
    compiled = {
        (bucket, width): self.compile(rows, bucket, width)
        for (bucket, _), width in zip(batches, widths)
    }
    stats.compile_seconds = time.perf_counter() - start
    if progress is not None:
      progress(0, 0)

    start = time.perf_counter()
    results: list[tuple[Hypothesis, ...]] = [()] * len(sources)
    for number, ((bucket, indices), width) in enumerate(zip(batches, widths)):
      inputs = np.full((rows, bucket), PAD_ID, np.int32)
      inputs[:, 0] = EOS_ID  # Dummy rows: an empty sentence.
      for row, i in enumerate(indices):
        inputs[row, :] = PAD_ID
        inputs[row, : len(sources[i])] = sources[i]
      arguments = [
          self.all_params,
          self.place_batch(inputs),
          self._place_index(first_batch + number),
      ]
      if width:
        forced = np.full((rows, width), PAD_ID, np.int32)
        for row, i in enumerate(indices):
          forced[row, : len(prefixes[i])] = prefixes[i]  # type: ignore[index]
        arguments.append(self.place_batch(forced))
      sequences, scores, log_probs = jax.device_get(compiled[bucket, width](*arguments))
      batch_tokens = 0
      for row, i in enumerate(indices):
        hypotheses = []
        for k in range(self.options.n_best):
          output = sequences[row, k]
          length = int(np.sum(output != PAD_ID))
          tokens = tuple(int(t) for t in output[:length] if t != EOS_ID)
          hypotheses.append(
              Hypothesis(
                  tokens=tokens,
                  score=float(scores[row, k]),
                  length=length,
                  log_prob=float(log_probs[row, k]),
              )
          )
        results[i] = tuple(hypotheses)
        batch_tokens += hypotheses[0].length
      stats.output_tokens += batch_tokens
      stats.batches += 1
      if progress is not None:
        progress(len(indices), batch_tokens)
    stats.decode_seconds = time.perf_counter() - start
    return results, stats

  def translate(
      self,
      texts: Sequence[str],
      progress: ProgressFn | None = None,
      prefixes: Sequence[str] | None = None,
  ) -> tuple[list[str], DecodeStats]:
    """Translates sentences; each gives exactly one output line, in input order.

    A blank sentence gives ''. A sentence longer than `max_len` tokens is cut (its index
    goes to `truncated`); one the tokenizer fails on gives '' (its index and the error go
    to `failed`). Outputs never contain line breaks.

    Args:
      texts: the sentences.
      progress: see `translate_ids`; blank and failed sentences are reported last.
      prefixes: one forced output prefix a sentence ('' for none), see `translate_n_best`.

    Returns:
      The best translation of each sentence and what the call did.
    """
    n_best, stats = self.translate_n_best(texts, progress, prefixes)
    return [hypotheses[0].text for hypotheses in n_best], stats

  def translate_n_best(
      self,
      texts: Sequence[str],
      progress: ProgressFn | None = None,
      prefixes: Sequence[str] | None = None,
      first_batch: int = 0,
  ) -> tuple[list[tuple[Hypothesis, ...]], DecodeStats]:
    """`translate`, with the `n_best` hypotheses of each sentence, best first, their `text`
    filled (a blank or failed sentence: `n_best` empty hypotheses of score 0); `first_batch`
    as `translate_ids` takes it.

    `prefixes` (one a sentence, '' for none) are the outputs' forced starts: every
    hypothesis begins with the prefix's pieces and its text with the prefix (as the
    tokenizer writes it back). A sentence whose prefix cannot be encoded or does not fit
    its output limit fails alone: its index and the reason go to `failed`."""
    if prefixes is not None and len(prefixes) != len(texts):
      raise ValueError(f'{len(prefixes)} prefixes for {len(texts)} sentences.')
    sources, kept, truncated, failed = [], [], [], []
    forced: list[list[int]] = []
    for i, text in enumerate(texts):
      if not text.strip():
        continue
      try:
        ids, cut = self.encode_source(text)
        prefix = self.encode_prefix(prefixes[i]) if prefixes and prefixes[i].strip() else []
      except Exception as e:  # One sentence must not stop all.
        failed.append((i, f'could not be tokenized ({type(e).__name__}: {e})'))
        continue
      problem = self.check_prefix(len(ids), prefix)
      if problem:
        failed.append((i, problem))
        continue
      sources.append(ids)
      forced.append(prefix)
      kept.append(i)
      if cut:
        truncated.append(i)
    n_best, stats = self.translate_ids(
        sources, progress, forced if any(forced) else None, first_batch=first_batch
    )
    if progress is not None and len(kept) < len(texts):
      progress(len(texts) - len(kept), 0)
    empty = Hypothesis(tokens=(), score=0.0, length=0)
    outputs = [(empty,) * self.options.n_best] * len(texts)
    for i, hypotheses in zip(kept, n_best):
      outputs[i] = tuple(
          dataclasses.replace(
              h, text=' '.join(self.tokenizer.decode(h.tokens).splitlines()).strip()
          )
          for h in hypotheses
      )
    stats.sentences = len(texts)
    stats.truncated = tuple(truncated)
    stats.capped = tuple(kept[i] for i in stats.capped)
    stats.failed = tuple(failed)
    return outputs, stats


# --- Building a translator from a work directory. ---


def load_translator(
    workdir: str | Sequence[str],
    *,
    step: int | str | None = None,
    average_last: int = 0,
    weights: Sequence[float] | None = None,
    target_lang: str | None = None,
    untagged: bool = False,
    **overrides: Any,
) -> tuple['Translator', loading.InferenceCheckpoint]:
  """A `Translator` for a checkpoint (or the average of the last ones) of `workdir`, or an
  ensemble of several work directories' (the same `step` or `average_last` in each).

  Parameters are placed, and batches split, as `loading.load` chooses for the first work
  directory; the other models' parameters go on its mesh. Decoding options come from the
  first run's config unless overridden.

  Args:
    workdir: a training run's work directory (or one written by `average_checkpoints`), or
      several, decoded as one ensemble.
    step: the checkpoint; None for the latest, 'best' for the best (see `loading.load`).
    average_last: average the last this many checkpoints instead (0: none).
    weights: with several work directories, each one's weight (None: equal).
    target_lang: the language to translate into (`languages.chosen_target`; None: the
      model's only one); a multilingual model's tag for it starts every source.
    untagged: no tag (the caller sets `source_prefix` per direction, or reads tagged text),
      so no `target_lang` is needed.
    **overrides: `DecodeOptions` fields; None values are ignored.

  Returns:
    The translator and the (first) loaded checkpoint (`checkpoint.steps`: where its
    parameters come from).

  Raises:
    errors.UserError: no such checkpoint, a damaged one, a decoding option that cannot
      work (checked before anything is read), or models that cannot form an ensemble
      (`EnsembleError`: other vocabularies, weights that do not fit).
  """
  workdirs = [workdir] if isinstance(workdir, str) else list(workdir)
  DecodeOptions(**{k: v for k, v in overrides.items() if v is not None})  # Check early.
  ensemble_weights(weights, len(workdirs))  # Check early.
  checkpoints = [loading.load(w, step=step, average_last=average_last) for w in workdirs]
  first = checkpoints[0]
  if untagged and target_lang is None:
    target_lang = languages.target_languages(first.config)[0]
  targets = [languages.chosen_target(c.config, target_lang) for c in checkpoints]
  prefixes = [languages.source_prefix(c.config, t) for c, t in zip(checkpoints, targets)]
  check_ensemble(
      [c.model_config for c in checkpoints],
      [c.tokenizer for c in checkpoints],
      weights,
      workdirs,
      directions=[languages.direction_into(c.config, t) for c, t in zip(checkpoints, targets)],
      source_prefixes=prefixes,
  )
  ensemble = []
  for checkpoint in checkpoints[1:]:
    params = checkpoint.params
    if checkpoint.partitioner.mesh != first.partitioner.mesh:
      params = jax.device_put(
          params, loading.param_shardings(checkpoint.model_config, first.partitioner)
      )
    ensemble.append((checkpoint.model_config, params))
  options = DecodeOptions.from_config(first.config, **overrides)
  translator = Translator(
      first.model_config,
      first.params,
      first.tokenizer,
      options,
      first.partitioner,
      ensemble=ensemble,
      weights=weights,
      source_prefix='' if untagged else prefixes[0],
  )
  return translator, first

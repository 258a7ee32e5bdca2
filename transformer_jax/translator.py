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
  * the output limit is a bucket's, not a sentence's: bucket length + `max_decode_extra_length`
    (the paper: source length + 50), at most `max_len` with learned positions, whose table
    ends there. Every sentence gets at least its paper limit; a search stops early anyway.

Each (rows, bucket) shape is compiled ahead of time, once, when first needed; the number of
compiled functions is `Translator.num_compiled`. Given a `Partitioner`, the rows are split
over its batch mesh axes and the parameters over its rules, as in training.

Sources longer than `max_len` tokens (EOS included) are cut to their first `max_len - 1`
tokens plus EOS by `encode_source`; callers report which (see `DecodeStats.truncated`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import loading
from transformer_jax import decode
from transformer_jax.config import (EOS_ID, LENGTH_PENALTY_FORMS, PAD_ID, ConfigError,
                                    TransformerConfig)
from transformer_jax.models import Transformer
from transformer_jax.partitioning import Partitioner
from transformer_jax.tokenizer import Tokenizer

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
    max_decode_extra_length: output limit = source (bucket) length + this.
    batch_size: sentences decoded together (each takes `beam_size` rows of the search).
    buckets: source lengths compiled for; sources are padded to the shortest that fits.
  """

  beam_size: int = 4
  length_penalty: float = 0.6
  length_penalty_form: str = 'gnmt'
  max_decode_extra_length: int = 50
  batch_size: int = 32
  buckets: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

  def __post_init__(self):
    for name in ('beam_size', 'batch_size'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f'{name}={value!r} must be an int >= 1.')
    if not isinstance(self.max_decode_extra_length, int) or self.max_decode_extra_length < 1:
      raise ConfigError(f'max_decode_extra_length={self.max_decode_extra_length!r} must be '
                        'an int >= 1 (the paper: 50).')
    if self.length_penalty < 0:
      raise ConfigError(f'length_penalty={self.length_penalty!r} must be >= 0 (the paper: '
                        '0.6; 0 turns it off).')
    if self.length_penalty_form not in LENGTH_PENALTY_FORMS:
      raise ConfigError(f'length_penalty_form={self.length_penalty_form!r} is not one of '
                        f'{LENGTH_PENALTY_FORMS}.')
    if any(not isinstance(b, int) or b < 1 for b in self.buckets):
      raise ConfigError(f'buckets={self.buckets!r} must be positive ints (max_len is always '
                        'a bucket too).')

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, **overrides: Any) -> 'DecodeOptions':
    """The decoding fields of a run config; `overrides` that are None are ignored."""
    fields = dict(
        beam_size=config.beam_size,
        length_penalty=float(config.length_penalty),
        length_penalty_form=config.length_penalty_form,
        max_decode_extra_length=config.max_decode_extra_length,
        batch_size=config.decode_batch_size,
        buckets=tuple(int(b) for b in config.bucket_boundaries),
    )
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Hypothesis:
  """One sentence's best output.

  Attributes:
    tokens: the output ids, without EOS and padding.
    score: log P(Y) / lp(|Y|) (greedy search: the same, with its own |Y|).
    length: |Y|, the output tokens the model produced, the EOS included if it came.
  """

  tokens: tuple[int, ...]
  score: float
  length: int


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
    failed: (index, error) of the sentences the tokenizer failed on (given '').
  """

  sentences: int = 0
  source_tokens: int = 0
  output_tokens: int = 0
  batches: int = 0
  compile_seconds: float = 0.0
  decode_seconds: float = 0.0
  truncated: tuple[int, ...] = ()
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
  self-attention keys and values [rows, positions, heads, head_dim] padded at the end."""
  def grow(x):
    if jnp.ndim(x) < 2:
      return x  # The cache_index counters.
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return jax.tree.map(grow, cache)


def start_decoding(model_config: TransformerConfig, params: PyTree, inputs: jax.Array,
                   max_decode_len: int, beam_size: int = 1
                   ) -> tuple[decode.TokensToLogits, PyTree]:
  """Runs the encoder once and creates the decode caches (traceable under jit).

  Of the two collections `Transformer.init_cache` creates, only 'cache' (self-attention keys
  and values, the cache index) changes per step; it is returned for the search to carry and,
  in beam search, to tile and reorder with the beams. 'encoder_cache' (encoder-decoder
  attention keys, values and source mask) is the same at every step and for every beam of a
  sentence: it is tiled to `beam_size` rows per sentence here, once, with `decode.tile_beams`
  (row b * beam_size + j is beam j of sentence b, the layout of beam search's rows), and
  closed over by the step, which only reads it.

  Args:
    model_config: the model's config (decode mode and no dropout are set here).
    params: the parameters.
    inputs: int32 [batch, source_length], ids ending with EOS, then PAD.
    max_decode_len: room in the self-attention caches, in output tokens: pass
      `decode.cache_lengths(n)[0]` to search up to n tokens with `grow_cache=grow_cache`.
    beam_size: the beam size of the search the step is for; 1 for greedy search and
      sampling.

  Returns:
    `tokens_to_logits(tokens [batch * beam_size, 1], cache) -> (logits [batch * beam_size,
    vocab], cache)`, one decoder step for `decode.py`, and the 'cache' for `batch` rows (not
    tiled: `decode.beam_search` tiles it).
  """
  model = Transformer(dataclasses.replace(model_config, decode=True, deterministic=True))
  encoded = model.apply({'params': params}, inputs, method=Transformer.encode)
  _, variables = model.apply({'params': params}, encoded, inputs, max_decode_len,
                             method=Transformer.init_cache,
                             mutable=['cache', 'encoder_cache'])
  encoder_cache = decode.tile_beams(variables['encoder_cache'], beam_size)

  def tokens_to_logits(tokens: jax.Array, cache: PyTree) -> tuple[jax.Array, PyTree]:
    logits, new_variables = model.apply(
        {'params': params, 'encoder_cache': encoder_cache, 'cache': cache}, None, None,
        tokens, method=Transformer.decode, mutable=['cache'])
    return logits[:, 0], new_variables['cache']  # [batch * beam_size, vocab]

  return tokens_to_logits, variables['cache']


def search(model_config: TransformerConfig, params: PyTree, inputs: jax.Array,
           options: DecodeOptions, max_decode_len: int) -> tuple[jax.Array, jax.Array]:
  """Encodes `inputs`, creates the caches and runs the whole search (traceable under jit).

  Beam size 1 is greedy search (`decode.greedy_search`); its score gets the same length
  penalty as beam search's.

  Args:
    model_config: the model's config.
    params: the parameters.
    inputs: int32 [batch, source_length], ids ending with EOS, then PAD.
    options: the search options.
    max_decode_len: the most output tokens, EOS included.

  Returns:
    sequences: int32 [batch, beam, max_decode_len], best first, PAD after the end.
    scores: float32 [batch, beam], log P(Y) / lp(|Y|), descending.
  """
  tokens_to_logits, cache = start_decoding(
      model_config, params, inputs, decode.cache_lengths(max_decode_len)[0],
      options.beam_size)
  batch_size = inputs.shape[0]
  if options.beam_size == 1:
    sequences, log_probs = decode.greedy_search(tokens_to_logits, cache, batch_size,
                                                max_decode_len, grow_cache=grow_cache)
    lengths = jnp.sum(sequences != PAD_ID, axis=1)
    scores = log_probs / decode.length_penalty(lengths, options.length_penalty,
                                               options.length_penalty_form)
    return sequences[:, None], scores[:, None]
  return decode.beam_search(
      tokens_to_logits, cache, batch_size, options.beam_size, max_decode_len,
      alpha=options.length_penalty, length_penalty_form=options.length_penalty_form,
      grow_cache=grow_cache)


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


class Translator:
  """Translates batches of sentences with one compiled search per (rows, bucket) shape."""

  def __init__(self, model_config: TransformerConfig, params: PyTree, tokenizer: Tokenizer,
               options: DecodeOptions | None = None,
               partitioner: Partitioner | None = None):
    """Prepares the translator; nothing compiles until the first batch of a shape.

    Args:
      model_config: the model's config.
      params: its parameters, placed as `loading.param_shardings` says when `partitioner` is given.
      tokenizer: the model's vocabulary.
      options: the search; defaults to the paper's.
      partitioner: splits the batch rows over its batch mesh axes; None: one device.
    """
    self.model_config = model_config
    self.params = params
    self.tokenizer = tokenizer
    self.options = options or DecodeOptions()
    self.partitioner = partitioner
    max_len = model_config.max_len
    self.buckets = tuple(sorted({b for b in self.options.buckets if b < max_len} | {max_len}))
    self._row_multiple = partitioner.num_batch_shards if partitioner else 1
    self._compiled: dict[tuple[int, int], Callable] = {}

  @property
  def num_compiled(self) -> int:
    """How many (rows, bucket) shapes have been compiled so far."""
    return len(self._compiled)

  @property
  def max_source_length(self) -> int:
    """The longest source, EOS included (`max_len`)."""
    return self.model_config.max_len

  def max_decode_len(self, bucket: int) -> int:
    """The output limit of a bucket: its length + the extra length (at most `max_len` with
    learned positions)."""
    limit = bucket + self.options.max_decode_extra_length
    if self.model_config.positional_encoding == 'learned':
      limit = min(limit, self.model_config.max_len)
    return limit

  def bucket_for(self, length: int) -> int:
    """The shortest bucket holding a source of `length` tokens."""
    for bucket in self.buckets:
      if length <= bucket:
        return bucket
    raise ValueError(f'A source of {length} tokens is longer than max_len={self.buckets[-1]}; '
                     'cut it first (Translator.encode_source does).')

  def rows_for(self, num_sentences: int) -> int:
    """Batch rows for a call translating `num_sentences` sentences."""
    rows = min(self.options.batch_size, _next_power_of_two(max(num_sentences, 1)))
    return -(-rows // self._row_multiple) * self._row_multiple

  def encode_source(self, text: str) -> tuple[list[int], bool]:
    """Source ids ending with EOS, cut to `max_len` tokens; and whether it was cut."""
    ids = self.tokenizer.encode(text)
    if len(ids) <= self.max_source_length:
      return ids, False
    return ids[:self.max_source_length - 1] + [EOS_ID], True

  # --- Compilation. ---

  def compile(self, rows: int, bucket: int) -> Callable:
    """The search compiled for [rows, bucket] sources (once per shape; `params` may be
    `jax.ShapeDtypeStruct`s with shardings, to compile without any weights)."""
    key = (rows, bucket)
    if key not in self._compiled:
      fn = functools.partial(search, self.model_config, options=self.options,
                             max_decode_len=self.max_decode_len(bucket))
      if self.partitioner is None:
        jitted = jax.jit(fn)
        spec = jax.ShapeDtypeStruct((rows, bucket), jnp.int32)
        self._compiled[key] = jitted.lower(self.params, spec).compile()
      else:
        p = self.partitioner
        jitted = jax.jit(fn, out_shardings=p.replicated)
        spec = jax.ShapeDtypeStruct((rows, bucket), jnp.int32, sharding=p.batch_sharding)
        with p.activate():
          self._compiled[key] = jitted.lower(self.params, spec).compile()
    return self._compiled[key]

  def _place(self, inputs: np.ndarray) -> jax.Array:
    if self.partitioner is None:
      return jnp.asarray(inputs)
    # Every process holds the whole batch; each device takes its rows.
    return jax.make_array_from_callback(inputs.shape, self.partitioner.batch_sharding,
                                        lambda index: inputs[index])

  # --- Translation. ---

  def translate_ids(self, sources: Sequence[Sequence[int]],
                    progress: ProgressFn | None = None) -> tuple[list[Hypothesis], DecodeStats]:
    """Translates source ids (each ending with EOS, at most `max_len` long).

    Args:
      sources: one id list per sentence.
      progress: called with (0, 0) once compilation is done, then after each batch with
        (sentences, output tokens) of that batch.

    Returns:
      The best hypothesis of each source, in input order, and what the call did.
    """
    stats = DecodeStats(sentences=len(sources),
                        source_tokens=sum(len(s) for s in sources))
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

    start = time.perf_counter()
    compiled = {bucket: self.compile(rows, bucket) for bucket, _ in batches}
    stats.compile_seconds = time.perf_counter() - start
    if progress is not None:
      progress(0, 0)

    start = time.perf_counter()
    results: list[Hypothesis | None] = [None] * len(sources)
    for bucket, indices in batches:
      inputs = np.full((rows, bucket), PAD_ID, np.int32)
      inputs[:, 0] = EOS_ID  # Dummy rows: an empty sentence.
      for row, i in enumerate(indices):
        inputs[row, :] = PAD_ID
        inputs[row, :len(sources[i])] = sources[i]
      sequences, scores = jax.device_get(compiled[bucket](self.params, self._place(inputs)))
      batch_tokens = 0
      for row, i in enumerate(indices):
        best = sequences[row, 0]
        length = int(np.sum(best != PAD_ID))
        tokens = tuple(int(t) for t in best[:length] if t != EOS_ID)
        results[i] = Hypothesis(tokens=tokens, score=float(scores[row, 0]), length=length)
        batch_tokens += length
      stats.output_tokens += batch_tokens
      stats.batches += 1
      if progress is not None:
        progress(len(indices), batch_tokens)
    stats.decode_seconds = time.perf_counter() - start
    return results, stats

  def translate(self, texts: Sequence[str], progress: ProgressFn | None = None
                ) -> tuple[list[str], DecodeStats]:
    """Translates sentences; each gives exactly one output line, in input order.

    A blank sentence gives ''. A sentence longer than `max_len` tokens is cut (its index
    goes to `truncated`); one the tokenizer fails on gives '' (its index and the error go
    to `failed`). Outputs never contain line breaks.

    Args:
      texts: the sentences.
      progress: see `translate_ids`; blank and failed sentences are reported last.

    Returns:
      The translations and what the call did.
    """
    sources, kept, truncated, failed = [], [], [], []
    for i, text in enumerate(texts):
      if not text.strip():
        continue
      try:
        ids, cut = self.encode_source(text)
      except Exception as e:  # pylint: disable=broad-except  # One sentence must not stop all.
        failed.append((i, f'{type(e).__name__}: {e}'))
        continue
      sources.append(ids)
      kept.append(i)
      if cut:
        truncated.append(i)
    hypotheses, stats = self.translate_ids(sources, progress)
    if progress is not None and len(kept) < len(texts):
      progress(len(texts) - len(kept), 0)
    outputs = [''] * len(texts)
    for i, hypothesis in zip(kept, hypotheses):
      outputs[i] = ' '.join(self.tokenizer.decode(hypothesis.tokens).splitlines()).strip()
    stats.sentences = len(texts)
    stats.truncated = tuple(truncated)
    stats.failed = tuple(failed)
    return outputs, stats


# --- Building a translator from a work directory. ---


def load_translator(workdir: str, *, step: int | None = None, average_last: int = 0,
                    **overrides: Any) -> tuple['Translator', loading.InferenceCheckpoint]:
  """A `Translator` for a checkpoint (or the average of the last ones) of `workdir`.

  Parameters are placed, and batches split, as `loading.load` chooses. Decoding options
  come from the run's config unless overridden.

  Args:
    workdir: a training run's work directory (or one written by `average_checkpoints`).
    step: the checkpoint; None for the latest.
    average_last: average the last this many checkpoints instead (0: none).
    **overrides: `DecodeOptions` fields; None values are ignored.

  Returns:
    The translator and the loaded checkpoint (`checkpoint.steps`: where its parameters
    come from).

  Raises:
    errors.UserError: no such checkpoint, a damaged one, or a decoding option that cannot
      work (checked before anything is read).
  """
  DecodeOptions(**{k: v for k, v in overrides.items() if v is not None})  # Check early.
  checkpoint = loading.load(workdir, step=step, average_last=average_last)
  options = DecodeOptions.from_config(checkpoint.config, **overrides)
  translator = Translator(checkpoint.model_config, checkpoint.params, checkpoint.tokenizer,
                          options, checkpoint.partitioner)
  return translator, checkpoint

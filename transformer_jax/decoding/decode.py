"""Autoregressive search over a key/value cache: greedy search, beam search, sampling.

The search knows the model only through a callback that feeds one token a step:

    tokens_to_logits(tokens: int32[batch, 1], cache) -> (logits: float[batch, vocab], cache)

The encoder runs once, outside; the callback closes over its output and runs one decoder
step, reading and writing the decoder's key/value cache. The first call is fed `bos_id`.

The cache is a pytree (a Flax 'cache' collection) of what changes from step to step. Leaves
with ndim >= 1 have the batch as their leading dimension; leaves with ndim 0 (the per-layer
`cache_index` counters) are shared by every row and are passed through untouched. Beam search
repeats each batch row `beam_size` times (`tile_beams`: [batch, ...] -> [batch * beam, ...],
beam index minor) and gathers every row of every leaf at every step, as beams are reordered.
What no step changes (the encoder output, its encoder-decoder attention keys and values, the
source mask) is the same for all beams of a row, so it belongs in the callback's closure, not
in the cache: tiled once, the same way, with `tile_beams`, and never gathered (or kept one
row a sentence, where the callback maps its rows b * beam + j to row b, as
`translator.start_decoding`'s does).

Every search is one `lax.while_loop` (one per phase with `grow_cache`, see `cache_lengths`)
with only batch-parallel operations and no host callbacks, so it can be traced under
`jax.jit` with the batch sharded over devices. Sizes and search options are Python values
(static under `jit`); what the three searches share is one hashable `SearchOptions`:

    @functools.partial(jax.jit, static_argnames=('options',))
    def translate(params, encoded, source_mask, cache, options):
      batch_size = encoded.shape[0]
      # Each beam attends to its own copy of the source, tiled once, outside the loop.
      encoded, source_mask = decode.tile_beams((encoded, source_mask), 4)
      def step(tokens, cache):
        return decoder_step(params, encoded, source_mask, tokens, cache)
      return decode.beam_search(step, cache, batch_size, 4, options)

    translate(params, encoded, source_mask, cache, decode.SearchOptions(max_decode_len=60))

Outputs leave out the `bos_id` fed first: a sequence is its tokens, then `eos_id` (when
generated), then `pad_id` up to `max_decode_len`. `pad_id` is never generated (its logit is
masked for the choice only, not in the reported log-probabilities), so the output length |Y|
is the number of non-pad tokens, the EOS included. All log-softmax is done in float32.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from transformer_jax.config import BOS_ID
from transformer_jax.config import EOS_ID
from transformer_jax.config import LENGTH_PENALTY_FORMS
from transformer_jax.config import PAD_ID

PyTree = Any
# tokens [batch, 1] int32, cache -> logits [batch, vocab], new cache.
TokensToLogits = Callable[[jax.Array, PyTree], tuple[jax.Array, PyTree]]
# cache, new length -> the cache with room for that many positions (see `cache_lengths`).
GrowCache = Callable[[PyTree, int], PyTree]
FIRST_CACHE_LENGTH = 16


def cache_lengths(max_decode_len: int, first: int = FIRST_CACHE_LENGTH) -> tuple[int, ...]:
  """The cache lengths of a search in phases: first, 2 first, 4 first, ... below
  `max_decode_len`, then `max_decode_len`.

  A search given `grow_cache` runs one loop per phase over a cache of that phase's length,
  and grows the cache between phases. Self-attention over the cache and beam search's
  reordering of it then cost what the longest alive hypothesis needs, within 2x, instead
  of `max_decode_len` (the paper's source length + 50) at every step.
  """
  lengths = []
  length = first
  while length < max_decode_len:
    lengths.append(length)
    length *= 2
  return tuple(lengths) + (max_decode_len,)


def _phased_while(
    cond: Callable[[Any], jax.Array],
    body: Callable[[Any], Any],
    init: Any,
    max_decode_len: int,
    grow_cache: GrowCache | None,
) -> Any:
  """`lax.while_loop(cond, body, init)`, in phases of growing cache when `grow_cache` is
  given (`init.cache` then has `cache_lengths(max_decode_len)[0]` positions). `init` has
  `step` and `cache` fields; the loop ends where the single loop would."""
  if grow_cache is None:
    return lax.while_loop(cond, body, init)
  state = init
  for i, length in enumerate(cache_lengths(max_decode_len)):
    if i:
      state = state._replace(cache=grow_cache(state.cache, length))
    state = lax.while_loop(lambda s, end=length: cond(s) & (s.step < end), body, state)
  return state


NEG_INF = float('-inf')


def length_penalty(length: jax.Array | int, alpha: float, form: str = 'gnmt') -> jax.Array:
  """The length penalty lp(Y) that beam search divides log-probabilities by.

  Args:
    length: |Y|, the number of output tokens, the EOS included.
    alpha: the exponent; 0 turns the penalty off (lp = 1).
    form: 'gnmt', lp = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, used by the paper), or
      'power', lp = |Y|^alpha (fairseq, Hugging Face).

  Returns:
    lp(Y) as float32, with the shape of `length`.
  """
  length = jnp.asarray(length, jnp.float32)
  if form == 'gnmt':
    return ((5.0 + length) / 6.0) ** alpha
  if form == 'power':
    return length**alpha
  raise ValueError(f'length_penalty_form={form!r} is not one of {LENGTH_PENALTY_FORMS}.')


def tile_beams(tree: PyTree, beam_size: int) -> PyTree:
  """Repeats each batch row `beam_size` times, beam index minor.

  Args:
    tree: a pytree whose leaves with ndim >= 1 are batch-major, [batch, ...].
    beam_size: copies of each row.

  Returns:
    The same pytree with those leaves [batch * beam_size, ...], row b * beam_size + j being
    copy j of row b. Leaves with ndim 0 (shared `cache_index` counters) are unchanged.
  """

  def tile(x):
    return x if jnp.ndim(x) == 0 else jnp.repeat(x, beam_size, axis=0)

  return jax.tree.map(tile, tree)


def _take_beams(x: jax.Array, beam_indices: jax.Array) -> jax.Array:
  """x [batch, beams, ...], beam_indices [batch, n] -> [batch, n, ...], per batch row."""
  indices = beam_indices.reshape(beam_indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, indices, axis=1)


def _gather_cache(cache: PyTree, beam_indices: jax.Array, batch_size: int) -> PyTree:
  """Reorders a [batch * beam, ...] cache so that new beam j of row b is old beam idx[b, j]."""

  def gather(x):
    if x.ndim == 0:
      return x
    x = x.reshape((batch_size, -1) + x.shape[1:])  # [batch, beam, ...]
    return _take_beams(x, beam_indices).reshape((-1,) + x.shape[2:])

  return jax.tree.map(gather, cache)


def top_k_of_rows(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the last axis of x [rows, n]: the same values and indices, ties included.

  XLA:CPU's TopK sorts each whole row partially, a cost that grows with the vocabulary. On
  CPU, rows of at least 2 * k * block elements are cut into blocks of `block` first: the k
  best elements lie in the k blocks with the largest maxima (ties to the lower block, as to
  the lower index), so only those k * block elements are ranked, in index order (timed in
  bench/RESULTS.md, section "each beam's best candidates first, by blocks"). Other backends have
  their own TopK kernels and get
  `lax.top_k` unchanged.

  Returns:
    (values, indices), each [rows, k], best first.
  """
  rows, n = x.shape
  if jax.default_backend() != 'cpu' or n < 2 * k * block:
    return lax.top_k(x, k)
  num_blocks = -(-n // block)
  maxima = lax.reduce_window(
      x, NEG_INF, lax.max, (1, block), (1, block), padding=((0, 0), (0, num_blocks * block - n))
  )  # [rows, blocks]
  _, blocks = lax.top_k(maxima, k)
  blocks = -lax.top_k(-blocks, k)[0]  # Ascending, so candidates keep the index order.
  indices = (blocks[:, :, None] * block + jnp.arange(block)).reshape(rows, k * block)
  # The last block may run past n: those places are -inf and after every real element.
  candidates = jnp.take_along_axis(x, indices, axis=1, mode='fill', fill_value=NEG_INF)
  values, picks = lax.top_k(candidates, k)
  return values, jnp.take_along_axis(indices, picks, axis=1)


def argmax_of_rows(x: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis of x [rows, n]: the first index of the maximum.

  Through `top_k_of_rows` with k=1: XLA:CPU's argmax is a variadic (value, index)
  reduction it does not vectorise, and the blocks are faster (bench/RESULTS.md, section "CPU: 2
  cores (Intel Xeon with AVX-512 and AMX)"). Other backends get
  `jnp.argmax`, their own reduction kernel: greedy search on an H200 was slower through
  `lax.top_k` (bench/RESULTS.md, section "decoding with `jnp.argmax` again, and the token-budget
  search").
  """
  if jax.default_backend() != 'cpu':
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  return top_k_of_rows(x, 1)[1][:, 0]


def _check_batch_size(batch_size: int) -> None:
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be >= 1.')


def _row_limits(max_lengths: jax.Array | None, batch_size: int, max_decode_len: int) -> jax.Array:
  """int32 [batch]: each row's output limit, `max_lengths` clipped to [1, max_decode_len]
  (every row `max_decode_len` when None)."""
  if max_lengths is None:
    return jnp.full((batch_size,), max_decode_len, jnp.int32)
  if jnp.shape(max_lengths) != (batch_size,):
    raise ValueError(
        f'max_lengths has shape {jnp.shape(max_lengths)}; it needs one limit a '
        f'row, ({batch_size},).'
    )
  return jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_decode_len)


def _forced_tokens(prefixes: jax.Array | None, step: jax.Array, pad_id: int) -> jax.Array | None:
  """int32 [batch]: each row's forced token at `step` (its prefix's token there), `pad_id`
  where the row's prefix has ended; None without prefixes."""
  if prefixes is None or prefixes.shape[1] == 0:
    return None
  column = lax.dynamic_index_in_dim(
      prefixes, jnp.minimum(step, prefixes.shape[1] - 1), axis=1, keepdims=False
  )
  return jnp.where(step < prefixes.shape[1], column, pad_id)


def _check_prefixes(prefixes: jax.Array | None, batch_size: int, max_decode_len: int) -> None:
  if prefixes is None:
    return
  if jnp.ndim(prefixes) != 2 or prefixes.shape[0] != batch_size:
    raise ValueError(
        f'prefixes has shape {jnp.shape(prefixes)}; it needs one row a batch row, '
        f'({batch_size}, prefix_length).'
    )
  if prefixes.shape[1] >= max_decode_len:
    raise ValueError(
        f'prefixes of {prefixes.shape[1]} tokens leave no room for an output of at most '
        f'max_decode_len={max_decode_len} tokens.'
    )


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """What greedy search, sampling and beam search share: the ids, the length, the cache's
  growth and the bans on repeats.

  Python values only, so it is hashable: a static argument of `jax.jit`, or closed over by
  the jitted function. Each row's own limit (`max_lengths`) is an array, data of the batch:
  it is passed to the searches with the cache instead.

  Attributes:
    max_decode_len: the most tokens a row (or hypothesis) gets, EOS included: the size of
      the outputs (the paper: source length + 50).
    eos_id: the end-of-sequence id; a row stops after producing it.
    bos_id: the first input token (not part of the outputs).
    pad_id: fills rows after their end; never generated.
    grow_cache: search in phases of growing cache (see `cache_lengths`; the cache handed to
      the search then has room for the first of them); None: one loop over a cache of
      `max_decode_len`.
    no_repeat_ngram_size: n > 0: no output repeats an n-gram of its tokens (see
      `ban_repeated_ngrams`); 0: off. The log-probabilities stay the model's.
    no_adjacent_repeat_size: n > 0: no output says a span of up to n tokens twice in a row
      (see `ban_adjacent_repeats`); 0: off. The log-probabilities stay the model's.
  """

  max_decode_len: int
  eos_id: int = EOS_ID
  bos_id: int = BOS_ID
  pad_id: int = PAD_ID
  grow_cache: GrowCache | None = None
  no_repeat_ngram_size: int = 0
  no_adjacent_repeat_size: int = 0

  def __post_init__(self):
    if self.max_decode_len < 1:
      raise ValueError(f'max_decode_len={self.max_decode_len} must be >= 1.')
    for name in ('no_repeat_ngram_size', 'no_adjacent_repeat_size'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f'{name}={value!r} must be an int >= 0 (0 turns it off).')

  @property
  def bans_repeats(self) -> bool:
    return bool(self.no_repeat_ngram_size or self.no_adjacent_repeat_size)

  def ban_repeats(self, logits: jax.Array, history: jax.Array, length: jax.Array) -> jax.Array:
    """`ban_repeated_ngrams` with n = `no_repeat_ngram_size` and `ban_adjacent_repeats` with
    n = `no_adjacent_repeat_size`, each where it is > 0."""
    if self.no_repeat_ngram_size:
      logits = ban_repeated_ngrams(logits, history, length, self.no_repeat_ngram_size)
    if self.no_adjacent_repeat_size:
      logits = ban_adjacent_repeats(logits, history, length, self.no_adjacent_repeat_size)
    return logits


def ban_adjacent_repeats(
    logits: jax.Array, history: jax.Array, length: jax.Array, n: int
) -> jax.Array:
  """Sets to -inf the logit of every token that would end a span of up to n tokens said
  twice in a row: a piece doubled (`la la`, `te te te` inside a word) or a phrase repeated
  back to back (`con Dios con Dios`). Repeats apart from each other stay allowed.

  For each span length m <= n, the one token that would do it is the row's m-th last, and
  only where the m - 1 tokens before that equal the row's last m - 1.

  Args:
    logits: float [rows, vocab], this step's.
    history: int32 [rows, positions], each row's tokens so far in its first `length`
      positions.
    length: int32 [], the tokens each row holds.
    n: the longest span, >= 1.

  Returns:
    `logits` with the banned tokens at -inf.
  """
  rows = history.shape[0]
  # The row's last 2n tokens, after n * 2 columns of -1 (no token) in front of the history:
  # last[:, j] is the token 2n - j from the end.
  padded = jnp.concatenate([jnp.full((rows, 2 * n), -1, history.dtype), history], axis=1)
  last = lax.dynamic_slice_in_dim(padded, length, 2 * n, axis=1)
  tokens, matches = [], []
  for m in range(1, n + 1):
    # The candidate ends s[-2m+1:] + [t] as two halves: t = s[-m], s[-2m+1:-m] = s[-m+1:].
    first, second = last[:, 2 * n - 2 * m + 1 : 2 * n - m], last[:, 2 * n - m + 1 :]
    match = jnp.all(first == second, axis=1) & (length >= 2 * m - 1)
    tokens.append(jnp.where(match, last[:, 2 * n - m], 0))
    matches.append(match)
  banned = (
      jnp.zeros(logits.shape, bool)
      .at[jnp.arange(rows)[:, None], jnp.stack(tokens, axis=1)]
      .max(jnp.stack(matches, axis=1))
  )
  return jnp.where(banned, NEG_INF, logits)


def ban_repeated_ngrams(
    logits: jax.Array, history: jax.Array, length: jax.Array, n: int
) -> jax.Array:
  """Sets to -inf the logit of every token that would repeat an n-gram of the history.

  A row's next token t is banned when its last n - 1 tokens followed by t already occur in
  it (with n = 1, every token it holds). fairseq's and Hugging Face's
  `no_repeat_ngram_size`, over the output tokens only (the fed `bos_id` is not part of
  any n-gram).

  Args:
    logits: float [rows, vocab], this step's.
    history: int32 [rows, positions], each row's tokens so far in its first `length`
      positions (anything after them is ignored).
    length: int32 [], the tokens each row holds (the same for every row: the step).
    n: the n-gram size, >= 1.

  Returns:
    `logits` with the banned tokens at -inf.
  """
  rows, positions = history.shape
  if n > positions:
    return logits
  starts = positions - n + 1  # n-grams that fit in the history.
  # match[r, j]: the n-gram at j is complete (ends before `length`) and its first n - 1
  # tokens are the row's last n - 1.
  match = (jnp.arange(starts) + n - 1 < length)[None, :]  # [1, starts]
  for i in range(n - 1):
    last = lax.dynamic_index_in_dim(
        history, jnp.maximum(length - (n - 1) + i, 0), axis=1, keepdims=True
    )  # [rows, 1]
    match = match & (history[:, i : i + starts] == last)
  follows = history[:, n - 1 :]  # [rows, starts]: each n-gram's last token.
  banned = jnp.zeros(logits.shape, bool).at[jnp.arange(rows)[:, None], follows].max(match)
  return jnp.where(banned, NEG_INF, logits)


# --- Greedy search and sampling. ---


class _SamplingState(NamedTuple):
  step: jax.Array  # int32 []: tokens generated so far.
  tokens: jax.Array  # int32 [batch]: the last token, the next input.
  sequences: jax.Array  # int32 [batch, max_decode_len]
  log_probs: jax.Array  # float32 [batch]
  finished: jax.Array  # bool [batch]
  cache: PyTree
  rng: jax.Array | None


# logits [batch, vocab] (float32, pad and banned tokens at -inf), this step's key or None ->
# the next token of each row [batch].
Select = Callable[[jax.Array, jax.Array | None], jax.Array]


def _sampling_loop(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    batch_size: int,
    options: SearchOptions,
    max_lengths: jax.Array | None,
    select: Select,
    rng: jax.Array | None = None,
    prefixes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Decodes one token a row a step with `select(logits, fold_in(rng, step))` (greedy search
  and sampling; see `greedy_search` for the arguments and the outputs)."""
  _check_batch_size(batch_size)
  max_decode_len, pad_id = options.max_decode_len, options.pad_id
  _check_prefixes(prefixes, batch_size, max_decode_len)
  limits = _row_limits(max_lengths, batch_size, max_decode_len)
  positions = jnp.arange(max_decode_len)[None, :]  # [1, max_decode_len]

  def cond(state: _SamplingState) -> jax.Array:
    return (state.step < max_decode_len) & ~jnp.all(state.finished)

  def body(state: _SamplingState) -> _SamplingState:
    logits, cache = tokens_to_logits(state.tokens[:, None], state.cache)
    logits = logits.astype(jnp.float32)  # [batch, vocab]
    step_rng = None if state.rng is None else jax.random.fold_in(state.rng, state.step)
    allowed = options.ban_repeats(logits.at[:, pad_id].set(NEG_INF), state.sequences, state.step)
    token = select(allowed, step_rng).astype(jnp.int32)
    forced = _forced_tokens(prefixes, state.step, pad_id)
    if forced is not None:
      token = jnp.where(forced != pad_id, forced, token)
    token = jnp.where(state.finished, pad_id, token)  # [batch]
    token_log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=1)[:, 0]
    return _SamplingState(
        step=state.step + 1,
        tokens=token,
        sequences=jnp.where(positions == state.step, token[:, None], state.sequences),
        log_probs=state.log_probs + jnp.where(state.finished, 0.0, token_log_prob),
        finished=state.finished | (token == options.eos_id) | (state.step + 1 >= limits),
        cache=cache,
        rng=state.rng,
    )

  init = _SamplingState(
      step=jnp.array(0, jnp.int32),
      tokens=jnp.full((batch_size,), options.bos_id, jnp.int32),
      sequences=jnp.full((batch_size, max_decode_len), pad_id, jnp.int32),
      log_probs=jnp.zeros((batch_size,), jnp.float32),
      finished=jnp.zeros((batch_size,), bool),
      cache=cache,
      rng=rng,
  )
  final = _phased_while(cond, body, init, max_decode_len, options.grow_cache)
  return final.sequences, final.log_probs


def greedy_search(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    batch_size: int,
    options: SearchOptions,
    max_lengths: jax.Array | None = None,
    prefixes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Picks the most probable next token (never `pad_id`) until EOS or `max_decode_len`.

  Args:
    tokens_to_logits: one decoder step, see the module docstring.
    cache: the decoder cache for `batch_size` rows (for the first of `cache_lengths` when
      `options.grow_cache` is given).
    batch_size: rows decoded together.
    options: the ids, the length, the cache's growth and the bans on repeats.
    max_lengths: int32 [batch], each row's own limit (at most `max_decode_len`, the size
      of the outputs): a row stops there as if `max_decode_len` were its limit. None: every
      row `max_decode_len`.
    prefixes: int32 [batch, prefix_length], each row's forced first tokens, then `pad_id`
      (fewer than `max_decode_len`, and fewer than the row's limit): while a row's prefix
      lasts, its token is the prefix's, whatever the model prefers or the bans say; the
      output and its log-probability include it. None: no prefixes.

  Returns:
    sequences: int32 [batch, max_decode_len], the EOS included, then `pad_id`.
    log_probs: float32 [batch], the model's log-probability of each sequence (the EOS
      included, padding not).
  """
  return _sampling_loop(
      tokens_to_logits,
      cache,
      batch_size,
      options,
      max_lengths,
      lambda logits, _: argmax_of_rows(logits),
      prefixes=prefixes,
  )


def _filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Sets logits outside the top-k tokens, then outside the nucleus of mass top_p, to -inf.

  Args:
    logits: float32 [batch, vocab], already divided by the temperature.
    top_k: keep the k most probable tokens; 0 keeps all.
    top_p: keep the smallest set of most probable tokens whose probability reaches top_p
      (the most probable token is always kept); 1 keeps all.

  Returns:
    float32 [batch, vocab]. Tokens tied with the last kept one are kept too.
  """
  if top_k > 0 and top_k < logits.shape[-1]:
    kth = top_k_of_rows(logits, top_k)[0][:, -1:]  # [batch, 1]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if top_p < 1.0:
    sorted_logits = -jnp.sort(-logits, axis=-1)  # [batch, vocab], descending.
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # Mass of the more probable tokens.
    num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # [batch, 1], >= 1.
    threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
    logits = jnp.where(logits < threshold, NEG_INF, logits)
  return logits


def sample(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    rng: jax.Array,
    batch_size: int,
    options: SearchOptions,
    max_lengths: jax.Array | None = None,
    prefixes: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
  """Samples each next token (never `pad_id`) until EOS or `max_decode_len`.

  The logits are divided by `temperature`, then restricted to the `top_k` most probable
  tokens, then to the nucleus of probability `top_p` (Holtzman et al. 2020).

  Args:
    tokens_to_logits: one decoder step, see the module docstring.
    cache: the decoder cache for `batch_size` rows (see `greedy_search`).
    rng: a PRNG key; step t uses `fold_in(rng, t)`.
    batch_size: rows decoded together.
    options: the ids, the length, the cache's growth and the bans on repeats.
    max_lengths: see `greedy_search`.
    prefixes: see `greedy_search`.
    temperature: >= 0; 0 is greedy search (argmax), 1 the model's distribution.
    top_k: >= 0; 0 keeps every token.
    top_p: in (0, 1]; 1 keeps every token.

  Returns:
    sequences: int32 [batch, max_decode_len], the EOS included, then `pad_id`.
    log_probs: float32 [batch], the log-probability of each sequence under the model itself
      (temperature 1, no top-k/top-p), not under the sampling distribution.
  """
  if temperature < 0:
    raise ValueError(f'temperature={temperature} must be >= 0.')
  if top_k < 0:
    raise ValueError(f'top_k={top_k} must be >= 0 (0 keeps every token).')
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f'top_p={top_p} must be in (0, 1] (1 keeps every token).')

  def select(logits: jax.Array, step_rng: jax.Array) -> jax.Array:
    if temperature == 0:
      return argmax_of_rows(logits)
    logits = _filter_logits(logits / temperature, top_k, top_p)
    return jax.random.categorical(step_rng, logits, axis=-1)

  return _sampling_loop(
      tokens_to_logits, cache, batch_size, options, max_lengths, select, rng, prefixes
  )


# --- Beam search. ---


class _BeamState(NamedTuple):
  step: jax.Array  # int32 []: tokens generated so far by the alive beams.
  alive_seqs: jax.Array  # int32 [batch, beam, 1 + max_decode_len], bos_id in column 0.
  alive_log_probs: jax.Array  # float32 [batch, beam], sorted best-first; -inf: no beam.
  finished_seqs: jax.Array  # int32 [batch, beam, 1 + max_decode_len]
  finished_scores: jax.Array  # float32 [batch, beam], sorted best-first among the flagged.
  finished_flags: jax.Array  # bool [batch, beam]: the slot holds a hypothesis.
  cache: PyTree  # Leaves [batch * beam, ...].


def beam_search(
    tokens_to_logits: TokensToLogits,
    cache: PyTree,
    batch_size: int,
    beam_size: int,
    options: SearchOptions,
    max_lengths: jax.Array | None = None,
    prefixes: jax.Array | None = None,
    *,
    alpha: float = 0.6,
    length_penalty_form: str = 'gnmt',
    early_stopping: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Beam search with a length penalty, as in the paper (beam 4, alpha 0.6).

  Each step extends every alive beam by every token but `pad_id` and ranks the candidates by
  log-probability. A candidate ending in EOS that ranks among the best `beam_size` becomes a
  finished hypothesis, scored log P(Y) / lp(|Y|) with |Y| counting the EOS; the best
  `beam_size` candidates not ending in EOS stay alive. (Admitting only top-ranked EOS
  candidates, as fairseq does, makes beam size 1 with alpha = 0 exactly greedy search.)
  Only the `beam_size` best finished hypotheses are kept.

  The search stops at `max_decode_len` or, with `early_stopping`, as soon as for every batch
  row `beam_size` hypotheses have finished and no alive beam can beat the worst of them:
  log-probabilities only fall as a beam grows, so an alive beam's best possible score is its
  log-probability divided by the largest lp over the lengths it can still reach. The bound
  is exact, so early stopping never changes the result.

  Beams still alive at `max_decode_len` end there without an EOS (|Y| = max_decode_len).
  They are returned only to fill the slots that finished hypotheses leave empty, after all
  finished ones.

  Args:
    tokens_to_logits: one decoder step for [batch * beam_size] rows, see the module
      docstring; arrays it closes over must be tiled with `tile_beams`.
    cache: the decoder cache for `batch_size` rows (not tiled); leaves with ndim >= 1 are
      tiled to [batch * beam_size, ...] here and reordered with the beams at every step,
      ndim-0 leaves are passed through. Keep what no step changes out of it (see the module
      docstring). With `options.grow_cache`, for the first of `cache_lengths` (the cache is
      grown after tiling).
    batch_size: rows decoded together.
    beam_size: hypotheses kept per row.
    options: the ids, the length (`max_decode_len`: the most tokens a hypothesis has, EOS
      included), the cache's growth and the bans on repeats (each beam's candidates that
      would repeat are left out, as in fairseq and Hugging Face; scores stay the model's
      log-probabilities).
    max_lengths: int32 [batch], each row's own limit (at most `max_decode_len`): a row's
      search ends there exactly as a search with that `max_decode_len` would (its state is
      kept while the other rows go on). None: every row `max_decode_len`.
    prefixes: int32 [batch, prefix_length], each row's forced first tokens, then `pad_id`
      (see `greedy_search`): while a row's prefix lasts, each of its beams has one
      candidate, the prefix's token, so the search goes on from the one hypothesis that
      starts with the prefix; its score includes the prefix's log-probability.
    alpha: the length-penalty exponent; 0 ranks by plain log-probability.
    length_penalty_form: 'gnmt' or 'power', see `length_penalty`.
    early_stopping: stop once the result can no longer change (see above).

  Returns:
    sequences: int32 [batch, beam_size, max_decode_len], best first; each the tokens, the
      EOS (for finished hypotheses), then `pad_id`.
    scores: float32 [batch, beam_size], log P(Y) / lp(|Y|) in float32 (model log-softmax),
      descending among finished hypotheses, then descending among the unfinished ones that
      fill the remaining slots. A slot with score -inf holds no hypothesis (all `pad_id`);
      that happens only when a beam is wider than the number of possible sequences.
  """
  _check_batch_size(batch_size)
  if beam_size < 1:
    raise ValueError(f'beam_size={beam_size} must be >= 1.')
  if length_penalty_form not in LENGTH_PENALTY_FORMS:
    raise ValueError(
        f'length_penalty_form={length_penalty_form!r} is not one of {LENGTH_PENALTY_FORMS}.'
    )
  max_decode_len, pad_id = options.max_decode_len, options.pad_id
  _check_prefixes(prefixes, batch_size, max_decode_len)

  def penalty(length):
    return length_penalty(length, alpha, length_penalty_form)

  positions = jnp.arange(1 + max_decode_len)[None, None, :]  # [1, 1, 1 + max_decode_len]
  rank = jnp.arange(2 * beam_size)[None, :]  # [1, 2 * beam]
  limits = _row_limits(max_lengths, batch_size, max_decode_len)  # [batch]

  def cond(state: _BeamState) -> jax.Array:
    running = state.step < max_decode_len
    if not early_stopping:
      return running
    # lp is monotonic in |Y|, so its largest value over the reachable lengths
    # [step + 1, max_decode_len] is at one of the two ends.
    best_alive = jnp.max(state.alive_log_probs, axis=1)  # [batch]
    best_possible = best_alive / jnp.maximum(penalty(state.step + 1), penalty(limits))
    worst_finished = jnp.min(
        jnp.where(state.finished_flags, state.finished_scores, NEG_INF), axis=1
    )
    done = (
        (best_possible < worst_finished) | (best_alive == NEG_INF) | (state.step >= limits)
    )  # [batch]
    return running & ~jnp.all(done)

  def body(state: _BeamState) -> _BeamState:
    step = state.step
    tokens = lax.dynamic_index_in_dim(state.alive_seqs, step, axis=2, keepdims=False)
    logits, cache = tokens_to_logits(tokens.reshape(batch_size * beam_size, 1), state.cache)
    # log_softmax(x) = shifted - log(sum(exp(shifted))) with shifted = x - max(x), as
    # `jax.nn.log_softmax` computes it. Within one beam, `shifted` ranks the tokens as their
    # log-probabilities do, so the 2 * beam best of each beam are chosen first and only those
    # get the normalizer and the beam's score: the [batch * beam, vocab] log-probabilities
    # and candidate scores are never written (bench/RESULTS.md, section "each beam's best candidates
    # first, by blocks").
    logits = logits.astype(jnp.float32)  # [batch * beam, vocab]
    vocab_size = logits.shape[-1]
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    normalizer = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    per_beam = min(2 * beam_size, vocab_size)
    allowed = shifted.at[:, pad_id].set(NEG_INF)
    if options.bans_repeats:
      # Each beam's tokens so far: columns 1..step, after bos_id.
      history = state.alive_seqs[:, :, 1:].reshape(batch_size * beam_size, max_decode_len)
      allowed = options.ban_repeats(allowed, history, step)
    forced = _forced_tokens(prefixes, step, pad_id)
    if forced is not None:
      # A row in its prefix: each beam's one candidate is the prefix's token (bans aside).
      forced = jnp.repeat(forced, beam_size)[:, None]  # [batch * beam, 1]
      only = jnp.where(jnp.arange(vocab_size)[None, :] == forced, shifted, NEG_INF)
      allowed = jnp.where(forced != pad_id, only, allowed)
    beam_top, beam_tokens = top_k_of_rows(allowed, per_beam)
    candidates = state.alive_log_probs[:, :, None] + (beam_top - normalizer).reshape(
        batch_size, beam_size, per_beam
    )  # [batch, beam, per_beam]

    # 2 * beam candidates hold at least `beam` that do not end in EOS (one EOS per beam).
    # The best 2 * beam of a row are among the best 2 * beam of each of its beams.
    top_log_probs, top_picks = lax.top_k(
        candidates.reshape(batch_size, beam_size * per_beam), 2 * beam_size
    )
    top_beams = top_picks // per_beam  # [batch, 2 * beam]
    top_tokens = jnp.take_along_axis(
        beam_tokens.reshape(batch_size, beam_size * per_beam), top_picks, axis=1
    )
    top_seqs = _take_beams(state.alive_seqs, top_beams)  # [batch, 2 * beam, 1 + len]
    top_seqs = jnp.where(positions == step + 1, top_tokens[:, :, None], top_seqs)
    ends = top_tokens == options.eos_id

    alive_log_probs, alive_picks = lax.top_k(
        jnp.where(ends, NEG_INF, top_log_probs), beam_size
    )  # [batch, beam]
    alive_seqs = _take_beams(top_seqs, alive_picks)
    cache = _gather_cache(cache, jnp.take_along_axis(top_beams, alive_picks, axis=1), batch_size)

    new_flags = ends & (rank < beam_size) & (top_log_probs > NEG_INF)
    new_scores = top_log_probs / penalty(step + 1)
    # Old hypotheses come first, so ties keep the earlier one.
    flags = jnp.concatenate([state.finished_flags, new_flags], axis=1)  # [batch, 3 * beam]
    scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
    seqs = jnp.concatenate([state.finished_seqs, top_seqs], axis=1)
    _, finished_picks = lax.top_k(jnp.where(flags, scores, NEG_INF), beam_size)
    new = _BeamState(
        step=step + 1,
        alive_seqs=alive_seqs,
        alive_log_probs=alive_log_probs,
        finished_seqs=_take_beams(seqs, finished_picks),
        finished_scores=jnp.take_along_axis(scores, finished_picks, axis=1),
        finished_flags=jnp.take_along_axis(flags, finished_picks, axis=1),
        cache=cache,
    )
    if max_lengths is None:
      return new
    # Rows past their own limit keep their state (their cache is never read again).
    active = step < limits  # [batch]

    def keep(fresh, kept):
      return jnp.where(active.reshape((-1,) + (1,) * (fresh.ndim - 1)), fresh, kept)

    return new._replace(
        **{
            name: keep(getattr(new, name), getattr(state, name))
            for name in (
                'alive_seqs',
                'alive_log_probs',
                'finished_seqs',
                'finished_scores',
                'finished_flags',
            )
        }
    )

  empty_seqs = jnp.full((batch_size, beam_size, 1 + max_decode_len), pad_id, jnp.int32)
  # All beams start as copies of one; the others get -inf so the first step does not pick
  # the same candidate `beam_size` times.
  init = _BeamState(
      step=jnp.array(0, jnp.int32),
      alive_seqs=empty_seqs.at[:, :, 0].set(options.bos_id),
      alive_log_probs=jnp.tile(
          jnp.array([0.0] + [NEG_INF] * (beam_size - 1), jnp.float32), (batch_size, 1)
      ),
      finished_seqs=empty_seqs,
      finished_scores=jnp.full((batch_size, beam_size), NEG_INF, jnp.float32),
      finished_flags=jnp.zeros((batch_size, beam_size), bool),
      cache=tile_beams(cache, beam_size),
  )
  final = _phased_while(cond, body, init, max_decode_len, options.grow_cache)

  # Finished hypotheses (flagged ones first, sorted) fill the first slots; alive beams, all
  # as long as their row's limit when this is needed, fill the rest in order.
  num_finished = jnp.sum(final.finished_flags, axis=1, keepdims=True)  # [batch, 1]
  slots = jnp.arange(beam_size)[None, :]  # [1, beam]
  from_alive = slots >= num_finished  # [batch, beam]
  alive_picks = jnp.clip(slots - num_finished, 0, beam_size - 1)
  unfinished_scores = (
      jnp.take_along_axis(final.alive_log_probs, alive_picks, axis=1) / penalty(limits)[:, None]
  )
  scores = jnp.where(from_alive, unfinished_scores, final.finished_scores)
  sequences = jnp.where(
      from_alive[:, :, None], _take_beams(final.alive_seqs, alive_picks), final.finished_seqs
  )[:, :, 1:]
  sequences = jnp.where(scores[:, :, None] > NEG_INF, sequences, pad_id)
  return sequences, scores

"""Search over a key/value cache: greedy, beam search and sampling against independent checks.

The model is a toy decoder with random weights and a real cache (a recurrent state, a memory
of past inputs written at a shared scalar `cache_index`, like a key/value cache), so a search
that tiles or reorders the cache wrongly gets different logits. Every score is recomputed by
teacher forcing the same toy in numpy (float64), a code path independent of the search.
"""

import dataclasses
import functools
import itertools
import os
import subprocess
import sys
import textwrap

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import train_testlib
from transformer_jax.config import BOS_ID
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.decoding import decode


def toy_step(params: dict, tokens: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
  """One decoder step of `ToyDecoder`: tokens [batch, 1] -> logits [batch, vocab], cache."""
  index = cache['cache_index']
  x = params['embed'][tokens[:, 0]]  # [batch, hidden]
  memory = lax.dynamic_update_slice_in_dim(cache['memory'], x[:, None], index, axis=1)
  seen = (jnp.arange(memory.shape[1]) <= index)[None, :, None]
  memory_mean = jnp.sum(memory * seen, axis=1) / (index + 1)  # [batch, hidden]
  state = jnp.tanh(x + cache['state'] @ params['w_state'] + cache['source'])
  logits = (
      jnp.tanh(state + memory_mean @ params['w_memory']) @ params['w_out']
      + params['position_bias'][index]
  )
  return logits, {
      'source': cache['source'],
      'state': state,
      'memory': memory,
      'cache_index': index + 1,
  }


class ToyDecoder:
  """A random-weights decoder with a per-row cache and a shared step counter.

  Cache: 'source' [batch, hidden] (fixed per row, like the encoder output), 'state'
  [batch, hidden] (recurrent state), 'memory' [batch, max_len, hidden] (embeddings of past
  inputs, written at 'cache_index'), 'cache_index' [] (int32, shared by all rows).
  """

  def __init__(
      self,
      vocab_size: int = 7,
      hidden: int = 8,
      max_len: int = 32,
      seed: int = 0,
      eos_bias: float = 0.0,
  ):
    rng = np.random.default_rng(seed)
    self.vocab_size, self.hidden, self.max_len = vocab_size, hidden, max_len
    self.embed = rng.normal(size=(vocab_size, hidden))
    self.w_state = rng.normal(size=(hidden, hidden)) * 0.7
    self.w_memory = rng.normal(size=(hidden, hidden)) * 0.7
    self.w_out = rng.normal(size=(hidden, vocab_size)) * 1.5
    self.position_bias = rng.normal(size=(max_len, vocab_size))
    self.position_bias[:, EOS_ID] += eos_bias
    self.params = {
        name: jnp.asarray(getattr(self, name), jnp.float32)
        for name in ('embed', 'w_state', 'w_memory', 'w_out', 'position_bias')
    }
    self.tokens_to_logits = functools.partial(toy_step, self.params)

  def sources(self, batch_size: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch_size, self.hidden))

  def init_cache(self, sources: np.ndarray) -> dict:
    batch_size = sources.shape[0]
    return {
        'source': jnp.asarray(sources, jnp.float32),
        'state': jnp.zeros((batch_size, self.hidden), jnp.float32),
        'memory': jnp.zeros((batch_size, self.max_len, self.hidden), jnp.float32),
        'cache_index': jnp.array(0, jnp.int32),
    }

  def step_logits_np(self, inputs: list[int], source: np.ndarray) -> np.ndarray:
    """Teacher forcing in numpy: the logits [len(inputs), vocab] after each input."""
    state, seen, out = np.zeros(self.hidden), [], []
    for t, token in enumerate(inputs):
      x = self.embed[token]
      seen.append(x)
      state = np.tanh(x + state @ self.w_state + source)
      memory_mean = np.mean(seen, axis=0)
      out.append(np.tanh(state + memory_mean @ self.w_memory) @ self.w_out + self.position_bias[t])
    return np.stack(out)

  def log_prob_np(self, output: list[int], source: np.ndarray) -> float:
    """log P(output) with the BOS fed first; `output` has no BOS and no padding."""
    logits = self.step_logits_np([BOS_ID] + list(output[:-1]), source)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    return float(np.sum(log_probs[np.arange(len(output)), output]))


def lp_np(length: int, alpha: float, form: str) -> float:
  return ((5 + length) / 6) ** alpha if form == 'gnmt' else length**alpha


def strip(sequence: np.ndarray) -> list[int]:
  """The tokens up to the first PAD; checks that only PAD follows and EOS is last if present."""
  sequence = [int(t) for t in sequence]
  length = sequence.index(PAD_ID) if PAD_ID in sequence else len(sequence)
  assert all(t == PAD_ID for t in sequence[length:]), sequence
  if EOS_ID in sequence[:length]:
    assert sequence.index(EOS_ID) == length - 1, sequence
  return sequence[:length]


_SEARCH_OPTIONS = frozenset(field.name for field in dataclasses.fields(decode.SearchOptions))


def _call_search(search, params, cache, rng, options, max_lengths=None):
  """`search` ('beam', 'greedy' or 'sample') over the toy, `options` (name, value) pairs:
  the `decode.SearchOptions` fields among them bundled, the others passed as they are."""
  step = functools.partial(toy_step, params)
  batch_size = cache['source'].shape[0]
  rest = dict(options)
  shared = decode.SearchOptions(
      **{name: rest.pop(name) for name in dict(options) if name in _SEARCH_OPTIONS}
  )
  if search == 'beam':
    beam_size = rest.pop('beam_size')
    return decode.beam_search(step, cache, batch_size, beam_size, shared, max_lengths, **rest)
  if search == 'greedy':
    return decode.greedy_search(step, cache, batch_size, shared, max_lengths, **rest)
  return decode.sample(step, cache, rng, batch_size, shared, max_lengths, **rest)


@functools.partial(jax.jit, static_argnames=('search', 'options'))
def _search(params, cache, rng, search, options):
  """One compiled search per (search, options, shapes); the toy's weights are arguments."""
  return _call_search(search, params, cache, rng, options)


def run_beam(model, sources, beam_size, max_len, **kwargs):
  options = tuple(sorted(dict(kwargs, beam_size=beam_size, max_decode_len=max_len).items()))
  return jax.device_get(_search(model.params, model.init_cache(sources), None, 'beam', options))


def run_greedy(model, sources, max_len):
  return jax.device_get(
      _search(
          model.params, model.init_cache(sources), None, 'greedy', (('max_decode_len', max_len),)
      )
  )


def run_sample(model, sources, max_len, seed=0, **kwargs):
  options = tuple(sorted(dict(kwargs, max_decode_len=max_len).items()))
  return jax.device_get(
      _search(model.params, model.init_cache(sources), jax.random.key(seed), 'sample', options)
  )


def test_length_penalty_forms():
  np.testing.assert_allclose(decode.length_penalty(7, 0.6), (12 / 6) ** 0.6, rtol=1e-6)
  np.testing.assert_allclose(decode.length_penalty(7, 0.6, 'power'), 7**0.6, rtol=1e-6)
  assert decode.length_penalty(7, 0.0) == 1.0
  with pytest.raises(ValueError, match='length_penalty_form'):
    decode.length_penalty(7, 0.6, 'linear')


def test_tile_beams_repeats_rows_beam_minor_and_keeps_scalars():
  cache = {'k': jnp.arange(6).reshape(2, 3), 'cache_index': jnp.array(5)}
  tiled = decode.tile_beams(cache, 2)
  np.testing.assert_array_equal(tiled['k'], [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]])
  assert tiled['cache_index'].shape == () and int(tiled['cache_index']) == 5


@pytest.mark.parametrize('seed', [0, 1])
def test_greedy_picks_argmax_and_reports_log_prob(seed):
  model = ToyDecoder(seed=seed, eos_bias=1.0)
  sources = model.sources(4, seed=4)
  sequences, log_probs = run_greedy(model, sources, max_len=10)
  for row in range(4):
    output = strip(sequences[row])
    logits = model.step_logits_np([BOS_ID] + output[:-1], sources[row])
    logits[:, PAD_ID] = -np.inf  # PAD is never generated.
    np.testing.assert_array_equal(np.argmax(logits, -1), output)
    assert output[-1] == EOS_ID or len(output) == 10
    np.testing.assert_allclose(
        log_probs[row], model.log_prob_np(output, sources[row]), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_beam_size_one_equals_greedy_without_length_penalty(seed):
  model = ToyDecoder(seed=seed, eos_bias=0.5)
  sources = model.sources(4, seed=seed)
  greedy_seqs, greedy_log_probs = run_greedy(model, sources, max_len=10)
  beam_seqs, beam_scores = run_beam(model, sources, beam_size=1, max_len=10, alpha=0.0)
  np.testing.assert_array_equal(beam_seqs[:, 0], greedy_seqs)
  np.testing.assert_allclose(beam_scores[:, 0], greedy_log_probs, rtol=1e-5, atol=1e-5)


def check_beam_order(outputs: list[list[int]], scores: np.ndarray, max_len: int) -> int:
  """Finished hypotheses first, then unfinished full-length ones, each group best-first."""
  ended = [o[-1] == EOS_ID for o in outputs]
  num_finished = sum(ended)
  assert ended == [True] * num_finished + [False] * (len(outputs) - num_finished), outputs
  assert all(len(o) == max_len for o in outputs[num_finished:]), outputs
  assert np.all(np.diff(scores[:num_finished]) <= 0), scores
  assert np.all(np.diff(scores[num_finished:]) <= 0), scores
  return num_finished


@pytest.mark.parametrize('alpha,form', [(0.6, 'gnmt'), (1.0, 'power'), (0.0, 'gnmt')])
def test_beam_scores_are_sorted_and_equal_recomputed_penalised_log_probs(alpha, form):
  model = ToyDecoder(seed=0, eos_bias=1.0)
  sources = model.sources(4, seed=4)
  sequences, scores = run_beam(
      model, sources, beam_size=4, max_len=10, alpha=alpha, length_penalty_form=form
  )
  assert sequences.shape == (4, 4, 10) and sequences.dtype == np.int32
  lengths = set()
  for row in range(4):
    outputs = [strip(s) for s in sequences[row]]
    assert check_beam_order(outputs, scores[row], 10) == 4
    assert len({tuple(o) for o in outputs}) == 4
    lengths.update(len(o) for o in outputs)
    expected = [model.log_prob_np(o, sources[row]) / lp_np(len(o), alpha, form) for o in outputs]
    np.testing.assert_allclose(scores[row], expected, rtol=1e-4, atol=1e-4)
  assert len(lengths) > 2  # The length penalty matters.


def test_beam_search_decodes_each_batch_row_as_if_alone():
  model = ToyDecoder(seed=0, eos_bias=1.0)
  sources = model.sources(4, seed=4)
  sequences, scores = run_beam(model, sources, beam_size=4, max_len=10)
  alone_seqs, alone_scores = run_beam(model, sources[2:3], beam_size=4, max_len=10)
  np.testing.assert_array_equal(alone_seqs[0], sequences[2])
  np.testing.assert_allclose(alone_scores[0], scores[2], rtol=1e-6)


def test_wide_beam_finds_the_exhaustive_ranking():
  alpha, form = 0.6, 'gnmt'
  # Vocabulary {PAD, BOS, EOS, 3, 4}; PAD is never generated, so 3 tokens continue a prefix.
  model = ToyDecoder(vocab_size=5, seed=5, eos_bias=-0.5)
  max_len, continuing = 4, (BOS_ID, 3, 4)
  sources = model.sources(2, seed=6)
  sequences, scores = run_beam(
      model, sources, beam_size=128, max_len=max_len, alpha=alpha, length_penalty_form=form
  )
  for row in range(2):

    def score(output):
      return model.log_prob_np(list(output), sources[row]) / lp_np(len(output), alpha, form)

    finished = [
        p + (EOS_ID,) for n in range(max_len) for p in itertools.product(continuing, repeat=n)
    ]
    truncated = list(itertools.product(continuing, repeat=max_len))
    finished.sort(key=score, reverse=True)
    truncated.sort(key=score, reverse=True)
    expected = finished + truncated  # 40 + 81 hypotheses; the other 7 slots are empty.
    # The order is the search's only where float32 cannot swap neighbours (7e-4 apart here).
    for group in (finished, truncated):
      assert min(score(a) - score(b) for a, b in zip(group, group[1:])) > 1e-4
    got = [tuple(strip(s)) for s in sequences[row, : len(expected)]]
    assert got == expected
    np.testing.assert_allclose(
        scores[row, : len(expected)], [score(o) for o in expected], rtol=1e-4, atol=1e-4
    )
    assert np.all(scores[row, len(expected) :] == -np.inf)
    assert np.all(sequences[row, len(expected) :] == PAD_ID)


@pytest.mark.parametrize('n,k', [(4096, 8), (5000, 8), (37000, 8), (1000, 3)])
def test_top_k_equals_lax_top_k_with_ties_and_a_ragged_last_block(n, k):
  rng = np.random.default_rng(n)
  x = np.round(rng.normal(size=(6, n)) * 4).astype(np.float32)  # Many ties.
  x[1] = -np.inf  # A row of nothing.
  x[2, :] = 0.0
  x[3, -5:] = 100.0  # The best in the last (partial) block.
  x[4, ::2] = -np.inf
  values, indices = jax.jit(decode.top_k_of_rows, static_argnums=1)(x, k)
  expected_values, expected_indices = lax.top_k(x, k)
  np.testing.assert_array_equal(values, expected_values)
  np.testing.assert_array_equal(indices, expected_indices)


@pytest.mark.parametrize('n', [37000, 300, 100])
def test_argmax_of_rows_is_jnp_argmax_first_index_on_ties(n):
  rng = np.random.default_rng(n)
  x = np.round(rng.normal(size=(5, n)) * 3).astype(np.float32)  # Many tied maxima.
  x[1, :] = 0.0  # All tied: index 0.
  x[2, -1] = 50.0  # The best in the last (partial) block.
  x[3, ::3] = np.inf  # Several infinite maxima: the first.
  got = jax.jit(decode.argmax_of_rows)(x)
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
  assert got.dtype == jnp.int32


def repeats_an_ngram(tokens, n: int) -> bool:
  """Whether some n-gram occurs twice in `tokens` (a direct count)."""
  grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
  return len(grams) != len(set(grams))


def says_a_span_twice_in_a_row(tokens, n: int) -> bool:
  """Whether some span of 1..n tokens is followed at once by itself in `tokens`."""
  return any(
      tokens[i : i + m] == tokens[i + m : i + 2 * m]
      for m in range(1, n + 1)
      for i in range(len(tokens) - 2 * m + 1)
  )


def reference_beam_search_np(model, source, beam_size, max_len, alpha, no_repeat=0, no_adjacent=0):
  """The documented beam search for one row, in numpy float64, over every candidate at once
  (with `no_repeat`, only the candidates whose output repeats no n-gram of that size; with
  `no_adjacent`, only those that say no span of up to that size twice in a row).

  Returns the `beam_size` (output, score) pairs, finished ones first, and the smallest gap
  between the last candidate kept at a step and the first one dropped (a near-tie there
  could go either way in float32).
  """
  alive, finished, gap = [((BOS_ID,), 0.0)], [], np.inf
  for step in range(max_len):
    candidates = []
    for seq, log_prob in alive:
      logits = model.step_logits_np(list(seq), source)[-1]
      log_probs = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
      candidates += [
          (log_prob + log_probs[t], seq + (t,))
          for t in range(model.vocab_size)
          if t != PAD_ID
          and not (no_repeat and repeats_an_ngram(seq[1:] + (t,), no_repeat))
          and not (no_adjacent and says_a_span_twice_in_a_row(seq[1:] + (t,), no_adjacent))
      ]
    candidates.sort(key=lambda c: -c[0])
    if len(candidates) > 2 * beam_size:
      gap = min(gap, candidates[2 * beam_size - 1][0] - candidates[2 * beam_size][0])
    top = candidates[: 2 * beam_size]
    finished += [
        (seq[1:], log_prob / lp_np(step + 1, alpha, 'gnmt'))
        for log_prob, seq in top[:beam_size]
        if seq[-1] == EOS_ID
    ]
    finished = sorted(finished, key=lambda f: -f[1])[:beam_size]
    alive = [(seq, log_prob) for log_prob, seq in top if seq[-1] != EOS_ID][:beam_size]
  unfinished = [(seq[1:], log_prob / lp_np(max_len, alpha, 'gnmt')) for seq, log_prob in alive]
  return (finished + unfinished)[:beam_size], gap


def test_beam_search_over_a_vocabulary_wider_than_two_beams_matches_the_reference():
  # Each beam's candidates are cut to its 2 * beam best before the row's best 2 * beam are
  # chosen; with 40 tokens that cut is real, and must not change the search.
  model = ToyDecoder(vocab_size=40, seed=3, eos_bias=2.5)
  sources = model.sources(3, seed=9)
  sequences, scores = run_beam(
      model, sources, beam_size=3, max_len=7, alpha=0.6, early_stopping=False
  )
  finished_rows = 0
  for row in range(3):
    expected, gap = reference_beam_search_np(model, sources[row], 3, 7, alpha=0.6)
    assert gap > 1e-4  # No near-tie that float32 could break the other way.
    assert [tuple(strip(s)) for s in sequences[row]] == [tuple(o) for o, _ in expected]
    np.testing.assert_allclose(scores[row], [score for _, score in expected], rtol=1e-4)
    finished_rows += expected[0][0][-1] == EOS_ID
  assert finished_rows  # Finished hypotheses are ranked too, not only truncated ones.


@pytest.mark.parametrize('n', [1, 2, 3, 4])
def test_banned_tokens_are_those_that_would_repeat_an_ngram(n):
  rng = np.random.default_rng(n)
  rows, positions, vocab = 6, 12, 5
  history = rng.integers(0, vocab, size=(rows, positions)).astype(np.int32)
  logits = rng.normal(size=(rows, vocab)).astype(np.float32)
  ban = jax.jit(decode.ban_repeated_ngrams, static_argnames='n')
  for length in range(positions + 1):
    got = np.asarray(ban(logits, history, jnp.int32(length), n=n))
    for row in range(rows):
      tokens = list(history[row, :length])
      grams = {tuple(tokens[i : i + n]) for i in range(length - n + 1)}
      banned = {t for t in range(vocab) if length >= n - 1 and tuple((tokens + [t])[-n:]) in grams}
      assert set(np.flatnonzero(np.isneginf(got[row]))) == banned, (length, row, tokens)
      kept = [t for t in range(vocab) if t not in banned]
      np.testing.assert_array_equal(got[row, kept], logits[row, kept])


# Each rule with the predicate it keeps true.
REPEAT_RULES = {
    'no_repeat_ngram_size': (lambda o, n: repeats_an_ngram(list(o), n), 'no_repeat'),
    'no_adjacent_repeat_size': (lambda o, n: says_a_span_twice_in_a_row(list(o), n), 'no_adjacent'),
}


@pytest.mark.parametrize(
    'rule,n',
    [
        ('no_repeat_ngram_size', 2),
        ('no_repeat_ngram_size', 3),
        ('no_adjacent_repeat_size', 1),
        ('no_adjacent_repeat_size', 3),
    ],
)
def test_beam_search_without_repeats_matches_the_reference(rule, n):
  # A 9-token toy over 12 steps repeats itself unless told not to.
  repeats, reference_option = REPEAT_RULES[rule]
  model = ToyDecoder(vocab_size=9, seed=2, eos_bias=-1.0)
  sources = model.sources(3, seed=9)
  plain, _ = run_beam(model, sources, beam_size=3, max_len=12, early_stopping=False)
  assert any(repeats(strip(s), n) for s in plain.reshape(-1, 12))
  sequences, scores = run_beam(
      model, sources, beam_size=3, max_len=12, early_stopping=False, **{rule: n}
  )
  for row in range(3):
    expected, gap = reference_beam_search_np(
        model, sources[row], 3, 12, 0.6, **{reference_option: n}
    )
    assert gap > 1e-4  # No near-tie that float32 could break the other way.
    outputs = [tuple(strip(s)) for s in sequences[row]]
    assert outputs == [tuple(o) for o, _ in expected]
    assert not any(repeats(o, n) for o in outputs)
    # Scores stay the model's log-probabilities, penalised: the ban only removes candidates.
    np.testing.assert_allclose(scores[row], [score for _, score in expected], rtol=1e-4)


@pytest.mark.parametrize('n', [1, 2, 4])
def test_banned_tokens_are_those_that_would_say_a_span_twice_in_a_row(n):
  rng = np.random.default_rng(n)
  rows, positions, vocab = 8, 12, 3  # Few tokens: many spans come back at once.
  history = rng.integers(0, vocab, size=(rows, positions)).astype(np.int32)
  logits = rng.normal(size=(rows, vocab)).astype(np.float32)
  ban = jax.jit(decode.ban_adjacent_repeats, static_argnames='n')
  seen = 0
  for length in range(positions + 1):
    got = np.asarray(ban(logits, history, jnp.int32(length), n=n))
    for row in range(rows):
      tokens = list(history[row, :length])
      banned = {t for t in range(vocab) if _ends_in_a_doubled_span(tokens + [t], n)}
      seen += len(banned)
      assert set(np.flatnonzero(np.isneginf(got[row]))) == banned, (length, row, tokens)
      kept = [t for t in range(vocab) if t not in banned]
      np.testing.assert_array_equal(got[row, kept], logits[row, kept])
  assert seen > rows * positions // 2


def _ends_in_a_doubled_span(tokens, n):
  return any(len(tokens) >= 2 * m and tokens[-2 * m : -m] == tokens[-m:] for m in range(1, n + 1))


@pytest.mark.parametrize('search', ['greedy', 'sample'])
def test_greedy_and_sampling_repeat_no_ngram_and_report_the_models_log_probs(search):
  model = ToyDecoder(vocab_size=9, seed=3, eos_bias=-1.0)
  sources = model.sources(8, seed=9)
  cache = model.init_cache(sources)

  def run(**options):
    options = tuple(sorted(dict(options, max_decode_len=12).items()))
    rng = jax.random.key(0) if search == 'sample' else None
    return jax.device_get(_search(model.params, cache, rng, search, options))

  plain, _ = run()
  for rule, n in (('no_repeat_ngram_size', 2), ('no_adjacent_repeat_size', 3)):
    repeats, _ = REPEAT_RULES[rule]
    assert any(repeats(strip(s), n) for s in plain)
    sequences, log_probs = run(**{rule: n})
    for row in range(8):
      output = strip(sequences[row])
      assert not repeats(output, n), (rule, output)
      np.testing.assert_allclose(
          log_probs[row], model.log_prob_np(output, sources[row]), rtol=1e-4, atol=1e-4
      )
      if search == 'greedy':  # Each token the best one the ban leaves.
        logits = model.step_logits_np([BOS_ID] + output[:-1], sources[row])
        for t, token in enumerate(output):
          allowed = [
              v for v in range(model.vocab_size) if v != PAD_ID and not repeats(output[:t] + [v], n)
          ]
          assert token == max(allowed, key=lambda v: logits[t, v]), (rule, row, t)


def _count_steps(model):
  """Wraps the toy so each decoder step bumps a host counter (test-only; not in the search)."""
  calls = []

  def tokens_to_logits(tokens, cache):
    jax.debug.callback(lambda: calls.append(1))
    return model.tokens_to_logits(tokens, cache)

  return tokens_to_logits, calls


# The second case stops one step early, and a bound taking lp at the current length instead
# of the largest reachable one would have stopped before a longer hypothesis overtook.
@pytest.mark.parametrize('seed,alpha', [(7, 0.6), (0, 1.0)])
def test_early_stopping_gives_the_same_result_in_fewer_steps(seed, alpha):
  model = ToyDecoder(seed=seed, eos_bias=2.0)
  sources = model.sources(4, seed=8)
  results = {}
  for early in (True, False):
    fn, calls = _count_steps(model)
    out = jax.jit(
        functools.partial(
            decode.beam_search,
            fn,
            batch_size=4,
            beam_size=4,
            options=decode.SearchOptions(max_decode_len=24),
            alpha=alpha,
            early_stopping=early,
        )
    )(model.init_cache(sources))
    out = jax.device_get(out)
    jax.effects_barrier()
    results[early] = out, len(calls)
  (early_seqs, early_scores), early_steps = results[True]
  (full_seqs, full_scores), full_steps = results[False]
  assert full_steps == 24 and early_steps < 24
  np.testing.assert_array_equal(early_seqs, full_seqs)
  np.testing.assert_array_equal(early_scores, full_scores)


def test_searches_end_at_an_immediate_eos():
  model = ToyDecoder(seed=0, eos_bias=50.0)  # EOS first, always.
  fn, calls = _count_steps(model)
  sources = model.sources(4)
  sequences, log_probs = jax.jit(
      functools.partial(
          decode.greedy_search, fn, batch_size=4, options=decode.SearchOptions(max_decode_len=10)
      )
  )(model.init_cache(sources))
  jax.effects_barrier()
  assert len(calls) == 1
  np.testing.assert_array_equal(sequences, [[EOS_ID] + [PAD_ID] * 9] * 4)
  np.testing.assert_allclose(log_probs, 0.0, atol=1e-5)
  beam_seqs, beam_scores = run_beam(model, sources, beam_size=4, max_len=10)
  np.testing.assert_array_equal(beam_seqs[:, 0], [[EOS_ID] + [PAD_ID] * 9] * 4)
  np.testing.assert_allclose(beam_scores[:, 0], 0.0, atol=1e-5)


def test_without_eos_every_search_returns_full_length_outputs():
  model = ToyDecoder(seed=9, eos_bias=-1e4)  # EOS practically never wins.
  sources = model.sources(4, seed=9)
  max_len = 10
  greedy_seqs, greedy_log_probs = run_greedy(model, sources, max_len)
  sequences, scores = run_beam(model, sources, beam_size=4, max_len=max_len)
  for row in range(4):
    output = strip(greedy_seqs[row])
    assert len(output) == max_len and EOS_ID not in output
    np.testing.assert_allclose(
        greedy_log_probs[row], model.log_prob_np(output, sources[row]), rtol=1e-4, atol=1e-4
    )
    assert check_beam_order([strip(q) for q in sequences[row]], scores[row], max_len) == 0
    for sequence, score in zip(sequences[row], scores[row]):
      output = strip(sequence)
      assert len(output) == max_len and EOS_ID not in output
      expected = model.log_prob_np(output, sources[row]) / lp_np(max_len, 0.6, 'gnmt')
      np.testing.assert_allclose(score, expected, rtol=1e-4, atol=1e-4)


def test_unfinished_beams_fill_the_slots_finished_ones_leave():
  model = ToyDecoder(seed=9, eos_bias=1.0)
  sources = model.sources(4, seed=4)
  sequences, scores = run_beam(model, sources, beam_size=4, max_len=10)
  mixed = 0
  for row in range(4):
    outputs = [strip(s) for s in sequences[row]]
    num_finished = check_beam_order(outputs, scores[row], 10)
    mixed += 0 < num_finished < 4
    expected = [model.log_prob_np(o, sources[row]) / lp_np(len(o), 0.6, 'gnmt') for o in outputs]
    np.testing.assert_allclose(scores[row], expected, rtol=1e-4, atol=1e-4)
  assert mixed > 0  # The case this test is about happened.


@pytest.mark.parametrize('seed', [0, 1])
def test_sampling_with_top_k_one_or_zero_temperature_is_greedy(seed):
  model = ToyDecoder(seed=seed, eos_bias=0.5)
  sources = model.sources(4, seed=seed)
  greedy = run_greedy(model, sources, max_len=10)
  for kwargs in ({'top_k': 1}, {'temperature': 0.0}, {'temperature': 1e-4}, {'top_p': 1e-6}):
    sampled = run_sample(model, sources, max_len=10, seed=seed, **kwargs)
    np.testing.assert_array_equal(sampled[0], greedy[0], err_msg=str(kwargs))
    np.testing.assert_allclose(sampled[1], greedy[1], rtol=1e-5, err_msg=str(kwargs))


def test_sampled_log_probs_are_the_model_log_probs():
  model = ToyDecoder(seed=2, eos_bias=0.5)
  sources = np.tile(model.sources(1, seed=3), (4, 1))  # Equal rows: samples differ by chance.
  sequences, log_probs = run_sample(model, sources, max_len=10, temperature=1.5, top_k=4)
  assert len({tuple(s) for s in sequences}) > 1
  for row in range(4):
    output = strip(sequences[row])
    assert output[-1] == EOS_ID or len(output) == 10
    np.testing.assert_allclose(
        log_probs[row], model.log_prob_np(output, sources[row]), rtol=1e-4, atol=1e-4
    )


def _first_token_frequencies(model, kwargs, num_samples=4000):
  """Samples the first token of `num_samples` equal rows: (frequencies, logits) [vocab]."""
  sources = np.tile(model.sources(1), (num_samples, 1))
  sequences, _ = run_sample(model, sources, max_len=2, seed=3, **kwargs)
  frequencies = np.bincount(sequences[:, 0], minlength=model.vocab_size) / num_samples
  logits = model.step_logits_np([BOS_ID], sources[0])[0]
  logits[PAD_ID] = -np.inf
  return frequencies, logits


def _softmax(logits):
  e = np.exp(logits - np.max(logits))
  return e / e.sum()


def test_sampling_follows_the_tempered_distribution():
  temperature = 2.5
  model = ToyDecoder(vocab_size=9, seed=4)
  frequencies, logits = _first_token_frequencies(model, {'temperature': temperature})
  np.testing.assert_allclose(frequencies, _softmax(logits / temperature), atol=0.03)


def test_top_k_restricts_the_support_to_the_k_most_probable_tokens():
  model = ToyDecoder(vocab_size=9, seed=4)
  frequencies, logits = _first_token_frequencies(model, {'top_k': 3})
  expected = np.full_like(logits, -np.inf)
  top3 = np.argsort(-logits)[:3]
  expected[top3] = logits[top3]
  assert set(np.flatnonzero(frequencies)) == set(top3)
  np.testing.assert_allclose(frequencies, _softmax(expected), atol=0.03)


def test_top_p_restricts_the_support_to_the_nucleus():
  model = ToyDecoder(vocab_size=9, seed=4)
  top_p = 0.7
  frequencies, logits = _first_token_frequencies(model, {'top_p': top_p})
  probs = _softmax(logits)
  order = np.argsort(-probs)
  num_kept = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
  nucleus = order[:num_kept]
  assert 1 < num_kept < model.vocab_size - 1  # A real restriction, not a trivial one.
  expected = np.full_like(logits, -np.inf)
  expected[nucleus] = logits[nucleus]
  assert set(np.flatnonzero(frequencies)) == set(nucleus)
  np.testing.assert_allclose(frequencies, _softmax(expected), atol=0.03)


def test_invalid_search_options_are_rejected():
  model = ToyDecoder()
  cache = model.init_cache(model.sources(1))
  five = decode.SearchOptions(5)
  with pytest.raises(ValueError, match='beam_size'):
    decode.beam_search(model.tokens_to_logits, cache, 1, 0, five)
  with pytest.raises(ValueError, match='length_penalty_form'):
    decode.beam_search(model.tokens_to_logits, cache, 1, 2, five, length_penalty_form='x')
  with pytest.raises(ValueError, match='top_p'):
    decode.sample(model.tokens_to_logits, cache, jax.random.key(0), 1, five, top_p=0.0)
  with pytest.raises(ValueError, match='temperature'):
    decode.sample(model.tokens_to_logits, cache, jax.random.key(0), 1, five, temperature=-1.0)
  with pytest.raises(ValueError, match='no_repeat_ngram_size'):
    decode.beam_search(
        model.tokens_to_logits, cache, 1, 2, decode.SearchOptions(5, no_repeat_ngram_size=-1)
    )
  with pytest.raises(ValueError, match='no_adjacent_repeat_size=-1 must be an int >= 0'):
    decode.greedy_search(
        model.tokens_to_logits, cache, 1, decode.SearchOptions(5, no_adjacent_repeat_size=-1)
    )


def test_search_options_are_a_static_argument_of_jit():
  model = ToyDecoder(seed=0, eos_bias=1.0)
  cache = model.init_cache(model.sources(2))
  options = decode.SearchOptions(5, no_repeat_ngram_size=2)
  assert options == decode.SearchOptions(5, no_repeat_ngram_size=2)
  assert hash(options) == hash(decode.SearchOptions(5, no_repeat_ngram_size=2))
  search = jax.jit(decode.greedy_search, static_argnums=(0, 2, 3))
  static = search(model.tokens_to_logits, cache, 2, options)
  closed = jax.jit(lambda c: decode.greedy_search(model.tokens_to_logits, c, 2, options))(cache)
  np.testing.assert_array_equal(static[0], closed[0])


def test_searches_have_no_host_callbacks():
  model = ToyDecoder()
  cache = model.init_cache(model.sources(2))
  five = decode.SearchOptions(5)
  searches = [
      lambda c: decode.greedy_search(model.tokens_to_logits, c, 2, five),
      lambda c: decode.beam_search(model.tokens_to_logits, c, 2, 3, five),
      lambda c: decode.sample(
          model.tokens_to_logits, c, jax.random.key(0), 2, five, top_k=3, top_p=0.9
      ),
  ]
  for search in searches:
    assert 'callback' not in str(jax.make_jaxpr(search)(cache))


_SHARDED_SCRIPT = textwrap.dedent("""
    import functools, sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from test_decode import ToyDecoder, SHARDED_CASES, _search

    assert jax.device_count() == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ('data',))
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P('data') if x.ndim else P()))
    expected = np.load(sys.argv[1])
    for name, (search, options) in SHARDED_CASES.items():
      model = ToyDecoder(seed=0, eos_bias=1.0)
      cache = jax.tree.map(shard, model.init_cache(model.sources(4, seed=4)))
      got = jax.device_get(_search(model.params, cache, jax.random.key(0), search, options))
      np.testing.assert_array_equal(got[0], expected[name + '_sequences'], err_msg=name)
      np.testing.assert_allclose(got[1], expected[name + '_scores'], rtol=1e-5, err_msg=name)
    print('ok')
""")
# Options as `run_beam` and `run_sample` spell them, so the reference runs reuse compilations.
SHARDED_CASES = {
    'beam': ('beam', (('beam_size', 4), ('max_decode_len', 10))),
    'sample': ('sample', (('max_decode_len', 10), ('temperature', 1.5), ('top_k', 4))),
}


def test_searches_run_with_the_batch_sharded_over_two_devices(tmp_path):
  model = ToyDecoder(seed=0, eos_bias=1.0)
  cache = model.init_cache(model.sources(4, seed=4))
  expected = {}
  for name, (search, options) in SHARDED_CASES.items():
    sequences, scores = jax.device_get(
        _search(model.params, cache, jax.random.key(0), search, options)
    )
    expected[name + '_sequences'], expected[name + '_scores'] = sequences, scores
  np.savez(tmp_path / 'expected.npz', **expected)
  env = train_testlib.subprocess_env(2)
  env['PYTHONPATH'] = os.pathsep.join(
      [train_testlib.REPO, train_testlib.TESTS, os.path.dirname(os.path.abspath(__file__))]
  )
  result = subprocess.run(
      [sys.executable, '-c', _SHARDED_SCRIPT, str(tmp_path / 'expected.npz')],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0 and 'ok' in result.stdout, result.stderr[-3000:]


def _grow_toy_cache(cache, length):
  memory = cache['memory']
  return dict(cache, memory=jnp.pad(memory, ((0, 0), (0, length - memory.shape[1]), (0, 0))))


@pytest.mark.parametrize('search', ['greedy', 'beam', 'sample'])
def test_searches_in_phases_of_growing_cache_equal_one_loop(search):
  """Phases of 16, 32 and 40 positions give what one loop over 40 gives."""
  assert decode.cache_lengths(40) == (16, 32, 40)
  assert decode.cache_lengths(16) == (16,) and decode.cache_lengths(5) == (5,)
  model = ToyDecoder(max_len=40, seed=3, eos_bias=-2.0)  # Long outputs: every phase runs.
  sources = model.sources(3)
  cache = model.init_cache(sources)
  short = dict(cache, memory=cache['memory'][:, :16])
  options = {'max_decode_len': 40}
  if search == 'beam':
    options['beam_size'] = 3
  rng = jax.random.key(5) if search == 'sample' else None
  one = jax.device_get(_search(model.params, cache, rng, search, tuple(sorted(options.items()))))
  phased = jax.device_get(
      _search(
          model.params,
          short,
          rng,
          search,
          tuple(sorted(dict(options, grow_cache=_grow_toy_cache).items())),
      )
  )
  np.testing.assert_array_equal(phased[0], one[0])
  np.testing.assert_allclose(phased[1], one[1], rtol=1e-6)
  assert max(len(strip(s)) for s in np.reshape(one[0], (-1, 40))) > 32  # The last phase ran.


@functools.partial(jax.jit, static_argnames=('search', 'options'))
def _search_with_limits(params, cache, rng, max_lengths, search, options):
  return _call_search(search, params, cache, rng, options, max_lengths)


@pytest.mark.parametrize('search', ['greedy', 'beam', 'sample'])
def test_each_row_stops_at_its_own_limit_as_if_it_were_the_search_limit(search):
  """Rows with limits 3, 9 and 20 in one search of 20 get what a search limited to 3, to 9
  and to 20 gives them (outputs padded to 20): the paper's source length + 50 per sentence."""
  model = ToyDecoder(max_len=24, seed=3, eos_bias=-3.0)  # Long outputs: the limits bind.
  sources = model.sources(3)
  limits = np.array([3, 9, 20], np.int32)
  options = {'max_decode_len': 20}
  if search == 'beam':
    options['beam_size'] = 3
  rng = jax.random.key(5) if search == 'sample' else None
  together = jax.device_get(
      _search_with_limits(
          model.params,
          model.init_cache(sources),
          rng,
          jnp.asarray(limits),
          search,
          tuple(sorted(options.items())),
      )
  )
  for row, limit in enumerate(limits):
    alone = jax.device_get(
        _search(
            model.params,
            model.init_cache(sources),
            rng,
            search,
            tuple(sorted(dict(options, max_decode_len=int(limit)).items())),
        )
    )
    sequences = np.asarray(together[0])[row]
    assert np.all(sequences[..., limit:] == PAD_ID)
    np.testing.assert_array_equal(sequences[..., :limit], np.asarray(alone[0])[row])
    np.testing.assert_allclose(together[1][row], alone[1][row], rtol=1e-6)
  lengths = np.sum(np.asarray(together[0]) != PAD_ID, axis=-1)
  assert np.max(lengths[0]) == 3 and np.max(lengths[1]) == 9  # The limits did bind.

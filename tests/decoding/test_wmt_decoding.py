"""What WMT systems do around search: forced prefixes, ensembles and scoring given pairs.

The quick tests use a toy step (`_toy_step`) and a random tiny model; the slow ones the
trained fixture of test_translator.py, two of its checkpoints standing for two runs. Every
assertion is a property (prefixes kept, scores recomputed by another path, an ensemble of a
model with itself being that model), never this machine's outputs.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models_testlib
from test_translator import _short_sources
from test_translator import _teacher_forced_log_probs
from test_translator import TRAIN_STEPS
from transformer_jax.checkpoints import loading
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.decoding import decode
from transformer_jax.decoding import ensembles
from transformer_jax.decoding import scoring
from transformer_jax.decoding import translator as translator_lib
from transformer_jax.errors import EnsembleError

VOCAB = 12


def _toy_step(seed: int):
  """A decoder step whose logits depend on the last token only, EOS likely after a few."""
  table = jax.random.normal(jax.random.key(seed), (VOCAB, VOCAB)) * 2.0
  table = table.at[:, EOS_ID].add(jnp.linspace(-4, 2, VOCAB))

  def step(tokens, cache):
    return table[tokens[:, 0]], cache + 1

  return step


def _searches(step, rows, prefixes, options):
  cache = jnp.zeros((rows,), jnp.int32)
  return {
      'greedy': decode.greedy_search(step, cache, rows, options, prefixes=prefixes)[0],
      'sample': decode.sample(step, cache, jax.random.key(0), rows, options, prefixes=prefixes)[0],
      'beam': decode.beam_search(step, cache, rows, 3, options, prefixes=prefixes)[0][:, 0],
  }


def test_every_search_starts_each_row_with_its_prefix_and_rows_without_one_are_unchanged():
  options = decode.SearchOptions(max_decode_len=10, no_adjacent_repeat_size=2)
  step = _toy_step(0)
  prefixes = jnp.asarray([[5, 5, 7], [PAD_ID] * 3, [9, PAD_ID, PAD_ID]], jnp.int32)
  forced = _searches(step, 3, prefixes, options)
  free = _searches(step, 3, None, options)
  for name, sequences in forced.items():
    sequences = np.asarray(sequences)
    # The prefix holds even where the ban on adjacent repeats would refuse `5 5`.
    assert list(sequences[0, :3]) == [5, 5, 7], name
    assert sequences[2, 0] == 9, name
    np.testing.assert_array_equal(sequences[1], np.asarray(free[name])[1], err_msg=name)


def test_forcing_greedy_search_s_own_first_tokens_changes_nothing():
  options = decode.SearchOptions(max_decode_len=10)
  step = _toy_step(1)
  cache = jnp.zeros((2,), jnp.int32)
  free, free_log_probs = decode.greedy_search(step, cache, 2, options)
  prefixes = jnp.asarray(np.asarray(free)[:, :2])
  forced, forced_log_probs = decode.greedy_search(step, cache, 2, options, prefixes=prefixes)
  np.testing.assert_array_equal(forced, free)
  np.testing.assert_allclose(forced_log_probs, free_log_probs, rtol=1e-6)


def test_a_prefix_without_room_for_the_output_is_refused():
  step = _toy_step(0)
  with pytest.raises(ValueError, match='leave no room'):
    decode.greedy_search(
        step, jnp.zeros((1,), jnp.int32), 1, decode.SearchOptions(3), prefixes=jnp.ones((1, 3))
    )


def _random_model(**fields):
  config = dataclasses.replace(models_testlib.TINY, max_len=16, **fields)
  return config, nn.unbox(models_testlib.cached_params(config))


@pytest.fixture(scope='module')
def loaded(run_dir):
  return translator_lib.load_translator(run_dir, batch_size=4, buckets=(8, 16))


def test_ensemble_weights_and_vocabularies_are_checked_with_the_fix_named():
  first, params = _random_model()
  with pytest.raises(EnsembleError, match=r'2 weight\(s\) \[1.0, 2.0\] for 1 model'):
    translator_lib.Translator(first, params, None, weights=[1, 2])
  with pytest.raises(EnsembleError, match='positive numbers; got \\[0.0\\]'):
    translator_lib.Translator(first, params, None, ensemble=[(first, params)], weights=[1, 0])
  other, other_params = _random_model(vocab_size=models_testlib.VOCAB + 4)
  with pytest.raises(EnsembleError, match='another vocabulary.*same SentencePiece model'):
    translator_lib.Translator(first, params, None, ensemble=[(other, other_params)])
  assert ensembles.ensemble_weights([1, 3], 2) == (0.25, 0.75)


def test_models_whose_vocabularies_differ_only_in_where_they_were_trained_ensemble(tmp_path):
  """Two runs' vocabularies trained apart on the same text (their trainer's temporary
  paths differ) are one vocabulary; other pieces are another."""
  from sentencepiece import sentencepiece_model_pb2

  corpus = [f'the {w} river runs by {v} town' for w in 'red old long' for v in 'a the one']
  first = tokenizer_lib.train_tokenizer(corpus, str(tmp_path / 'a.model'), vocab_size=40)
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(first.sentencepiece_models()['source'])
  proto.trainer_spec.model_prefix = str(tmp_path / 'tmp123' / 'spm')  # As older runs have.
  (tmp_path / 'b.model').write_bytes(proto.SerializeToString())
  second = tokenizer_lib.Tokenizer(str(tmp_path / 'b.model'))
  config = dataclasses.replace(models_testlib.TINY, vocab_size=first.vocab_size)
  assert ensembles.check_ensemble([config, config], [first, second], None) == (0.5, 0.5)
  other = tokenizer_lib.train_tokenizer(
      [*corpus, 'green fields near the sea'], str(tmp_path / 'c.model'), vocab_size=40
  )
  config = dataclasses.replace(models_testlib.TINY, vocab_size=other.vocab_size)
  with pytest.raises(EnsembleError, match='model 2 has another vocabulary than model 1'):
    ensembles.check_ensemble([config, config], [first, other], None)
  # One vocabulary serves both directions of a pair; the models of an ensemble share one.
  config = dataclasses.replace(models_testlib.TINY, vocab_size=first.vocab_size)
  with pytest.raises(EnsembleError, match='model 2 translates es->en, model 1 en->es: the mod'):
    ensembles.check_ensemble(
        [config, config], [first, first], None, directions=[('en', 'es'), ('es', 'en')]
    )


def test_an_ensemble_searches_the_weighted_log_probabilities_of_its_models():
  """Two random models of different depths: the ensemble's output log-probability is the
  scorer's, which recomputes it by full forward passes; weights move it toward a model."""
  first, first_params = _random_model()
  second, second_params = _random_model(num_decoder_layers=1, norm_position='pre')
  rng = np.random.default_rng(0)
  sources = [
      [int(t) for t in rng.integers(4, models_testlib.VOCAB, n)] + [EOS_ID] for n in (2, 5, 6)
  ]
  options = translator_lib.DecodeOptions(
      beam_size=2, batch_size=4, buckets=(8,), max_decode_extra_length=4
  )
  for weights in ([3, 1],):
    ensemble = translator_lib.Translator(
        first, first_params, None, options, ensemble=[(second, second_params)], weights=weights
    )
    lists, _ = ensemble.translate_ids(sources)
    best = [hypotheses[0] for hypotheses in lists]
    outputs = [list(h.tokens) + [EOS_ID] * (h.length > len(h.tokens)) for h in best]
    rescored, _ = scoring.Scorer(ensemble).score_ids(sources, outputs)
    np.testing.assert_allclose(
        [s.log_prob for s in rescored], [h.log_prob for h in best], atol=2e-4
    )
    assert ensemble.num_compiled == 1


def test_scores_of_one_model_are_its_teacher_forced_log_probabilities():
  config, params = _random_model()
  translator = translator_lib.Translator(
      config, params, None, translator_lib.DecodeOptions(batch_size=4, buckets=(8,))
  )
  rng = np.random.default_rng(1)
  draw = lambda n: [int(t) for t in rng.integers(4, models_testlib.VOCAB, n)] + [EOS_ID]
  sources = [draw(n) for n in (3, 9, 5)]
  targets = [draw(n) for n in (6, 2, 12)]
  scores, stats = scoring.Scorer(translator).score_ids(sources, targets)
  for source, target, s in zip(sources, targets, scores):
    expected = _teacher_forced_log_probs(
        config, params, jnp.asarray([source]), jnp.asarray([target])
    )
    assert s.length == len(target) and len(s.token_log_probs) == len(target)
    assert s.log_prob == pytest.approx(float(expected[0]), abs=1e-4)
    assert s.score == pytest.approx(
        s.log_prob / float(decode.length_penalty(len(target), 0.6)), rel=1e-6
    )
    assert all(v <= 0 for v in s.token_log_probs)
  assert stats.pairs == 3 and stats.batches >= 2  # Two target buckets: 8 and max_len.


def test_calls_that_go_on_from_one_another_sample_with_their_own_keys():
  """translate.py and translate_corpus.py sample chunk after chunk: a chunk's batches number
  on from the batches before it, so no two share a key, and a resumed chunk draws again
  what it drew the first time."""
  config, params = _random_model()
  options = translator_lib.DecodeOptions(
      batch_size=4, buckets=(8,), sampling=True, max_decode_extra_length=6
  )
  translator = translator_lib.Translator(config, params, None, options)
  sources = [[5, 6, 7, EOS_ID]] * 4

  def drawn(first_batch):
    lists, _ = translator.translate_ids(sources, first_batch=first_batch)
    return [hypotheses[0].tokens for hypotheses in lists]

  assert drawn(0) == drawn(0) and drawn(3) == drawn(3)
  assert drawn(0) != drawn(1) != drawn(3)


@pytest.mark.slow
def test_an_ensemble_of_a_model_with_itself_translates_as_the_model(loaded, run_dir):
  translator, checkpoint = loaded
  texts = _short_sources(run_dir, checkpoint.tokenizer, 4)
  options = dataclasses.replace(translator.options, n_best=2)
  single = translator_lib.Translator(
      checkpoint.model_config,
      checkpoint.params,
      checkpoint.tokenizer,
      options,
      checkpoint.partitioner,
  )
  double = translator_lib.Translator(
      checkpoint.model_config,
      checkpoint.params,
      checkpoint.tokenizer,
      options,
      checkpoint.partitioner,
      ensemble=[(checkpoint.model_config, checkpoint.params)],
  )
  alone, _ = single.translate_n_best(texts)
  together, _ = double.translate_n_best(texts)
  assert [[h.text for h in n] for n in together] == [[h.text for h in n] for n in alone]
  np.testing.assert_allclose(
      [h.log_prob for n in together for h in n], [h.log_prob for n in alone for h in n], atol=1e-4
  )


@pytest.mark.slow
def test_loaded_ensemble_of_two_checkpoints_scores_its_outputs_as_the_scorer(run_dir):
  """Two checkpoints of the fixture as two models (the same vocabulary): greedy, beam and
  sampling outputs' log-probabilities are the ensemble's by full forward passes."""
  earliest = loading.load(run_dir, step=TRAIN_STEPS[0])
  for extra in ({'beam_size': 1}, {'beam_size': 3, 'n_best': 2}, {'sampling': True, 'n_best': 2}):
    translator, checkpoint = translator_lib.load_translator(
        run_dir, batch_size=4, buckets=(8, 16), **extra
    )
    ensemble = translator_lib.Translator(
        checkpoint.model_config,
        checkpoint.params,
        checkpoint.tokenizer,
        translator.options,
        checkpoint.partitioner,
        ensemble=[(earliest.model_config, earliest.params)],
        weights=[2, 1],
    )
    texts = _short_sources(run_dir, checkpoint.tokenizer, 4)
    lists, _ = ensemble.translate_n_best(texts)
    # The output ids themselves (with the EOS when one came): its text may tokenize into
    # other pieces, whose score is another sequence's.
    pairs = [(text, h) for text, hypotheses in zip(texts, lists) for h in hypotheses]
    sources = [checkpoint.tokenizer.encode(text) for text, _ in pairs]
    outputs = [list(h.tokens) + ([EOS_ID] if h.length > len(h.tokens) else []) for _, h in pairs]
    scores, _ = scoring.Scorer(ensemble).score_ids(sources, outputs)
    np.testing.assert_allclose(
        [s.log_prob for s in scores], [h.log_prob for _, h in pairs], atol=2e-3, err_msg=str(extra)
    )


@pytest.mark.slow
def test_forced_prefixes_start_the_output_and_a_prefix_too_long_fails_its_line_only(
    loaded, run_dir
):
  translator, checkpoint = loaded
  texts = _short_sources(run_dir, checkpoint.tokenizer, 3)
  free, _ = translator.translate(texts)
  first_word = free[0].split()[0]
  prefixes = [first_word, 'ein ' * 40, '']
  outputs, stats = translator.translate(texts, prefixes=prefixes)
  assert outputs[0].startswith(first_word)
  assert outputs[1] == '' and [i for i, _ in stats.failed] == [1]
  assert 'its prefix has' in stats.failed[0][1]
  assert outputs[2] == free[2]
  # A prefix the model would not choose is kept, and the rest follows from it.
  forced, _ = translator.translate(texts[:1], prefixes=['wasser wasser'])
  assert forced[0].startswith('wasser wasser')

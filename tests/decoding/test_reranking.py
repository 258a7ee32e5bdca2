"""Reranking n-best lists: the file format read back, weighted totals, bad weights and lines,
and the tuning search."""

import types

import pytest

from transformer_jax.commands import line_io
from transformer_jax.decoding import reranking
from transformer_jax.errors import DataError
from transformer_jax.errors import UserError


def _line(index, text, log_prob, score):
  hypothesis = types.SimpleNamespace(text=text, log_prob=log_prob, score=score)
  return line_io.n_best_line(index, hypothesis)


def test_the_n_best_file_translate_writes_parses_back_by_source_line():
  lines = [
      _line(0, 'el perro', -1.5, -0.75),
      _line(0, 'un perro grande', -2.0, -0.5),
      _line(2, 'la casa', -0.25, -0.125),
  ]
  lists = reranking.parse_n_best(lines, 3, 'nbest.txt')
  assert [len(c) for c in lists] == [2, 0, 1]
  assert lists[0][1].text == 'un perro grande'
  assert lists[0][1].features == {'score': -0.5, 'log_prob': -2.0, 'words': 3.0}
  # A source line without hypotheses (all of them failed) gets no pick: an empty output.
  assert reranking.rerank(lists, {'score': 1.0}) == [1, -1, 0]


@pytest.mark.parametrize(
    'line,message',
    [
        ('0 ||| el perro ||| -1.5 ||| -0.7', r'nbest.txt line 2 is not an n-best line'),
        ('x ||| el perro ||| LogProb= -1.5 ||| -0.7', r'nbest.txt line 2 is not an n-best line'),
        ('el perro', r'Write the list with translate.py --n_best=K'),
        ('7 ||| el perro ||| LogProb= -1.5 ||| -0.7', r'line 2 is for source line 7, but the'),
    ],
)
def test_a_malformed_line_is_named_with_its_number_and_the_fix(line, message):
  with pytest.raises(DataError, match=message):
    reranking.parse_n_best([_line(0, 'a', -1.0, -1.0), line], 2, 'nbest.txt')


def test_the_weighted_total_ranks_and_a_tie_keeps_the_original_order():
  first = reranking.Candidate('a', {'score': -1.0, 'reverse': -4.0, 'words': 1.0})
  second = reranking.Candidate('a b', {'score': -2.0, 'reverse': -1.0, 'words': 2.0})
  assert reranking.rerank([[first, second]], {'score': 1.0}) == [0]
  assert reranking.rerank([[first, second]], {'score': 1.0, 'reverse': 1.0}) == [1]
  assert reranking.total(second, {'score': 1.0, 'reverse': 0.5, 'words': -1.0}) == -4.5
  # score - reverse: -1 + 4 = 3 and -2 + 1 = -1; with words 4: 7 and 7, a tie.
  tied = {'score': 1.0, 'reverse': -1.0, 'words': 4.0}
  assert reranking.total(first, tied) == reranking.total(second, tied)
  assert reranking.rerank([[first, second]], tied) == [0]
  assert reranking.rerank([[second, first]], tied) == [0]


def test_a_weight_for_a_feature_that_is_not_there_names_the_features_that_are():
  features = ('score', 'log_prob', 'words', 'reverse')
  reranking.check_weights({'score': 1.0, 'reverse': 0.3}, features)
  with pytest.raises(UserError, match=r'for forward1, which is not a feature here: the feat'):
    reranking.check_weights({'forward1': 1.0}, features)


def _lists_where_the_second_feature_knows_better(sentences=8):
  """Each line's reference is its second candidate, which `score` ranks below a wrong one
  and `reverse` above it."""
  lists, references = [], []
  for i in range(sentences):
    right = f'the {i} cat sat on the mat today'
    wrong = f'a {i} dog stood by some door'
    lists.append(
        [
            reranking.Candidate(wrong, {'score': -1.0, 'reverse': -3.0, 'words': 7.0}),
            reranking.Candidate(right, {'score': -1.5, 'reverse': -1.0, 'words': 8.0}),
        ]
    )
    references.append(right)
  return lists, references


def test_tuning_finds_weights_that_beat_the_first_feature_alone_and_is_seeded():
  lists, references = _lists_where_the_second_feature_knows_better()
  seen = []
  tuned = reranking.tune(
      lists, references, ('score', 'reverse'), trials=30, seed=3, progress=lambda *a: seen.append(a)
  )
  assert tuned.baseline_bleu < 10.0 and tuned.bleu == pytest.approx(100.0)
  assert tuned.weights['score'] == 1.0 and tuned.weights['reverse'] > 0.25
  assert reranking.rerank(lists, tuned.weights) == [1] * len(lists)
  assert [trial for trial, _ in seen] == list(range(1, 30))
  again = reranking.tune(lists, references, ('score', 'reverse'), trials=30, seed=3)
  assert again.weights == tuned.weights
  # One trial is the first feature alone: never below it.
  alone = reranking.tune(lists, references, ('score', 'reverse'), trials=1)
  assert alone.weights == {'score': 1.0, 'reverse': 0.0} and alone.bleu == alone.baseline_bleu

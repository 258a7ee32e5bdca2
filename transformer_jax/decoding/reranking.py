"""Reranking n-best lists with further models' scores, weights given or tuned.

An n-best list (`translate.py --n_best=K`, the Moses/Marian format `line_io.n_best_line`
writes) gives each source line K hypotheses and two features of the model that wrote them:
`score` (log P(Y | X) / lp(|Y|)) and `log_prob`. Further models add one feature each, a
`scoring.Scorer` score: a forward model's of (source -> hypothesis), or a reverse-direction
model's of (hypothesis -> source), the channel model of noisy-channel reranking (Yee et al.
2019; fairseq's `noisychannel`). `words`, the hypothesis's word count, lets a weight favour
longer or shorter outputs. Each hypothesis's total is the weighted sum of its features, and
the best total wins.

Weights come from the command line, or `tune` searches them: random weights (seeded) scored
by corpus sacreBLEU of the reranked outputs on a validation set, the best kept (the first
feature's weight stays 1: the ranking does not change when every weight is scaled).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import random

import sacrebleu

from transformer_jax.errors import DataError
from transformer_jax.errors import UserError

# Features of the n-best file itself; models add theirs.
FILE_FEATURES = ('score', 'log_prob', 'words')


@dataclasses.dataclass
class Candidate:
  """One hypothesis of an n-best list and its features (name -> value)."""

  text: str
  features: dict[str, float]


def parse_n_best(lines: Sequence[str], source_count: int, name: str) -> list[list[Candidate]]:
  """The hypotheses of each of `source_count` source lines, in file order.

  Raises:
    DataError: a line not in the n-best format, or an index outside the sources, naming the
      line and the fix.
  """
  lists: list[list[Candidate]] = [[] for _ in range(source_count)]
  for number, line in enumerate(lines, 1):
    fields = line.split(' ||| ')
    try:
      if len(fields) != 4 or not fields[2].startswith('LogProb= '):
        raise ValueError('not INDEX ||| TRANSLATION ||| LogProb= LOG_P ||| SCORE')
      index = int(fields[0])
      log_prob, score = float(fields[2].split()[1]), float(fields[3])
    except (ValueError, IndexError) as e:
      raise DataError(
          f'{name} line {number} is not an n-best line ({e}): {line[:120]!r}. Write the list '
          'with translate.py --n_best=K (or --print_scores).'
      ) from e
    if not 0 <= index < source_count:
      raise DataError(
          f'{name} line {number} is for source line {index}, but the sources have '
          f'{source_count} lines: give the source file the n-best list was translated from.'
      )
    features = {'score': score, 'log_prob': log_prob, 'words': float(len(fields[1].split()))}
    lists[index].append(Candidate(fields[1], features))
  return lists


def check_weights(weights: Mapping[str, float], features: Sequence[str]) -> None:
  """Raises a `UserError` for a weight of a feature that is not there, naming those that are."""
  unknown = sorted(set(weights) - set(features))
  if unknown:
    raise UserError(
        f'a reranking weight for {", ".join(unknown)}, which is not a feature here: the '
        f'features are {", ".join(features)} (give --forward/--reverse for a model\'s).'
    )


def rerank(lists: Sequence[Sequence[Candidate]], weights: Mapping[str, float]) -> list[int]:
  """Each list's best candidate's index by the weighted sum of features (-1: an empty list);
  ties go to the earlier candidate, the original order."""
  best = []
  for candidates in lists:
    totals = [total(c, weights) for c in candidates]
    best.append(max(range(len(totals)), key=lambda i: (totals[i], -i)) if totals else -1)
  return best


def total(candidate: Candidate, weights: Mapping[str, float]) -> float:
  return sum(w * candidate.features[name] for name, w in weights.items())


def bleu(lists: Sequence[Sequence[Candidate]], picks: Sequence[int], references: Sequence[str]):
  """Corpus sacreBLEU of the picked candidates (an empty list: an empty output)."""
  outputs = [c[i].text if i >= 0 else '' for c, i in zip(lists, picks)]
  return sacrebleu.corpus_bleu(outputs, [list(references)])


@dataclasses.dataclass
class Tuning:
  """What `tune` found: the weights, their BLEU, and the BLEU of the first feature alone."""

  weights: dict[str, float]
  bleu: float
  baseline_bleu: float
  trials: int


def tune(
    lists: Sequence[Sequence[Candidate]],
    references: Sequence[str],
    features: Sequence[str],
    trials: int = 200,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> Tuning:
  """Random search for the weights that give the reranked outputs the best corpus BLEU.

  The first feature keeps weight 1; each other is drawn from [0, 2] (`words`: [-1, 1], a
  length bonus or penalty). The first feature alone is the first trial, so the result is
  never below it on this set.
  """
  rng = random.Random(seed)
  first, others = features[0], list(features[1:])
  baseline = {first: 1.0, **{name: 0.0 for name in others}}
  best_weights, best_bleu = baseline, bleu(lists, rerank(lists, baseline), references).score
  baseline_bleu = best_bleu
  for trial in range(1, trials):
    weights = {first: 1.0}
    for name in others:
      weights[name] = rng.uniform(-1.0, 1.0) if name == 'words' else rng.uniform(0.0, 2.0)
    value = bleu(lists, rerank(lists, weights), references).score
    if value > best_bleu:
      best_weights, best_bleu = weights, value
    if progress is not None:
      progress(trial, best_bleu)
  return Tuning(best_weights, best_bleu, baseline_bleu, trials)

"""The early-stopping count: what improves, what it saves in a checkpoint, what a resume reads."""

import pytest

from transformer_jax.config import base_config
from transformer_jax.training.early_stopping import EarlyStopping


def _config(**fields):
  config = base_config()
  config.update({'eval_every_steps': 100, **fields})
  return config


@pytest.mark.parametrize(
    'metric,values,counts',
    [
        ('bleu', [10.0, 12.0, 12.0, 11.0, 13.0], [0, 0, 1, 2, 0]),
        ('loss', [3.0, 2.0, 2.0, 2.5, 1.5], [0, 0, 1, 2, 0]),
        ('chrf', [float('nan'), 40.0, float('nan'), 41.0], [1, 0, 1, 0]),
    ],
)
def test_only_a_strictly_better_value_resets_the_count(metric, values, counts):
  tracker = EarlyStopping.from_meta(_config(best_checkpoint_metric=metric), None)
  seen = []
  for step, value in enumerate(values, start=1):
    tracker.update(step, {metric: value, 'other': 0.0})
    seen.append(tracker.without_improvement)
  assert seen == counts
  assert not tracker.out_of_patience  # Patience 0: never.


def test_the_count_survives_a_checkpoint_and_restarts_for_another_metric():
  config = _config(best_checkpoint_metric='loss', early_stopping_patience=2)
  tracker = EarlyStopping.from_meta(config, None)
  for step, loss in ((100, 2.0), (200, 2.5), (300, 2.0)):
    tracker.update(step, {'loss': loss})
  assert tracker.out_of_patience
  assert tracker.describe() == (
      'validation loss did not improve on its best, 2.0000 (step 100), in 2 validations in a '
      'row (early_stopping_patience=2)'
  )
  meta = {'config': {}, **tracker.to_meta()}
  resumed = EarlyStopping.from_meta(config, meta)
  assert resumed == tracker
  # A patience raised on resume (a field a resume may change) lets the run go on.
  more = EarlyStopping.from_meta(
      _config(best_checkpoint_metric='loss', early_stopping_patience=3), meta
  )
  assert (more.best, more.best_step, more.without_improvement) == (2.0, 100, 2)
  assert not more.out_of_patience
  # Another metric counts afresh; no evaluations, or no best kept: no count at all.
  fresh = EarlyStopping.from_meta(_config(best_checkpoint_metric='bleu'), meta)
  assert fresh.best is None and fresh.without_improvement == 0
  assert EarlyStopping.from_meta(_config(best_checkpoint_metric=''), meta) is None
  assert EarlyStopping.from_meta(_config(eval_every_steps=0), meta) is None

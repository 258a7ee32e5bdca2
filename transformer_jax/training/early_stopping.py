"""Early stopping: validations in a row without a new best `best_checkpoint_metric`.

With `early_stopping_patience=N` a run ends after N validations in a row whose metric does not
improve on the best so far (a tie is no improvement). The count is kept whenever validations
keep best checkpoints, patience or not, so that a patience set on resume counts from the run's
start. It travels in every checkpoint's meta (`META_KEY`): a resumed run counts on from its
checkpoint, and a rerun of a stopped run finds the patience spent and trains no further.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import math
from typing import Any

import ml_collections

from transformer_jax.config import BEST_CHECKPOINT_METRICS

META_KEY = 'early_stopping'  # Of the checkpoint's meta item.


@dataclasses.dataclass
class EarlyStopping:
  """The best validation value so far and the validations since it.

  Attributes:
    metric: `best_checkpoint_metric` ('bleu', 'chrf' or 'loss').
    patience: `early_stopping_patience` (0: the run never stops for it).
    best: the best value so far (None before the first finite one).
    best_step: the step it was measured at.
    without_improvement: validations since then (or since the first) that did not beat it.
  """

  metric: str
  patience: int
  best: float | None = None
  best_step: int | None = None
  without_improvement: int = 0

  @classmethod
  def from_meta(
      cls, config: ml_collections.ConfigDict, meta: Mapping[str, Any] | None
  ) -> EarlyStopping | None:
    """The count saved in a checkpoint's `meta` (None: a fresh run's); counted afresh when
    the run's metric changed since. None when the run keeps no best checkpoints."""
    if not (config.eval_every_steps and config.best_checkpoint_metric):
      return None
    saved = dict((meta or {}).get(META_KEY) or {})
    if saved.pop('metric', None) != config.best_checkpoint_metric:
      saved = {}
    return cls(config.best_checkpoint_metric, config.early_stopping_patience, **saved)

  def to_meta(self) -> dict[str, Any]:
    """The entry for a checkpoint's meta (`{META_KEY: ...}`)."""
    state = dataclasses.asdict(self)
    del state['patience']  # The config's, which may change on resume.
    return {META_KEY: state}

  def update(self, step: int, metrics: Mapping[str, float]) -> None:
    """Counts the validation of `step`."""
    value = float(metrics[self.metric])
    higher_is_better = BEST_CHECKPOINT_METRICS[self.metric]
    better = not math.isnan(value) and (
        self.best is None or (value > self.best if higher_is_better else value < self.best)
    )
    if better:
      self.best, self.best_step, self.without_improvement = value, step, 0
    else:
      self.without_improvement += 1

  @property
  def out_of_patience(self) -> bool:
    """Whether the run is to stop (has stopped) for want of improvement."""
    return bool(self.patience) and self.without_improvement >= self.patience

  def describe(self) -> str:
    """One line: the metric, its best value and step, the validations without a better."""
    best = 'no finite value' if self.best is None else f'{self.best:.4f} (step {self.best_step})'
    return (
        f'validation {self.metric} did not improve on its best, {best}, in '
        f'{self.without_improvement} validations in a row (early_stopping_patience='
        f'{self.patience})'
    )

"""What the user sees of a run: a progress bar or log lines, TensorBoard and JSON lines.

Only process 0 writes. Every `metrics.jsonl` row has the step, the split ('train' or 'eval'),
the wall-clock `time` (Unix seconds) and the scalars; TensorBoard gets the same scalars, the
run's config (text, at the start) and the validation sample translations (text).

Metrics arrive as sums (see `losses.compute_metrics`) and become
means here: `summarize_train` and `summarize_eval` turn the sums of a logging interval into
loss, perplexity, learning rate, gradient norm, tokens/s, MFU, padding share and skips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import functools
import json
import math
import sys
import time
from typing import Any
import uuid

from absl import logging
import numpy as np
import tqdm

from transformer_jax.model import flops as model_flops
from transformer_jax.storage import storage

# What tensorboardX imports when it is installed and this module never gives it: PyTorch (to
# accept its tensors; a slow import at every train.py start where the tests or the benchmarks
# installed it) and the Cloud Storage client (for gs:// log directories; a gs:// run's events are
# written locally and uploaded whole, see `MetricsWriter`).
_HIDDEN_FROM_TENSORBOARDX = ('torch', 'google.cloud.storage')


@functools.cache
def _summary_writer_class() -> type:
  """tensorboardX's `SummaryWriter`, imported with `_HIDDEN_FROM_TENSORBOARDX` hidden (they
  import as usual afterwards, for whoever needs them)."""
  hidden = [name for name in _HIDDEN_FROM_TENSORBOARDX if name not in sys.modules]
  for name in hidden:
    sys.modules[name] = None  # `import name` raises ImportError, which tensorboardX expects.
  try:
    import tensorboardX
  finally:
    for name in hidden:
      if sys.modules.get(name, False) is None:
        del sys.modules[name]
  return tensorboardX.SummaryWriter


def summarize_train(
    sums: Mapping[str, float],
    *,
    steps: int,
    last: Mapping[str, float],
    skipped_total: int,
    timed: Mapping[str, float] | None = None,
    seconds: float = 0.0,
    flops: float = 0.0,
    peak_flops: float | None = None,
    data_wait_seconds: float | None = None,
) -> dict[str, float]:
  """Means and rates of one logging interval of training.

  Args:
    sums: the interval's summed step metrics (see `train_steps.train_step`).
    steps: steps in the interval.
    last: the last step's metrics (learning rate).
    skipped_total: updates skipped so far in the run.
    timed: the sums of the steps that `seconds` timed (compilation excluded); no rates
      are reported without them.
    seconds: the wall time of the `timed` steps.
    flops: their model FLOPs (see `flops.batch_flops`).
    peak_flops: the whole job's peak FLOP/s; None where unknown (no MFU then).
    data_wait_seconds: of `seconds`, how long the loop waited for input batches.
  """
  tokens = max(sums['tokens'], 1.0)
  out = {
      'loss': sums['loss'] / tokens,
      'perplexity': math.exp(min(sums['nll'] / tokens, 100.0)),
      'accuracy': sums['correct'] / tokens,
      'learning_rate': last['learning_rate'],
      'grad_norm': sums['grad_norm'] / steps,
      'padding_share': 1.0 - (sums['tokens'] + sums['source_tokens']) / max(sums['slots'], 1.0),
      'skipped_steps': float(skipped_total),
  }
  if timed and seconds > 0:
    out['tokens_per_second'] = (timed['tokens'] + timed['source_tokens']) / seconds
    out['target_tokens_per_second'] = timed['tokens'] / seconds
    if peak_flops:
      out['mfu'] = model_flops.mfu(flops, seconds, peak_flops)
    if data_wait_seconds is not None:
      out['data_wait_share'] = min(1.0, data_wait_seconds / seconds)
  return out


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
  """Loss (label-smoothed, as trained), perplexity and accuracy over evaluation batches."""
  tokens = max(sums['tokens'], 1.0)
  return {
      'loss': sums['loss'] / tokens,
      'perplexity': math.exp(min(sums['nll'] / tokens, 100.0)),
      'accuracy': sums['correct'] / tokens,
      'tokens': sums['tokens'],
  }


def sum_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Adds step metric dicts key by key (as float64 on the host)."""
  total: dict[str, float] = {}
  for m in metrics:
    for k, value in m.items():
      total[k] = total.get(k, 0.0) + float(np.asarray(value, np.float64))
  return total


class MetricsWriter:
  """Progress display, TensorBoard event files and `metrics.jsonl` for one run."""

  def __init__(
      self,
      metrics_path: str,
      tensorboard_dir: str,
      *,
      total_steps: int,
      start_step: int,
      enabled: bool,
      config: Any = None,
  ):
    """Opens the outputs, the run's `RunLayout.metrics` and `RunLayout.tensorboard`; with
    `enabled=False` (processes other than 0) does nothing.

    `config` (a `ConfigDict`), if given, goes to TensorBoard as text at `start_step`.

    A resumed run first drops JSON lines of steps after `start_step`: they came from the
    stretch after the last checkpoint, which is about to be trained again.
    """
    self._enabled = enabled
    self._total = total_steps
    self._bar = None
    self._tb = None
    if not enabled:
      return
    self._metrics = storage.LineLog(
        metrics_path,
        keep=lambda line: _step_at_most(line, start_step),
    )
    # Event file names have the second and the host: a random suffix keeps a restart within
    # the second from replacing the file where it is uploaded whole (Cloud Storage).
    # On Cloud Storage the events are written locally and uploaded whole after each flush
    # (every event kept), rather than through tensorboardX's own gs:// writer, which uploads
    # once more when it is collected: at the end of the process, when the run's last upload
    # is long done.
    self._tb_dir = storage.LocalMirror(tensorboard_dir, 'the TensorBoard directory')
    self._tb = _summary_writer_class()(
        self._tb_dir.local, filename_suffix=f'.{uuid.uuid4().hex[:8]}'
    )
    if config is not None:
      # Indented four spaces: Markdown code, so TensorBoard keeps the layout.
      text = '\n'.join('    ' + line for line in str(config).splitlines())
      self._tb.add_text('config', text, start_step)
    self._start_time = time.time()
    self._start_step = start_step
    if sys.stderr.isatty():
      self._bar = tqdm.tqdm(
          total=total_steps, initial=start_step, unit='step', dynamic_ncols=True, file=sys.stderr
      )

  def step_done(self, step: int) -> None:
    """Advances the progress bar (cheap; called every step)."""
    if self._bar is not None:
      self._bar.update(step - self._bar.n)

  def write(self, step: int, split: str, values: Mapping[str, float]) -> None:
    """Writes one set of scalars ('train' or 'eval') at `step`."""
    if not self._enabled:
      return
    values = {k: float(v) for k, v in values.items()}
    for name, value in values.items():
      self._tb.add_scalar(f'{split}/{name}', value, step)
    self._flush_tensorboard()
    row = json.dumps({'step': step, 'split': split, 'time': round(time.time(), 3), **values}) + '\n'
    self._metrics.append(row)
    if split == 'train':
      rate = values.get('tokens_per_second', float('nan'))
      shown = {'loss': f'{values["loss"]:.3f}', 'tok/s': f'{rate:.0f}'}
      if 'data_wait_share' in values:
        shown['data wait'] = f'{values["data_wait_share"]:.0%}'
      if self._bar is not None:
        self._bar.set_postfix(shown, refresh=False)
        return
      done = step - self._start_step
      eta = (self._total - step) * (time.time() - self._start_time) / max(done, 1)
      logging.info(
          'step %d/%d  loss %.4f  ppl %.2f  lr %.3g  |g| %.3g  %.0f tok/s  '
          'pad %.0f%%  data wait %.0f%%  skipped %d  ETA %s',
          step,
          self._total,
          values['loss'],
          values['perplexity'],
          values['learning_rate'],
          values['grad_norm'],
          rate,
          100 * values['padding_share'],
          100 * values.get('data_wait_share', float('nan')),
          values['skipped_steps'],
          _duration(eta),
      )
    else:
      message = (
          f'step {step}: {split} loss {values["loss"]:.4f}  perplexity '
          f'{values["perplexity"]:.2f}  accuracy {values["accuracy"]:.3f}'
      )
      if 'bleu' in values:
        message += (
            f'  sacreBLEU {values["bleu"]:.2f}  chrF {values["chrf"]:.2f}  '
            f'({values["translate_seconds"]:.0f}s translating)'
        )
      if self._bar is not None:
        self._bar.write(message)
      else:
        logging.info(message)

  def text(self, step: int, tag: str, markdown: str) -> None:
    """A Markdown text (a table of sample translations) in TensorBoard at `step`."""
    if self._enabled:
      self._tb.add_text(tag, markdown, step)
      self._flush_tensorboard()

  def _flush_tensorboard(self) -> None:
    self._tb.flush()
    self._tb_dir.sync()

  def log(self, message: str) -> None:
    """A plain message that does not break the progress bar."""
    if not self._enabled:
      return
    if self._bar is not None:
      self._bar.write(message)
    else:
      logging.info(message)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
      self._tb_dir.close()


def _step_at_most(line: str, step: int) -> bool:
  """Whether a metrics row is of `step` or before (a line cut short by a kill is not)."""
  try:
    return json.loads(line)['step'] <= step
  except (ValueError, KeyError, TypeError):
    return False


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'

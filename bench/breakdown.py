"""Where a training step's time goes, by kind of work, alike for our step and PyTorch's.

Kinds: matmul, attention (its softmax and masks; the matmuls are matmul), normalization,
loss (the softmax and cross entropy over the vocabulary), optimizer (the update, the
gradient norm, the finiteness check and the metrics), data movement (copies, transposes,
broadcasts, concatenations, gathers), other (embeddings, activations, residual adds), and
for JAX the idle time in which no traced XLA operation runs (dispatch gaps, waits, and work
that XLA:CPU hands to its pool without a trace event: a plain `dot`'s contraction, a
parallel loop fusion's other partitions).

JAX: the step runs a few times under `jax.profiler`; every XLA:CPU operation in the trace is
an instruction of the optimized HLO, which names the JAX operation it came from (its
`op_name`, e.g. `jit(train_step)/transpose(jvp(Transformer))/.../norm/mul`). PyTorch: the
operators of `torch.profiler` by their own time, each under the first named ancestor that
fixes a kind (`Optimizer.step`, `aten::layer_norm`, a backward node's name, ...). Times are
per step. XLA:CPU runs independent operations at once, on threads that share the cores; each
instant is split evenly among the operations running then, so that JAX's kinds sum to the
time in which any ran, as PyTorch's (one operator at a time, each on every thread) do.

Imports neither JAX nor PyTorch: both workers use it. The JAX side's kinds are
`transformer_jax.aot.hlo_view.kind`'s, which `compile.py` also gives each kernel of a step.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
import glob
import gzip
import json
import os
from typing import Any

from transformer_jax.aot import hlo_view

KINDS = hlo_view.KINDS


def _shared_time(
    events: list[dict[str, Any]], kinds: Mapping[str, str]
) -> tuple[collections.Counter, float]:
  """Time by kind with each instant split evenly among the operations running then (XLA:CPU
  runs independent operations at once, on threads that share the cores), and the time in
  which any ran. So kinds sum to the busy time, as PyTorch's, which runs one at a time."""
  edges = sorted(
      [(e['ts'], 1, i) for i, e in enumerate(events)]
      + [(e['ts'] + e['dur'], -1, i) for i, e in enumerate(events)]
  )
  by_kind, busy = collections.Counter(), 0.0
  active: set[int] = set()
  last = edges[0][0]
  for t, change, i in edges:
    if active and t > last:
      share = (t - last) / len(active)
      for j in active:
        by_kind[kinds[events[j]['name']]] += share
      busy += t - last
    last = t
    if change > 0:
      active.add(i)
    else:
      active.discard(i)
  return by_kind, busy


def jax_trace_breakdown(
    trace_dir: str, kinds: Mapping[str, str], steps: int, order: Iterable[str] = KINDS
) -> dict[str, Any]:
  """Milliseconds a step by kind, from the newest `jax.profiler` trace under `trace_dir`
  (`order`: the kinds reported, those `kinds` maps to).

  Returns {'kinds_ms': {kind: ms}, 'busy_ms': time any XLA operation ran (the kinds' sum),
  'idle_ms': the rest of the traced span (dispatch gaps and waits), 'span_ms', 'operations':
  a step's}.
  """
  paths = sorted(glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*', '*.trace.json.gz')))
  if not paths:
    raise FileNotFoundError(f'no *.trace.json.gz under {trace_dir}')
  with gzip.open(paths[-1]) as f:
    events = [
        e for e in json.load(f)['traceEvents'] if e.get('ph') == 'X' and e.get('name') in kinds
    ]
  if not events:
    raise ValueError(f'the trace under {trace_dir} has no operation of the step')
  by_kind, busy = _shared_time(events, kinds)
  span = max(e['ts'] + e['dur'] for e in events) - min(e['ts'] for e in events)
  per_step = lambda us: us / steps / 1e3
  return {
      'kinds_ms': {k: per_step(by_kind.get(k, 0.0)) for k in order},
      'busy_ms': per_step(busy),
      'idle_ms': per_step(span - busy),
      'span_ms': per_step(span),
      'operations': len(events) // steps,
  }


_TORCH_RULES = (
    ('optimizer', ('optimizer.step', 'clip_grad')),
    ('normalization', ('layer_norm', 'layernorm')),
    ('loss', ('log_softmax', 'logsoftmax', 'nll_loss', 'cross_entropy')),
    ('attention', ('scaled_dot_product', 'softmax', 'attention')),
    (
        'matmul',
        (
            'aten::mm',
            'aten::addmm',
            'aten::bmm',
            'aten::baddbmm',
            'aten::linear',
            'aten::matmul',
            'mmbackward',
            'addmmbackward',
            'bmmbackward',
        ),
    ),
    (
        'data movement',
        (
            'aten::copy_',
            'aten::clone',
            'aten::contiguous',
            'aten::cat',
            'aten::transpose',
            'aten::fill_',
            'aten::zero_',
            'aten::to',
            'aten::_to_copy',
            'aten::empty',
            'aten::index',
            'aten::expand',
        ),
    ),
)


def torch_kind(names: Iterable[str]) -> str:
  """The kind of a leaf operator, from its name and its ancestors' (innermost first): the
  optimizer wins wherever it is; otherwise the innermost name a rule knows."""
  names = [n.lower() for n in names]
  if any(m in n for n in names for m in _TORCH_RULES[0][1]):
    return 'optimizer'
  for n in names:
    for kind, marks in _TORCH_RULES[1:]:
      if any(
          n == m or n.startswith(m + '_') or (not m.startswith('aten::') and m in n) for m in marks
      ):
        return kind
  return 'other'


def torch_breakdown(events: Iterable[Any], steps: int, wall_s: float) -> dict[str, Any]:
  """Milliseconds a step by kind from `torch.profiler`'s events (`profile.events()`): each
  operator's self CPU time (its own, without its children's) under `torch_kind` of its
  ancestry. Their sum is the time in operators; the rest of the wall time is idle."""
  by_kind = collections.Counter()
  operations = 0
  for e in events:
    ancestry, node = [], e
    while node is not None:
      ancestry.append(node.name)
      node = node.cpu_parent
    by_kind[torch_kind(ancestry)] += e.self_cpu_time_total
    operations += not e.cpu_children
  per_step = lambda us: us / steps / 1e3
  total = sum(by_kind.values())
  return {
      'kinds_ms': {k: per_step(by_kind.get(k, 0.0)) for k in KINDS},
      'busy_ms': per_step(total),
      'idle_ms': max(wall_s * 1e3 / steps - per_step(total), 0),
      'span_ms': wall_s * 1e3 / steps,
      'operations': operations // steps,
  }

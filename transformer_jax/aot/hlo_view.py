"""A compiled step read from its optimized HLO text: its kernels, what each reads and does.

A kernel is what a device launches: a fusion, a custom call (a cuBLAS or cuDNN call), a
collective, or an unfused operation (a copy, a sort). For each one this module finds the
FLOPs of its matrix multiplies (dots and dot-like convolutions, cuBLAS calls, cuDNN fused
attention), the bytes it writes and reads (its result; its operands whole, except one that
it only gathers or slices from: what it takes), whether it passes over a [tokens, vocab]
array (writes one or reads one whole), and its kind of work from the JAX operation it came from
(`kind`). `roofline` turns them into an estimate of the step's time: each kernel takes the
longer of its FLOPs at the device's peak rate and its bytes at the device's memory
bandwidth.

That is an estimate, not a measurement. It leaves out what a real step also pays (launches
and gaps between kernels, matmuls below the peak rate) and counts an update in place as a
pass over its whole buffer. A compile without a device is also not autotuned, so the GPU's
tiles and some fusion choices differ from a real run. Its use is comparing two compiles of
the step: kernel counts, passes over the logits and bytes move the same way on the real
device.

Pure Python (no JAX): the bench's PyTorch worker reads `kind` too.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
import dataclasses
import math
import re
from typing import Any

KINDS = ('matmul', 'attention', 'normalization', 'loss', 'optimizer', 'data movement', 'other')
# A search's kinds (`decode_kind`): the encoder and the caches' set-up run once, the rest each
# step; `beam gathers` reorder the caches and hypotheses to the surviving beams, `search` is
# the rest of the search's own work (log-softmax, top-k, scores, length penalty, its loop).
DECODE_KINDS = (
    'encoder',
    'matmul',
    'output layer',
    'attention',
    'cache write',
    'normalization',
    'beam gathers',
    'search',
    'data movement',
    'other',
)

DTYPE_BYTES = {
    'pred': 1,
    's8': 1,
    'u8': 1,
    's16': 2,
    'u16': 2,
    'f16': 2,
    'bf16': 2,
    's32': 4,
    'u32': 4,
    'f32': 4,
    's64': 8,
    'u64': 8,
    'f64': 8,
    'f8e4m3fn': 1,
    'f8e5m2': 1,
    's4': 1,
    'u4': 1,
}
COLLECTIVES = (
    'all-reduce',
    'all-gather',
    'reduce-scatter',
    'all-to-all',
    'collective-permute',
    'collective-broadcast',
    'ragged-all-to-all',
)

# Operations that launch nothing: names, views, the TPU's DMAs between memory spaces
# (prefetches that overlap the kernels) and the second halves of asynchronous pairs (any
# `-done`; the `-start` of a collective is counted).
_NOT_KERNELS = frozenset(
    (
        'parameter',
        'get-tuple-element',
        'tuple',
        'bitcast',
        'constant',
        'after-all',
        'opt-barrier',
        'partition-id',
        'replica-id',
        'add-dependency',
        'domain',
        'async-update',
        'copy-start',
        'slice-start',
    )
)
_VIEW_CALLS = ('ConcatBitcast',)  # TPU custom calls that only reinterpret a buffer.
_MOVEMENT = (
    'transpose',
    'copy',
    'broadcast',
    'concatenate',
    'slice',
    'pad',
    'gather',
    'scatter',
    'reshape',
    'rev',
    'iota',
)
_ARRAY = re.compile(r'\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(
    r'\b(?:calls|to_apply|body|condition|true_computation|'
    r'false_computation)=(%[\w.\-]+(?:,\s*%[\w.\-]+)*)'
)
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')


def arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in a shape (`bf16[8,512]{1,0}` or a tuple of them)."""
  return [
      (dtype, tuple(int(d) for d in dims.split(',') if d))
      for dtype, dims in _ARRAY.findall(shape_text)
      if dtype in DTYPE_BYTES
  ]


def shape_bytes(shape_text: str) -> int:
  """Bytes of every array in a shape."""
  return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(shape_text))


def top_level(shape_text: str) -> list[str]:
  """The elements of a tuple shape `(a, (b, c), d)`; [shape_text] for an array shape."""
  text = shape_text.strip()
  if not text.startswith('('):
    return [text]
  parts, depth, begin = [], 0, 1
  for i, ch in enumerate(text):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 1:
      parts.append(text[begin:i])
      begin = i + 1
  parts.append(text[begin:-1])
  return parts


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group that opens at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in '([{':
      depth += 1
    elif text[i] in ')]}':
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One line of HLO: `%name = shape opcode(operands), attributes`."""

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  arguments: str = ''  # The text between the parentheses (a parameter's number).

  @property
  def op_name(self) -> str:
    match = _OP_NAME.search(self.attributes)
    return match.group(1) if match else ''

  def called(self) -> list[str]:
    """The computations this instruction runs (fused bodies, loop bodies, branches)."""
    names = [n for group in _CALLED.findall(self.attributes) for n in group.split(',')]
    for group in _BRANCHES.findall(self.attributes):
      names += group.split(',')
    return [n.strip().lstrip('%') for n in names if n.strip()]

  def config(self, key: str) -> str | None:
    match = re.search(r'"' + re.escape(key) + r'"\s*:\s*"?([^",}]*)', self.attributes)
    return match.group(1) if match else None


def parse_instruction(line: str) -> Instruction | None:
  text = line.strip()
  if text.startswith('ROOT '):
    text = text[5:]
  if not text.startswith('%') or ' = ' not in text:
    return None
  name, rest = text[1:].split(' = ', 1)
  end = _balanced(rest, 0) if rest.startswith('(') else rest.find(' ')
  if end <= 0:
    return None
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find('(')
  if paren <= 0 or not re.fullmatch(r'[a-z][\w\-]*', rest[:paren]):
    return None
  close = _balanced(rest, paren)
  operands = tuple(re.findall(r'%([\w.\-]+)', rest[paren + 1 : close - 1]))
  return Instruction(name, shape, rest[:paren], operands, rest[close:], rest[paren + 1 : close - 1])


def computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
  """{computation name: its instructions} and the entry computation's name."""
  found: dict[str, list[Instruction]] = {}
  entry, current = '', None
  for line in hlo_text.splitlines():
    if not line.startswith((' ', '\t')):
      header = re.match(r'^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$', line)
      if header:
        current = found.setdefault(header.group(2), [])
        entry = header.group(2) if header.group(1) else entry
      elif line.startswith('}'):
        current = None
      continue
    if current is not None:
      instruction = parse_instruction(line)
      if instruction:
        current.append(instruction)
  return found, entry


def kind(name: str, opcode: str, op_name: str) -> str:
  """The kind of work (`KINDS`) of one optimized-HLO instruction from its JAX `op_name`."""
  primitive = op_name.rsplit('/', 1)[-1]
  if 'dot_general' in primitive or opcode in ('dot', 'convolution'):
    return 'matmul'
  if opcode == 'custom-call' and 'dot_product_attention' in op_name:
    return 'attention'  # cuDNN's fused kernel, which the optimizer's rule would miss.
  if 'jvp(' not in op_name:
    return 'optimizer'  # Outside the gradient: the update, norms, checks, metrics.
  if (
      any(m in primitive for m in _MOVEMENT)
      or opcode in ('copy', 'transpose')
      or (name.split('.')[0] in ('copy', 'transpose', 'wrapped_broadcast', 'wrapped_transpose'))
  ):
    return 'data movement'
  if '/norm/' in op_name or 'final_norm' in op_name:
    return 'normalization'
  if 'attention' in op_name:
    return 'attention'
  if 'Transformer' not in op_name:
    return 'loss'  # Under the gradient but outside the model: the loss over the logits.
  return 'other'


def decode_kind(name: str, opcode: str, op_name: str) -> str:
  """The kind of work (`DECODE_KINDS`) of one instruction of a compiled search (the encoder,
  then a `while` loop of decoder steps), from its JAX `op_name`."""
  primitive = op_name.rsplit('/', 1)[-1]
  if not op_name:
    return 'other'
  if 'while/' not in op_name:
    return 'encoder'  # Before the loop: the encoder and the cross-attention caches.
  if 'output_layer' in op_name:
    return 'output layer'
  if 'dot_general' in primitive or opcode in ('dot', 'convolution'):
    return 'matmul'
  if 'Transformer' in op_name:
    if opcode == 'dynamic-update-slice' or 'dynamic_update_slice' in primitive:
      return 'cache write'
    if any(m in primitive for m in _MOVEMENT) or opcode in ('copy', 'transpose'):
      return 'data movement'
    if '/norm/' in op_name or 'final_norm' in op_name:
      return 'normalization'
    if 'attention' in op_name:
      return 'attention'
    return 'other'
  if 'take_along_axis' in op_name or 'gather' in primitive:
    return 'beam gathers'
  return 'search'


def instruction_kinds(hlo_text: str, classify: Any = None) -> dict[str, str]:
  """Instruction name -> kind, for every instruction of a compiled program's HLO text, by
  `classify(name, opcode, op_name)` (default `kind`, a train step's; `decode_kind` for a
  search)."""
  classify = classify or kind
  found, _ = computations(hlo_text)
  return {
      i.name: classify(i.name, i.opcode, i.op_name)
      for instructions in found.values()
      for i in instructions
  }


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One launch of a step (`count` of them where a loop runs it several times).

  Attributes:
    name: the HLO instruction.
    category: 'matmul' (a dot or cuBLAS call), 'fused attention' (cuDNN), 'triton' (a
      Pallas kernel), 'collective', 'fusion' or the opcode of an unfused operation.
    kind: the kind of work (`KINDS`).
    flops: of its matrix multiplies (0 where it has none).
    bytes: its operands' and result's.
    touches_logits: it writes a [tokens, vocab] array or reads one whole.
    op_name: the JAX operation it came from.
    count: how many times a step runs it.
  """

  name: str
  category: str
  kind: str
  flops: float
  bytes: int
  touches_logits: bool
  op_name: str
  count: int = 1


def _dims(attributes: str, key: str) -> list[int]:
  match = re.search(key + r'=\{([\d,]*)\}', attributes)
  return [int(d) for d in match.group(1).split(',') if d] if match else []


def _dot_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
  out = arrays(top_level(instruction.shape)[0])
  lhs = arrays(shapes.get(instruction.operands[0], '')) if instruction.operands else []
  if not out or not lhs:
    return 0.0
  if instruction.opcode == 'dot':
    contracting = _dims(instruction.attributes, 'lhs_contracting_dims')
  else:  # A cuBLAS call: its dimension numbers are in its backend config.
    match = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', instruction.attributes)
    contracting = [int(d) for d in re.findall(r'\d+', match.group(1))] if match else []
  return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in contracting)


def _window(attributes: str, key: str, spatial: int, default: int) -> list[int]:
  match = re.search(r'\b' + key + r'=([\d_x]+)', attributes)
  if not match:
    return [default] * spatial
  return [int(v) for v in match.group(1).split('x')]


def _convolution_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
  """2 x the multiply-adds of a convolution, as XLA counts them: each output element's
  input features times the window positions that fall on input (not on padding or the holes
  of a dilation). XLA on TPU writes dots as convolutions, windows and dilations included."""
  out = arrays(top_level(instruction.shape)[0])
  operands = [arrays(shapes.get(o, '')) for o in instruction.operands[:2]]
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', instruction.attributes)
  if not out or len(operands) < 2 or not all(operands) or not labels:
    return 0.0
  (lhs, rhs), out = (o[0][1] for o in operands), out[0][1]
  lhs_labels, rhs_labels, out_labels = labels.groups()
  spatial = sum(ch.isdigit() for ch in out_labels)
  sizes = _window(instruction.attributes, 'size', spatial, 1)
  strides = _window(instruction.attributes, 'stride', spatial, 1)
  lhs_dilation = _window(instruction.attributes, 'lhs_dilate', spatial, 1)
  rhs_dilation = _window(instruction.attributes, 'rhs_dilate', spatial, 1)
  pads = re.search(r'\bpad=([\d_x-]+)', instruction.attributes)
  low = [int(p.split('_')[0]) for p in pads.group(1).split('x')] if pads else [0] * spatial
  positions = 1
  for d in range(spatial):
    extent = (lhs[lhs_labels.index(str(d))] - 1) * lhs_dilation[d]
    positions *= sum(
        1
        for o in range(out[out_labels.index(str(d))])
        for k in range(sizes[d])
        if 0 <= (p := o * strides[d] - low[d] + k * rhs_dilation[d]) <= extent
        and p % lhs_dilation[d] == 0
    )
  return (
      2.0
      * out[out_labels.index('b')]
      * out[out_labels.index('f')]
      * rhs[rhs_labels.index('i')]
      * positions
  )


def _attention_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
  """cuDNN fused attention: the score and value products ([batch, length, heads, head
  dim] operands), forward 2 of them, backward 5 (the scores are recomputed); a causal mask
  skips about half."""
  q = arrays(shapes.get(instruction.operands[0], '')) if instruction.operands else []
  k = arrays(shapes.get(instruction.operands[1], '')) if len(instruction.operands) > 1 else []
  if not q or not k or len(q[0][1]) != 4:
    return 0.0
  (batch, q_len, heads, head_dim), k_len = q[0][1], k[0][1][1]
  products = 5 if 'Backward' in instruction.attributes.split('custom_call_target=')[1][:60] else 2
  causal = 0.5 if 'CAUSAL' in (instruction.config('mask_type') or '') else 1.0
  return products * 2.0 * batch * heads * q_len * k_len * head_dim * causal


def _fused_flops(name: str, found: dict[str, list[Instruction]]) -> float:
  """FLOPs of the dots and convolutions in a fused computation and those it calls."""
  instructions = found.get(name, [])
  shapes = {i.name: i.shape for i in instructions}
  total = 0.0
  for i in instructions:
    if i.opcode == 'dot':
      total += _dot_flops(i, shapes)
    elif i.opcode == 'convolution':
      total += _convolution_flops(i, shapes)
    elif i.opcode == 'fusion':
      total += sum(_fused_flops(c, found) for c in i.called())
  return total


def _trip_count(instruction: Instruction) -> int:
  match = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', instruction.attributes)
  return int(match.group(1)) if match else 1


def kernels(
    hlo_text: str, logits_elements: int | None = None, vocab: int | None = None
) -> list[Kernel]:
  """Every kernel the entry computation launches, in order, through loops (times their
  known trip count), calls (GPU command buffers) and the costlier branch of a conditional.

  Args:
    hlo_text: a compiled program's optimized HLO (`compiled.as_text()`).
    logits_elements: the elements of one device's [tokens, vocab] logits; an array with at
      least half as many, and a dimension of at least `vocab` (one device's share of the
      vocabulary), is one (None: none is looked for).
    vocab: see `logits_elements`.
  """
  found, entry = computations(hlo_text)
  logits = (logits_elements / 2 if logits_elements else math.inf, vocab or 0)

  def launches(computation: str, count: int) -> Iterator[Kernel]:
    instructions = found.get(computation, [])
    shapes = {i.name: i.shape for i in instructions}
    for i in instructions:
      if (
          i.opcode in _NOT_KERNELS
          or i.opcode.endswith('-done')
          or _view_call(i)
          or _scalar_arithmetic(i, shapes)
      ):
        continue
      if i.opcode == 'while':
        body, condition = _loop_parts(i)
        trips = _trip_count(i)
        yield from launches(body, count * trips)
        yield from launches(condition, count * (trips + 1))
        continue
      if i.opcode == 'conditional':
        branches = [list(launches(c, count)) for c in i.called()]
        yield from max(branches, key=lambda b: sum(k.bytes + k.flops for k in b), default=[])
        continue
      if i.opcode in ('call', 'async-start'):
        for c in i.called():
          yield from launches(c, count)
        continue
      yield _kernel(i, shapes, found, logits, count)

  return list(launches(entry, 1))


def _view_call(i: Instruction) -> bool:
  return i.opcode == 'custom-call' and any(
      f'custom_call_target="{t}"' in i.attributes for t in _VIEW_CALLS
  )


def _scalar_arithmetic(i: Instruction, shapes: dict[str, str]) -> bool:
  """An unfused operation of scalars on scalars (on a TPU, its scalar unit's work: the
  random keys' arithmetic, the step counter, a loop's condition): no kernel of its own."""
  return (
      i.opcode not in ('fusion', 'custom-call', 'while', 'conditional', 'call')
      and not i.opcode.startswith('async')
      and i.opcode.removesuffix('-start') not in COLLECTIVES
      and all(
          not dims
          for shape in [i.shape] + [shapes.get(o, '') for o in i.operands]
          for _, dims in arrays(shape)
      )
  )


_PART_READERS = ('gather', 'slice', 'dynamic-slice')


def _read_bytes(i: Instruction, n: int, shape: str, found: dict[str, list[Instruction]]) -> int:
  """Bytes a kernel reads of its operand `n`: all of it, or, where its fused computation
  only gathers or slices that operand, what the gathers and slices take (the label's logit
  of each token, not the logits)."""
  if i.opcode != 'fusion' or not i.called():
    return shape_bytes(shape)
  fused = found.get(i.called()[0], [])
  parameter = next(
      (p.name for p in fused if p.opcode == 'parameter' and p.arguments.strip() == str(n)), None
  )
  views, users = {parameter}, []
  for u in fused:  # In order: a view's users come after it.
    if views.intersection(u.operands):
      if u.opcode in ('bitcast', 'reshape'):
        views.add(u.name)
      else:
        users.append(u)
  if not users or any(
      u.opcode not in _PART_READERS
      or u.operands[0] not in views
      or views.intersection(u.operands[1:])
      for u in users
  ):
    return shape_bytes(shape)
  return sum(shape_bytes(u.shape) for u in users)


def _loop_parts(instruction: Instruction) -> tuple[str, str]:
  body = re.search(r'body=%?([\w.\-]+)', instruction.attributes)
  condition = re.search(r'condition=%?([\w.\-]+)', instruction.attributes)
  return (body.group(1) if body else '', condition.group(1) if condition else '')


def _kernel(
    i: Instruction,
    shapes: dict[str, str],
    found: dict[str, list[Instruction]],
    logits: tuple[float, int],
    count: int,
) -> Kernel:
  target = re.search(r'custom_call_target="([^"]*)"', i.attributes)
  target = target.group(1) if target else ''
  base = i.opcode.removesuffix('-start')
  flops, category = 0.0, i.opcode
  if i.opcode == 'fusion':
    flops = sum(_fused_flops(c, found) for c in i.called())
    category = 'matmul' if flops else 'fusion'
  elif i.opcode in ('dot', 'convolution'):
    flops = (_dot_flops if i.opcode == 'dot' else _convolution_flops)(i, shapes)
    category = 'matmul'
  elif target.startswith('__cublas'):
    flops, category = _dot_flops(i, shapes), 'matmul'
  elif target.startswith('__cudnn$fmha'):
    flops, category = _attention_flops(i, shapes), 'fused attention'
  elif target == '__gpu$xla.gpu.triton':
    category = 'triton'  # A Pallas kernel (`fused_norm`).
  elif base in COLLECTIVES:
    category = 'collective'
  operands = [shapes.get(o, '') for o in i.operands]
  reads = [_read_bytes(i, n, shape, found) for n, shape in enumerate(operands)]
  size = shape_bytes(i.shape) + sum(reads)
  # The arrays it writes, and those it reads whole.
  touched = [i.shape] + [s for s, read in zip(operands, reads) if read == shape_bytes(s)]
  touches_logits = any(
      math.prod(dims) >= logits[0] and max(dims, default=1) >= logits[1]
      for s in touched
      for _, dims in arrays(s)
  )
  return Kernel(
      i.name,
      category,
      'matmul' if category == 'matmul' else kind(i.name, i.opcode, i.op_name),
      flops,
      size,
      touches_logits,
      i.op_name,
      count,
  )


def roofline(
    found: list[Kernel], peak_flops: float | None, bandwidth: float | None
) -> dict[str, Any]:
  """The step's kernels summed, and with a device's rates a roofline estimate of its time.

  Each kernel (collectives aside: they move data between devices, at the interconnect's
  rate) takes max(FLOPs / peak_flops, bytes / bandwidth), times its count.
  """
  on_device = [k for k in found if k.category != 'collective']
  summary: dict[str, Any] = {
      'kernels': sum(k.count for k in found),
      'matmul_kernels': sum(k.count for k in found if k.category == 'matmul'),
      'fused_attention_kernels': sum(k.count for k in found if k.category == 'fused attention'),
      'collective_kernels': sum(k.count for k in found if k.category == 'collective'),
      'triton_kernels': sum(k.count for k in found if k.category == 'triton'),
      'logits_passes': sum(k.count for k in found if k.touches_logits),
      'matmul_flops': sum(k.flops * k.count for k in found),
      'bytes_accessed': sum(k.bytes * k.count for k in on_device),
      'peak_flops': peak_flops,
      'bandwidth_bytes_per_s': bandwidth,
      'estimate_s': None,
  }
  if not peak_flops or not bandwidth:
    return summary
  by_kind: dict[str, float] = collections.defaultdict(float)
  bound = {'compute': 0, 'memory': 0}
  for k in on_device:
    by_kind[k.kind] += estimate_s(k, peak_flops, bandwidth)
    bound['compute' if k.flops / peak_flops >= k.bytes / bandwidth else 'memory'] += k.count
  summary.update(
      estimate_s=sum(by_kind.values()),
      estimate_s_by_kind={k: by_kind.get(k, 0.0) for k in KINDS},
      kernels_bound_by=bound,
  )
  return summary


def estimate_s(k: Kernel, peak_flops: float, bandwidth: float) -> float:
  """One kernel's roofline time, all its launches."""
  return max(k.flops / peak_flops, k.bytes / bandwidth) * k.count

"""Compiling the real train step (and decoder) for hardware this machine does not have.

JAX compiles ahead of time for a described device topology: libtpu (in the environment
`python -m transformer_jax.aot.aot_env DIR` makes) describes TPU slices, and the CUDA PJRT
plugin plus a GPU target config (the device facts the compiler needs:
`gpu_targets/*.txtpb`) describes GPU hosts. No accelerator, driver or data is needed.
`compile_train_step` then builds exactly what `train.py` would run for the config on that
target (the mesh, the shardings, the largest batch shape of the input pipeline) and reads off
the compiler's answers: the memory each device needs, the FLOPs, the collectives.
`largest_fitting` searches the batch that fits.

Used by `compile.py`; `bench/` uses `memory_bytes` and `largest_fitting` on a real GPU.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from transformer_jax.aot import hlo_view
from transformer_jax.checkpoints import loading
from transformer_jax.data import batching
from transformer_jax.decoding import translator
from transformer_jax.errors import ConfigError
from transformer_jax.errors import UserError
from transformer_jax.model import flops as model_flops
from transformer_jax.model import models
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.kernels import kernel_choice
from transformer_jax.runtime.partitioning import Partitioner
from transformer_jax.training import config_checks
from transformer_jax.training import optimizer
from transformer_jax.training import train_steps

GiB = 1 << 30

# Cloud TPU names -> (libtpu topology, options). A name of the form 'v5e:4x4' is passed to
# libtpu as it is (multi-host by libtpu's default of 4 chips a host for v5e/v6e).
TPU_SLICES = {
    'v3-8': ('v3:2x2', {}),
    'v4-8': ('v4:2x2x1', {}),
    'v4-32': ('v4:2x2x4', {}),
    'v5e-1': ('v5e:1x1', {'chips_per_host_bounds': [1, 1, 1]}),
    'v5e-4': ('v5e:2x2', {'chips_per_host_bounds': [2, 2, 1]}),
    'v5e-8': ('v5e:2x4', {'chips_per_host_bounds': [2, 4, 1]}),
    'v5e-16': ('v5e:4x4', {}),
    'v5e-256': ('v5e:16x16', {}),
    'v5p-8': ('v5p:2x2x1', {}),
    'v5p-32': ('v5p:2x2x4', {}),
    'v6e-8': ('v6e:2x4', {'chips_per_host_bounds': [2, 4, 1]}),
}
# High-bandwidth memory per TPU chip (Cloud TPU documentation); a chip's TensorCores share it
# when libtpu shows each core as a device (v3, and v4 without a real chip to set megacore).
TPU_HBM_PER_CHIP = {
    'TPU v3': 32 * GiB,
    'TPU v4': 32 * GiB,
    'TPU v5 lite': 16 * GiB,
    'TPU v5': 95 * GiB,  # v5p
    'TPU v5p': 95 * GiB,
    'TPU v6 lite': 32 * GiB,
}
# HBM bandwidth of one chip, bytes/s, from the Cloud TPU system-architecture pages; the
# roofline estimate (`hlo_view.roofline`) divides bytes by it. GPUs take theirs from the
# target config.
TPU_BANDWIDTH_PER_CHIP = {
    'TPU v3': 900e9,
    'TPU v4': 1200e9,
    'TPU v5 lite': 819e9,
    'TPU v5': 2765e9,
    'TPU v5p': 2765e9,
    'TPU v6 lite': 1640e9,
}
GPU_SPECS = {'H100': 'h100_sxm.txtpb', 'H200': 'h200.txtpb'}
_GPU_NAME = re.compile(r'^(?:(\d+)x)?(\d+)x(H100|H200)$', re.IGNORECASE)
_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')


@dataclasses.dataclass(frozen=True)
class Target:
  """Devices to compile for.

  Attributes:
    name: as given (`v5e-8`, `8xH100`, `2x8xH200`, `cpu`).
    devices: the target's devices (compile-only for TPU and GPU), every host's.
    memory_bytes: memory of one device (datasheet HBM for TPU, the target config's for GPU).
    platform: 'tpu', 'gpu' or 'cpu'.
    peak_flops: one device's datasheet dense bf16 FLOP/s (None where unknown, as for CPUs).
    bandwidth: one device's memory bandwidth in bytes/s (None where unknown).
  """

  name: str
  devices: tuple[Any, ...]
  memory_bytes: int
  platform: str
  peak_flops: float | None = None
  bandwidth: float | None = None

  @property
  def device_kind(self) -> str:
    return self.devices[0].device_kind

  @property
  def num_hosts(self) -> int:
    return len({d.process_index for d in self.devices})


def target_names() -> str:
  return (
      f'TPU slices {", ".join(TPU_SLICES)} (or a libtpu topology such as v5e:4x4); GPU '
      'hosts NxH100 or NxH200 (one host of N), HxNxH100 (H hosts of N); cpu (this '
      'machine)'
  )


def _aot_wheel_error(what: str, error: Exception) -> UserError:
  return UserError(
      f'Compiling for {what} needs the compile-only wheels of jax {jax.__version__}, which are '
      f'missing here ({type(error).__name__}: {str(error).splitlines()[0][:200]}); make an '
      'environment with them once, `python -m transformer_jax.aot.aot_env ~/.venv-aot`, and run '
      'this command with its Python: `~/.venv-aot/bin/python -m '
      'transformer_jax.commands.compile ...` (in a checkout, `bash scripts/setup.sh --aot` '
      'makes .venv-aot: `.venv-aot/bin/python compile.py ...`).'
  )


def _tpu_target(name: str) -> Target:
  from jax.experimental import topologies

  topology, options = TPU_SLICES.get(name, (name, {}))
  # Without a TPU, libtpu would probe the cloud metadata for these and complain.
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  # Compiling touches no chip, so several compile.py (or tests) may load libtpu at once.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  if name in TPU_SLICES:
    os.environ.setdefault('TPU_ACCELERATOR_TYPE', name.replace('v5e-', 'v5litepod-'))
  try:
    devices = topologies.get_topology_desc(topology, platform='tpu', **options).devices
  except RuntimeError as e:  # JaxRuntimeError derives from it.
    if 'invalid' in str(e).lower():
      raise ConfigError(
          f'--topology={name} is not a TPU topology libtpu knows; use one of {target_names()}.'
      ) from e
    raise _aot_wheel_error('TPU', e) from e
  kind = devices[0].device_kind
  if kind not in TPU_HBM_PER_CHIP:
    raise ConfigError(
        f'--topology={name}: no memory size known for {kind!r}; known: '
        f'{sorted(TPU_HBM_PER_CHIP)}.'
    )
  chips = collections.Counter(tuple(d.coords) for d in devices)
  cores_per_device_chip = max(chips.values())
  peak = model_flops.peak_flops(kind)
  return Target(
      name,
      tuple(devices),
      TPU_HBM_PER_CHIP[kind] // cores_per_device_chip,
      'tpu',
      peak and peak / cores_per_device_chip,
      TPU_BANDWIDTH_PER_CHIP[kind] / cores_per_device_chip,
  )


def gpu_target_config(gpu: str) -> str:
  """The text proto of a GPU kind's target config (`gpu_targets/`)."""
  path = os.path.join(os.path.dirname(__file__), 'gpu_targets', GPU_SPECS[gpu.upper()])
  with open(path, encoding='utf-8') as f:
    return f.read()


def _gpu_target(name: str, hosts: int, per_host: int, gpu: str) -> Target:
  from jax.experimental import topologies

  spec = gpu_target_config(gpu)
  try:
    devices = topologies.get_topology_desc(
        platform='cuda', topology=f'1x{hosts}x{per_host}', target_config=spec
    ).devices
  except (RuntimeError, NotImplementedError) as e:
    raise _aot_wheel_error('GPU', e) from e
  memory = int(re.search(r'device_memory_size:\s*(\d+)', spec).group(1))
  bandwidth = float(re.search(r'memory_bandwidth:\s*(\d+)', spec).group(1))
  return Target(
      name, tuple(devices), memory, 'gpu', model_flops.peak_flops(devices[0].device_kind), bandwidth
  )


def _cpu_target(name: str) -> Target:
  return Target(
      name,
      tuple(jax.devices('cpu')),
      os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'),
      'cpu',
  )


def target(name: str) -> Target:
  """The devices of a named TPU slice, GPU host layout or this machine's CPU.

  Raises:
    ConfigError: an unknown name. UserError: the compile-only wheels are missing.
  """
  if name == 'cpu':
    return _cpu_target(name)
  match = _GPU_NAME.match(name)
  if match:
    hosts, per_host, gpu = match.groups()
    return _gpu_target(name, int(hosts or 1), int(per_host), gpu)
  if name in TPU_SLICES or re.match(r'^v\d+[a-z]*[:=]\d+(x\d+)*$', name):
    return _tpu_target(name)
  raise ConfigError(f'--topology={name!r} is unknown; use one of {target_names()}.')


# --- What the compiler says. ---


def memory_bytes(compiled: Any) -> int | None:
  """Device memory a compiled program needs: arguments + outputs - donated + temporaries
  + code; None where the backend does not say."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # Not every backend implements it.
    return None
  if m is None:
    return None
  return int(
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes
      + m.temp_size_in_bytes
      + m.generated_code_size_in_bytes
  )


def memory_breakdown(compiled: Any) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {
      k: int(getattr(m, f'{k}_size_in_bytes'))
      for k in ('argument', 'output', 'alias', 'temp', 'generated_code')
  }


def compiled_flops(compiled: Any) -> float | None:
  """FLOPs of one device's compiled program, rematerialization included.

  TPU and CPU executables report them; a compile-only GPU executable does not, so its
  optimized HLO is costed with this machine's (CPU) cost analysis, which counts the same
  operations.
  """
  try:
    cost = compiled.cost_analysis()
  except Exception:
    cost = None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if cost and 'flops' in cost:
    return float(cost['flops'])
  try:
    from jax._src.lib import xla_client

    module = compiled.runtime_executable().hlo_modules()[0]
    cost = xla_client._xla.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module)
    return float(cost['flops'])
  except Exception:
    return None


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Count and result bytes on one device of each kind of collective in optimized HLO.

  The bytes are of each collective's result: for an all-gather the gathered array, for a
  reduce-scatter the device's shard, for an all-reduce the reduced array. An asynchronous
  `-start`/`-done` pair counts once; its tuple holds (operands, results, ...), of which the
  results are taken (an all-reduce's operands and results are alike).
  """
  found: dict[str, dict[str, int]] = {}
  pattern = re.compile(r'=\s*(.+?)\s+(' + '|'.join(_COLLECTIVES) + r')(-start)?\(')
  for line in hlo_text.splitlines():
    match = pattern.search(line)
    if not match:
      continue
    shape, kind, is_start = match.groups()
    if is_start and kind != 'all-reduce':
      elements = hlo_view.top_level(shape)
      shape = elements[1] if len(elements) > 1 else elements[0]
    entry = found.setdefault(kind, {'count': 0, 'bytes': 0})
    entry['count'] += 1
    entry['bytes'] += hlo_view.shape_bytes(shape)
  return found


def fused_attention_calls(hlo_text: str) -> int:
  """cuDNN fused-attention calls in compiled HLO (0 off GPU)."""
  return hlo_text.count('__cudnn$fmha')


def fused_attention_masks(hlo_text: str) -> dict[str, int]:
  """The cuDNN fused-attention calls by mask type ('PADDING', 'PADDING_CAUSAL', ...)."""
  found: dict[str, int] = {}
  for line in hlo_text.splitlines():
    if '__cudnn$fmha' in line:
      match = re.search(r'"mask_type"\s*:\s*"(\w+)"', line)
      kind = match.group(1) if match else 'unknown'
      found[kind] = found.get(kind, 0) + 1
  return found


# --- The train step for a target. ---


@contextlib.contextmanager
def _cudnn_library_named() -> Iterator[None]:
  """JAX asks the cuDNN library for its version when it traces cuDNN attention, even to
  compile for an absent GPU; without the library that is a user-fixable setup."""
  try:
    yield
  except RuntimeError as e:
    if 'cuDNN not found' not in str(e):
      raise
    raise UserError(
        "attention_implementation='cudnn' needs the cuDNN library even to compile (JAX "
        'checks its version while tracing), and this environment has none; install a cuDNN '
        'where this Python finds it (`python -m transformer_jax.aot.aot_env DIR` puts the '
        'nvidia-cudnn-cu12 wheel into the environment it makes) or '
        'compile with --config.attention_implementation=xla.'
    ) from e


def train_batch_shape(
    config: ml_collections.ConfigDict, partitioner: Partitioner, tokens_per_batch: int | None = None
) -> tuple[int, int]:
  """(global rows, length) of the input pipeline's largest training batch for `config`.

  Packed batches are all this shape; bucketed ones take the longest bucket, whose attention
  makes it the one that needs the most memory.
  """
  tokens = config.tokens_per_batch if tokens_per_batch is None else tokens_per_batch
  longest = max(config.max_source_length, config.max_target_length)
  length = (
      longest if config.packing else batching.bucket_lengths(config.bucket_boundaries, longest)[-1]
  )
  shards = partitioner.rows_multiple(config.grad_accum_steps) * partitioner.num_hosts
  return batching.rows_for(length, tokens, shards), length


@dataclasses.dataclass
class TrainStepSetup:
  """The model, optimizer and jitted train step of `config` on a target's devices."""

  config: ml_collections.ConfigDict
  partitioner: Partitioner
  model_config: TransformerConfig
  abstract_state: Any
  step: Callable

  @classmethod
  @_cudnn_library_named()
  def create(cls, config: ml_collections.ConfigDict, devices) -> 'TrainStepSetup':
    config_checks.validate_run(config, training=True)
    vocab_size = config.vocab_size or config.vocab_size_target
    partitioner = Partitioner.from_config(config, devices=list(devices))
    model_config = TransformerConfig.from_config(
        config, vocab_size=vocab_size, platform=devices[0].platform
    )
    opt_config = optimizer.OptimizerConfig.from_config(config, model_config.d_model)
    tx, schedule = optimizer.create_optimizer(opt_config)
    abstract, shardings = train_steps.abstract_state(model_config, tx, partitioner)
    step_config = train_steps.StepConfig.from_config(config, model_config)
    step = train_steps.jit_train_step(step_config, tx, schedule, partitioner, shardings)
    return cls(config, partitioner, model_config, abstract, step)

  @_cudnn_library_named()
  def compile(self, rows: int, length: int) -> tuple[Any, float]:
    """The step compiled for [rows, length] batches (both sides), and the seconds it took."""
    sharding = self.partitioner.batch_sharding
    batch = {
        k: jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding)
        for k in models.BATCH_KEYS
    }
    start = time.perf_counter()
    with self.partitioner.activate():
      compiled = self.step.lower(self.abstract_state, batch).compile()
    return compiled, time.perf_counter() - start


def is_out_of_memory(error: Exception) -> bool:
  text = str(error)
  return 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower()


def report(
    compiled: Any, compile_s: float, target: Target, model_flops_per_device: float
) -> dict[str, Any]:
  """What the compiler says about one device's program, as a JSON-able dict."""
  text = compiled.as_text()
  need = memory_bytes(compiled)
  xla = compiled_flops(compiled)
  return {
      'compile_s': round(compile_s, 1),
      'peak_bytes': need,
      'device_memory_bytes': target.memory_bytes,
      'fits': need is not None and need <= target.memory_bytes,
      'headroom_bytes': None if need is None else target.memory_bytes - need,
      'memory': memory_breakdown(compiled),
      'xla_flops': xla,
      'model_flops': model_flops_per_device,
      'xla_over_model_flops': xla / model_flops_per_device if xla else None,
      'collectives': collectives(text),
      'fused_attention_calls': fused_attention_calls(text),
      'fused_attention_masks': fused_attention_masks(text),
  }


def step_view(
    hlo_text: str,
    tgt: Target,
    logits: tuple[int, int],
    model_flops_per_device: float,
    top: int = 10,
) -> dict[str, Any]:
  """The compiled step's kernels (`hlo_view`): counts, passes over the logits, bytes, and
  on a target with known rates a roofline estimate of the step's time, the MFU that time
  would give, and the `top` kernels by their estimated time. `logits`: the elements of one
  device's logits and its share of the vocabulary (`hlo_view.kernels`)."""
  kernels = hlo_view.kernels(hlo_text, *logits)
  view = hlo_view.roofline(kernels, tgt.peak_flops, tgt.bandwidth)
  if view['estimate_s']:
    view['estimated_mfu'] = model_flops_per_device / view['estimate_s'] / tgt.peak_flops
    timed = [
        {
            **dataclasses.asdict(k),
            'estimate_s': hlo_view.estimate_s(k, tgt.peak_flops, tgt.bandwidth),
        }
        for k in kernels
    ]
    view['top_kernels'] = sorted(timed, key=lambda k: -k['estimate_s'])[:top]
  return view


def compile_train_step(
    config: ml_collections.ConfigDict,
    tgt: Target,
    *,
    tokens_per_batch: int | None = None,
    top_kernels: int = 10,
) -> dict[str, Any]:
  """Compiles `train.py`'s step for `tgt` and reports per device (see `report`), with its
  kernels (`step_view`, the `top_kernels` costliest listed).

  Raises:
    ConfigError: the config or its mesh does not suit the target (before compiling).
  """
  setup = TrainStepSetup.create(config, tgt.devices)
  rows, length = train_batch_shape(config, setup.partitioner, tokens_per_batch)
  try:
    compiled, seconds = setup.compile(rows, length)
  except Exception as e:
    if not is_out_of_memory(e):
      raise
    result = {
        'fits': False,
        'error': str(e).splitlines()[0][:500],
        'device_memory_bytes': tgt.memory_bytes,
    }
  else:
    per_device = model_flops.batch_flops(
        setup.model_config, [length] * rows, [length] * rows
    ) / len(tgt.devices)
    result = report(compiled, seconds, tgt, per_device)
    vocab = setup.model_config.vocab_size
    logits = (
        rows * length * vocab // len(tgt.devices),
        vocab // setup.partitioner.mesh.shape['tensor'],
    )
    result['kernels'] = step_view(compiled.as_text(), tgt, logits, per_device, top_kernels)
  return {
      **describe(setup, tgt),
      'batch': {'rows': rows, 'length': length, 'tokens_per_side': rows * length},
      **result,
  }


def describe(setup: TrainStepSetup, tgt: Target) -> dict[str, Any]:
  c = setup.config
  return {
      'target': tgt.name,
      'device_kind': tgt.device_kind,
      'devices': len(tgt.devices),
      'hosts': tgt.num_hosts,
      'mesh': dict(setup.partitioner.mesh.shape),
      'params': sum(math.prod(x.shape) for x in jax.tree.leaves(setup.abstract_state.params)),
      'dtype': f'{c.dtype} ({jnp.dtype(setup.model_config.dtype).name})'
      if c.dtype == 'auto'
      else c.dtype,
      'remat_policy': c.remat_policy,
      'attention_implementation': kernel_choice.attention_choice(
          c, tgt.devices[0].platform, jnp.dtype(setup.model_config.dtype).name
      ).reason,
      'grad_accum_steps': c.grad_accum_steps,
      'vocab_size': setup.model_config.vocab_size,
      'peak_flops_per_device': model_flops.peak_flops(tgt.device_kind),
  }


# --- Searching the largest batch that fits. ---


def largest_fitting(
    fits: Callable[[int], tuple[bool, int | None]],
    *,
    start: int,
    multiple: int,
    limit_bytes: int,
    time_budget_s: float,
    max_doublings: int = 6,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
  """The largest multiple of `multiple` for which `fits(n)` holds, in few probes.

  A step's memory grows about linearly with its rows, so after two probes that fit, the next
  is where the line through them meets `limit_bytes`, then just past it; bisection between
  the closest probes that fit and do not fit takes over when the line is off, until they are
  within 3%. Each probe is a compile, so this needs about 4-6 of them where doubling and
  bisection need 10 or more. The search stops when `time_budget_s` is spent and reports
  the bracket it has.

  Args:
    fits: n -> (whether it fits, bytes needed or None if the compiler refused).
    start: the first n to try.
    multiple: every n tried is a multiple of this.
    limit_bytes: the device memory the line is extrapolated to.
    time_budget_s: seconds to stop after.
    max_doublings: growth steps before giving up on finding a size that does not fit.
    log: gets a line per probe.

  Returns:
    {'largest': n or 0, 'smallest_not_fitting': n or None, 'probes': {n: bytes}, 'search_s'}.
  """
  round_down = lambda n: max(multiple, int(n) // multiple * multiple)
  began = time.perf_counter()
  probes: dict[int, int | None] = {}
  elapsed = lambda: time.perf_counter() - began

  def probe(n: int) -> bool:
    ok, probes[n] = fits(n)
    need = (
        f'needs {probes[n]:,} bytes of {limit_bytes:,}'
        if probes[n] is not None
        else 'the compiler refused it (more memory than the device has)'
    )
    log(f'{n}: {need}: {"fits" if ok else "does not fit"} ({elapsed():.0f} s)')
    return ok

  def at_limit(a: int, b: int) -> int | None:
    """Where the line through probes a and b reaches the limit."""
    if probes.get(a) is None or probes.get(b) is None or probes[b] == probes[a]:
      return None
    slope = (probes[b] - probes[a]) / (b - a)
    return round_down(b + (limit_bytes - probes[b]) / slope) if slope > 0 else None

  lo, hi, n = 0, None, round_down(start)
  for _ in range(max_doublings + 1):  # Grow until a size does not fit.
    if not probe(n):
      hi = n
      break
    fitting = sorted(r for r in probes if r <= n and probes[r] is not None)
    guess = at_limit(fitting[-2], fitting[-1]) if len(fitting) >= 2 else None
    lo, n = n, n * 2 if guess is None else round_down(max(guess, n + max(multiple, n // 32)))
    if elapsed() > time_budget_s:
      break
  while hi is not None and hi - lo > max(multiple, lo // 32) and elapsed() <= time_budget_s:
    guess = at_limit(lo, hi) if lo else None
    mid = round_down((lo + hi) // 2 if guess is None else guess)
    mid = min(max(mid, round_down(lo + max(multiple, lo // 32))), hi - multiple)
    if mid <= lo or mid >= hi:
      break
    lo, hi = (mid, hi) if probe(mid) else (lo, mid)
  return {
      'largest': lo,
      'smallest_not_fitting': hi,
      'probes': {str(k): v for k, v in sorted(probes.items())},
      'search_s': round(elapsed(), 1),
  }


def largest_train_batch(
    config: ml_collections.ConfigDict,
    tgt: Target,
    *,
    time_budget_s: float = 600.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
  """The largest `tokens_per_batch` whose train step fits a device of `tgt` (longest bucket,
  or packed rows), searched over whole rows of the batch."""
  setup = TrainStepSetup.create(config, tgt.devices)
  shards = setup.partitioner.rows_multiple(config.grad_accum_steps) * setup.partitioner.num_hosts
  rows, length = train_batch_shape(config, setup.partitioner)

  def fits(n: int) -> tuple[bool, int | None]:
    try:
      compiled, _ = setup.compile(n, length)
    except Exception as e:
      if is_out_of_memory(e):
        return False, None
      raise
    need = memory_bytes(compiled)
    return need is not None and need <= tgt.memory_bytes, need

  found = largest_fitting(
      fits,
      start=rows,
      multiple=shards,
      limit_bytes=tgt.memory_bytes,
      time_budget_s=time_budget_s,
      log=log,
  )
  return {
      'length': length,
      'largest_rows': found['largest'],
      'largest_tokens_per_batch': found['largest'] * length,
      'smallest_not_fitting_rows': found['smallest_not_fitting'],
      'probes_rows_to_bytes': found['probes'],
      'search_s': found['search_s'],
  }


# --- The decoder for a target. ---


@_cudnn_library_named()
def compile_decoder(
    config: ml_collections.ConfigDict, tgt: Target, *, batch_size: int | None = None
) -> dict[str, Any]:
  """Compiles `translate.py`'s search (beam size, length limit and batch of the config) for
  the longest source bucket on `tgt`, and reports per device."""
  config_checks.validate_run(config)
  vocab_size = config.vocab_size or config.vocab_size_target
  partitioner = Partitioner.from_config(config, devices=list(tgt.devices))
  model_config = TransformerConfig.from_config(
      config, vocab_size=vocab_size, platform=tgt.platform, deterministic=True
  )
  options = translator.DecodeOptions.from_config(config)
  params = loading.abstract_params(model_config, partitioner)
  decoder = translator.Translator(model_config, params, None, options, partitioner)
  bucket = decoder.buckets[-1]
  rows = decoder.rows_for(batch_size or options.batch_size)
  start = time.perf_counter()
  compiled = decoder.compile(rows, bucket)
  seconds = time.perf_counter() - start
  result = report(compiled, seconds, tgt, float('nan'))
  for key in ('model_flops', 'xla_over_model_flops'):
    result.pop(key)
  return {
      'rows': rows,
      'source_length': bucket,
      'beam_size': options.beam_size,
      'max_decode_len': decoder.max_decode_len(bucket),
      **result,
  }

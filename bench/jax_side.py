"""The JAX side of the benchmark: the real train step, decoding, matmul peak, token budgets.

Run by `bench.run` as a worker process (see `bench/worker.py`); its environment sets the XLA
thread flags. Everything here uses the project's own code paths: `train_steps.create_train_state`
and `train_steps.jit_train_step` for training, and the same encode -> init_cache -> search
function that `translator.search` builds, with one change: the end-of-sequence logit is
masked, so that every system generates exactly the requested number of tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
import importlib.util
import math
import os
import sys
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bench import breakdown as bench_breakdown
from bench import marian as bench_marian
from bench import worker
from bench.sizes import PAPER_CONFIGS
from bench.sizes import PAPER_TOKENS_PER_BATCH
from bench.sizes import PAPER_VOCAB_SIZE
from bench.sizes import TINY_SIZE
from transformer_jax.aot import aot
from transformer_jax.aot import hlo_view
from transformer_jax.config import base_config
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.decoding import decode
from transformer_jax.decoding import translator
from transformer_jax.interop import marian
from transformer_jax.model import flops
from transformer_jax.model import models
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.kernels import kernel_choice
from transformer_jax.model.models import Transformer
from transformer_jax.runtime import host_memory
from transformer_jax.runtime.partitioning import Partitioner
from transformer_jax.training import optimizer
from transformer_jax.training import train_steps

FIRST_ORDINARY_ID = 4  # Ids 0-3 are pad, bos, eos, unk.


# 'main': the main job's config file (`scripts/main_job.sh`), every field as it trains.
MAIN_JOB_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'bible_en_es.py'
)


# The main job's output layer (output_vocabulary='target') scores the 5,314 pieces on the
# Spanish side of the Bible corpus's training split with EOS and UNK (of 8,000); a benchmark
# of its step scores as many, EOS and UNK first (which ids does not change the time).
MAIN_JOB_OUTPUT_PIECES = 5314


def output_ids(config: ml_collections.ConfigDict) -> tuple[int, ...] | None:
  """The ids a benchmark's output layer scores: None (all) unless output_vocabulary='target'."""
  if config.output_vocabulary != 'target':
    return None
  return tuple(range(EOS_ID, EOS_ID + min(MAIN_JOB_OUTPUT_PIECES, config.vocab_size - EOS_ID)))


def main_job_config() -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location('bench_main_job_config', MAIN_JOB_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run_config(
    model: str,
    vocab_size: int,
    dtype: str = 'float32',
    remat: str = 'none',
    attention: str = '',
    overrides: Mapping[str, Any] | None = None,
) -> ml_collections.ConfigDict:
  """The run config of a benchmark model: the shipped config of the paper's 'base' or 'big'
  model, the main job's config for 'main', or `base_config()` at `TINY_SIZE` for 'tiny';
  then `overrides` (config field -> value: the GPU plan's `--variants`, which `bench.run`
  checks before any worker starts)."""
  if model == 'main':
    config = main_job_config()
  elif model == 'tiny':
    config = base_config()
    config.update(TINY_SIZE)
  else:
    config = PAPER_CONFIGS[model]()
  config.vocab_size = vocab_size
  config.dtype = dtype
  config.remat_policy = remat
  config.attention_implementation = attention
  for field, value in (overrides or {}).items():
    config[field] = value
  return config


def random_batch(
    rows: int,
    source_length: int,
    target_length: int,
    vocab_size: int,
    seed: int = 0,
    packed: bool = False,
) -> dict[str, np.ndarray]:
  """A training batch of unpadded rows of random ordinary ids, every key of `BATCH_KEYS`.

  `packed`: each row holds several examples of 20-44 tokens end to end (the last one cut at
  the row's end), as packing lays out the main job's batches; otherwise one example a row.
  """
  rng = np.random.default_rng(seed)

  def side(length):
    tokens = rng.integers(FIRST_ORDINARY_ID, vocab_size, (rows, length), dtype=np.int32)
    positions = np.empty((rows, length), np.int32)
    segments = np.empty((rows, length), np.int32)
    for row in range(rows):
      start, segment = 0, 1
      while start < length:
        size = min(int(rng.integers(20, 45)) if packed else length, length - start)
        positions[row, start : start + size] = np.arange(size)
        segments[row, start : start + size] = segment
        tokens[row, start + size - 1] = EOS_ID
        start, segment = start + size, segment + 1
    return tokens, positions, segments

  inputs, inputs_positions, inputs_segmentation = side(source_length)
  targets, targets_positions, targets_segmentation = side(target_length)
  return dict(
      inputs=inputs,
      targets=targets,
      inputs_positions=inputs_positions,
      targets_positions=targets_positions,
      inputs_segmentation=inputs_segmentation,
      targets_segmentation=targets_segmentation,
  )


def device_memory_stats() -> dict[str, Any]:
  stats = jax.local_devices()[0].memory_stats() or {}
  return {k: stats[k] for k in ('peak_bytes_in_use', 'bytes_limit') if k in stats}


class _TrainSetup:
  """The train step of `steps` for one model size and batch shape."""

  def __init__(
      self,
      model: str,
      dtype: str,
      rows: int,
      source_length: int,
      target_length: int,
      vocab_size: int,
      remat: str,
      seed: int = 0,
      attention: str = '',
      overrides: Mapping[str, Any] | None = None,
  ):
    self.config = run_config(model, vocab_size, dtype, remat, attention, overrides)
    self.model_config = TransformerConfig.from_config(
        self.config, output_ids=output_ids(self.config)
    )
    self.partitioner = Partitioner.from_config(self.config)
    opt_config = optimizer.OptimizerConfig.from_config(self.config, self.model_config.d_model)
    self.tx, self.schedule = optimizer.create_optimizer(opt_config)
    self.abstract, self.shardings = train_steps.abstract_state(
        self.model_config, self.tx, self.partitioner
    )
    self.step_config = train_steps.StepConfig(
        model=self.model_config,
        seed=seed,
        dropout_rng_impl=self.config.dropout_rng_impl,
        label_smoothing=self.config.label_smoothing,
    )
    self.step = train_steps.jit_train_step(
        self.step_config, self.tx, self.schedule, self.partitioner, self.shardings
    )
    self.shape = (rows, source_length, target_length)
    self.seed = seed

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    rows, source_length, target_length = self.shape
    sharding = self.partitioner.batch_sharding
    return {
        k: jax.ShapeDtypeStruct(
            (rows, target_length if k.startswith('targets') else source_length),
            jnp.int32,
            sharding=sharding,
        )
        for k in models.BATCH_KEYS
    }

  def compile(self) -> tuple[Any, float]:
    start = time.perf_counter()
    with self.partitioner.activate():
      compiled = self.step.lower(self.abstract, self.abstract_batch()).compile()
    return compiled, time.perf_counter() - start


class TrainTask:
  """One full training step (forward, backward, Adam update) of `train_steps.train_step`."""

  def __init__(
      self,
      model: str = 'base',
      dtype: str = 'float32',
      rows: int = 8,
      source_length: int = 64,
      target_length: int = 64,
      vocab_size: int = PAPER_VOCAB_SIZE,
      remat: str = 'none',
      attention: str = '',
      packed: bool = False,
      overrides: Mapping[str, Any] | None = None,
  ):
    self.train = _TrainSetup(
        model,
        dtype,
        rows,
        source_length,
        target_length,
        vocab_size,
        remat,
        attention=attention,
        overrides=overrides,
    )
    self.packed = packed

  def setup(self) -> dict[str, Any]:
    t = self.train
    rows, source_length, target_length = t.shape
    start = time.perf_counter()
    self.state = train_steps.create_train_state(
        t.seed, t.model_config, t.tx, t.partitioner, t.shardings
    )
    jax.block_until_ready(self.state)
    init_s = time.perf_counter() - start
    self.compiled, compile_s = t.compile()
    self.batch = t.partitioner.shard_batch(
        random_batch(
            rows, source_length, target_length, t.model_config.vocab_size, packed=self.packed
        )
    )
    start = time.perf_counter()
    self.run()
    first_step_s = time.perf_counter() - start
    return {
        'compile_s': compile_s,
        'init_s': init_s,
        'first_step_s': first_step_s,
        'params': train_steps.count_params(self.state.params),
        'source_tokens': rows * source_length,
        'target_tokens': rows * target_length,
        'model_flops': flops.batch_flops(
            t.model_config, [source_length] * rows, [target_length] * rows
        ),
        'xla_flops': aot.compiled_flops(self.compiled),
        'compiled_memory_bytes': aot.memory_bytes(self.compiled),
        'attention_implementation': kernel_choice.attention_choice(
            t.config, jax.default_backend(), np.dtype(t.model_config.dtype).name
        ).reason,
        'fused_attention_calls': aot.fused_attention_calls(self.compiled.as_text()),
        'device_memory': device_memory_stats(),
        'device': jax.devices()[0].device_kind,
        'loss_per_token': float(self.metrics['loss'] / self.metrics['tokens']),
    }

  def run(self) -> None:
    self.dispatch()
    self.wait()

  def dispatch(self) -> None:
    """Enqueues one step and returns (JAX dispatches asynchronously)."""
    self.state, self.metrics = self.compiled(self.state, self.batch)

  def wait(self) -> None:
    jax.block_until_ready((self.state, self.metrics))

  def breakdown(self, steps: int) -> dict[str, Any]:
    """Where `steps` more steps spend their time, by kind (`bench/breakdown.py`)."""
    return traced_breakdown(self.run, self.compiled.as_text(), steps)


def traced_breakdown(
    run: Any,
    hlo_text: str,
    iterations: int,
    classify: Any = hlo_view.kind,
    order: tuple[str, ...] = hlo_view.KINDS,
) -> dict[str, Any]:
  """Where `iterations` more calls of `run` spend their time, by the kinds `classify` gives
  the instructions of `hlo_text` (`bench/breakdown.py`)."""
  kinds = hlo_view.instruction_kinds(hlo_text, classify)
  with tempfile.TemporaryDirectory(prefix='bench_trace_') as directory:
    with jax.profiler.trace(directory):
      for _ in range(iterations):
        run()
    return bench_breakdown.jax_trace_breakdown(directory, kinds, iterations, order)


def fixed_length_search(
    model_config: TransformerConfig,
    params: Any,
    inputs: jax.Array,
    beam_size: int,
    output_length: int,
    alpha: float = 0.6,
) -> jax.Array:
  """Encode, create the caches and search, as `translator.search`, with EOS never chosen.

  Random weights stop at arbitrary times; masking the end-of-sequence logit makes every
  hypothesis exactly `output_length` tokens long, as min = max length does for the others.

  Returns:
    int32 [batch, output_length], the best hypothesis of each row.
  """
  model_step, cache = translator.start_decoding(
      model_config, params, inputs, decode.cache_lengths(output_length)[0]
  )

  def tokens_to_logits(tokens, cache):
    logits, cache = model_step(tokens, cache)
    return logits.at[:, EOS_ID].set(-jnp.inf), cache  # [batch, vocab]

  batch_size = inputs.shape[0]
  options = decode.SearchOptions(
      output_length, bos_id=model_config.decoder_start_id, grow_cache=translator.grow_cache
  )
  if beam_size == 1:
    sequences, _ = decode.greedy_search(tokens_to_logits, cache, batch_size, options)
    return sequences
  sequences, _ = decode.beam_search(
      tokens_to_logits, cache, batch_size, beam_size, options, alpha=alpha
  )
  return sequences[:, 0]


class DecodeTask:
  """Greedy or beam search over a batch of random sources, fixed output length.

  The model starts its decoder from a zero vector (`decoder_start='zero'`), as CTranslate2
  starts every Marian model. With `export_dir` it is also written there as a Marian
  directory (`marian.write_model`, what users export), with the sources in the exported ids,
  for the reference systems to decode; the outputs, in those ids, come with the setup facts.
  """

  def __init__(
      self,
      model: str = 'base',
      dtype: str = 'float32',
      batch: int = 32,
      source_length: int = 32,
      output_length: int = 32,
      beam_size: int = 1,
      vocab_size: int = PAPER_VOCAB_SIZE,
      attention: str = '',
      export_dir: str = '',
  ):
    config = run_config(model, vocab_size, dtype, attention=attention)
    config.decoder_start = 'zero'
    self.model_config = TransformerConfig.from_config(config, deterministic=True)
    self.shape = (batch, source_length, output_length)
    self.beam_size = beam_size
    self.export_dir = export_dir

  def setup(self) -> dict[str, Any]:
    batch, source_length, output_length = self.shape
    cfg = self.model_config
    tokens = jnp.ones((1, 8), jnp.int32)
    self.params = jax.jit(lambda rng: Transformer(cfg).init(rng, tokens, tokens)['params'])(
        jax.random.key(0)
    )
    self.inputs = jnp.asarray(random_batch(batch, source_length, 1, cfg.vocab_size)['inputs'])
    fn = jax.jit(
        lambda params, inputs: fixed_length_search(
            cfg, params, inputs, self.beam_size, output_length
        )
    )
    start = time.perf_counter()
    self.compiled = fn.lower(self.params, self.inputs).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    self.run()
    first_s = time.perf_counter() - start
    out = np.asarray(self.output)
    lengths = (out != PAD_ID).sum(axis=1)
    if not (lengths == output_length).all() or (out == EOS_ID).any():
      raise AssertionError(f'outputs are not all {output_length} tokens: {lengths}')
    info = {
        'compile_s': compile_s,
        'first_s': first_s,
        'generated_tokens': int(lengths.sum()),
        'fused_attention_calls': aot.fused_attention_calls(self.compiled.as_text()),
        'device_memory': device_memory_stats(),
        'device': jax.devices()[0].device_kind,
    }
    if self.export_dir:
      self._export()
      info['outputs'] = self._exported_ids(out).tolist()
    return info

  def _exported_ids(self, ids: np.ndarray) -> np.ndarray:
    vocab_size = self.model_config.vocab_size
    return np.asarray([marian.exported_id(i, vocab_size) for i in range(vocab_size)])[ids]

  def _export(self) -> None:
    """The model and the sources for the reference systems (once per worker)."""
    if os.path.exists(os.path.join(self.export_dir, 'config.json')):
      return
    pieces = ['<pad>', '<s>', '</s>', '<unk>'] + [
        f't{i}' for i in range(FIRST_ORDINARY_ID, self.model_config.vocab_size)
    ]
    marian.write_model(
        self.export_dir,
        nn.unbox(self.params),
        self.model_config,
        pieces,
        {},
        source_lang='src',
        target_lang='tgt',
        decoding={'beam_size': self.beam_size},
    )
    np.save(
        os.path.join(self.export_dir, bench_marian.SOURCES_FILE),
        self._exported_ids(np.asarray(self.inputs)),
    )

  def run(self) -> None:
    self.output = self.compiled(self.params, self.inputs)
    jax.block_until_ready(self.output)

  def breakdown(self, searches: int) -> dict[str, Any]:
    """Where `searches` more searches spend their time, by `hlo_view.DECODE_KINDS`."""
    return traced_breakdown(
        self.run,
        self.compiled.as_text(),
        searches,
        hlo_view.decode_kind,
        hlo_view.DECODE_KINDS,
    )


class MatmulTask:
  """Square matrix multiplies through XLA: the measured peak a step is compared with."""

  def __init__(
      self, n: int = 2048, dtype: str = 'float32', reps: int = 1, precision: str = 'default'
  ):
    self.n, self.dtype, self.reps, self.precision = n, jnp.dtype(dtype), reps, precision

  def setup(self) -> dict[str, Any]:
    n, reps = self.n, self.reps
    key_a, key_b = jax.random.split(jax.random.key(0))
    self.a = jax.random.normal(key_a, (n, n), self.dtype)
    self.b = (jax.random.normal(key_b, (n, n), jnp.float32) / math.sqrt(n)).astype(self.dtype)
    precision = jax.lax.Precision[self.precision.upper()]

    def chain(a, b):  # reps dependent multiplies, so one dispatch covers them all.
      return jax.lax.fori_loop(0, reps, lambda _, x: jnp.dot(x, b, precision=precision), a)

    start = time.perf_counter()
    self.compiled = jax.jit(chain).lower(self.a, self.b).compile()
    compile_s = time.perf_counter() - start
    self.run()
    return {
        'flops_per_iter': 2.0 * n**3 * reps,
        'compile_s': compile_s,
        'device': jax.devices()[0].device_kind,
    }

  def run(self) -> None:
    jax.block_until_ready(self.compiled(self.a, self.b))


class BudgetTask:
  """The largest token budget whose train step fits the device's memory, and runs.

  Each probe compiles the step for some rows of `length` tokens (source and target alike) and
  reads XLA's memory analysis; `aot.largest_fitting` chooses the probes (a handful of
  compiles, each long for the big model) within `time_budget_s`. The largest size found
  is then run once to confirm it. Reports tokens per side (the paper's budget,
  `PAPER_TOKENS_PER_BATCH`, is per side).
  """

  def __init__(
      self,
      model: str = 'base',
      dtype: str = 'bfloat16',
      remat: str = 'none',
      length: int = 64,
      vocab_size: int = PAPER_VOCAB_SIZE,
      limit_bytes: int | None = None,
      start_tokens: int = PAPER_TOKENS_PER_BATCH,
      max_doublings: int = 6,
      row_multiple: int = 8,
      attention: str = '',
      time_budget_s: float = 400.0,
  ):
    self.args = (model, dtype, remat, length, vocab_size)
    self.attention = attention
    self.limit_bytes = limit_bytes
    self.start_tokens, self.max_doublings = start_tokens, max_doublings
    self.multiple = row_multiple
    self.time_budget_s = time_budget_s

  def _fits(self, rows: int) -> tuple[bool, int | None]:
    model, dtype, remat, length, vocab_size = self.args
    setup = _TrainSetup(
        model, dtype, rows, length, length, vocab_size, remat, attention=self.attention
    )
    try:
      compiled, _ = setup.compile()
    except Exception as e:  # XLA may refuse to compile.
      if aot.is_out_of_memory(e):
        return False, None
      raise
    need = aot.memory_bytes(compiled)
    return need is not None and need <= self.limit_bytes, need

  def _runs(self, rows: int) -> bool:
    model, dtype, remat, length, vocab_size = self.args
    task = TrainTask(model, dtype, rows, length, length, vocab_size, remat, self.attention)
    try:
      task.setup()
      return True
    except Exception as e:
      if aot.is_out_of_memory(e):
        return False
      raise
    finally:
      del task
      jax.clear_caches()

  def setup(self) -> dict[str, Any]:
    if self.limit_bytes is None:
      self.limit_bytes = device_memory_stats().get('bytes_limit')
    if self.limit_bytes is None:
      raise RuntimeError('the device reports no memory limit; pass limit_bytes.')
    length, m = self.args[3], self.multiple
    found = aot.largest_fitting(
        self._fits,
        start=math.ceil(self.start_tokens / length / m) * m,
        multiple=m,
        limit_bytes=self.limit_bytes,
        time_budget_s=self.time_budget_s,
        max_doublings=self.max_doublings,
        log=lambda line: print(f'budget probe: rows {line}', file=sys.stderr, flush=True),
    )
    lo, confirmed = found['largest'], False
    while lo > 0 and not confirmed:
      confirmed = self._runs(lo)
      if not confirmed:
        lo = max(m, int(lo * 0.95) // m * m) if lo > m else 0
    return {
        'rows': lo,
        'length': length,
        'tokens_per_side': lo * length,
        'upper_bound_found': found['smallest_not_fitting'] is not None,
        'confirmed_by_running': confirmed,
        'smallest_not_fitting_rows': found['smallest_not_fitting'],
        'search_s': found['search_s'],
        'compiles': len(found['probes']),
        'limit_bytes': self.limit_bytes,
        'probes': found['probes'],
        'device': jax.devices()[0].device_kind,
    }

  def run(self) -> None:
    pass


def profile_tasks(tasks: Mapping[str, worker.Task], directory: str) -> None:
  """Three more iterations of each task under `jax.profiler`, into <directory>/<task name>
  (TensorBoard's profile tab or ui.perfetto.dev read it)."""
  for name, task in tasks.items():
    with jax.profiler.trace(os.path.join(directory, name)):
      for _ in range(3):
        task.run()


FACTORIES = {'train': TrainTask, 'decode': DecodeTask, 'matmul': MatmulTask, 'budget': BudgetTask}

if __name__ == '__main__':
  # As every command does (`cli.run`): the step's scratch memory is reused, not page-faulted
  # in afresh each step. TRANSFORMER_JAX_MALLOC=system measures glibc's defaults.
  host_memory.retain_freed_memory()
  worker.serve(
      FACTORIES,
      extra_exit_info=lambda: {'device_memory': device_memory_stats()},
      profile=profile_tasks,
  )

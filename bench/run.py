"""Benchmark command: every comparison in one process tree, one table, one JSON file.

    python -m bench.run [--quick] [--json=bench.json] [--threads=2] [--platform=auto]

Each system runs in its own worker process (`bench/worker.py`) whose environment fixes its
thread count: XLA's flags for JAX, `torch.set_num_threads` for PyTorch, `intra_threads` for
CTranslate2. The parent never imports JAX or PyTorch. Workers of one comparison are set up
one after the other (so compile times are not inflated by each other), then timed in
alternating rounds, so that load from elsewhere on a shared machine hits both sides alike;
each ratio is the median of the per-round ratios.

On a CPU backend: matmul peak (XLA and PyTorch), a base-model fp32 training step against
Hugging Face `MarianMTModel`, and greedy / beam-4 decoding against `generate` and
CTranslate2 (each reference is skipped when its package is not importable). On a GPU
backend: the bf16 matmul peak, base and big bf16 steps of 25,000 tokens a side, the largest
token budget that fits with and without rematerialization, and decoding at batch 32 and at
large bucketed batches; no reference systems (they would run on the host CPU).
See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import breakdown
from bench import worker
from bench.jax_side import main_job_config
from bench.jax_side import output_ids
from bench.jax_side import run_config
from bench.sizes import PAPER_TOKENS_PER_BATCH
from bench.sizes import PAPER_VOCAB_SIZE
from transformer_jax import config as config_lib
from transformer_jax.aot import hlo_view
from transformer_jax.errors import ConfigError
from transformer_jax.model import flops
from transformer_jax.model.config import TransformerConfig
from transformer_jax.runtime import host_memory
from transformer_jax.training import config_checks

GIB = 1024**3
MAIN_JOB_RSS_GOAL = 8 * GIB


class Worker:
  """A worker process of `bench/worker.py`, driven over its stdin/stdout."""

  def __init__(
      self, label: str, module: str, specs: list[dict[str, Any]], env: dict[str, str], log_dir: str
  ):
    self.label, self.specs = label, specs
    self.log_path = os.path.join(log_dir, f'{label}.log')
    self.log = open(self.log_path, 'w')
    start = time.perf_counter()
    cpus = worker_cpus(env)
    self.process = subprocess.Popen(
        [sys.executable, '-m', module, json.dumps(specs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self.log,
        env=env,
        text=True,
        bufsize=1,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    self.ready = self._receive()['ready']
    self.startup_s = time.perf_counter() - start
    print(
        f'[bench] {label}: set up in {self.startup_s:.0f} s (log: {self.log_path})',
        file=sys.stderr,
        flush=True,
    )
    self.exit_info: dict[str, Any] = {}

  def _receive(self) -> dict[str, Any]:
    line = self.process.stdout.readline()
    if not line:
      self.log.flush()
      with open(self.log_path) as f:
        tail = f.read()[-3000:]
      raise RuntimeError(f'worker {self.label} died (exit {self.process.wait()}):\n{tail}')
    return json.loads(line)

  def ok(self, task: str) -> bool:
    return task in self.ready and 'error' not in self.ready[task]

  def time(self, task: str, iters: int, chain: int = 0) -> list[float]:
    """Seconds of each of `iters` runs; with `chain`, of each run among `chain` dispatched
    back to back (tasks with `dispatch` and `wait`)."""
    command = {'task': task, 'iters': iters} | ({'chain': chain} if chain else {})
    self.process.stdin.write(json.dumps(command) + '\n')
    self.process.stdin.flush()
    return self._receive()['times']

  def breakdown(self, task: str, iters: int) -> dict[str, Any]:
    self.process.stdin.write(json.dumps({'breakdown': task, 'iters': iters}) + '\n')
    self.process.stdin.flush()
    return self._receive()['breakdown']

  def close(self) -> dict[str, Any]:
    self.process.stdin.write(json.dumps({'exit': True}) + '\n')
    self.process.stdin.flush()
    self.exit_info = self._receive()
    self.process.wait()
    self.log.close()
    return self.exit_info


def interleave(
    workers: dict[str, tuple[Worker, str]], rounds: int, iters: int, chain: int = 0
) -> dict[str, list[list[float]]]:
  """Times each (worker, task) for `iters` iterations a round, alternating the order; with
  `chain`, each iteration is `chain` runs dispatched back to back (`Worker.time`)."""
  times: dict[str, list[list[float]]] = {name: [] for name in workers}
  names = [n for n, (w, task) in workers.items() if w.ok(task)]
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      w, task = workers[name]
      times[name].append(w.time(task, iters, chain))
  return times


def summarize(rounds: list[list[float]]) -> dict[str, float] | None:
  if not rounds:
    return None
  flat = sorted(t for r in rounds for t in r)
  q = statistics.quantiles(flat, n=4) if len(flat) > 1 else [flat[0]] * 3
  return {
      'median_s': statistics.median(flat),
      'min_s': flat[0],
      'p25_s': q[0],
      'p75_s': q[2],
      'n': len(flat),
      'round_medians_s': [statistics.median(r) for r in rounds],
  }


def paired_speedup(ours: dict | None, ref: dict | None) -> float | None:
  """Median over rounds of (reference time / our time): > 1 means we are faster."""
  if not ours or not ref:
    return None
  pairs = [b / a for a, b in zip(ours['round_medians_s'], ref['round_medians_s'])]
  return statistics.median(pairs)


def best_speedup(ours: dict | None, ref: dict | None) -> float | None:
  """Reference's fastest iteration over ours: the least load-sensitive comparison."""
  if not ours or not ref:
    return None
  return ref['min_s'] / ours['min_s']


# --- Environments. ---


# Set in a JAX worker's environment: the CPUs it may run on (`worker_cpus`).
CPUS_VAR = 'BENCH_JAX_CPUS'


def jax_env(
    threads: int, platform_name: str, extra_xla_flags: str, profile_dir: str = ''
) -> dict[str, str]:
  """The JAX workers' environment. XLA:CPU has no thread-count flag: it sizes its thread
  pools by the CPUs the process may run on, so on the CPU plan the worker is pinned to
  `threads` of them (`worker_cpus`). XLA_FLAGS holds `--flag=value` tokens only: XLA stops
  reading at the first other token and silently ignores every flag after it."""
  env = dict(os.environ)
  flags = [extra_xla_flags] if extra_xla_flags else []
  if platform_name == 'cpu':
    env['JAX_PLATFORMS'] = 'cpu'
    available = sorted(os.sched_getaffinity(0))
    if threads < len(available):
      env[CPUS_VAR] = ','.join(map(str, available[:threads]))
  else:
    env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.95')
  env['XLA_FLAGS'] = ' '.join([env.get('XLA_FLAGS', '')] + flags).strip()
  bad = [t for t in env['XLA_FLAGS'].split() if not t.startswith('--')]
  if bad:
    raise SystemExit(
        f'XLA_FLAGS has {bad}: each flag is --name=value (XLA ignores every '
        'flag after a token without the dashes).'
    )
  env.update(OMP_NUM_THREADS=str(threads), TF_CPP_MIN_LOG_LEVEL='2')
  if profile_dir:
    env[worker.PROFILE_VAR] = os.path.abspath(profile_dir)
  return env


def worker_cpus(env: dict[str, str]) -> set[int] | None:
  """The CPUs `jax_env` pinned a worker to, or None for all."""
  value = env.get(CPUS_VAR, '')
  return {int(c) for c in value.split(',')} if value else None


def torch_env(threads: int) -> dict[str, str]:
  env = dict(os.environ)
  env.update(
      OMP_NUM_THREADS=str(threads),
      MKL_NUM_THREADS=str(threads),
      BENCH_THREADS=str(threads),
      TOKENIZERS_PARALLELISM='false',
      HF_HUB_OFFLINE='1',
      TRANSFORMERS_VERBOSITY='error',
      CUDA_VISIBLE_DEVICES='',
  )
  return env


def detect_backend(env: dict[str, str]) -> str:
  out = subprocess.run(
      [sys.executable, '-c', 'import jax; print(jax.default_backend())'],
      env=env,
      capture_output=True,
      text=True,
      check=True,
  )
  return out.stdout.strip().splitlines()[-1]


def importable(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


# --- Plans. ---


@dataclasses.dataclass
class Sizes:
  model: str
  vocab: int
  decode_batch: int
  decode_source: int
  decode_output: int
  matmul_n: int
  rounds: int
  train_iters: int
  decode_iters: int
  train_chain: int  # Training steps dispatched back to back in each chained round.


def cpu_sizes(quick: bool) -> Sizes:
  if quick:
    return Sizes('tiny', 1000, 8, 8, 8, 512, 2, 2, 2, 3)
  return Sizes('base', PAPER_VOCAB_SIZE, 32, 32, 32, 2048, 5, 3, 2, 5)


def model_config(model: str, vocab: int) -> TransformerConfig:
  config = run_config(model, vocab)
  return TransformerConfig.from_config(config, output_ids=output_ids(config))


def run_cpu(args, results: dict[str, Any], log_dir: str) -> None:
  s = cpu_sizes(args.quick)
  jenv = jax_env(args.threads, 'cpu', args.xla_flags, args.profile_dir)
  tenv = torch_env(args.threads)
  has_torch = importable('torch') and importable('transformers')
  has_ct2 = has_torch and importable('ctranslate2')
  results['sizes'] = dataclasses.asdict(s)
  results['references'] = {'transformers': has_torch, 'ctranslate2': has_ct2}

  # 1. Matrix-multiply peak: what both training steps are measured against.
  n = s.matmul_n
  only = set(args.only.split(',')) if args.only else {'train', 'decode'}
  group = {
      'xla': (
          Worker(
              'peak_jax', 'bench.jax_side', [dict(name='mm', kind='matmul', n=n)], jenv, log_dir
          ),
          'mm',
      )
  }
  if has_torch:
    group['torch'] = (
        Worker(
            'peak_torch', 'bench.marian', [dict(name='mm', kind='torch_matmul', n=n)], tenv, log_dir
        ),
        'mm',
    )
  times = interleave(group, s.rounds, 3)
  peak = {}
  for name, (w, task) in group.items():
    st = summarize(times[name])
    if st:
      peak[name] = w.ready[task]['flops_per_iter'] / st['min_s']
    w.close()
  results['matmul_peak_flops'] = peak
  machine_peak = max(peak.values())
  results['machine_peak_flops'] = machine_peak

  # 2. Training step, same batch, fp32; 3. decoding.
  if 'train' in only:
    run_cpu_train(args, s, results, log_dir, jenv, tenv, has_torch, machine_peak)
  if 'decode' in only:
    run_cpu_decode(args, s, results, log_dir, jenv, tenv, has_torch, has_ct2)


# The CPU plan's training sizes: (rows, length a side, vocabulary, packed rows).
CPU_TRAIN_SHAPES = {
    'base': (8, 64, PAPER_VOCAB_SIZE, False),
    # The main job's packed batches (8 rows of 128 tokens: its tokens_per_batch), its pieces.
    'main': (8, 128, main_job_config().vocab_size_target, True),
    'tiny': (4, 16, 1000, False),
}
BREAKDOWN_STEPS = 3


def torch_size(cfg: TransformerConfig) -> dict[str, Any]:
  """The reference model's dimensions and normalization, from ours."""
  return dict(
      d_model=cfg.d_model,
      heads=cfg.num_heads,
      d_ff=cfg.d_ff,
      encoder_layers=cfg.num_encoder_layers,
      decoder_layers=cfg.num_decoder_layers,
      dropout=cfg.dropout_rate,
      norm=cfg.norm_position,
  )


def run_cpu_train(args, s, results, log_dir, jenv, tenv, has_torch, machine_peak):
  """Training steps, ours against Hugging Face's of the same architecture, fp32: for each
  model size (`--models`; the main job's config and the paper's base by default)."""
  models = args.models.split(',') if args.models else (['tiny'] if args.quick else ['main', 'base'])
  results['train'] = {}
  for model in models:
    if model not in CPU_TRAIN_SHAPES:
      raise SystemExit(
          f'--models: {model!r} is not one of {sorted(CPU_TRAIN_SHAPES)} on the CPU plan.'
      )
    results['train'][model] = run_cpu_train_model(
        model, s, log_dir, jenv, tenv, has_torch, machine_peak, args
    )


def run_cpu_train_model(model, s, log_dir, jenv, tenv, has_torch, machine_peak, args):
  """Our step (the first of `--attention`) against Hugging Face's, and with
  `--glibc_malloc_too` and each further value of `--attention` another worker of ours in the
  same rounds."""
  glibc_malloc_too, attentions = args.glibc_malloc_too, args.attention.split(',')
  rows, length, vocab, packed = CPU_TRAIN_SHAPES[model]
  cfg = model_config(model, vocab)
  step_flops = flops.batch_flops(cfg, [length] * rows, [length] * rows)
  tokens = 2 * rows * length
  group = {
      'jax': (
          Worker(
              f'train_{model}_jax',
              'bench.jax_side',
              [
                  dict(
                      name='train',
                      kind='train',
                      model=model,
                      rows=rows,
                      source_length=length,
                      target_length=length,
                      vocab_size=vocab,
                      packed=packed,
                      attention=attentions[0],
                  )
              ],
              jenv,
              log_dir,
          ),
          'train',
      )
  }
  if has_torch:
    group['torch'] = (
        Worker(
            f'train_{model}_torch',
            'bench.marian',
            [
                dict(
                    name='train',
                    kind='torch_train',
                    model=model,
                    rows=rows,
                    source_length=length,
                    target_length=length,
                    vocab_size=vocab,
                    size=torch_size(cfg),
                )
            ],
            tenv,
            log_dir,
        ),
        'train',
    )
  if glibc_malloc_too:  # Our step again, with glibc's malloc defaults (host_memory.py).
    group['jax_glibc_malloc'] = (
        Worker(
            f'train_{model}_jax_glibc_malloc',
            'bench.jax_side',
            group['jax'][0].specs,
            dict(jenv, **{host_memory.ENV_VAR: 'system'}),
            log_dir,
        ),
        'train',
    )
  for attention in attentions[1:]:  # Our step with another attention_implementation.
    group[f'jax [{attention}]'] = (
        Worker(
            f'train_{model}_jax_{attention or "auto"}',
            'bench.jax_side',
            [dict(group['jax'][0].specs[0], attention=attention)],
            jenv,
            log_dir,
        ),
        'train',
    )
  times = interleave(group, s.rounds, s.train_iters)
  # The same steps dispatched back to back, as train.py runs them: JAX queues the next step
  # while one runs (its dispatch overlaps the step before), PyTorch's CPU step ends before
  # it returns. Each round one chain a worker, in the same alternating order.
  chained = interleave(group, s.rounds, 1, chain=s.train_chain)
  train = {
      'model_flops_per_step': step_flops,
      'tokens_per_step': tokens,
      'norm_position': cfg.norm_position,
      'reference': (
          'M2M100ForConditionalGeneration' if cfg.norm_position == 'pre' else 'MarianMTModel'
      ),
      'batch': (
          f'{rows} x {length} source + {length} target, no padding'
          + (' (ours packed, several examples a row)' if packed else '')
          + (
              f'; our output layer scores {cfg.output_size:,} of the {cfg.vocab_size:,} pieces, '
              "theirs all (output_vocabulary='target')"
              if cfg.output_ids is not None
              else ''
          )
      ),
  }
  for name, (w, task) in group.items():
    st = summarize(times[name])
    entry = {'setup': w.ready[task], 'startup_s': w.startup_s, 'times': st}
    entry['chained_times'] = summarize(chained[name])
    if entry['chained_times']:
      entry['chained_tokens_per_s'] = tokens / entry['chained_times']['median_s']
    if st:
      entry['tokens_per_s'] = tokens / st['median_s']
      entry['steps_per_s'] = 1 / st['median_s']
      entry['mfu'] = flops.mfu(step_flops, st['median_s'], machine_peak)
      entry['mfu_best'] = flops.mfu(step_flops, st['min_s'], machine_peak)
      entry['breakdown'] = w.breakdown(task, BREAKDOWN_STEPS)
    entry['exit'] = w.close()
    train[name] = entry
  train['speedup_vs_torch'] = paired_speedup(
      train['jax'].get('times'), train.get('torch', {}).get('times')
  )
  train['best_speedup_vs_torch'] = best_speedup(
      train['jax'].get('times'), train.get('torch', {}).get('times')
  )
  train['chain'] = s.train_chain
  train['chained_speedup_vs_torch'] = paired_speedup(
      train['jax'].get('chained_times'), train.get('torch', {}).get('chained_times')
  )
  if glibc_malloc_too:
    train['speedup_vs_glibc_malloc'] = paired_speedup(
        train['jax'].get('times'), train['jax_glibc_malloc'].get('times')
    )
  for attention in attentions[1:]:
    train[f'speedup_vs_jax [{attention}]'] = paired_speedup(
        train['jax'].get('times'), train[f'jax [{attention}]'].get('times')
    )
  return train


def same_rows(ours: list[list[int]] | None, theirs: list[list[int]] | None) -> int | None:
  """How many sentences got exactly our output tokens."""
  if ours is None or theirs is None:
    return None
  return sum(a == b for a, b in zip(ours, theirs))


def run_cpu_decode(args, s, results, log_dir, jenv, tenv, has_torch, has_ct2):
  """Decoding: batch, fixed output length, greedy and beam 4, one model in every system.

  The JAX worker exports its model (`marian.write_model`) and the sources; Hugging Face
  loads that directory and CTranslate2 converts it, so all three decode the same sentences
  with the same weights.
  """
  dec = dict(batch=s.decode_batch, source_length=s.decode_source, output_length=s.decode_output)
  beams = {'greedy': 1, 'beam4': 4}
  model_dir = os.path.join(log_dir, 'exported_model')
  workers = {
      'jax': Worker(
          'decode_jax',
          'bench.jax_side',
          [
              dict(
                  name=k,
                  kind='decode',
                  beam_size=b,
                  model=s.model,
                  vocab_size=s.vocab,
                  export_dir=model_dir,
                  **dec,
              )
              for k, b in beams.items()
          ],
          jenv,
          log_dir,
      )
  }
  # CTranslate2 twice: fp32, and its int8 weights (what it ships for CPU serving).
  refs = {
      'hf': ('hf_generate', has_torch, {}),
      'ct2': ('ct2_translate', has_ct2, {}),
      'ct2_int8': ('ct2_translate', has_ct2, {'compute_type': 'int8'}),
  }
  for name, (kind, available, extra) in refs.items():
    if available and workers['jax'].ok('greedy'):
      workers[name] = Worker(
          f'decode_{name}',
          'bench.marian',
          [
              dict(
                  name=k,
                  kind=kind,
                  beam_size=b,
                  model_dir=model_dir,
                  output_length=s.decode_output,
                  **extra,
              )
              for k, b in beams.items()
          ],
          tenv,
          log_dir,
      )
  decoding = {'shape': dict(dec, model=s.model, vocab_size=s.vocab)}
  for search in beams:
    times = interleave({name: (w, search) for name, w in workers.items()}, s.rounds, s.decode_iters)
    entry = {}
    ours = workers['jax'].ready[search].pop('outputs', None)
    for name, w in workers.items():
      st = summarize(times[name])
      outputs = w.ready[search].pop('outputs', None)
      e = {'setup': w.ready[search], 'times': st}
      if st:
        e['tokens_per_s'] = s.decode_batch * s.decode_output / st['median_s']
      extra = w.ready[search].get('run_peak_extra_bytes')
      if extra is not None:
        e['memory_per_sentence_bytes'] = extra / s.decode_batch
      if name != 'jax':
        e['same_tokens_as_ours'] = same_rows(ours, outputs)
      elif st:  # Where our search goes, by kind (hlo_view.DECODE_KINDS).
        e['breakdown'] = w.breakdown(search, BREAKDOWN_STEPS)
      entry[name] = e
    for ref in ('hf', 'ct2', 'ct2_int8'):
      entry[f'speedup_vs_{ref}'] = paired_speedup(
          entry['jax']['times'], entry.get(ref, {}).get('times')
      )
      entry[f'best_speedup_vs_{ref}'] = best_speedup(
          entry['jax']['times'], entry.get(ref, {}).get('times')
      )
    decoding[search] = entry
  decoding['exit'] = {name: w.close() for name, w in workers.items()}
  results['decode'] = decoding


def gpu_sizes(quick: bool) -> dict[str, Any]:
  if quick:  # Plumbing only: tiny shapes, which also run on a CPU with --platform=gpu.
    return dict(
        models=['tiny'],
        vocab=1000,
        length=16,
        tokens=256,
        matmul_n=512,
        matmul_reps=2,
        decode_batches=[8, 32],
        decode_source=8,
        decode_output=8,
        rounds=2,
        iters=2,
        chain=5,
        budget_doublings=3,
    )
  return dict(
      models=['base', 'big'],
      vocab=PAPER_VOCAB_SIZE,
      length=64,
      tokens=PAPER_TOKENS_PER_BATCH,
      matmul_n=8192,
      matmul_reps=10,
      decode_batches=[32, 256, 1024],
      decode_source=32,
      decode_output=32,
      rounds=3,
      iters=3,
      chain=50,
      budget_doublings=6,
  )


GPU_PARTS = ('train', 'budget', 'decode')


def parse_variants(text: str) -> list[dict[str, Any]]:
  """`--variants`: the defaults ({}) first, then one change from them per ';'-separated
  item, each item `field=value[,field=value]` of the run config. Every variant is checked
  with `config_checks.validate_run` here, before any worker starts: a typo fails in a second, not
  after the minutes of the variants before it."""
  variants: list[dict[str, Any]] = [{}]
  defaults = config_lib.base_config()
  for item in filter(None, (part.strip() for part in text.split(';'))):
    overrides = {}
    for pair in item.split(','):
      field, sep, value = pair.partition('=')
      field = field.strip()
      if not sep or field not in defaults:
        raise SystemExit(
            f'--variants: {pair!r} is not field=value of a run config field; '
            "e.g. --variants='qkv_projection=separate;logits_sum=reduce'"
        )
      default = defaults[field]
      try:
        overrides[field] = (
            value.strip().lower() in ('1', 'true', 'yes')
            if isinstance(default, bool)
            else type(default)(value.strip())
        )
      except ValueError as e:
        raise SystemExit(f'--variants: {field}={value!r}: {e}') from None
    config = config_lib.base_config()
    config.update(overrides)
    try:
      config_checks.validate_run(config)
    except ConfigError as e:
      raise SystemExit(f'--variants: {item!r}: {e}') from None
    variants.append(overrides)
  return variants


def run_gpu(args, results: dict[str, Any], log_dir: str) -> None:
  """The GPU plan; `--only`, `--models`, `--attention` and `--remat` pick a part of it, so
  that each command fits a 10-minute slot (bench/README.md lists the commands)."""
  g = gpu_sizes(args.quick)
  parts = args.only.split(',') if args.only else list(GPU_PARTS)
  unknown = set(parts) - set(GPU_PARTS)
  if unknown:
    raise SystemExit(f'--only: unknown GPU parts {sorted(unknown)}; choose from {GPU_PARTS}')
  models = args.models.split(',') if args.models else g['models']
  attentions = args.attention.split(',')
  variants = parse_variants(args.variants)
  remats = args.remat.split(',')
  env = jax_env(args.threads, 'gpu', args.xla_flags, args.profile_dir)
  results['sizes'] = g
  results['references'] = 'skipped on GPU: the reference systems would run on the host CPU'
  dtype = 'bfloat16'

  def solo(label, specs, rounds, iters, chain=0):
    """One worker at a time, so that device memory peaks are its own. With `chain`, each
    task is also timed over `chain` runs dispatched back to back ('<name>/chained')."""
    w = Worker(label, 'bench.jax_side', specs, env, log_dir)
    times = {
        spec['name']: summarize(
            interleave({spec['name']: (w, spec['name'])}, rounds, iters)[spec['name']]
        )
        for spec in specs
        if spec['kind'] != 'budget'
    }
    for spec in specs if chain else ():
      if w.ok(spec['name']):
        times[spec['name'] + '/chained'] = summarize([w.time(spec['name'], 2, chain)])
    exit_info = w.close()
    return w.ready, times, exit_info

  ready, times, _ = solo(
      'peak_gpu',
      [
          dict(
              name='bf16', kind='matmul', n=g['matmul_n'], dtype='bfloat16', reps=g['matmul_reps']
          ),
          dict(
              name='fp32',
              kind='matmul',
              n=g['matmul_n'],
              dtype='float32',
              reps=g['matmul_reps'],
              precision='highest',
          ),
      ],
      g['rounds'],
      3,
  )
  peak = {k: ready[k]['flops_per_iter'] / times[k]['min_s'] for k in times if times[k]}
  results['matmul_peak_flops'] = peak
  results['machine_peak_flops'] = peak['bf16']
  device = ready['bf16'].get('device', '')
  datasheet = flops.peak_flops(device)
  results['device'] = device
  results['datasheet_bf16_flops'] = datasheet

  rows = -(-g['tokens'] // g['length'])
  rows = -(-rows // 8) * 8
  label = lambda name, attention: name + (f' [{attention}]' if attention else '')
  train, budgets = {}, {}
  for model in models:
    cfg = model_config(model, g['vocab'])
    step_flops = flops.batch_flops(cfg, [g['length']] * rows, [g['length']] * rows)
    runs = [(a, v) for a in attentions for v in variants] if 'train' in parts else []
    for attention, overrides in runs:
      change = ','.join(f'{k}={v}' for k, v in overrides.items())
      ready, times, exit_info = solo(
          f'train_{model}_{attention or "auto"}' + (f'_{change}' if change else ''),
          [
              dict(
                  name='train',
                  kind='train',
                  model=model,
                  dtype=dtype,
                  rows=rows,
                  source_length=g['length'],
                  target_length=g['length'],
                  vocab_size=g['vocab'],
                  attention=attention,
                  overrides=overrides,
              )
          ],
          g['rounds'],
          g['iters'],
          chain=g['chain'],
      )
      entry = {
          'setup': ready['train'],
          'times': times.get('train'),
          'exit': exit_info,
          'chained_times': times.get('train/chained'),
          'chain': g['chain'],
          'model_flops_per_step': step_flops,
          'tokens_per_step': 2 * rows * g['length'],
          'batch': f'{rows} x {g["length"]} source + {g["length"]} target, bf16',
      }
      if entry['times']:
        entry['tokens_per_s'] = entry['tokens_per_step'] / entry['times']['median_s']
        entry['mfu'] = flops.mfu(step_flops, entry['times']['median_s'], peak['bf16'])
      if entry['chained_times']:  # Steps back to back, as training runs them.
        step_s = entry['chained_times']['median_s']
        entry['chained_tokens_per_s'] = entry['tokens_per_step'] / step_s
        entry['chained_mfu'] = flops.mfu(step_flops, step_s, peak['bf16'])
        entry['chained_mfu_datasheet'] = (
            flops.mfu(step_flops, step_s, datasheet) if datasheet else None
        )
      if change:
        entry['change'] = change
      train[label(model, attention) + (f' {{{change}}}' if change else '')] = entry
    for remat in remats if 'budget' in parts else ():
      spec = dict(
          name='budget',
          kind='budget',
          model=model,
          dtype=dtype,
          remat=remat,
          length=g['length'],
          vocab_size=g['vocab'],
          start_tokens=g['tokens'],
          max_doublings=g['budget_doublings'],
          attention=attentions[0],
      )
      if args.memory_limit_gib:
        spec['limit_bytes'] = int(args.memory_limit_gib * GIB)
      ready, _, _ = solo(f'budget_{model}_{remat}', [spec], 0, 0)
      budgets[label(f'{model}/{remat}', attentions[0])] = ready['budget']
  results['train'] = train
  results['token_budget'] = budgets

  decoding = {}
  for batch in g['decode_batches'] if 'decode' in parts else ():
    for attention in attentions:
      specs = [
          dict(
              name=label(f'{k}_b{batch}', attention),
              kind='decode',
              model=models[0],
              dtype=dtype,
              batch=batch,
              source_length=g['decode_source'],
              output_length=g['decode_output'],
              beam_size=b,
              vocab_size=g['vocab'],
              attention=attention,
          )
          for k, b in (('greedy', 1), ('beam4', 4))
      ]
      ready, times, exit_info = solo(
          f'decode_b{batch}_{attention or "auto"}', specs, g['rounds'], g['iters']
      )
      for spec in specs:
        t = times.get(spec['name'])
        decoding[spec['name']] = {
            'setup': ready[spec['name']],
            'times': t,
            'exit': exit_info,
            'tokens_per_s': batch * g['decode_output'] / t['median_s'] if t else None,
        }
  results['decode'] = decoding


# --- The table. ---


def _fmt(x, spec='.1f', scale=1.0, suffix=''):
  return '-' if x is None else f'{x * scale:{spec}}{suffix}'


def train_table(lines: list[str], model: str, t: dict[str, Any]) -> None:
  """The CPU plan's rows for one training comparison, and where each step's time goes."""
  add = lines.append
  row = '{:<34} {:>14} {:>14} {:>14}'
  add(
      f"Training step ({model}, {t['norm_position']}-norm, fp32, {t['batch']}; "
      f"{t['model_flops_per_step'] / 1e9:.1f} model GFLOP/step)"
  )
  add(row.format('', 'JAX (ours)', f"HF {t['reference'][:11]}", 'ours/theirs'))
  j, p = t['jax'], t.get('torch', {})
  add(
      row.format(
          'tokens/s (source+target)',
          _fmt(j.get('tokens_per_s')),
          _fmt(p.get('tokens_per_s')),
          _fmt(t['speedup_vs_torch'], '.2f', 1, 'x'),
      )
  )
  add(
      row.format(
          f"  {t['chain']} steps back to back",
          _fmt(j.get('chained_tokens_per_s')),
          _fmt(p.get('chained_tokens_per_s')),
          _fmt(t['chained_speedup_vs_torch'], '.2f', 1, 'x'),
      )
  )
  add(
      row.format(
          'steps/s', _fmt(j.get('steps_per_s'), '.2f'), _fmt(p.get('steps_per_s'), '.2f'), ''
      )
  )
  add(
      row.format(
          'step time, median s',
          _fmt((j.get('times') or {}).get('median_s'), '.3f'),
          _fmt((p.get('times') or {}).get('median_s'), '.3f'),
          '',
      )
  )
  add(
      row.format(
          'step time, best s',
          _fmt((j.get('times') or {}).get('min_s'), '.3f'),
          _fmt((p.get('times') or {}).get('min_s'), '.3f'),
          _fmt(t['best_speedup_vs_torch'], '.2f', 1, 'x'),
      )
  )
  add(
      row.format(
          'MFU vs machine matmul peak', _fmt(j.get('mfu'), '.1%'), _fmt(p.get('mfu'), '.1%'), ''
      )
  )
  add(
      row.format(
          'MFU at the best step', _fmt(j.get('mfu_best'), '.1%'), _fmt(p.get('mfu_best'), '.1%'), ''
      )
  )
  add(
      row.format(
          'compile s / first step s',
          f"{_fmt(j['setup'].get('compile_s'))} / {_fmt(j['setup'].get('first_step_s'))}",
          f"- / {_fmt(p.get('setup', {}).get('first_step_s'))}",
          '',
      )
  )
  add(
      row.format(
          'peak RSS GiB',
          _fmt(j['exit']['peak_rss_bytes'], '.2f', 1 / GIB),
          _fmt(p.get('exit', {}).get('peak_rss_bytes'), '.2f', 1 / GIB),
          '',
      )
  )
  add(
      f'  main job (JAX train) peak RSS goal < 8 GiB: '
      f"{'met' if j['exit']['peak_rss_bytes'] < MAIN_JOB_RSS_GOAL else 'NOT met'}"
  )
  if 'jax_glibc_malloc' in t:
    g = t['jax_glibc_malloc']
    add(
        row.format(
            'ours, glibc malloc defaults',
            _fmt(g.get('tokens_per_s')),
            '',
            _fmt(t['speedup_vs_glibc_malloc'], '.2f', 1, 'x'),
        )
    )
  for name in t:
    if name.startswith('jax ['):
      add(
          row.format(
              f'ours, attention_implementation={name[5:-1]!r}',
              _fmt(t[name].get('tokens_per_s')),
              '',
              _fmt(t[f'speedup_vs_{name}'], '.2f', 1, 'x'),
          )
      )
  jb, pb = j.get('breakdown'), p.get('breakdown')
  if jb:
    add(f'  where a step goes, ms (profiled, {BREAKDOWN_STEPS} steps; bench/breakdown.py):')
    for kind in breakdown.KINDS:
      add(
          row.format(
              f'    {kind}',
              _fmt(jb['kinds_ms'][kind], '.1f'),
              _fmt(pb['kinds_ms'][kind] if pb else None, '.1f'),
              '',
          )
      )
    add(
        row.format(
            '    idle (no operation running)',
            _fmt(jb['idle_ms'], '.1f'),
            _fmt(pb['idle_ms'] if pb else None, '.1f'),
            '',
        )
    )
    add(
        row.format(
            '    operations a step', str(jb['operations']), str(pb['operations']) if pb else '-', ''
        )
    )
  add('')


def table(results: dict[str, Any]) -> str:
  lines = []
  add = lines.append
  env = results['environment']
  add(
      f"transformer_jax benchmark ({env['backend']}, {env['threads']} threads, "
      f"{env['cpu']}); load average {env['load_before'][0]:.2f} before, "
      f"{env['load_after'][0]:.2f} after (1 min)"
  )
  add('')
  peak = results['matmul_peak_flops']
  add(
      'Matrix-multiply peak (measured): '
      + ', '.join(f'{k} {v / 1e9:.1f} GFLOP/s' for k, v in peak.items())
      + f"; MFU below is against {results['machine_peak_flops'] / 1e9:.1f} GFLOP/s"
  )
  add('')
  row = '{:<34} {:>14} {:>14} {:>14} {:>10}'
  if env['plan'] == 'cpu' and 'train' in results:
    for model, t in results['train'].items():
      train_table(lines, model, t)
  if env['plan'] == 'cpu' and 'decode' in results:
    d = results['decode']
    add(
        f"Decoding ({results['sizes']['model']}, fp32, batch {d['shape']['batch']}, source "
        f"{d['shape']['source_length']}, exactly {d['shape']['output_length']} generated "
        'tokens; generated tokens/s of the best hypothesis)'
    )
    systems = ('jax', 'hf', 'ct2', 'ct2_int8')
    row5 = '{:<20} {:>11} {:>11} {:>11} {:>9} {:>9} {:>9} {:>9} {:>12}'
    add(
        row5.format(
            '',
            'JAX (ours)',
            'HF generate',
            'CTranslate2',
            'CT2 int8',
            'ours/HF',
            'ours/CT2',
            '/CT2 int8',
            'JAX compile s',
        )
    )
    for search in ('greedy', 'beam4'):
      e = d[search]
      add(
          row5.format(
              search,
              *[_fmt(e.get(k, {}).get('tokens_per_s')) for k in systems],
              *[_fmt(e.get(f'speedup_vs_{k}'), '.2f', 1, 'x') for k in systems[1:]],
              _fmt(e['jax']['setup'].get('compile_s')),
          )
      )
      add(
          row5.format(
              '  best iteration',
              *[''] * len(systems),
              *[_fmt(e.get(f'best_speedup_vs_{k}'), '.2f', 1, 'x') for k in systems[1:]],
              '',
          )
      )
    blank = [''] * len(systems)
    add(
        row5.format(
            'peak RSS GiB',
            *[_fmt(d['exit'].get(k, {}).get('peak_rss_bytes'), '.2f', 1 / GIB) for k in systems],
            *blank,
        )
    )
    for search in ('greedy', 'beam4'):
      e = d[search]
      add(
          row5.format(
              f'{search} MiB/sentence',
              *[
                  _fmt(e.get(k, {}).get('memory_per_sentence_bytes'), '.1f', 1 / 2**20)
                  for k in systems
              ],
              *blank,
          )
      )
      same = [e.get(k, {}).get('same_tokens_as_ours') for k in systems[1:]]
      add(
          row5.format(
              f'{search} same as ours',
              '',
              *['-' if n is None else f"{n}/{d['shape']['batch']}" for n in same],
              *blank,
          )
      )
    searches = [k for k in ('greedy', 'beam4') if d[k]['jax'].get('breakdown')]
    if searches:
      kinds_row = '{:<34}' + ' {:>16}' * len(searches)
      add(
          f'  where our search goes, ms a search (profiled, {BREAKDOWN_STEPS} searches; '
          'bench/breakdown.py):'
      )
      add(kinds_row.format('', *searches))
      found = [d[k]['jax']['breakdown'] for k in searches]
      for kind in hlo_view.DECODE_KINDS:
        cells = [
            f"{b['kinds_ms'][kind]:.1f} ({100 * b['kinds_ms'][kind] / b['span_ms']:.0f}%)"
            for b in found
        ]
        add(kinds_row.format(f'    {kind}', *cells))
      add(
          kinds_row.format(
              '    idle (no operation running)',
              *[f"{b['idle_ms']:.1f} ({100 * b['idle_ms'] / b['span_ms']:.0f}%)" for b in found],
          )
      )
    add(
        '  One model in all three: ours exported (marian.write_model); Hugging Face loads '
        'it, CTranslate2 converts it (and runs it with int8 weights too). MiB/sentence: the '
        'memory one more search adds at its peak, over the batch.'
    )
  if env['plan'] == 'gpu':
    datasheet = results.get('datasheet_bf16_flops')
    add(
        f"{results.get('device', '')}: datasheet bf16 dense "
        + (f'{datasheet / 1e12:.0f} TFLOP/s' if datasheet else 'unknown to flops.py')
    )
    add(row.format('Training step, bf16', 'tokens/s', 'MFU', 'compile s', 'peak GiB'))
    for model, e in results['train'].items():
      fused = e['setup'].get('fused_attention_calls')
      if fused:
        model = f'{model} ({fused} cuDNN attention calls)'

      mem = e['exit'].get('device_memory', {}).get('peak_bytes_in_use')
      add(
          row.format(
              f"{model}: {e['batch']}",
              _fmt(e.get('tokens_per_s'), '.0f'),
              _fmt(e.get('mfu'), '.1%'),
              _fmt(e['setup'].get('compile_s')),
              _fmt(mem, '.1f', 1 / GIB),
          )
      )
      if e.get('chained_times'):
        add(
            row.format(
                f"  {e['chain']} steps back to back",
                _fmt(e['chained_tokens_per_s'], '.0f'),
                _fmt(e['chained_mfu'], '.1%'),
                f"{_fmt(e['chained_mfu_datasheet'], '.1%')} of datasheet",
                '',
            )
        )
      if 'error' in e['setup']:
        add(f"  {model}: {e['setup']['error']}")
    add('')
    add(row.format('Largest token budget', 'tokens/side', 'rows x len', 'confirmed', ''))
    for key, b in results['token_budget'].items():
      if 'error' in b:
        add(f'  {key}: {b["error"]}')
        continue
      add(
          row.format(
              f'{key} (model/remat)',
              b['tokens_per_side'],
              f"{b['rows']} x {b['length']}",
              str(b['confirmed_by_running']),
              f"{b.get('compiles', '?')} compiles, {_fmt(b.get('search_s'), '.0f')} s",
          )
      )
    add('')
    add(row.format('Decoding, bf16', 'tokens/s', 'compile s', '', ''))
    for name, e in results['decode'].items():
      add(
          row.format(
              name, _fmt(e['tokens_per_s'], '.0f'), _fmt(e['setup'].get('compile_s')), '', ''
          )
      )
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='tiny sizes, few iterations')
  parser.add_argument('--json', default='', help='write all results to this path')
  parser.add_argument('--threads', type=int, default=2)
  parser.add_argument(
      '--platform',
      choices=('auto', 'cpu', 'gpu'),
      default='auto',
      help="'gpu' runs the GPU plan on whatever backend JAX has",
  )
  parser.add_argument(
      '--xla_flags',
      '--xla-flags',
      default='',
      help='extra XLA_FLAGS for the JAX workers (experiments)',
  )
  parser.add_argument(
      '--only',
      default='',
      help='comma-separated parts: train,decode on the CPU plan; '
      'train,budget,decode on the GPU plan (the matmul peak always runs)',
  )
  parser.add_argument(
      '--models',
      default='',
      help="comma-separated model sizes to train: CPU plan 'main' (the main "
      "job's config), 'base', 'tiny' (default 'main,base'; --quick 'tiny'); "
      "GPU plan 'base', 'big' (default 'base,big')",
  )
  parser.add_argument(
      '--glibc_malloc_too',
      '--glibc-malloc-too',
      action='store_true',
      help="CPU plan: also time our training step with glibc's malloc "
      'defaults (TRANSFORMER_JAX_MALLOC=system), side by side',
  )
  parser.add_argument(
      '--attention',
      default='',
      help='comma-separated attention_implementation values to compare, e.g. '
      "'xla,cudnn' ('' is automatic, the default: cuDNN on a GPU where it can "
      'serve, the explicit softmax on a CPU); on the CPU plan the first is ours '
      'and each further one another worker timed in the same rounds',
  )
  parser.add_argument(
      '--variants',
      default='',
      help='GPU plan: training steps with one change from the defaults each, after the '
      "defaults: ';'-separated field=value[,field=value] of the run config, e.g. "
      "'qkv_projection=separate;logits_sum=reduce'",
  )
  parser.add_argument(
      '--profile_dir',
      '--profile-dir',
      default='',
      help='after timing, trace 3 more iterations of each JAX task with '
      'jax.profiler into DIR/<task> (TensorBoard, Perfetto)',
  )
  parser.add_argument(
      '--log_dir',
      '--log-dir',
      default='',
      help="keep the workers' logs here (default: a temporary directory)",
  )
  parser.add_argument(
      '--remat', default='none,full', help='GPU plan: remat policies of the token-budget search'
  )
  parser.add_argument(
      '--memory_limit_gib',
      '--memory-limit-gib',
      type=float,
      default=0,
      help='token-budget limit when the device reports none (CPU)',
  )
  args = parser.parse_args(argv)

  backend = detect_backend(jax_env(args.threads, 'auto', ''))
  plan = backend if args.platform == 'auto' else args.platform
  plan = 'cpu' if plan == 'cpu' else 'gpu'
  results: dict[str, Any] = {
      'environment': {
          'backend': backend,
          'plan': plan,
          'threads': args.threads,
          'cpu': platform.processor() or platform.machine(),
          'cpus': os.cpu_count(),
          'load_before': os.getloadavg(),
          'quick': args.quick,
          'xla_flags': args.xla_flags,
          'python': sys.version.split()[0],
      }
  }
  try:
    with open('/proc/cpuinfo') as f:
      names = [line.split(':', 1)[1].strip() for line in f if line.startswith('model name')]
    results['environment']['cpu'] = names[0] if names else results['environment']['cpu']
  except OSError:
    pass
  start = time.perf_counter()
  if args.log_dir:  # Kept: each worker's log, written as it goes (budget probes too).
    os.makedirs(args.log_dir, exist_ok=True)
    (run_cpu if plan == 'cpu' else run_gpu)(args, results, args.log_dir)
  else:
    with tempfile.TemporaryDirectory(prefix='bench_logs_') as log_dir:
      (run_cpu if plan == 'cpu' else run_gpu)(args, results, log_dir)
  results['environment']['load_after'] = os.getloadavg()
  results['environment']['wall_s'] = time.perf_counter() - start
  results['environment']['parent_peak_rss_bytes'] = (
      __import__('resource').getrusage(__import__('resource').RUSAGE_SELF).ru_maxrss * 1024
  )
  text = table(results)
  results['table'] = text
  print(text)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1, default=str)
    print(f'\nwrote {args.json}')
  return results


if __name__ == '__main__':
  main()

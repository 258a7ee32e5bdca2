"""`python -m bench.run --quick`: the decoding comparison runs one model in every system.

The JAX side exports its model (`marian.write_model`); Hugging Face's `MarianMTModel` loads
the directory and CTranslate2 converts it, so greedy search must give our tokens in both
(a tiny random model; a near-tie on another CPU may split one sentence, never most).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import train_testlib
from transformer_jax.aot import hlo_view

pytestmark = pytest.mark.slow  # the benchmarks, through subprocesses.


# The reference systems come with the test extra (`pip install -e .[test]`, which the README's
# test command runs); without them the bench has nothing to compare against.
needs_references = pytest.mark.skipif(
    importlib.util.find_spec('transformers') is None,
    reason='Hugging Face transformers, the reference side, is not installed: '
    "pip install -e '.[test]' (the README's test command does)",
)


def run_bench(tmp_path, *args: str) -> tuple[dict, str]:
  """`python -m bench.run ARGS --json=...`: its JSON results and its table."""
  out = tmp_path / 'bench.json'
  result = subprocess.run(
      [sys.executable, '-m', 'bench.run', *args, f'--json={out}'],
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(out.read_text()), result.stdout


@needs_references
def test_quick_decoding_bench_runs_our_exported_model_in_every_system(tmp_path):
  results, table = run_bench(
      tmp_path,
      '--quick',
      '--only=decode',
      f'--log_dir={tmp_path / "logs"}',
      f'--profile_dir={tmp_path / "profile"}',
  )
  decode = results['decode']
  batch = decode['shape']['batch']
  systems = ['jax', 'hf', 'ct2']  # The test extra installs both references.
  for search in ('greedy', 'beam4'):
    for name in [*systems, 'ct2_int8']:  # int8 weights: other outputs, so only timed.
      entry = decode[search][name]
      assert entry['tokens_per_s'] > 0 and entry['memory_per_sentence_bytes'] >= 0, name
    assert decode[search]['ct2_int8']['setup']['compute_type'] == 'int8'
    for name in systems[1:]:
      same = decode[search][name]['same_tokens_as_ours']
      assert same >= (batch - 1 if search == 'greedy' else batch // 2), (search, name, same)
    assert decode[search]['speedup_vs_hf'] > 0
    # Where our search goes: every kind reported, summing to the time any operation ran.
    found = decode[search]['jax']['breakdown']
    assert set(found['kinds_ms']) == set(hlo_view.DECODE_KINDS)
    assert sum(found['kinds_ms'].values()) == pytest.approx(found['busy_ms'], rel=1e-6)
    assert found['kinds_ms']['matmul'] > 0 and found['kinds_ms']['search'] > 0, found
  assert decode['beam4']['jax']['breakdown']['kinds_ms']['beam gathers'] > 0
  assert 'same as ours' in table and 'MiB/sentence' in table
  assert 'where our search goes' in table and 'beam gathers' in table and 'CT2 int8' in table
  # --profile_dir: the JAX worker traced its tasks after timing them.
  traced = {
      p.parent.parent.parent.parent.name
      for p in (tmp_path / 'profile').glob('*/plugins/profile/*/*.xplane.pb')
  }
  assert {'greedy', 'beam4'} <= traced, traced


@needs_references
def test_training_bench_at_the_main_jobs_size_against_the_pre_norm_reference(tmp_path):
  """`--models=main`: the main job's config (pre-norm, packed rows) against Hugging Face's
  pre-norm M2M100 of the same size, with each step's time by kind on both sides; with
  `--attention=,xla` also our step with jax.nn's XLA attention, in the same rounds."""
  results, table = run_bench(
      tmp_path, '--quick', '--only=train', '--models=main', '--attention=,xla'
  )
  train = results['train']['main']
  assert train['norm_position'] == 'pre'
  assert train['reference'] == 'M2M100ForConditionalGeneration'
  assert train['tokens_per_step'] == 2 * 1024 and train['speedup_vs_torch'] > 0
  # The same steps also dispatched back to back, as train.py runs them, on both sides.
  assert train['chain'] == 3 and train['chained_speedup_vs_torch'] > 0
  assert '3 steps back to back' in table
  for side in ('jax', 'torch'):
    entry = train[side]
    assert entry['tokens_per_s'] > 0 and entry['setup']['loss_per_token'] > 0, side
    assert entry['chained_times']['n'] == 2 and entry['chained_tokens_per_s'] > 0, side
    kinds = entry['breakdown']['kinds_ms']
    # Every kind of work shows up on both sides, and the kinds account for the busy time
    # (which kind is largest is a timing, and differs between CPUs: it is never asserted).
    assert all(
        kinds[k] > 0 for k in ('matmul', 'attention', 'normalization', 'loss', 'optimizer')
    ), (side, kinds)
    breakdown = entry['breakdown']
    assert sum(kinds.values()) == pytest.approx(breakdown['busy_ms'], rel=1e-6), (side, kinds)
    if side == 'jax':  # The union of the operations' intervals lies within their span.
      assert breakdown['busy_ms'] <= breakdown['span_ms'] * (1 + 1e-6), breakdown
  assert 'where a step goes' in table and 'M2M100' in table
  # Each worker trained with its own attention: automatic (on a CPU the explicit softmax) and
  # jax.nn's, the same loss to rounding from the same parameters and batch.
  xla = train['jax [xla]']
  assert train['jax']['setup']['attention_implementation'].startswith('explicit softmax')
  assert xla['setup']['attention_implementation'] == 'XLA attention, as configured'
  assert xla['tokens_per_s'] > 0 and train['speedup_vs_jax [xla]'] > 0
  assert xla['setup']['loss_per_token'] == pytest.approx(
      train['jax']['setup']['loss_per_token'], rel=1e-5
  )
  assert "ours, attention_implementation='xla'" in table


def test_gpu_plan_times_steps_back_to_back_besides_blocked_ones(tmp_path):
  """The GPU plan's training part, run on the CPU (`--platform=gpu --quick`): each step
  blocked on, and `chain` steps dispatched back to back as the training loop runs them."""
  results, table = run_bench(tmp_path, '--platform=gpu', '--quick', '--only=train')
  entry = results['train']['tiny']
  assert entry['chain'] == 5 and entry['chained_times']['n'] == 2
  assert entry['chained_tokens_per_s'] > 0 and entry['chained_mfu'] > 0
  # A CPU has no datasheet bf16 rate in flops.py; a GPU's MFU is also given against it.
  assert results['datasheet_bf16_flops'] is None and entry['chained_mfu_datasheet'] is None
  assert '5 steps back to back' in table


def test_jax_workers_get_the_extra_xla_flags_and_their_cpus(tmp_path):
  sys.path.insert(0, str(train_testlib.REPO))
  from bench import run as bench_run

  dump = tmp_path / 'dump'
  env = bench_run.jax_env(1, 'cpu', f'--xla_dump_to={dump}')
  # XLA reads the flag (it used to follow a token without dashes, after which XLA reads
  # nothing): the dump it asks for is written.
  subprocess.run(
      [sys.executable, '-c', 'import jax; jax.jit(lambda x: x * 2)(1.0)'],
      env=env,
      check=True,
      timeout=300,
  )
  assert list(dump.iterdir())
  with pytest.raises(SystemExit, match='--name=value'):
    bench_run.jax_env(1, 'cpu', 'xla_cpu_use_onednn=true')
  available = sorted(os.sched_getaffinity(0))
  assert bench_run.worker_cpus(bench_run.jax_env(len(available), 'cpu', '')) is None
  if len(available) > 1:
    assert bench_run.worker_cpus(bench_run.jax_env(1, 'cpu', '')) == {available[0]}


def test_checkpoint_storage_bench_runs_and_reports_both_sides(tmp_path):
  """`python -m bench.checkpoint_storage` on the tiny model, one round: its plumbing (the
  figures are in bench/RESULTS.md, never asserted)."""
  out = tmp_path / 'storage.json'
  result = subprocess.run(
      [
          sys.executable,
          '-m',
          'bench.checkpoint_storage',
          '--model=tiny',
          '--rounds=1',
          '--steps=1',
          f'--json={out}',
      ],
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'gs:// / local' in result.stdout
  rows = json.loads(out.read_text())['rows']
  assert sorted(row['where'] for row in rows) == ['gcs', 'local']
  assert all(row['save_s'] > 0 and row['restore_s'] > 0 for row in rows)


def test_gpu_plan_variants_are_one_change_each_from_the_defaults_and_checked_first():
  """`--variants`: the defaults first, then each item's changes alone, typed as the field's
  default; a field that does not exist or a value `config_checks.validate_run` refuses fails before
  any worker starts, naming the item."""
  sys.path.insert(0, str(train_testlib.REPO))
  from bench import jax_side
  from bench import run as bench_run

  variants = bench_run.parse_variants(
      'qkv_projection=separate; logits_sum=reduce,layer_norm_statistics=two_pass;'
      'dropout_rate=0.3'
  )
  assert variants == [
      {},
      {'qkv_projection': 'separate'},
      {'logits_sum': 'reduce', 'layer_norm_statistics': 'two_pass'},
      {'dropout_rate': 0.3},
  ]
  config = jax_side.run_config('tiny', 1000, overrides=variants[2])
  assert (config.logits_sum, config.layer_norm_statistics) == ('reduce', 'two_pass')
  assert jax_side.run_config('tiny', 1000).logits_sum == ''
  with pytest.raises(SystemExit, match="'qkv_projecton=separate' is not field=value"):
    bench_run.parse_variants('qkv_projecton=separate')
  with pytest.raises(SystemExit, match="'logits_sum=foo'.*not one of"):
    bench_run.parse_variants('logits_sum=foo')
  with pytest.raises(SystemExit, match='dropout_rate'):
    bench_run.parse_variants('dropout_rate=lots')


def test_the_papers_sizes_come_from_the_shipped_configs():
  """Both sides of a comparison take the paper's sizes from configs/ (`bench.sizes`): the JAX
  side's run config is the shipped one, the PyTorch side's Marian model has its dimensions."""
  from bench import jax_side
  from bench import marian
  from bench import sizes

  table_3 = {
      'base': dict(d_model=512, num_heads=8, d_ff=2048, dropout_rate=0.1),
      'big': dict(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3),
  }
  for model, expected in table_3.items():
    config = jax_side.run_config(model, 1000)
    shipped = sizes.PAPER_CONFIGS[model]()
    assert {field: config[field] for field in expected} == expected
    assert (config.num_encoder_layers, config.num_decoder_layers) == (6, 6)
    # The shipped config as it is, but for what `run_config` is given.
    assert config.to_dict() == dict(
        shipped.to_dict(),
        vocab_size=1000,
        dtype='float32',
        remat_policy='none',
        attention_implementation='',
    )
    theirs = marian.marian_config(model, 1000)
    assert (theirs.d_model, theirs.encoder_attention_heads, theirs.encoder_ffn_dim) == (
        config.d_model,
        config.num_heads,
        config.d_ff,
    )
    assert (theirs.encoder_layers, theirs.decoder_layers) == (6, 6)
  assert (sizes.PAPER_VOCAB_SIZE, sizes.PAPER_TOKENS_PER_BATCH) == (37000, 25000)

"""compile.py and `transformer_jax.aot.aot`: the real train step and decoder compiled for a TPU
slice and a GPU host this machine does not have, and for 8 CPU devices.

The TPU and GPU compiles need the compile-only wheels in .venv-aot (`bash scripts/setup.sh
--test` makes it); they take about a minute each on 2 cores. The rest runs anywhere.
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

import train_testlib
from transformer_jax.aot import aot
from transformer_jax.aot import aot_env
from transformer_jax.errors import ConfigError

AOT_PYTHON = os.path.join(train_testlib.REPO, '.venv-aot', 'bin', 'python')
COMPILE = os.path.join(train_testlib.REPO, 'compile.py')


def _compile(*flags, python=sys.executable, devices=1, timeout=600, elsewhere=None):
  """compile.py on configs/tiny.py; from the directory `elsewhere`, as a user of the installed
  package runs it: the module, and the shipped config by name."""
  command = (
      [python, '-m', 'transformer_jax.commands.compile', '--config=tiny']
      if elsewhere
      else [python, COMPILE, '--config=configs/tiny.py']
  )
  return train_testlib.run_command(
      [*command, *flags],
      cwd=elsewhere or train_testlib.REPO,
      env=train_testlib.subprocess_env(devices),
      timeout=timeout,
  )


def _aot_python() -> str:
  if not os.path.exists(AOT_PYTHON):
    pytest.fail('.venv-aot is missing: run `bash scripts/setup.sh --test` (or --aot) first.')
  return AOT_PYTHON


def _check_train_step(r: dict, devices: int, kind: str) -> None:
  assert r['devices'] == devices and r['device_kind'] == kind
  assert r['fits'] and 0 < r['peak_bytes'] < r['device_memory_bytes']
  assert r['headroom_bytes'] == r['device_memory_bytes'] - r['peak_bytes']
  # The float32 parameters and Adam's two moments, split over fsdp and tensor only.
  shards = r['mesh']['fsdp'] * r['mesh']['tensor']
  assert r['memory']['argument'] >= 3 * 4 * r['params'] // shards
  # XLA counts every operation, the model count only the matrix multiplies, so XLA's is at
  # least the model's, and tiny's TPU and GPU compiles come out well inside these bounds.
  assert 0.95 <= r['xla_over_model_flops'] < 3
  # Data parallelism: every gradient (fsdp: its shard) is all-reduced, at least 2 bytes a
  # parameter (XLA may reduce the bfloat16 gradients of the bfloat16 copies).
  assert r['collectives']['all-reduce']['bytes'] >= 2 * r['params'] // shards


def _check_kernels(train: dict, stdout: str) -> None:
  """The step's kernels (`hlo_view`) as compile.py reports them."""
  view = train['kernels']
  assert view['kernels'] > view['matmul_kernels'] >= 3, view
  # The logits' product, and its two gradients, read or write [tokens, vocab].
  assert view['logits_passes'] >= 3, view
  assert view['collective_kernels'] == sum(c['count'] for c in train['collectives'].values())
  assert view['fused_attention_kernels'] == train['fused_attention_calls']
  # The matrix products hlo_view finds are the model's, with what remat, cuDNN's backward
  # and the causal discount change: the same order.
  assert 0.5 < view['matmul_flops'] / train['model_flops'] < 2, view
  assert 0 < view['estimate_s'] and 0 < view['estimated_mfu'] < 1, view
  assert sum(view['estimate_s_by_kind'].values()) == pytest.approx(view['estimate_s'])
  assert len(view['top_kernels']) == 10 and 'roofline estimate (not a measurement' in stdout
  assert view['top_kernels'][0]['estimate_s'] >= view['top_kernels'][-1]['estimate_s']


@pytest.mark.parametrize(
    'topology,flags,kind,hosts,mesh',
    [
        # One layer a side: every kind of layer and kernel, half the program to compile.
        (
            'v5e-8',
            ['--config.num_encoder_layers=1', '--config.num_decoder_layers=1'],
            'TPU v5 lite',
            1,
            {'data': 8, 'fsdp': 1, 'tensor': 1},
        ),
        # Two hosts of 4: the mesh spans both; fsdp adds the parameter all-gathers and the
        # gradient reduce-scatters. The post-norm kernels are Pallas's, compiled by Triton, one
        # each way a sub-layer on each device's rows: one layer a side has every kind of them
        # (and compiles half as many Triton kernels as tiny's two).
        (
            '2x4xH100',
            [
                '--config.mesh.fsdp=2',
                '--config.post_norm_kernel=pallas',
                '--config.num_encoder_layers=1',
                '--config.num_decoder_layers=1',
            ],
            'NVIDIA H100 80GB HBM3',
            2,
            {'data': 4, 'fsdp': 2, 'tensor': 1},
        ),
    ],
)
@pytest.mark.slow
def test_compiles_tiny_for_a_tpu_slice_and_gpu_hosts(tmp_path, topology, flags, kind, hosts, mesh):
  out = tmp_path / 'report.json'
  # The TPU compile as the compiling guide gives it to a user of the installed package.
  result = _compile(
      f'--topology={topology}',
      *flags,
      '--decode',
      f'--json={out}',
      python=_aot_python(),
      elsewhere=str(tmp_path) if hosts == 1 else None,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'fits' in result.stdout, result.stdout
  report = json.loads(out.read_text())
  train = report['train_step']
  _check_train_step(train, 8, kind)
  assert train['hosts'] == hosts and train['mesh'] == mesh
  assert train['dtype'] == 'auto (bfloat16)'  # The accelerator default.
  assert train['batch']['rows'] % 8 == 0
  if 'H100' in topology:  # cuDNN's fused kernel by default, fed lengths, never a mask.
    assert 'cuDNN fused attention (automatic on GPU)' in train['attention_implementation']
    assert set(train['fused_attention_masks']) == {'PADDING', 'PADDING_CAUSAL'}, train
  else:
    assert train['fused_attention_calls'] == 0
  if mesh['fsdp'] > 1:
    assert {'all-gather', 'reduce-scatter'} <= set(train['collectives'])
  _check_kernels(train, result.stdout)
  config = report['config']
  post_norms = 2 * config['num_encoder_layers'] + 3 * config['num_decoder_layers']
  pallas = '--config.post_norm_kernel=pallas' in flags
  assert train['kernels']['triton_kernels'] == (2 * post_norms if pallas else 0), train
  assert ('Pallas (Triton)' in result.stdout) == pallas
  decoder = report['decoder']
  assert decoder['fits'] and decoder['peak_bytes'] > 0
  assert decoder['beam_size'] == report['config']['beam_size']


@pytest.mark.slow
def test_h200_target_has_its_memory_and_kind():
  code = (
      'from transformer_jax.aot import aot; t = aot.target("2x8xH200"); '
      'print(t.device_kind, len(t.devices), t.num_hosts, t.memory_bytes)'
  )
  result = subprocess.run(
      [_aot_python(), '-c', code],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(1),
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split()[-4:] == ['H200', '16', '2', str(151397597184)]


@pytest.mark.slow
def test_cpu_target_search_and_decoder(tmp_path):
  """8 CPU devices and a made-up 50 MiB device: the search brackets the largest batch
  (a multiple of the batch shards) between a size that fits and one that does not."""
  out = tmp_path / 'report.json'
  result = _compile(
      '--topology=cpu',
      '--config.mesh.fsdp=2',
      '--config.num_encoder_layers=1',
      '--config.num_decoder_layers=1',
      '--search_batch',
      '--memory_limit_gib=0.05',
      '--search_budget_s=3000',
      '--decode',
      f'--json={out}',
      devices=8,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  search = report['largest_batch']
  limit = report['train_step']['device_memory_bytes']
  probes = {int(k): v for k, v in search['probes_rows_to_bytes'].items()}
  largest = search['largest_rows']
  assert largest > 0 and largest % 8 == 0
  assert probes[largest] <= limit
  assert search['smallest_not_fitting_rows'] == largest + 8  # Within one step of 8 rows.
  assert probes[largest + 8] > limit
  assert search['largest_tokens_per_batch'] == largest * search['length']
  assert len(probes) <= 8, probes  # A few compiles, not a doubling-and-bisection ladder.
  assert 'largest batch that fits' in result.stdout
  # A CPU has no datasheet rates here: its kernels are counted, their time not estimated.
  view = report['train_step']['kernels']
  assert view['kernels'] > view['matmul_kernels'] > 0 and view['estimate_s'] is None
  assert 'roofline estimate' not in result.stdout


@pytest.mark.parametrize(
    'flags,message',
    [
        (['--topology=v9z-8'], 'is unknown'),
        (['--topology=cpu', '--config.mesh.fsdp=3'], 'do not divide the 1 devices'),
        (['--topology=cpu', '--config.dtype=float8'], 'dtype'),
        (['--topology=cpu', '--memory_limit_gib=-1'], 'must be positive'),
        ([], '--topology is required'),
    ],
)
@pytest.mark.slow
def test_bad_input_fails_before_compiling(flags, message):
  result = _compile(*flags, timeout=120)
  assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
  assert message in result.stderr, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr


@pytest.mark.slow
def test_packed_rows_on_a_gpu_fall_back_to_xla_and_say_why(tmp_path):
  out = tmp_path / 'report.json'
  result = _compile(
      '--topology=1xH100',
      '--config.packing=True',
      '--config.num_encoder_layers=1',
      '--config.num_decoder_layers=1',
      f'--json={out}',
      python=_aot_python(),
      timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  train = json.loads(out.read_text())['train_step']
  assert train['fused_attention_calls'] == 0
  assert 'XLA attention: cuDNN cannot serve packed rows' in train['attention_implementation']
  assert 'packed rows' in result.stdout


def test_cudnn_attention_without_the_cudnn_library_is_a_clear_error():
  with pytest.raises(aot.UserError, match='needs the cuDNN library'):
    with aot._cudnn_library_named():
      raise RuntimeError('cuDNN not found.')


@pytest.mark.slow
def test_missing_wheels_are_named_with_the_fix():
  """This Python has no libtpu (the test environment keeps it in .venv-aot)."""
  import importlib.util

  if importlib.util.find_spec('libtpu') is not None:
    pytest.skip(
        'libtpu is installed in this Python, so the missing-wheel message cannot '
        'arise here; .venv-aot keeps it out of the test environment'
    )
  result = _compile('--topology=v5e-8', timeout=120)
  assert result.returncode == 2
  assert 'python -m transformer_jax.aot.aot_env ~/.venv-aot' in result.stderr
  assert 'setup.sh --aot' in result.stderr and 'Traceback' not in result.stderr


def test_largest_fitting_brackets_a_linear_memory_curve():
  """Memory a + b * n: found within 3% (or one multiple) in a handful of probes."""
  calls = []

  def fits(n):
    calls.append(n)
    need = 1000 + 37 * n
    return need <= 100_000, need

  found = aot.largest_fitting(fits, start=64, multiple=8, limit_bytes=100_000, time_budget_s=60)
  best = (100_000 - 1000) // 37 // 8 * 8  # 2672
  assert best - best // 32 <= found['largest'] <= best
  assert found['smallest_not_fitting'] > best
  assert len(calls) <= 6, calls
  assert all(n % 8 == 0 for n in calls), calls  # Every probe a whole number of shards.


def test_largest_fitting_when_the_compiler_refuses():
  """A TPU compile that does not fit raises (bytes unknown): bisection still brackets."""

  def fits(n):
    return (True, 10 * n) if n <= 200 else (False, None)

  lines = []
  found = aot.largest_fitting(
      fits, start=16, multiple=8, limit_bytes=10_000, time_budget_s=60, log=lines.append
  )
  assert 192 <= found['largest'] <= 200 and found['smallest_not_fitting'] > 200
  assert all(int(n) % 8 == 0 for n in found['probes'])
  # Each probe's line says what happened; a refused one names no byte count.
  assert any('needs 160 bytes of 10,000: fits' in line for line in lines), lines
  refused = [line for line in lines if 'does not fit' in line]
  assert refused and all('the compiler refused it' in line for line in refused), lines
  assert not any('None' in line for line in lines), lines


def test_collectives_count_results_once():
  hlo = '\n'.join(
      [
          '%ag = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), dimensions={0}',
          '%agd = f32[16,8]{1,0} all-gather-done(%ag)',
          '%rs = ((bf16[64]{0}, bf16[32]{0}), (bf16[16]{0}, bf16[8]{0})) reduce-scatter-start(%a)',
          '%ar = (f32[10]{0}, f32[6]{0}) all-reduce-start(%x, %y), to_apply=%add',
          '%ar2 = s32[] all-reduce(%z), to_apply=%add',
          '%cp = f32[5]{0} collective-permute(%w), source_target_pairs={{0,1}}',
      ]
  )
  assert aot.collectives(hlo) == {
      'all-gather': {'count': 1, 'bytes': 16 * 8 * 4},
      'reduce-scatter': {'count': 1, 'bytes': (16 + 8) * 2},
      'all-reduce': {'count': 2, 'bytes': 16 * 4 + 4},
      'collective-permute': {'count': 1, 'bytes': 20},
  }


def test_unknown_topology_is_a_config_error():
  with pytest.raises(ConfigError, match='is unknown'):
    aot.target('h100')


def test_the_compile_environment_takes_the_installed_jaxs_own_wheels(capsys):
  """`python -m transformer_jax.aot.aot_env DIR` (what setup.sh --aot runs): the compile-only
  wheels of exactly this jax, and a usage line, not a traceback, without a directory."""
  version = importlib.metadata.version('jax')
  assert aot_env.wheels(version) == [
      f'jax[tpu]=={version}',
      f'jax-cuda12-plugin=={version}',
      f'jax-cuda12-pjrt=={version}',
  ]
  assert aot_env.main(['aot_env']) == 2
  assert 'usage: python -m transformer_jax.aot.aot_env DIRECTORY' in capsys.readouterr().err
  assert aot_env.main(['aot_env', '--help']) == 0
  assert '~/.venv-aot/bin/python -m transformer_jax.commands.compile' in capsys.readouterr().out

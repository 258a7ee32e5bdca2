"""`host_memory.retain_freed_memory`: XLA:CPU's per-call scratch buffer is reused, not
page-faulted in afresh every call (glibc's defaults, the control, fault every page of it)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import train_testlib
from transformer_jax.runtime import host_memory

# A step-like program: a 96 MB temporary buffer (XLA's temp allocation) a call, written in
# full, then reduced; the page faults of each call are counted after a warm-up.
PROGRAM = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from transformer_jax.runtime import host_memory
applied = host_memory.retain_freed_memory()
import jax, jax.numpy as jnp

@jax.jit
def step(x):
  big = jnp.outer(x, x) + 1.0  # [4900, 4900] float32: 96 MB of scratch.
  return jnp.sum(jnp.sin(big), axis=0)[:8]

x = jnp.linspace(0.0, 1.0, 4900)
temp = step.lower(x).compile().memory_analysis().temp_size_in_bytes
for _ in range(3):
  jax.block_until_ready(step(x))
faults = []
for _ in range(12):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(step(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({'applied': applied, 'faults': faults, 'temp_pages': temp / 4096}))
"""


def _run(malloc: str) -> dict:
  env = train_testlib.subprocess_env()
  env[host_memory.ENV_VAR] = malloc
  result = subprocess.run(
      [sys.executable, '-c', PROGRAM, str(train_testlib.REPO)],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    not sys.platform.startswith('linux'),
    reason="retain_freed_memory sets glibc's malloc, which only Linux has; "
    'elsewhere it changes nothing',
)
def test_the_scratch_buffer_is_reused_instead_of_faulted_in_every_call():
  retained, system = _run(''), _run('system')
  assert retained['applied'] and not system['applied']
  pages = retained['temp_pages']
  assert pages > 20000  # The buffer is large enough for glibc to map it afresh.
  # Where the kernel backs every mapping with 2 MiB pages, a fault brings in 512 small ones.
  thp = pathlib.Path('/sys/kernel/mm/transparent_hugepage/enabled')
  if thp.exists() and '[always]' in thp.read_text():
    pages /= 512
  reused = lambda run: sum(f < 0.05 * pages for f in run['faults'])
  # glibc's defaults: every call maps the buffer anew and touches every page of it.
  assert reused(system) == 0 and min(system['faults']) > 0.5 * pages, system
  # Retained: the freed buffer stays mapped and the next call reuses it (every call on a quiet
  # machine; beside a busy test suite, other threads' allocations in the one heap left a
  # third to half of the calls without a block to reuse).
  assert reused(retained) >= len(retained['faults']) // 3, retained


def test_it_applies_only_where_jax_runs_on_the_cpu(monkeypatch):
  monkeypatch.setenv('JAX_PLATFORMS', 'tpu')
  assert host_memory.retain_freed_memory() is False
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv(host_memory.ENV_VAR, 'system')
  assert host_memory.retain_freed_memory() is False


@pytest.mark.slow
def test_a_bad_setting_is_a_clear_error_before_any_work(tmp_path):
  """A command refuses an unknown TRANSFORMER_JAX_MALLOC in one paragraph, exit 2."""
  env = train_testlib.subprocess_env()
  env[host_memory.ENV_VAR] = 'jemalloc'
  result = train_testlib.run_command(
      [sys.executable, 'translate.py', f'--workdir={tmp_path}'], env=env, timeout=300
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert "TRANSFORMER_JAX_MALLOC='jemalloc' is not one of retain" in result.stderr
  assert 'Traceback' not in result.stderr

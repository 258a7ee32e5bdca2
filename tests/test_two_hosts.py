"""Two hosts over a real network: `scripts/local_slurm.sh start --nodes=2` makes node1 and
node2 of this machine (network namespaces joined by a veth pair, each with its own address
and host name, SLURM's daemons in each), and docs/distributed.md's sbatch recipe trains
across them, one process of 4 (simulated) devices on each, with JAX's coordinator on node1's
address, to the losses of one 8-device process.

The cluster must start: these tests fail, never skip, where it cannot (not root, no apt).
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import pytest

import test_launchers
from test_launchers import Job
from test_launchers import recipe
import test_multihost
from transformer_jax import checkpointing

pytestmark = pytest.mark.slow  # a two-node SLURM cluster, training through it.

LOCAL_SLURM = test_launchers.LOCAL_SLURM
# Apart from test_launchers' one-node cluster, which may run at the same time.
CLUSTER = {
    'LOCAL_SLURM_DIR': '/tmp/transformer_jax_slurm_two_hosts',
    'LOCAL_SLURM_NETNS': 'transformer_jax_node1',
    'LOCAL_SLURM_NETNS_2': 'transformer_jax_node2',
}


def cluster_env() -> dict[str, str]:
  return test_launchers.job_env(**CLUSTER)


def in_two_hosts(*command: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return test_launchers.in_cluster(*command, env=cluster_env(), timeout=timeout)


@pytest.fixture(scope='module')
def two_hosts():
  """The two-node cluster, started for this module and stopped after it (even when a test
  failed)."""
  env = {**os.environ, **CLUSTER}
  started = subprocess.run(
      ['bash', LOCAL_SLURM, 'start', '--nodes=2'],
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  try:
    assert started.returncode == 0, (
        'scripts/local_slurm.sh start --nodes=2 could not start the two-node cluster:\n'
        f'{started.stdout}{started.stderr}'
    )
    yield
  finally:
    subprocess.run(['bash', LOCAL_SLURM, 'stop'], env=env, capture_output=True, timeout=120)


def test_two_hosts_srun_runs_a_task_on_each_with_its_own_name_and_address(two_hosts):
  names = in_two_hosts('srun', '--nodes=2', '--ntasks-per-node=1', 'hostname')
  assert names.returncode == 0, names.stderr
  assert sorted(names.stdout.split()) == ['node1', 'node2']
  addresses = in_two_hosts(
      'srun', '--nodes=2', '--ntasks-per-node=1', '--label', 'hostname', '--ip-address'
  )
  assert addresses.returncode == 0, addresses.stderr
  assert sorted(addresses.stdout.splitlines()) == ['0: 10.231.0.1', '1: 10.231.0.2']


@pytest.fixture(scope='module')
def across_two_hosts(two_hosts, multihost_config, tmp_path_factory) -> tuple[str, str]:
  """docs/distributed.md's recipe with --nodes=2, one task a host, run to the end: (its work
  directory, its output)."""
  directory = str(tmp_path_factory.mktemp('two_hosts'))
  workdir = os.path.join(directory, 'run')
  job = Job(recipe(multihost_config, workdir, nodes=2), directory, 'two_hosts', cluster_env())
  assert job.finish() == ('COMPLETED', '0:0'), job.log()[-4000:]
  return workdir, job.log()


def test_two_hosts_the_sbatch_recipe_trains_across_both_as_one_process_does(
    across_two_hosts, multihost_reference
):
  workdir, log = across_two_hosts
  test_launchers.assert_both_joined(log, 'node1', ('node1', 'node2'))
  test_launchers.assert_same_losses(workdir, multihost_reference)


# `tc` on node2's end of the link: 512 kbit/s out of node2 (tbf; this kernel has no netem).
# The test model's gradients (25,480 float32) need 1.6 s at that rate; a step took 0.8 s on
# a quiet 2-core machine without the shaping, 9 s with it (tbf drops what would queue longer
# than 400 ms, and TCP waits to resend it).
SLOW_LINK = ('tbf', 'rate', '512kbit', 'burst', '32kbit', 'latency', '400ms')
SLOW_LINK_BYTES_PER_S = 512e3 / 8


def _step_seconds(workdir: str) -> list[float]:
  """Each training step's wall time from metrics.jsonl (logged every step), the first
  (which compiles) left out."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    times = [json.loads(line)['time'] for line in f if '"split": "train"' in line]
  return [b - a for a, b in zip(times[1:], times[2:])]


def _tc(*command: str) -> subprocess.CompletedProcess:
  """`tc` in node2's network namespace."""
  return subprocess.run(
      ['ip', 'netns', 'exec', CLUSTER['LOCAL_SLURM_NETNS_2'], 'tc', *command],
      capture_output=True,
      text=True,
      timeout=60,
  )


def test_two_hosts_a_slow_link_gives_the_same_losses_in_slower_steps(
    across_two_hosts, multihost_config, multihost_reference, tmp_path
):
  """The recipe's first 4 steps with node2's link shaped to 512 kbit/s: the losses of one
  8-device process, and every step takes at least what node2's share of the gradients needs
  on that link. Each process holds all the parameters (fsdp over its own 4 devices, data
  parallel across the hosts), so every step node2 sends node1 at least one float32 a
  parameter."""
  workdir = str(tmp_path / 'run')
  added = _tc('qdisc', 'add', 'dev', 'eth0', 'root', *SLOW_LINK)
  assert added.returncode == 0, added.stderr
  try:
    script = recipe(multihost_config, workdir, '--config.num_train_steps=4', nodes=2)
    job = Job(script, str(tmp_path), 'slow_link', cluster_env())
    assert job.finish() == ('COMPLETED', '0:0'), job.log()[-4000:]
  finally:
    _tc('qdisc', 'del', 'dev', 'eth0', 'root')
  ours, theirs = (test_multihost.train_losses(w) for w in (workdir, multihost_reference))
  assert sorted(ours) == [1, 2, 3, 4]
  np.testing.assert_allclose([ours[s] for s in ours], [theirs[s] for s in ours], rtol=2e-5)

  params, _ = checkpointing.restore_params(workdir)
  floor = 4 * sum(np.size(p) for p in jax.tree.leaves(params)) / SLOW_LINK_BYTES_PER_S
  plain, slow = _step_seconds(across_two_hosts[0]), _step_seconds(workdir)
  shown = f'steps (s): unshaped {plain}, slow link {slow}; the link needs {floor:.2f}'
  assert min(slow) >= 0.9 * floor, shown
  assert np.median(slow) > 3 * np.median(plain), shown

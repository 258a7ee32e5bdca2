"""Two hosts over a real network: `scripts/local_slurm.sh start --nodes=2` makes node1 and
node2 of this machine (network namespaces joined by a veth pair, each with its own address
and host name, SLURM's daemons in each), and docs/distributed.md's sbatch recipe trains
across them, one process of 4 (simulated) devices on each, with JAX's coordinator on node1's
address, to the losses of one 8-device process.

The cluster must start: these tests fail, never skip, where it cannot (not root, no apt).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

import test_launchers
from test_launchers import Job
from test_launchers import recipe

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


def test_two_hosts_the_sbatch_recipe_trains_across_both_as_one_process_does(
    two_hosts, multihost_config, multihost_reference, tmp_path
):
  workdir = str(tmp_path / 'run')
  job = Job(recipe(multihost_config, workdir, nodes=2), str(tmp_path), 'two_hosts', cluster_env())
  assert job.finish() == ('COMPLETED', '0:0'), job.log()[-4000:]
  log = job.log()
  for process in (0, 1):
    assert re.search(
        rf'Process {process} of 2 joined the job \(slurm, coordinator node1:\d+\); '
        r'4 local / 8 global devices',
        log,
    ), log[-3000:]
  test_launchers.assert_same_losses(workdir, multihost_reference)

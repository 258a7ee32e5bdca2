"""The launch recipes of docs/distributed.md on a real scheduler: SLURM 22.05 (one node, this
machine, started by scripts/local_slurm.sh, reachable on loopback only) and Open MPI's
mpirun. Two processes x 4 CPU devices, with `--distributed` and no coordinator flags: both
find the job from the launcher's environment and train as one 8-device process does;
SIGTERM from the scheduler (scancel, the time limit's --signal) stops every task at one
step, and a resubmission ends bitwise equal to an uninterrupted run; a killed or hung task
ends the job; and bad launches get one paragraph, with exit code 2, on every process.

The cluster must start: these tests fail, never skip, where it cannot (not root, no apt).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import test_multihost
import train_testlib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.storage.layout import RunLayout

pytestmark = pytest.mark.slow  # a SLURM cluster and Open MPI, training through them.

REPO = train_testlib.REPO
LOCAL_SLURM = os.path.join(REPO, 'scripts', 'local_slurm.sh')
STEPS = train_testlib.MULTIHOST_STEPS
HEARTBEAT = 5
# The states a job ends in. A job may pass through others than PENDING and RUNNING on the way
# (CONFIGURING, COMPLETING, and SIGNALING while the time limit's --signal is delivered).
ENDED = frozenset(
    {
        'COMPLETED',
        'FAILED',
        'CANCELLED',
        'TIMEOUT',
        'NODE_FAIL',
        'OUT_OF_MEMORY',
        'PREEMPTED',
        'BOOT_FAIL',
        'DEADLINE',
    }
)


@pytest.fixture(scope='module')
def cluster():
  started = subprocess.run(
      ['bash', LOCAL_SLURM, 'start'], capture_output=True, text=True, timeout=600
  )
  assert started.returncode == 0, (
      f'scripts/local_slurm.sh could not start the local SLURM cluster:\n{started.stdout}'
      f'{started.stderr}'
  )
  yield
  if 'is up (node' in started.stdout:  # Started here, not found running: stop it again.
    subprocess.run(['bash', LOCAL_SLURM, 'stop'], capture_output=True, timeout=120)


def job_env(**extra: str) -> dict[str, str]:
  """4 simulated CPU devices a process; no launcher variables of an enclosing job."""
  env = {
      k: v
      for k, v in train_testlib.subprocess_env(devices=4).items()
      if not k.startswith(('SLURM_', 'OMPI_', 'PMIX_'))
  }
  env.update(extra)
  return env


def in_cluster(
    *command: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: str = REPO
) -> subprocess.CompletedProcess:
  """`command` inside the cluster's network namespace, with SLURM_CONF set."""
  return subprocess.run(
      ['bash', LOCAL_SLURM, 'run', *command],
      cwd=cwd,
      env=env or job_env(),
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def recipe(config_path: str, workdir: str, *flags: str, nodes: int = 1, **sbatch: str) -> str:
  """docs/distributed.md's sbatch script with only its sizes changed: 2 tasks of 4 (simulated)
  devices, one node of 2 tasks (so without JAX_LOCAL_DEVICE_IDS, the layout the guide names
  beside it) or, with `nodes=2`, one task on each; the test's config and work directory;
  `sbatch` replaces #SBATCH values."""
  with open(os.path.join(REPO, 'docs', 'distributed.md')) as f:
    text = f.read()
  start = text.index('    #!/bin/bash\n')
  script = '\n'.join(line[4:] for line in text[start : text.index('\n\n', start)].split('\n'))
  changes = [
      ('--nodes=4', f'--nodes={nodes}'),
      ('--ntasks-per-node=1', f'--ntasks-per-node={2 // nodes}'),
      ('#SBATCH --gpus-per-node=8\n', ''),
      (
          'export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7   # else JAX gives each process '
          'one GPU\n',
          '',
      ),
      ('--config=configs/wmt14_ende_big.py', f'--config={config_path}'),
      ('--workdir=/shared/runs/ende_big', f'--workdir={workdir}'),
      (
          '--config.mesh.fsdp=8 --config.mesh.data=-1',
          ' '.join(['--config.mesh.fsdp=4 --config.mesh.data=-1', *flags]),
      ),
  ]
  changes += [
      (re.search(rf'--{key}=\S+', script)[0], f'--{key}={value}') for key, value in sbatch.items()
  ]
  for old, new in changes:
    assert old in script, f'docs/distributed.md: the sbatch recipe has no {old!r}'
    script = script.replace(old, new)
  return script


class Job:
  """An sbatch job of `script`; its output (both tasks' stderr) goes to `name`.out. `env`:
  the cluster's (`job_env` with its LOCAL_SLURM_* variables; default: the one-node one)."""

  def __init__(self, script: str, directory: str, name: str, env: dict[str, str] | None = None):
    self.env = env
    self.out = os.path.join(directory, f'{name}.out')
    path = os.path.join(directory, f'{name}.sbatch')
    with open(path, 'w') as f:
      f.write(script)
    submitted = in_cluster('sbatch', '--parsable', f'--output={self.out}', path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    self.id = submitted.stdout.strip().split(';')[0]

  def log(self) -> str:
    try:
      with open(self.out) as f:
        return f.read()
    except FileNotFoundError:
      return ''

  def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if match := re.search(pattern, self.log()):
        return match
      if self.state()[0] in ENDED:
        break
      time.sleep(0.2)
    raise AssertionError(f'job {self.id}: no {pattern!r}:\n{self.log()[-4000:]}')

  def state(self) -> tuple[str, str]:
    """(JobState, ExitCode) as scontrol shows them."""
    shown = in_cluster('scontrol', 'show', 'job', self.id, env=self.env)
    state, code = (re.search(rf'{k}=(\S+)', shown.stdout) for k in ('JobState', 'ExitCode'))
    if not (state and code):  # slurmctld busy past scontrol's timeout (a lost node): ask again.
      return 'NO ANSWER', shown.stderr.strip()
    return state[1], code[1]

  def finish(self, timeout: float = 300) -> tuple[str, str]:
    deadline = time.time() + timeout
    while (state := self.state())[0] not in ENDED:
      if time.time() > deadline:
        in_cluster('scancel', '--signal=KILL', self.id, env=self.env)
        raise AssertionError(
            f'job {self.id} still {state} after {timeout}s:\n' + self.log()[-4000:]
        )
      time.sleep(0.5)
    return state

  def pid_of_task(self, task: int) -> int:
    """The process id of task `task` of the job's step 0 (the srun line)."""
    listed = in_cluster('scontrol', 'listpids', self.id, env=self.env).stdout
    for row in listed.splitlines()[1:]:
      pid, _, step, _, global_id = row.split()[:5]
      if step == '0' and global_id == str(task):
        return int(pid)
    raise AssertionError(f'job {self.id}: no task {task} in\n{listed}')


def stop_steps(log: str) -> dict[int, int]:
  """{process: the step it saved on a stop request}."""
  return {
      int(p): int(s)
      for s, p in re.findall(r'Stop requested: saving step (\d+) on process (\d+)', log)
  }


def assert_same_losses(workdir: str, reference: str) -> None:
  ours, theirs = test_multihost.train_losses(workdir), test_multihost.train_losses(reference)
  assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
  np.testing.assert_allclose(
      [ours[s] for s in sorted(ours)], [theirs[s] for s in sorted(theirs)], rtol=2e-5
  )


@pytest.fixture(scope='module')
def config_path(multihost_config):
  return multihost_config


@pytest.fixture(scope='module')
def reference(multihost_reference):
  """The same run as one process with 8 devices (shared with test_multihost)."""
  return multihost_reference


@pytest.fixture(scope='module')
def uninterrupted(cluster, config_path, tmp_path_factory):
  """The recipe's job, run to the end: (its work directory, its output)."""
  directory = str(tmp_path_factory.mktemp('sbatch'))
  workdir = os.path.join(directory, 'run')
  job = Job(recipe(config_path, workdir), directory, 'uninterrupted')
  assert job.finish() == ('COMPLETED', '0:0'), job.log()[-4000:]
  return workdir, job.log()


def assert_both_joined(log: str, coordinator_host: str, hosts: tuple[str, str]) -> None:
  """Both processes found the job from SLURM's environment, 4 of the 8 devices each, and
  said which host they are on (`hosts`: process 0's and 1's)."""
  for process, host in enumerate(hosts):
    assert re.search(
        rf'Process {process} of 2 joined the job on {host} \(slurm, coordinator '
        rf'{coordinator_host}:\d+\); 4 local / 8 global devices',
        log,
    ), log[-3000:]


def test_the_sbatch_recipe_trains_as_one_process_does(uninterrupted, reference):
  workdir, log = uninterrupted
  assert_both_joined(log, 'localhost', (socket.gethostname(),) * 2)
  assert_same_losses(workdir, reference)


def test_scancel_term_stops_every_task_at_one_step_and_resubmitting_ends_bitwise_equal(
    uninterrupted, config_path, tmp_path
):
  workdir = str(tmp_path / 'run')
  job = Job(recipe(config_path, workdir), str(tmp_path), 'stopped')
  job.wait_for(r'step 2/')
  assert in_cluster('scancel', '--signal=TERM', job.id).returncode == 0
  assert job.finish() == ('COMPLETED', '0:0'), job.log()[-4000:]
  stops = stop_steps(job.log())
  assert sorted(stops) == [0, 1] and len(set(stops.values())) == 1, job.log()[-4000:]
  step = stops[0]
  assert step < STEPS

  again = Job(recipe(config_path, workdir), str(tmp_path), 'resubmitted')
  assert again.finish() == ('COMPLETED', '0:0'), again.log()[-4000:]
  assert f'Resumed from the checkpoint at step {step}' in again.log()
  ours, last = checkpointing.restore_params(RunLayout.of(workdir).checkpoints)
  theirs, _ = checkpointing.restore_params(RunLayout.of(uninterrupted[0]).checkpoints)
  assert last == STEPS
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ours), jax.device_get(theirs))


def lose_task_1(
    script: str, directory: str, name: str, signum: int, resumed_from: int | None = None
) -> str:
  """Submits `script`, sends task 1 `signum` once it trains, and asserts that the job fails
  within the heartbeat timeout (and some seconds to spare); returns the job's output."""
  job = Job(script, directory, name)
  job.wait_for(rf'Resumed from the checkpoint at step {resumed_from or ""}')
  job.wait_for(r'step \d+/100000')
  os.kill(job.pid_of_task(1), signum)
  began = time.time()
  state, _ = job.finish(timeout=HEARTBEAT + 60)
  assert state == 'FAILED' and time.time() - began < HEARTBEAT + 30, (state, job.log()[-3000:])
  return job.log()


def test_the_time_limit_signal_stops_every_task_and_a_lost_task_ends_the_job(
    cluster, config_path, tmp_path
):
  workdir = str(tmp_path / 'run')
  long_run = ('--config.num_train_steps=100000', f'--heartbeat_timeout_seconds={HEARTBEAT}')
  # SLURM looks every 30 s and sends the signal on the first look within 30 s of its time: with
  # a 2-minute limit and TERM@70 it comes 20-50 s in, and the limit at least 70 s after it, time
  # enough to finish compiling, agree on a step and save on a loaded machine (TERM@10 on a
  # 1-minute limit left too little: a job slow to stop ended TIMEOUT).
  limited = recipe(config_path, workdir, *long_run, time='2', signal='TERM@70')
  job = Job(limited, str(tmp_path), 'time_limit')
  assert job.finish(timeout=180) == ('COMPLETED', '0:0'), job.log()[-4000:]
  stops = stop_steps(job.log())
  assert sorted(stops) == [0, 1] and len(set(stops.values())) == 1, job.log()[-4000:]

  # A killed task (the OOM killer, a lost host): the other stops within the heartbeat
  # timeout (on CPU gloo sees the broken connection at once), srun names the task it lost.
  killed = lose_task_1(
      recipe(config_path, workdir, *long_run),
      str(tmp_path),
      'killed',
      signal.SIGKILL,
      resumed_from=stops[0],
  )
  assert re.search(r'srun: error: localhost: task 1: Killed', killed), killed[-3000:]
  # A hung task (a frozen host): JAX's heartbeats name it, and the job ends.
  hung = lose_task_1(recipe(config_path, workdir, *long_run), str(tmp_path), 'hung', signal.SIGSTOP)
  assert re.search(r'unhealthy \(stopped sending heartbeats\):\s*1\b', hung), hung[-3000:]

  # The rerun resumes from the last complete checkpoint and finishes.
  last = max(int(n) for n in os.listdir(os.path.join(workdir, 'checkpoints')) if n.isdigit())
  final = Job(
      recipe(config_path, workdir, f'--config.num_train_steps={last + 2}'), str(tmp_path), 'final'
  )
  assert final.finish() == ('COMPLETED', '0:0'), final.log()[-4000:]
  assert f'Resumed from the checkpoint at step {last}' in final.log()
  assert f'step {last + 2}/{last + 2}' in final.log()


def test_mpirun_trains_as_one_process_does(cluster, config_path, reference, tmp_path):
  workdir = str(tmp_path / 'run')
  done = in_cluster(
      'mpirun',
      '--allow-run-as-root',
      '-np',
      '2',
      sys.executable,
      'train.py',
      '--distributed',
      f'--config={config_path}',
      f'--workdir={workdir}',
      '--config.mesh.fsdp=4',
      '--config.mesh.data=-1',
  )
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  for process in (0, 1):
    assert re.search(
        rf'Process {process} of 2 joined the job on \S+ \(ompi, coordinator 127\.0\.0\.1:\d+\)',
        done.stderr,
    ), done.stderr[-3000:]
  assert_same_losses(workdir, reference)


SHOW_DEVICES = (
    'import json, jax\n'
    'from transformer_jax.runtime import multihost\n'
    'multihost.initialize(heartbeat_timeout_seconds=60)\n'
    'print(json.dumps([jax.process_index(), jax.local_device_count(),\n'
    '                  jax.config.values["jax_cuda_visible_devices"]]))\n'
)


def test_one_process_per_gpu_and_one_per_host_get_their_devices(cluster):
  # One process per GPU (--ntasks-per-node=8 on a GPU node): each sees the GPU of its local id.
  per_device = in_cluster('srun', '--ntasks-per-node=2', sys.executable, '-c', SHOW_DEVICES)
  assert per_device.returncode == 0, per_device.stderr[-3000:]
  seen = sorted(json.loads(line) for line in per_device.stdout.splitlines())
  assert seen == [[0, 4, '0'], [1, 4, '1']]
  # One process per host with JAX_LOCAL_DEVICE_IDS: it sees all of them.
  per_host = in_cluster(
      'srun',
      '--ntasks-per-node=1',
      sys.executable,
      '-c',
      SHOW_DEVICES,
      env=job_env(JAX_LOCAL_DEVICE_IDS='0,1,2,3'),
  )
  assert per_host.returncode == 0, per_host.stderr[-3000:]
  assert [json.loads(line) for line in per_host.stdout.splitlines()] == [[0, 4, '0,1,2,3']]


def srun_train(config_path, workdir, *flags, tasks=2, shell_line=None, env=None):
  """srun of train.py with --distributed: (seconds it took, the result)."""
  command = [
      sys.executable,
      'train.py',
      '--distributed',
      f'--config={config_path}',
      f'--workdir={workdir}',
      f'--heartbeat_timeout_seconds={HEARTBEAT}',
      *flags,
  ]
  if shell_line:
    command = ['bash', '-c', ' '.join(command) + ' ' + shell_line]
  began = time.time()
  done = in_cluster('srun', f'--ntasks={tasks}', *command, env=env, timeout=HEARTBEAT + 120)
  return time.time() - began, done


def paragraphs(stderr: str, start: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith(f'train.py: error: {start}')]


def test_bad_launches_get_one_paragraph_on_every_process(cluster, config_path, tmp_path):
  # --distributed outside any launcher, without the coordinator flags.
  alone = subprocess.run(
      train_testlib.train_command(config_path, str(tmp_path / 'alone'), '--distributed'),
      cwd=REPO,
      env=job_env(),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert alone.returncode == 2, alone.stderr[-3000:]
  assert len(paragraphs(alone.stderr, '--distributed found no launcher')) == 1

  # 3 processes x 4 devices, and an fsdp axis of 8.
  _, mesh = srun_train(config_path, str(tmp_path / 'mesh'), '--config.mesh.fsdp=8', tasks=3)
  assert mesh.returncode == 2, mesh.stderr[-3000:]
  assert len(paragraphs(mesh.stderr, 'config.mesh=')) == 3, mesh.stderr[-3000:]

  # Two tasks with different configs.
  _, differ = srun_train(
      config_path, str(tmp_path / 'differ'), shell_line='--config.dropout_rate=0.$SLURM_PROCID'
  )
  assert differ.returncode == 2, differ.stderr[-3000:]
  found = paragraphs(differ.stderr, 'The processes of this job were not started with the same')
  assert len(found) == 2 and all(
      'process 1 has --config.dropout_rate=0.1 where process 0 has 0.0' in p for p in found
  )

  # The coordinator's port already in use (held inside the cluster's network).
  holder = subprocess.Popen(
      [
          'bash',
          LOCAL_SLURM,
          'run',
          sys.executable,
          '-c',
          'import socket, sys, time\n'
          's = socket.socket(socket.AF_INET6)\n'
          's.bind(("::", 0)); s.listen(); print(s.getsockname()[1], flush=True)\n'
          'time.sleep(300)',
      ],
      stdout=subprocess.PIPE,
      text=True,
  )
  try:
    port = holder.stdout.readline().strip()
    took, busy = srun_train(
        config_path, str(tmp_path / 'busy'), env=job_env(JAX_COORDINATOR_PORT=port)
    )
  finally:
    holder.kill()
  assert busy.returncode == 2, busy.stderr[-3000:]
  assert len(paragraphs(busy.stderr, f'Port {port} on this host is in use')) == 1
  assert len(paragraphs(busy.stderr, 'Process 1 of 2 could not join the job within')) == 1
  assert took < HEARTBEAT + 60, took


def test_a_cluster_whose_daemons_were_killed_mid_job_starts_again_idle(cluster, tmp_path):
  # A session or a test run that ends hard kills slurmctld and slurmd while a job runs. The
  # next `start` must not recover that job (nothing runs it: the node would stay busy and the
  # start would time out), and the job's leftover processes go with it; so must `stop`.
  directory = os.environ.get('LOCAL_SLURM_DIR', '/tmp/transformer_jax_slurm')

  def kill_the_daemons_under_a_running_job(name):
    job = Job('#!/bin/bash\n#SBATCH --ntasks=1\nsrun sleep 600\n', str(tmp_path), name)
    deadline = time.time() + 60
    while job.state()[0] != 'RUNNING':
      assert time.time() < deadline, job.state()
      time.sleep(0.2)
    for daemon in ('slurmctld', 'slurmd-localhost'):  # slurmd-%n.pid, %n: the node.
      with open(os.path.join(directory, f'{daemon}.pid')) as f:
        os.kill(int(f.read()), signal.SIGKILL)

  def local_slurm(command):
    return subprocess.run(
        ['bash', LOCAL_SLURM, command], capture_output=True, text=True, timeout=120
    )

  def sleeps():
    return subprocess.run(['pgrep', '-f', 'sleep 600'], capture_output=True).returncode == 0

  kill_the_daemons_under_a_running_job('first')
  started = local_slurm('start')
  assert started.returncode == 0 and 'is up (node' in started.stdout, started.stderr
  assert in_cluster('sinfo', '-h', '-o', '%T').stdout.split() == ['idle']
  assert in_cluster('squeue', '-h').stdout.strip() == '' and not sleeps()

  kill_the_daemons_under_a_running_job('second')
  assert local_slurm('stop').returncode == 0 and not sleeps()
  assert local_slurm('start').returncode == 0  # For the fixture, which stops it at the end.

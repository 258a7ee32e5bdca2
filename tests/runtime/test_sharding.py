"""The sharded step on 8 simulated CPU devices: every mesh shape computes what one device
computes, parameters are split as the logical-axis rules say, and a checkpoint restores onto
a different mesh.

JAX fixes its device count when it starts, so the 8-device work runs in a subprocess (this
file run as a script); the tests check what it reports.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import train_testlib
from transformer_jax.storage.layout import RunLayout

pytestmark = pytest.mark.slow  # training on 8 devices through a subprocess.

MESHES = {
    'data': {'data': 8, 'fsdp': 1, 'tensor': 1},
    'fsdp': {'data': 1, 'fsdp': 8, 'tensor': 1},
    'tensor': {'data': 2, 'fsdp': 1, 'tensor': 4},
    'mixed': {'data': 2, 'fsdp': 2, 'tensor': 2},
}
STEPS = 3
VOCAB = 64


def _worker(checkpoint_dir: str) -> dict:
  """Runs in the 8-device subprocess; returns what the tests check."""
  import grain
  import jax
  import jax.numpy as jnp

  from configs import tiny
  from transformer_jax.checkpoints import checkpointing
  from transformer_jax.model.config import TransformerConfig
  from transformer_jax.runtime.partitioning import Partitioner
  from transformer_jax.training import optimizer
  from transformer_jax.training import train_steps

  assert jax.device_count() == 8, jax.devices()
  config = tiny.get_config()
  # Adam's eps=1e-9 turns rounding noise in near-zero gradients into +-lr steps; a larger
  # eps keeps the update linear in the gradient, so parameters can be compared tightly.
  config.update(dict(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.1, adam_eps=1e-3))
  model_config = TransformerConfig.from_config(config, vocab_size=VOCAB)
  tx, schedule = optimizer.create_optimizer(
      optimizer.OptimizerConfig.from_config(config, model_config.d_model)
  )
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(STEPS):
    batch = {}
    for side in ('inputs', 'targets'):
      lengths = rng.integers(3, 16, size=8)
      ids = rng.integers(4, VOCAB, size=(8, 16)).astype(np.int32)
      mask = np.arange(16)[None] < lengths[:, None]
      batch[side] = np.where(mask, ids, 0).astype(np.int32)
      batch[f'{side}_positions'] = np.where(mask, np.arange(16)[None], 0).astype(np.int32)
      batch[f'{side}_segmentation'] = mask.astype(np.int32)
    batches.append(batch)

  def setup(mesh, devices, grad_accum_steps=1):
    config.mesh = mesh
    partitioner = Partitioner.from_config(config, devices=devices)
    _, shardings = train_steps.abstract_state(model_config, tx, partitioner)
    step = train_steps.jit_train_step(
        train_steps.StepConfig(model_config, seed=0, grad_accum_steps=grad_accum_steps),
        tx,
        schedule,
        partitioner,
        shardings,
    )
    return partitioner, shardings, step

  def train(partitioner, shardings, step, state):
    losses = []
    with partitioner.activate():
      for batch in batches:
        state, metrics = step(state, partitioner.shard_batch(batch))
        losses.append(float(metrics['loss'] / metrics['tokens']))
    return state, losses

  report = {'losses': {}, 'max_param_diff': {}, 'shards': {}, 'specs': {}}
  single = setup({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  initial = train_steps.create_train_state(0, model_config, tx, single[0], single[1])
  initial = jax.device_get(initial)
  reference, report['losses']['single'] = train(*single, jax.device_put(initial, single[1]))
  reference = jax.device_get(reference.params)

  for name, mesh in MESHES.items():
    partitioner, shardings, step = setup(
        mesh,
        jax.devices(),
    )
    if name == 'fsdp':  # Initialized straight into its shardings.
      state = train_steps.create_train_state(0, model_config, tx, partitioner, shardings)
    else:
      state = jax.device_put(initial, shardings)
    state, report['losses'][name] = train(partitioner, shardings, step, state)
    diffs = jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), state.params, reference
    )
    report['max_param_diff'][name] = max(jax.tree.leaves(diffs))
    params = state.params
    mu = state.opt_state[0].mu
    report['shards'][name] = {
        'embedding': list(params['shared_embedding']['embedding'].addressable_shards[0].data.shape),
        'wi': list(
            params['encoder']['layer_0']['feed_forward']['wi']['kernel']
            .addressable_shards[0]
            .data.shape
        ),
        'mu_wi': list(
            mu['encoder']['layer_0']['feed_forward']['wi']['kernel']
            .addressable_shards[0]
            .data.shape
        ),
        'batch': list(
            partitioner.shard_batch(batches[0])['inputs'].addressable_shards[0].data.shape
        ),
    }
    report['specs'][name] = str(params['shared_embedding']['embedding'].sharding.spec)
    if name == 'mixed':
      saved_state = state

  # Save on the mixed mesh, restore onto the fsdp mesh (orbax reshards at load).
  checkpointer = checkpointing.Checkpointer(
      RunLayout.of(checkpoint_dir).checkpoints, save_every=1, final_step=STEPS
  )
  data = iter(grain.MapDataset.range(4).to_iter_dataset())
  checkpointer.save(saved_state, data, {'note': 'test'}, force=True)
  checkpointer.wait()
  partitioner, _, _ = setup(MESHES['fsdp'], jax.devices())
  abstract, _ = train_steps.abstract_state(model_config, tx, partitioner)
  restored = checkpointer.restore(
      STEPS, abstract, iter(grain.MapDataset.range(4).to_iter_dataset())
  )
  checkpointer.close()
  same = jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)),
      jax.device_get(restored),
      jax.device_get(saved_state),
  )
  report['restore_equal'] = all(jax.tree.leaves(same))
  emb = restored.params['shared_embedding']['embedding']
  report['restore_spec'] = str(emb.sharding.spec)
  report['restore_mesh'] = dict(emb.sharding.mesh.shape)
  report['restore_shard'] = list(emb.addressable_shards[0].data.shape)
  return report


@pytest.fixture(scope='module')
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp('sharding')
  for attempt in range(2):
    shutil.rmtree(out / 'checkpoints', ignore_errors=True)
    process = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            str(out / 'checkpoints'),
            str(out / 'report.json'),
        ],
        # 8 simulated devices on 2 cores: slow, so the timeout leaves room for a slow CPU.
        cwd=train_testlib.REPO,
        env=train_testlib.subprocess_env(devices=8),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    # XLA:CPU's in-process collectives over 8 simulated devices can starve for threads and
    # deadlock (an all-reduce whose second participant never gets a thread; XLA aborts the
    # process after the timeout). `subprocess_env` gives them threads enough (PJRT_NPROC);
    # should it ever happen again, that is XLA's scheduler, not this code: run it once more.
    if process.returncode == 0 or 'Termination timeout for' not in process.stderr or attempt:
      break
  assert process.returncode == 0, process.stderr[-5000:]
  with open(out / 'report.json') as f:
    return json.load(f)


@pytest.mark.parametrize('mesh', list(MESHES))
def test_every_mesh_matches_one_device(report, mesh):
  np.testing.assert_allclose(report['losses'][mesh], report['losses']['single'], rtol=2e-5)
  assert report['losses']['single'][-1] < report['losses']['single'][0]
  assert report['max_param_diff'][mesh] < 2e-5


def test_parameters_are_split_as_the_rules_say(report):
  # Rules: vocab->tensor, embed->fsdp, mlp->tensor, batch->(data, fsdp). Tiny: d_model 32,
  # d_ff 64, vocab 64; batches of 8 rows of 16.
  shards = report['shards']
  assert shards['data'] == {
      'embedding': [64, 32],
      'wi': [32, 64],
      'mu_wi': [32, 64],
      'batch': [1, 16],
  }
  assert shards['fsdp'] == {'embedding': [64, 4], 'wi': [4, 64], 'mu_wi': [4, 64], 'batch': [1, 16]}
  assert shards['tensor'] == {
      'embedding': [16, 32],
      'wi': [32, 16],
      'mu_wi': [32, 16],
      'batch': [4, 16],
  }
  assert shards['mixed'] == {
      'embedding': [32, 16],
      'wi': [16, 32],
      'mu_wi': [16, 32],
      'batch': [2, 16],
  }
  assert report['specs']['mixed'] == "P('tensor', 'fsdp')"


def test_checkpoint_restores_onto_a_different_mesh(report):
  assert report['restore_equal']
  assert report['restore_mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1}
  assert report['restore_spec'] == "P('tensor', 'fsdp')"
  assert report['restore_shard'] == [64, 4]


if __name__ == '__main__':
  import time

  start = time.time()
  result = _worker(sys.argv[1])
  result['seconds'] = time.time() - start
  with open(sys.argv[2], 'w') as f:
    json.dump(result, f)

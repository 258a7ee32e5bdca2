"""The model's implementation options against the plain computation they replace, from the
same parameters: logits and gradients to rounding (remat policies, cuDNN's sequence
lengths, the explicit softmax attention, one-pass layer norm statistics, the linear logits
sum, the Pallas post-norm kernel, stacked q/k/v projections)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models_testlib import apply
from models_testlib import init
from models_testlib import SOURCE
from models_testlib import TARGET
from models_testlib import TINY
from models_testlib import tokens
from models_testlib import VARIANTS
from models_testlib import VOCAB
from transformer_jax.config import PAD_ID
from transformer_jax.model import losses
from transformer_jax.model.kernels import dot_product_attention
from transformer_jax.model.kernels import stacked_projection
from transformer_jax.model.models import Transformer

# One layer a side: every option here replaces a computation of each layer (or of the logits),
# which one encoder and one decoder layer run in every kind of attention and norm; a second
# layer would only repeat it, at a third more compile time per program (test_models keeps two).
ONE_LAYER = dataclasses.replace(TINY, num_encoder_layers=1, num_decoder_layers=1)


def test_remat_policies_give_the_same_gradients():
  rng = np.random.default_rng(9)
  inputs, targets = tokens(rng, 2, 6), tokens(rng, 2, 5)
  params = init(ONE_LAYER)

  def grads(cfg):
    def loss(p):
      logits = Transformer(cfg).apply({'params': p}, inputs, targets)
      return losses.compute_metrics(logits, targets, targets > 0)['loss']

    return jax.jit(jax.grad(loss))(params)

  reference = grads(ONE_LAYER)
  # Compiled as training compiles them, each policy's program is fused its own way: equal to
  # float32 rounding (2.4e-6 relative at most, measured), where a wrong recomputation is off
  # by O(1).
  for policy in ('full', 'dots'):
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        grads(dataclasses.replace(ONE_LAYER, remat_policy=policy)),
        reference,
    )


def assert_equal_to_rounding(result, reference, real):
  """Two `jax.value_and_grad(..., has_aux=True)` results of (loss, logits): the same loss,
  logits at the `real` target positions and gradients, to float32 rounding."""
  (loss, logits), grads = result
  (loss_r, logits_r), grads_r = reference
  np.testing.assert_allclose(
      np.asarray(logits)[real], np.asarray(logits_r)[real], atol=1e-5, rtol=1e-5
  )
  np.testing.assert_allclose(loss, loss_r, rtol=1e-6)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), grads, grads_r
  )


@pytest.mark.parametrize('attention_dropout', [0.0, 0.3])
def test_attention_fed_lengths_equals_the_dense_mask(attention_dropout):
  """What cuDNN is given on a GPU (sequence lengths and a causal flag) means what the dense
  mask means, for logits and gradients, on right-padded rows of different lengths; with
  attention dropout the lengths become a mask for the explicit softmax."""
  rng = np.random.default_rng(11)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  inputs = inputs.at[0, 5:].set(PAD_ID).at[2, 8:].set(PAD_ID)
  targets = targets.at[1, 3:].set(PAD_ID).at[2, 6:].set(PAD_ID)
  dense = dataclasses.replace(
      ONE_LAYER, attention_dropout_rate=attention_dropout, deterministic=attention_dropout == 0.0
  )
  params = init(dense)
  weights = targets > 0

  def loss_and_grads(cfg):
    def loss(p):
      logits = Transformer(cfg).apply(
          {'params': p}, inputs, targets, rngs={'dropout': jax.random.PRNGKey(3)}
      )
      return losses.compute_metrics(logits, targets, weights)['loss'], logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  assert_equal_to_rounding(
      loss_and_grads(dataclasses.replace(dense, attention_lengths=True)),
      loss_and_grads(dense),
      np.asarray(weights),
  )


def test_stacked_projection_equals_each_projection_on_its_own():
  """q/k/v from one product of the stacked kernels: each equal to x times its own kernel plus
  its bias, in the kernels' order."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  kernels = [jnp.asarray(rng.normal(size=(8, 2, 4)), jnp.float32) for _ in range(3)]
  biases = [jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(3)]
  stacked = stacked_projection.project(x, kernels, biases)
  assert len(stacked) == 3
  for got, kernel, bias in zip(stacked, kernels, biases):
    want = jnp.einsum('bld,dhk->blhk', x, kernel) + bias
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('causal', [False, True])
def test_lengths_attend_as_their_dense_mask_in_every_kernel(causal):
  """`Lengths` (right-padded rows as sequence lengths and a causal flag, what cuDNN takes)
  selects the keys its `dense` mask selects: the explicit softmax and `jax.nn`'s XLA kernel
  give the same output from either form, and the keys a row does not see do not matter."""
  rng = np.random.default_rng(3)
  query, key, value = (jnp.asarray(rng.normal(size=(2, 5, 2, 4)), jnp.float32) for _ in 'qkv')
  lengths = dot_product_attention.Lengths(
      jnp.asarray([5, 3], jnp.int32), jnp.asarray([5, 3], jnp.int32), causal
  )
  dense = lengths.dense(5, 5)
  attend = lambda k, v, mask, implementation: dot_product_attention.attention(
      query, k, v, mask, implementation=implementation
  )[0]
  reference = attend(key, value, dense, 'explicit')
  for mask in (lengths, dense):
    for implementation in ('explicit', 'xla'):
      got = attend(key, value, mask, implementation)
      np.testing.assert_allclose(got[0], reference[0], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(got[1, :3], reference[1, :3], rtol=1e-5, atol=1e-6)
  # Row 1's keys past its length changed: its real queries' outputs stay.
  noisy = key.at[1, 3:].set(100.0), value.at[1, 3:].set(-100.0)
  np.testing.assert_allclose(
      attend(*noisy, lengths, 'explicit')[1, :3], reference[1, :3], rtol=1e-5, atol=1e-6
  )


def test_explicit_softmax_attention_equals_jax_nn_on_packed_and_padded_rows():
  """`attention_implementation='explicit'` (what a CPU takes when automatic) gives what
  `jax.nn.dot_product_attention` gives ('xla'), logits and gradients, with every kind of
  mask at once: two examples packed in a row (segments and positions), padding, causal."""
  rng = np.random.default_rng(13)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  # Row 0: two packed examples a side, then padding; the other rows: one, right-padded.
  source_segments = np.ones(SOURCE, np.int32)
  target_segments = np.ones(TARGET, np.int32)
  source_segments[0, 3:7], source_segments[0, 7:] = 2, 0
  target_segments[0, 2:4], target_segments[0, 4:] = 2, 0
  source_segments[1, 5:], target_segments[2, 3:] = 0, 0
  inputs = jnp.where(source_segments > 0, inputs, PAD_ID)
  targets = jnp.where(target_segments > 0, targets, PAD_ID)

  def positions(segments):
    starts = np.r_[True, segments[1:] != segments[:-1]]
    index = np.arange(len(segments))
    return index - np.maximum.accumulate(np.where(starts, index, 0))

  batch = dict(
      inputs_positions=np.stack([positions(s) for s in source_segments]),
      targets_positions=np.stack([positions(s) for s in target_segments]),
      inputs_segmentation=source_segments,
      targets_segmentation=target_segments,
  )
  xla = dataclasses.replace(ONE_LAYER, attention_implementation='xla')
  explicit = dataclasses.replace(ONE_LAYER, attention_implementation='explicit')
  params = init(xla)
  weights = targets > 0

  def loss_and_grads(cfg):
    def loss(p):
      logits = Transformer(cfg).apply({'params': p}, inputs, targets, **batch)
      return losses.compute_metrics(logits, targets, weights)['loss'], logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, logits_e), _ = result = loss_and_grads(explicit)
  assert_equal_to_rounding(result, loss_and_grads(xla), np.asarray(weights))
  # The packing is seen: without segments the same rows give other logits.
  unpacked = Transformer(explicit).apply({'params': params}, inputs, targets)
  assert not np.allclose(np.asarray(unpacked)[0, :4], np.asarray(logits_e)[0, :4], atol=1e-3)


@pytest.mark.parametrize('norm_position', ['post', 'pre'])
def test_one_pass_layer_norm_statistics_equal_two_pass_ones(norm_position):
  """`layer_norm_statistics='one_pass'` (the default) gives the two-pass model's logits and
  gradients to float32 rounding, from the same parameters."""
  rng = np.random.default_rng(12)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  one = dataclasses.replace(ONE_LAYER, norm_position=norm_position)
  two = dataclasses.replace(one, layer_norm_statistics='two_pass')
  assert one.layer_norm_statistics == 'one_pass'
  params = init(one)

  def loss(cfg, p):
    logits = Transformer(cfg).apply({'params': p}, inputs, targets)
    return losses.compute_metrics(logits, targets, targets > 0)['loss'], logits

  (loss_one, logits_one), grads_one = jax.jit(
      jax.value_and_grad(lambda p: loss(one, p), has_aux=True)
  )(params)
  (loss_two, logits_two), grads_two = jax.jit(
      jax.value_and_grad(lambda p: loss(two, p), has_aux=True)
  )(params)
  np.testing.assert_allclose(logits_one, logits_two, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss_one, loss_two, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_one), jax.tree.leaves(grads_two)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  # The field reaches every layer norm (the two results differ by rounding at most, so
  # comparing them could not show it).
  def variances(cfg):
    seen = []

    def record(next_fun, args, kwargs, context):
      if isinstance(context.module, nn.LayerNorm):
        seen.append(context.module.use_fast_variance)
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):  # Traced only: nothing to compile.
      jax.eval_shape(lambda: Transformer(cfg).apply({'params': params}, inputs, targets))
    return seen

  norms = 2 * ONE_LAYER.num_encoder_layers + 3 * ONE_LAYER.num_decoder_layers
  assert len(variances(one)) >= norms and all(variances(one))
  assert len(variances(two)) >= norms and not any(variances(two))


@pytest.mark.parametrize(
    'variant',
    [
        {},
        {'tie_output_embedding': False},
        {'logits_bias': True, 'decoder_start': 'zero'},
        {'dtype': jnp.bfloat16},
    ],
)
def test_logits_sum_from_the_decoder_output_equals_the_reduction(variant):
  """`logits_sum='linear'` (GPUs' default: each token's sum of logits is the decoder output
  times the projection's column sums) gives the reduction's metrics and gradients to
  rounding: tied and untied projections, a bias and a zeroed pad logit, bfloat16."""
  from transformer_jax.training import train_steps

  rng = np.random.default_rng(13)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  reduce = dataclasses.replace(ONE_LAYER, **variant)
  assert reduce.logits_sum == 'reduce'
  linear = dataclasses.replace(reduce, logits_sum='linear')
  params = init(linear)
  if linear.logits_bias:  # Not zeros, so that its sum counts.
    params['decoder']['logits_bias'] = jnp.asarray(rng.normal(size=VOCAB), jnp.float32)
  batch = {
      'inputs': inputs,
      'targets': targets,
      'inputs_positions': None,
      'targets_positions': None,
      'inputs_segmentation': None,
      'targets_segmentation': None,
  }

  def metrics(cfg, p):
    sums = train_steps.batch_metrics(Transformer(cfg), p, batch, 0.1)
    return sums['loss'], sums

  # bfloat16 gradients differ by up to 0.6% of the largest here (f32: 2e-7): 5% leaves room
  # for another CPU's rounding; a wrong sum is caught by the float32 cases and below.
  tolerance = 5e-2 if variant.get('dtype') == jnp.bfloat16 else 1e-5
  (loss_l, sums_l), grads_l = jax.jit(
      jax.value_and_grad(lambda p: metrics(linear, p), has_aux=True)
  )(params)
  (loss_r, sums_r), grads_r = jax.jit(
      jax.value_and_grad(lambda p: metrics(reduce, p), has_aux=True)
  )(params)
  for name in ('loss', 'nll', 'correct', 'tokens'):
    np.testing.assert_allclose(sums_l[name], sums_r[name], rtol=tolerance)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_r))
  for a, b in zip(jax.tree.leaves(grads_l), jax.tree.leaves(grads_r)):
    np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance * scale)
  # The loss depends on the sums through the smoothing term: a wrong sum would show.
  wrong = losses.compute_metrics(
      apply(reduce, {'params': params}, inputs, targets),
      targets,
      targets > 0,
      0.1,
      logit_sums=jnp.zeros(targets.shape),
  )['loss']
  gap = abs(float(loss_l) - float(loss_r))
  assert abs(float(wrong) - float(loss_r)) > 10 * gap + 1e-4 * abs(float(loss_r)), gap


def _loss_logits_and_grads(cfg, params, inputs, targets, seed=0):
  """The loss, logits and parameter gradients of one jitted step (dropout from `seed`)."""

  def loss(p):
    logits = Transformer(cfg).apply(
        {'params': p}, inputs, targets, rngs={'dropout': jax.random.key(seed)}
    )
    return losses.compute_metrics(logits, targets, targets > 0)['loss'], logits

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _assert_same_step(got, want, tolerance):
  """Logits and gradients within `tolerance` of the largest, the loss within it relatively."""
  (loss, logits), grads = got
  (want_loss, want_logits), want_grads = want
  np.testing.assert_allclose(logits, want_logits, atol=tolerance * float(np.abs(want_logits).max()))
  np.testing.assert_allclose(loss, want_loss, rtol=tolerance)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, atol=tolerance * largest)


def test_pallas_post_norm_kernel_equals_xlas_with_the_same_dropout():
  """`post_norm_kernel='pallas'` (Pallas's interpreter here; Triton on GPUs) gives XLA's
  logits and gradients to float32 rounding, with dropout on: the same masks from the same
  keys, the same parameter tree. (bfloat16: test_fused_norm.)"""
  rng = np.random.default_rng(14)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  xla = dataclasses.replace(ONE_LAYER, dropout_rate=0.3, deterministic=False)
  fused = dataclasses.replace(xla, post_norm_kernel='pallas_interpret')
  params = init(xla)
  assert jax.tree.structure(params) == jax.tree.structure(init(fused))
  want = _loss_logits_and_grads(xla, params, inputs, targets)
  _assert_same_step(_loss_logits_and_grads(fused, params, inputs, targets), want, 1e-5)
  # Another dropout key moves the logits by far more: the masks are live and the same.
  (_, other), _ = _loss_logits_and_grads(xla, params, inputs, targets, seed=1)
  logits = want[0][1]
  assert np.abs(other - logits).max() > 1e-2 * np.abs(logits).max()


@pytest.mark.parametrize('name', ['post_sinusoidal', 'rope'])
def test_stacked_qkv_projection_equals_separate_ones(name):
  """`qkv_projection='stacked'` (one matmul over the kernels stacked at use) initialises the
  same parameters and gives the separate projections' logits and gradients to rounding."""
  rng = np.random.default_rng(15)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  separate = dataclasses.replace(VARIANTS[name], num_encoder_layers=1, num_decoder_layers=1)
  stacked = dataclasses.replace(separate, qkv_projection='stacked')
  params = init(separate)
  jax.tree.map(np.testing.assert_array_equal, init(stacked), params)
  _assert_same_step(
      _loss_logits_and_grads(stacked, params, inputs, targets),
      _loss_logits_and_grads(separate, params, inputs, targets),
      1e-5,
  )

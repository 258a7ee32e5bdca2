"""Behaviour of the model: causality, padding and packing invariance, cached decoding."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import attention
from transformer_jax import losses
from transformer_jax.config import BOS_ID, PAD_ID, TransformerConfig
from transformer_jax.models import Transformer

VOCAB = 40
TINY = TransformerConfig(vocab_size=VOCAB, d_model=32, num_heads=4, d_ff=64,
                         num_encoder_layers=2, num_decoder_layers=2, max_len=32,
                         deterministic=True)
VARIANTS = {
    'post_sinusoidal': TINY,
    'pre_norm': dataclasses.replace(TINY, norm_position='pre'),
    'learned': dataclasses.replace(TINY, positional_encoding='learned'),
    'rope': dataclasses.replace(TINY, positional_encoding='rope'),
    'alibi': dataclasses.replace(TINY, positional_encoding='alibi'),
    'separate_embeddings': dataclasses.replace(TINY, share_embeddings=False,
                                               tie_output_embedding=False),
    'stacked_qkv': dataclasses.replace(TINY, qkv_projection='stacked'),
}


def _tokens(rng, batch, length):
  return jnp.asarray(rng.integers(4, VOCAB, (batch, length)), jnp.int32)


def _init(cfg, inputs, targets):
  """The parameters of `cfg`'s model, which do not depend on the inputs' shapes: made once
  a config, at one small shape (eager ops compile for every new shape they meet)."""
  del inputs, targets
  return jax.tree.map(lambda x: x, _params(cfg))  # New dicts: a test may assign into them.


@functools.cache
def _params(cfg):
  tokens = jnp.full((1, 4), 5, jnp.int32)
  return Transformer(cfg).init(jax.random.PRNGKey(0), tokens, tokens)['params']


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
  return VARIANTS[request.param]


def test_alibi_slopes_and_bias_are_press_et_als():
  """The geometric slopes 2^(-8i/n), and for a head count that is not a power of two the
  closest power's slopes plus every other slope of twice as many (Press et al. 2021, 3.1)."""
  np.testing.assert_allclose(attention.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
  np.testing.assert_allclose(attention.alibi_slopes(6),
                             [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
  positions = jnp.arange(4)[None]
  bias = attention.alibi_bias(2, positions, positions)  # [1, heads, q, kv]
  np.testing.assert_allclose(bias[0, 1], -(2.0**-8) * np.abs(np.subtract.outer(
      np.arange(4), np.arange(4))), rtol=1e-6)


def test_changing_a_target_token_changes_no_earlier_logit(variant):
  rng = np.random.default_rng(0)
  inputs, targets = _tokens(rng, 2, 7), _tokens(rng, 2, 9)
  params = _init(variant, inputs, targets)
  model = Transformer(variant)
  logits = model.apply({'params': params}, inputs, targets)
  t = 4
  changed = targets.at[:, t].set((targets[:, t] + 1 - 4) % (VOCAB - 4) + 4)
  new_logits = model.apply({'params': params}, inputs, changed)
  # Target t is the decoder input at t+1: logits up to t depend only on targets < t.
  np.testing.assert_allclose(new_logits[:, :t + 1], logits[:, :t + 1], atol=1e-6)
  assert not np.allclose(new_logits[:, t + 1:], logits[:, t + 1:], atol=1e-4)


def test_extra_padding_changes_no_real_logit(variant):
  rng = np.random.default_rng(1)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 5)
  params = _init(variant, inputs, targets)
  model = Transformer(variant)
  logits = model.apply({'params': params}, inputs, targets)
  padded_inputs = jnp.pad(inputs, ((0, 0), (0, 5)), constant_values=PAD_ID)
  padded_targets = jnp.pad(targets, ((0, 0), (0, 3)), constant_values=PAD_ID)
  padded_logits = model.apply({'params': params}, padded_inputs, padded_targets)
  np.testing.assert_allclose(padded_logits[:, :5], logits, atol=2e-5, rtol=2e-5)


def _pack(rows):
  """Packs a list of 1-D token arrays into one row with positions and segment ids."""
  tokens = np.concatenate(rows)
  positions = np.concatenate([np.arange(len(r)) for r in rows])
  segments = np.concatenate([np.full(len(r), i + 1) for i, r in enumerate(rows)])
  return [jnp.asarray(a[None], jnp.int32) for a in (tokens, positions, segments)]


def test_packed_rows_equal_one_example_per_row(variant):
  rng = np.random.default_rng(2)
  sources = [rng.integers(4, VOCAB, n) for n in (5, 3, 6)]
  targets = [rng.integers(4, VOCAB, n) for n in (4, 6, 2)]
  packed_inputs, inputs_pos, inputs_seg = _pack(sources)
  packed_targets, targets_pos, targets_seg = _pack(targets)
  params = _init(variant, packed_inputs, packed_targets)
  model = Transformer(variant)
  packed_logits = model.apply(
      {'params': params}, packed_inputs, packed_targets, inputs_positions=inputs_pos,
      targets_positions=targets_pos, inputs_segmentation=inputs_seg,
      targets_segmentation=targets_seg)[0]
  # One example a row (right-padded to one shape: one set of compiled ops for all three).
  pad = lambda rows: jnp.asarray([np.pad(r, (0, 6 - len(r))) for r in rows], jnp.int32)
  singles = model.apply({'params': params}, pad(sources), pad(targets))
  offset = 0
  for single, target in zip(singles, targets):
    np.testing.assert_allclose(packed_logits[offset:offset + len(target)],
                               single[:len(target)], atol=2e-5, rtol=2e-5)
    offset += len(target)


def _decode_step_by_step(cfg, params, inputs, targets):
  """Teacher-forced decoding through the key/value cache, one token a call."""
  model = Transformer(dataclasses.replace(cfg, decode=True))
  encoded = model.apply({'params': params}, inputs, method=Transformer.encode)
  _, variables = model.apply({'params': params}, encoded, inputs, targets.shape[1],
                             method=Transformer.init_cache, mutable=['cache', 'encoder_cache'])
  cache, encoder_cache = variables['cache'], variables['encoder_cache']
  decoder_inputs = jnp.concatenate(
      [jnp.full((targets.shape[0], 1), BOS_ID, jnp.int32), targets[:, :-1]], axis=1)
  step = jax.jit(lambda cache, token: model.apply(
      {'params': params, 'encoder_cache': encoder_cache, 'cache': cache}, None, None, token,
      method=Transformer.decode, mutable=['cache']))
  logits = []
  for t in range(targets.shape[1]):
    out, variables = step(cache, decoder_inputs[:, t:t + 1])
    cache = variables['cache']
    logits.append(out[:, 0])
  return jnp.stack(logits, axis=1)


def test_cached_decoding_equals_full_forward_pass(variant):
  rng = np.random.default_rng(3)
  inputs, targets = _tokens(rng, 3, 6), _tokens(rng, 3, 8)
  inputs = inputs.at[1, 4:].set(PAD_ID)  # A padded source must be masked in the cache too.
  params = _init(variant, inputs, targets)
  full = Transformer(variant).apply({'params': params}, inputs, targets)
  cached = _decode_step_by_step(variant, params, inputs, targets)
  np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)


def _leaf_paths(tree) -> set[str]:
  return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def test_encoder_decoder_keys_and_values_are_kept_apart_from_the_step_cache():
  rng = np.random.default_rng(4)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 4)
  params = _init(TINY, inputs, targets)
  model = Transformer(dataclasses.replace(TINY, decode=True))
  encoded = model.apply({'params': params}, inputs, method=Transformer.encode)
  _, variables = model.apply({'params': params}, encoded, inputs, 5,
                             method=Transformer.init_cache, mutable=['cache', 'encoder_cache'])
  assert set(variables) == {'cache', 'encoder_cache'}
  layers = range(TINY.num_decoder_layers)
  # 'cache', which beam search reorders every step: self-attention and the index only.
  assert _leaf_paths(variables['cache']) == {"['decoder']['cache_index']"} | {
      f"['decoder']['layer_{i}']['self_attention']['cached_{name}']"
      for i in layers for name in ('key', 'value')}
  # 'encoder_cache': the source's keys, values and mask, for every layer.
  assert _leaf_paths(variables['encoder_cache']) == {
      f"['decoder']['layer_{i}']['encoder_decoder_attention']['cached_{name}']"
      for i in layers for name in ('key', 'value', 'mask')}
  self_cache = variables['cache']['decoder']['layer_0']['self_attention']
  cross = variables['encoder_cache']['decoder']['layer_0']['encoder_decoder_attention']
  # Heads-major, [batch, heads, positions, head_dim], as decode-step attention reads them.
  assert self_cache['cached_key'].shape == (2, 4, 5, 8)
  assert cross['cached_key'].shape == cross['cached_value'].shape == (2, 4, 6, 8)
  assert cross['cached_mask'].shape == (2, 1, 1, 6)

  # A step gets no encoder output at all, so it can only be using the cached projection:
  # changing the cached keys must change its logits. It writes 'cache' only.
  def step(encoder_cache):
    return model.apply({'params': params, 'encoder_cache': encoder_cache,
                        'cache': variables['cache']}, None, None, jnp.full((2, 1), BOS_ID),
                       method=Transformer.decode, mutable=['cache'])
  logits, new_variables = step(variables['encoder_cache'])
  assert set(new_variables) == {'cache'}
  assert int(new_variables['cache']['decoder']['cache_index']) == 1
  # A different shift for every source position and feature: one shift for all of them would
  # add the same q . shift to each of a query's scores, which softmax cancels.
  changed = jax.tree_util.tree_map_with_path(
      lambda path, x: (x + jnp.asarray(rng.normal(size=x.shape), x.dtype)
                       if 'cached_key' in jax.tree_util.keystr(path) else x),
      variables['encoder_cache'])
  assert np.abs(logits - step(changed)[0]).max() > 1e-3


def test_attention_weights_are_returned_on_request_and_sum_to_one():
  rng = np.random.default_rng(5)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 4)
  inputs = inputs.at[0, 4:].set(PAD_ID)
  params = _init(TINY, inputs, targets)
  model = Transformer(TINY)
  plain = model.apply({'params': params}, inputs, targets)
  logits, state = model.apply({'params': params}, inputs, targets, mutable=['intermediates'])
  np.testing.assert_allclose(logits, plain, atol=1e-5)
  weights = state['intermediates']['decoder']['layer_1']['encoder_decoder_attention'][
      'attention_weights'][0]
  assert weights.shape == (2, 4, 4, 6)  # [batch, heads, target, source]
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(weights[0, :, :, 4:], 0.0, atol=1e-7)  # Padding gets nothing.
  # The normal path neither computes nor stores them.
  assert 'intermediates' not in model.apply({'params': params}, inputs, targets,
                                            mutable=['cache'])[1]


def test_dropout_is_active_in_training_including_attention_dropout():
  cfg = dataclasses.replace(TINY, deterministic=False, attention_dropout_rate=0.2)
  rng = np.random.default_rng(6)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 5)
  params = _init(TINY, inputs, targets)
  model = Transformer(cfg)
  run = lambda seed: model.apply({'params': params}, inputs, targets,
                                 rngs={'dropout': jax.random.PRNGKey(seed)})
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(run(2), run(2))
  # Attention dropout alone (no other dropout) also changes the output.
  only_attention = dataclasses.replace(cfg, dropout_rate=0.0)
  run_attention = lambda seed: Transformer(only_attention).apply(
      {'params': params}, inputs, targets, rngs={'dropout': jax.random.PRNGKey(seed)})
  assert not np.allclose(run_attention(0), run_attention(1))


def test_bfloat16_computation_keeps_float32_params_and_loss():
  cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16)
  rng = np.random.default_rng(7)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 5)
  params = _init(cfg, inputs, targets)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  logits = Transformer(cfg).apply({'params': params}, inputs, targets)
  assert logits.dtype == jnp.bfloat16
  reference = Transformer(TINY).apply({'params': params}, inputs, targets)
  # bfloat16 keeps 8 bits of mantissa: logits of scale ~3 differ by 0.026 at most (measured
  # on two XLA CPU code paths); 0.15 is still far below the logits' spread (std ~1).
  np.testing.assert_allclose(np.asarray(logits, np.float32), reference, atol=0.15)
  metrics = losses.compute_metrics(logits, targets, jnp.ones_like(targets), 0.1)
  assert metrics['loss'].dtype == jnp.float32


def test_every_parameter_has_logical_axis_names():
  rng = np.random.default_rng(8)
  for cfg in VARIANTS.values():
    boxed = Transformer(cfg).init(jax.random.PRNGKey(0), _tokens(rng, 1, 4),
                                  _tokens(rng, 1, 4))['params']
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(
        x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
    vocabulary = {'batch', 'length', 'embed', 'mlp', 'heads', 'kv', 'vocab', None}
    for leaf in leaves:
      assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= vocabulary


def test_remat_policies_give_the_same_gradients():
  rng = np.random.default_rng(9)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 5)
  params = _init(TINY, inputs, targets)

  def grads(cfg):
    def loss(p):
      logits = Transformer(cfg).apply({'params': p}, inputs, targets)
      return losses.compute_metrics(logits, targets, targets > 0)['loss']
    return jax.grad(loss)(params)

  reference = grads(TINY)
  for policy in ('full', 'dots'):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                           grads(dataclasses.replace(TINY, remat_policy=policy)),
                           reference)


@pytest.mark.parametrize('shared', [True, False])
def test_zero_decoder_start_holds_the_pad_row_at_zero(shared):
  """decoder_start='zero': <pad>'s embedding row starts at zero and gets no gradient, so it
  stays zero through training, and what is stored in it never changes an output."""
  cfg = dataclasses.replace(TINY, decoder_start='zero', share_embeddings=shared,
                            tie_output_embedding=shared)
  rng = np.random.default_rng(11)
  inputs, targets = _tokens(rng, 2, 6), _tokens(rng, 2, 5)
  inputs, targets = inputs.at[0, 4:].set(PAD_ID), targets.at[1, 3:].set(PAD_ID)
  params = nn.unbox(_init(cfg, inputs, targets))
  names = ['shared_embedding'] if shared else ['source_embedding', 'target_embedding']
  for name in names:
    table = np.asarray(params[name]['embedding'])
    assert not table[PAD_ID].any() and table[1:].any(axis=1).all(), name

  def loss(p, cfg):
    logits = Transformer(cfg).apply({'params': p}, inputs, targets)
    return losses.compute_metrics(logits, targets, targets > 0)['loss']

  grads = jax.grad(loss)(params, cfg)
  for name in names:
    assert not np.asarray(grads[name]['embedding'][PAD_ID]).any(), name
  # Starting from <pad>'s own embedding ('pad', Hugging Face's way) trains that row.
  grads = jax.grad(loss)(params, dataclasses.replace(cfg, decoder_start='pad'))
  assert np.asarray(grads[names[-1]]['embedding'][PAD_ID]).any()

  filled = {**params, **{name: {'embedding': params[name]['embedding'].at[PAD_ID].set(5.0)}
                         for name in names}}
  np.testing.assert_array_equal(Transformer(cfg).apply({'params': filled}, inputs, targets),
                                Transformer(cfg).apply({'params': params}, inputs, targets))


def test_loss_sums_aggregate_and_label_smoothing_matches_definition():
  rng = np.random.default_rng(10)
  logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  targets = jnp.asarray([[1, 2, 0], [3, 0, 0]])
  weights = (targets > 0).astype(jnp.float32)
  m = losses.compute_metrics(logits, targets, weights, label_smoothing=0.1)
  log_probs = jax.nn.log_softmax(logits)
  q = 0.9 * jax.nn.one_hot(targets, 7) + 0.1 / 7
  expected = -(q * log_probs).sum(-1)
  np.testing.assert_allclose(m['loss'], (expected * weights).sum(), rtol=1e-6)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(m['nll'], (nll * weights).sum(), rtol=1e-6)
  assert m['tokens'] == 3
  # 'correct' counts argmax hits: here the first token of each row is one.
  guesses = targets.at[:, 0].set(jnp.argmax(logits[:, 0], axis=-1))
  hits = (jnp.argmax(logits, axis=-1) == guesses) * weights
  correct = losses.compute_metrics(logits, guesses, weights)['correct']
  assert correct == hits.sum() and 2 <= correct < 3
  # A tie for the largest logit counts as correct, whichever id argmax would pick.
  tied = jnp.zeros((1, 1, 7)).at[0, 0, 2].set(1.0).at[0, 0, 5].set(1.0)
  for target in (2, 5, 4):
    correct = losses.compute_metrics(tied, jnp.array([[target]]), jnp.ones((1, 1)))['correct']
    assert correct == (target != 4)
  # Sums over two halves add up to the sum over the whole.
  halves = [losses.compute_metrics(logits[i:i + 1], targets[i:i + 1], weights[i:i + 1])
            for i in range(2)]
  np.testing.assert_allclose(halves[0]['loss'] + halves[1]['loss'], m['loss'], rtol=1e-6)


def _plain_metrics(logits, targets, weights, eps):
  """The loss written the plain way (float32 log-softmax, autodiff through it)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  smoothed = (1.0 - eps) * nll - eps * log_probs.mean(axis=-1)
  return jnp.sum(smoothed * weights), jnp.sum(nll * weights)


@pytest.mark.parametrize('dtype,rtol', [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize('eps', [0.0, 0.1])
def test_fused_loss_and_its_gradient_equal_the_plain_ones(dtype, rtol, eps):
  """`token_losses`' hand-written gradient (no float32 log-probabilities kept) against
  autodiff through the plain float32 log-softmax, for the loss and for the nll."""
  rng = np.random.default_rng(11)
  logits = jnp.asarray(3 * rng.normal(size=(3, 5, 301)), dtype)
  targets = jnp.asarray(rng.integers(0, 301, size=(3, 5)))
  weights = jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32)
  m = losses.compute_metrics(logits, targets, weights, eps)
  loss, nll = _plain_metrics(logits, targets, weights, eps)
  np.testing.assert_allclose(m['loss'], loss, rtol=2e-6)
  np.testing.assert_allclose(m['nll'], nll, rtol=2e-6)
  for index, name in ((0, 'loss'), (1, 'nll')):
    got = jax.grad(lambda x: losses.compute_metrics(x, targets, weights, eps)[name])(logits)
    want = jax.grad(lambda x: _plain_metrics(x, targets, weights, eps)[index])(logits)
    assert got.dtype == dtype
    # float32: rounding only. bfloat16: both are rounded to 8 bits at the end.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=rtol, atol=rtol * float(jnp.abs(want).max()))


def test_fused_loss_keeps_no_float32_copy_of_the_logits():
  """What the backward pass keeps: the bfloat16 logits and a float32 number a token, not a
  float32 [batch, length, vocab] array."""
  logits = jnp.zeros((4, 8, 1000), jnp.bfloat16)
  targets = jnp.zeros((4, 8), jnp.int32)
  _, residuals = jax.vjp(lambda x: losses.token_losses(x, targets, 0.1), logits)
  kept = [leaf for leaf in jax.tree.leaves(residuals) if hasattr(leaf, 'shape')]
  large = [leaf for leaf in kept if leaf.size >= logits.size]
  assert large and all(leaf.dtype == jnp.bfloat16 for leaf in large), [
      (leaf.shape, leaf.dtype) for leaf in kept]


@pytest.mark.parametrize('attention_dropout', [0.0, 0.3])
def test_attention_fed_lengths_equals_the_dense_mask(attention_dropout):
  """What cuDNN is given on a GPU (sequence lengths and a causal flag) means what the dense
  mask means, for logits and gradients, on right-padded rows of different lengths; with
  attention dropout the lengths become a mask for the explicit softmax."""
  rng = np.random.default_rng(11)
  inputs, targets = _tokens(rng, 3, 9), _tokens(rng, 3, 7)
  inputs = inputs.at[0, 5:].set(PAD_ID).at[2, 8:].set(PAD_ID)
  targets = targets.at[1, 3:].set(PAD_ID).at[2, 6:].set(PAD_ID)
  dense = dataclasses.replace(TINY, attention_dropout_rate=attention_dropout,
                              deterministic=attention_dropout == 0.0)
  params = _init(dense, inputs, targets)
  weights = targets > 0

  def loss_and_grads(cfg):
    def loss(p):
      logits = Transformer(cfg).apply({'params': p}, inputs, targets,
                                      rngs={'dropout': jax.random.PRNGKey(3)})
      return losses.compute_metrics(logits, targets, weights)['loss'], logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (loss, logits), grads = loss_and_grads(dense)
  (loss_l, logits_l), grads_l = loss_and_grads(
      dataclasses.replace(dense, attention_lengths=True))
  real = np.asarray(weights)
  np.testing.assert_allclose(np.asarray(logits_l)[real], np.asarray(logits)[real],
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(loss_l, loss, rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
                         grads_l, grads)


@pytest.mark.parametrize('norm_position', ['post', 'pre'])
def test_one_pass_layer_norm_statistics_equal_two_pass_ones(norm_position):
  """`layer_norm_statistics='one_pass'` (the default) gives the two-pass model's logits and
  gradients to float32 rounding, from the same parameters."""
  rng = np.random.default_rng(12)
  inputs, targets = _tokens(rng, 3, 9), _tokens(rng, 3, 7)
  one = dataclasses.replace(TINY, norm_position=norm_position)
  two = dataclasses.replace(one, layer_norm_statistics='two_pass')
  assert one.layer_norm_statistics == 'one_pass'
  params = _init(one, inputs, targets)

  def loss(cfg, p):
    logits = Transformer(cfg).apply({'params': p}, inputs, targets)
    return losses.compute_metrics(logits, targets, targets > 0)['loss'], logits

  (loss_one, logits_one), grads_one = jax.value_and_grad(
      lambda p: loss(one, p), has_aux=True)(params)
  (loss_two, logits_two), grads_two = jax.value_and_grad(
      lambda p: loss(two, p), has_aux=True)(params)
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
  norms = 2 * TINY.num_encoder_layers + 3 * TINY.num_decoder_layers
  assert len(variances(one)) >= norms and all(variances(one))
  assert len(variances(two)) >= norms and not any(variances(two))


@pytest.mark.parametrize('variant', [
    {}, {'tie_output_embedding': False}, {'logits_bias': True, 'decoder_start': 'zero'},
    {'dtype': jnp.bfloat16}])
def test_logits_sum_from_the_decoder_output_equals_the_reduction(variant):
  """`logits_sum='linear'` (GPUs' default: each token's sum of logits is the decoder output
  times the projection's column sums) gives the reduction's metrics and gradients to
  rounding: tied and untied projections, a bias and a zeroed pad logit, bfloat16."""
  from transformer_jax import train_steps  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(13)
  inputs, targets = _tokens(rng, 3, 9), _tokens(rng, 3, 7)
  reduce = dataclasses.replace(TINY, **variant)
  assert reduce.logits_sum == 'reduce'
  linear = dataclasses.replace(reduce, logits_sum='linear')
  params = _init(linear, inputs, targets)
  if linear.logits_bias:  # Not zeros, so that its sum counts.
    params['decoder']['logits_bias'] = jnp.asarray(rng.normal(size=VOCAB), jnp.float32)
  batch = {'inputs': inputs, 'targets': targets,
           'inputs_positions': None, 'targets_positions': None,
           'inputs_segmentation': None, 'targets_segmentation': None}

  def metrics(cfg, p):
    sums = train_steps.batch_metrics(Transformer(cfg), p, batch, 0.1)
    return sums['loss'], sums

  # bfloat16 gradients differ by up to 0.6% of the largest here (f32: 2e-7): 5% leaves room
  # for another CPU's rounding; a wrong sum is caught by the float32 cases and below.
  tolerance = 5e-2 if variant.get('dtype') == jnp.bfloat16 else 1e-5
  (loss_l, sums_l), grads_l = jax.value_and_grad(lambda p: metrics(linear, p),
                                                 has_aux=True)(params)
  (loss_r, sums_r), grads_r = jax.value_and_grad(lambda p: metrics(reduce, p),
                                                 has_aux=True)(params)
  for name in ('loss', 'nll', 'correct', 'tokens'):
    np.testing.assert_allclose(sums_l[name], sums_r[name], rtol=tolerance)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_r))
  for a, b in zip(jax.tree.leaves(grads_l), jax.tree.leaves(grads_r)):
    np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance * scale)
  # The loss depends on the sums through the smoothing term: a wrong sum would show.
  wrong = losses.compute_metrics(
      Transformer(reduce).apply({'params': params}, inputs, targets), targets, targets > 0,
      0.1, logit_sums=jnp.zeros(targets.shape))['loss']
  gap = abs(float(loss_l) - float(loss_r))
  assert abs(float(wrong) - float(loss_r)) > 10 * gap + 1e-4 * abs(float(loss_r)), gap


def _loss_logits_and_grads(cfg, params, inputs, targets, seed=0):
  """The loss, logits and parameter gradients of one jitted step (dropout from `seed`)."""
  def loss(p):
    logits = Transformer(cfg).apply({'params': p}, inputs, targets,
                                    rngs={'dropout': jax.random.key(seed)})
    return losses.compute_metrics(logits, targets, targets > 0)['loss'], logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _assert_same_step(got, want, tolerance):
  """Logits and gradients within `tolerance` of the largest, the loss within it relatively."""
  (loss, logits), grads = got
  (want_loss, want_logits), want_grads = want
  np.testing.assert_allclose(logits, want_logits,
                             atol=tolerance * float(np.abs(want_logits).max()))
  np.testing.assert_allclose(loss, want_loss, rtol=tolerance)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, atol=tolerance * largest)


def test_pallas_post_norm_kernel_equals_xlas_with_the_same_dropout():
  """`post_norm_kernel='pallas'` (Pallas's interpreter here; Triton on GPUs) gives XLA's
  logits and gradients to float32 rounding, with dropout on: the same masks from the same
  keys, the same parameter tree. (bfloat16: test_fused_norm.)"""
  rng = np.random.default_rng(14)
  inputs, targets = _tokens(rng, 3, 9), _tokens(rng, 3, 7)
  xla = dataclasses.replace(TINY, dropout_rate=0.3, deterministic=False, num_encoder_layers=1,
                            num_decoder_layers=1)
  fused = dataclasses.replace(xla, post_norm_kernel='pallas_interpret')
  params = _init(xla, inputs, targets)
  assert jax.tree.structure(params) == jax.tree.structure(_init(fused, inputs, targets))
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
  inputs, targets = _tokens(rng, 3, 9), _tokens(rng, 3, 7)
  separate = VARIANTS[name]
  stacked = dataclasses.replace(separate, qkv_projection='stacked')
  params = _init(separate, inputs, targets)
  jax.tree.map(np.testing.assert_array_equal, _init(stacked, inputs, targets), params)
  _assert_same_step(_loss_logits_and_grads(stacked, params, inputs, targets),
                    _loss_logits_and_grads(separate, params, inputs, targets), 1e-5)

"""Behaviour of the model: causality, padding and packing invariance, cached decoding,
attention weights, dropout, dtypes, parameters' axes, the decoder start and the losses."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models_testlib import apply
from models_testlib import cached_params
from models_testlib import init
from models_testlib import SOURCE
from models_testlib import TARGET
from models_testlib import TINY
from models_testlib import tokens
from models_testlib import VARIANTS
from models_testlib import VOCAB
from transformer_jax.config import BOS_ID
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.model import attention
from transformer_jax.model import losses
from transformer_jax.model.kernels import cross_entropy
from transformer_jax.model.kernels import tied_projection
from transformer_jax.model.models import BATCH_KEYS
from transformer_jax.model.models import Transformer
from transformer_jax.training import train_steps


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
  return VARIANTS[request.param]


def test_rope_turns_each_half_split_pair_by_its_angle_and_keeps_dtypes():
  """Su et al.'s rotation in GPT-NeoX's layout: the pair (x[i], x[i + d/2]) as the complex
  number x[i] + j x[i + d/2], times exp(j * position * 10000^(-i/(d/2))); so a query at m and
  a key at n score by m - n alone."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  positions = np.array([[0, 1, 2, 0, 1], [4, 9, 2, 7, 100]])
  half = 4
  z = x[..., :half] + 1j * x[..., half:]
  angle = positions[:, :, None, None] * 10000.0 ** (-np.arange(half) / half)
  turned = z * np.exp(1j * angle)
  want = np.concatenate([turned.real, turned.imag], axis=-1)
  np.testing.assert_allclose(
      attention.rope(jnp.asarray(x), jnp.asarray(positions)), want, atol=2e-5
  )
  q, k = jnp.asarray(x[:1, :1]), jnp.asarray(x[1:, :1])
  score = lambda m, n: float(
      jnp.sum(attention.rope(q, jnp.array([[m]])) * attention.rope(k, jnp.array([[n]])))
  )
  assert score(7, 3) == pytest.approx(score(4, 0), rel=1e-4, abs=1e-5)
  assert abs(score(7, 3) - score(3, 7)) > 1e-3  # Direction matters.
  assert attention.rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions)).dtype == jnp.bfloat16


def test_alibi_slopes_and_bias_are_press_et_als():
  """The geometric slopes 2^(-8i/n), and for a head count that is not a power of two the
  closest power's slopes plus every other slope of twice as many (Press et al. 2021, 3.1)."""
  np.testing.assert_allclose(attention.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
  np.testing.assert_allclose(attention.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
  positions = jnp.arange(4)[None]
  bias = attention.alibi_bias(2, positions, positions)  # [1, heads, q, kv]
  np.testing.assert_allclose(
      bias[0, 1], -(2.0**-8) * np.abs(np.subtract.outer(np.arange(4), np.arange(4))), rtol=1e-6
  )


def test_changing_a_target_token_changes_no_earlier_logit(variant):
  rng = np.random.default_rng(0)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  params = init(variant)
  logits = apply(variant, {'params': params}, inputs, targets)
  t = 4
  changed = targets.at[:, t].set((targets[:, t] + 1 - 4) % (VOCAB - 4) + 4)
  new_logits = apply(variant, {'params': params}, inputs, changed)
  # Target t is the decoder input at t+1: logits up to t depend only on targets < t.
  np.testing.assert_allclose(new_logits[:, : t + 1], logits[:, : t + 1], atol=1e-6)
  assert not np.allclose(new_logits[:, t + 1 :], logits[:, t + 1 :], atol=1e-4)


def test_extra_padding_changes_no_real_logit(variant):
  rng = np.random.default_rng(1)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  params = init(variant)
  logits = apply(variant, {'params': params}, inputs, targets)
  padded_inputs = jnp.pad(inputs, ((0, 0), (0, 5)), constant_values=PAD_ID)
  padded_targets = jnp.pad(targets, ((0, 0), (0, 3)), constant_values=PAD_ID)
  padded_logits = apply(variant, {'params': params}, padded_inputs, padded_targets)
  np.testing.assert_allclose(padded_logits[:, : TARGET[1]], logits, atol=2e-5, rtol=2e-5)


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
  params = init(variant)
  packed_logits = apply(
      variant,
      {'params': params},
      packed_inputs,
      packed_targets,
      inputs_positions=inputs_pos,
      targets_positions=targets_pos,
      inputs_segmentation=inputs_seg,
      targets_segmentation=targets_seg,
  )[0]
  # One example a row, right-padded to the shapes the other tests compile for.
  pad = lambda rows, shape: jnp.asarray(
      [np.pad(r, (0, shape[1] - len(r))) for r in rows], jnp.int32
  )
  singles = apply(variant, {'params': params}, pad(sources, SOURCE), pad(targets, TARGET))
  offset = 0
  for single, target in zip(singles, targets):
    np.testing.assert_allclose(
        packed_logits[offset : offset + len(target)], single[: len(target)], atol=2e-5, rtol=2e-5
    )
    offset += len(target)


def _decode_step_by_step(cfg, params, inputs, targets):
  """Teacher-forced decoding through the key/value cache, one token a call."""
  cfg = dataclasses.replace(cfg, decode=True)
  model = Transformer(cfg)
  encoded = apply(cfg, {'params': params}, inputs, method=Transformer.encode)
  _, variables = model.apply(
      {'params': params},
      encoded,
      inputs,
      targets.shape[1],
      method=Transformer.init_cache,
      mutable=['cache', 'encoder_cache'],
  )
  cache, encoder_cache = variables['cache'], variables['encoder_cache']
  decoder_inputs = jnp.concatenate(
      [jnp.full((targets.shape[0], 1), BOS_ID, jnp.int32), targets[:, :-1]], axis=1
  )
  logits = []
  for t in range(targets.shape[1]):
    out, variables = apply(
        cfg,
        {'params': params, 'encoder_cache': encoder_cache, 'cache': cache},
        None,
        None,
        decoder_inputs[:, t : t + 1],
        method=Transformer.decode,
        mutable=['cache'],
    )
    cache = variables['cache']
    logits.append(out[:, 0])
  return jnp.stack(logits, axis=1)


def test_cached_decoding_equals_full_forward_pass(variant):
  rng = np.random.default_rng(3)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  inputs = inputs.at[1, 4:].set(PAD_ID)  # A padded source must be masked in the cache too.
  params = init(variant)
  full = apply(variant, {'params': params}, inputs, targets)
  cached = _decode_step_by_step(variant, params, inputs, targets)
  np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)


def test_output_ids_score_only_their_pieces_and_the_loss_counts_others_as_unk():
  # The main job's output layer (output_vocabulary='target'): tied, pre-norm, with a bias.
  full = dataclasses.replace(VARIANTS['pre_norm'], logits_bias=True)
  ids = (EOS_ID, UNK_ID, 5, 9, 17, 30, 39)
  short = dataclasses.replace(full, output_ids=ids)
  rng = np.random.default_rng(4)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  targets = targets.at[:, :3].set(jnp.asarray([17, 5, EOS_ID])).at[2, 5:].set(PAD_ID)
  params = init(full)
  params['decoder']['logits_bias'] = jnp.linspace(-1.0, 1.0, VOCAB)
  logits = apply(full, {'params': params}, inputs, targets)
  kept = logits[..., list(ids)]
  # Training: the columns of `ids`, in their order, and nothing else.
  trained = apply(short, {'params': params}, inputs, targets)
  np.testing.assert_allclose(trained, kept, rtol=1e-5, atol=1e-5)
  # Decoding: the whole vocabulary, -inf where the layer scores nothing.
  cached = _decode_step_by_step(short, params, inputs, targets)
  real = np.asarray(targets != PAD_ID)  # The full pass masks the padding; decoding cannot.
  np.testing.assert_allclose(cached[..., list(ids)][real], kept[real], rtol=1e-5, atol=1e-5)
  others = np.setdiff1d(np.arange(VOCAB), ids)
  assert np.all(np.isneginf(cached[..., others])) and np.all(np.isfinite(cached[..., list(ids)]))
  # The loss: a softmax over `ids`; a reference outside them is scored as UNK. Both ways of
  # summing the logits for label smoothing sum over `ids` only.
  log_probs = jax.nn.log_softmax(kept, axis=-1)
  column = np.where(np.isin(targets, ids), np.searchsorted(ids, targets), ids.index(UNK_ID))
  assert (column[:, :3] == [4, 2, 0]).all()
  assert (~np.isin(targets, ids) & (targets != PAD_ID)).sum() >= 3  # Counted as UNK.
  nll = -np.take_along_axis(np.asarray(log_probs), column[..., None], -1)[..., 0]
  weights = real
  smoothed = 0.9 * nll - 0.1 * np.asarray(log_probs).mean(-1)
  batch = {k: None for k in BATCH_KEYS} | {'inputs': inputs, 'targets': targets}
  for logits_sum in ('reduce', 'linear'):
    model = Transformer(dataclasses.replace(short, logits_sum=logits_sum))
    # One program, not each operation compiled on its own.
    metrics = jax.jit(lambda p, b, m=model: train_steps.batch_metrics(m, p, b, 0.1))(params, batch)
    np.testing.assert_allclose(metrics['nll'], (nll * weights).sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics['loss'], (smoothed * weights).sum(), rtol=1e-5)


def _leaf_paths(tree) -> set[str]:
  return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


def test_encoder_decoder_keys_and_values_are_kept_apart_from_the_step_cache():
  rng = np.random.default_rng(4)
  inputs = tokens(rng, 2, 6)
  params = init(TINY)
  model = Transformer(dataclasses.replace(TINY, decode=True))
  encoded = apply(model.config, {'params': params}, inputs, method=Transformer.encode)
  _, variables = model.apply(
      {'params': params},
      encoded,
      inputs,
      5,
      method=Transformer.init_cache,
      mutable=['cache', 'encoder_cache'],
  )
  assert set(variables) == {'cache', 'encoder_cache'}
  layers = range(TINY.num_decoder_layers)
  # 'cache', which beam search reorders every step: self-attention and the index only.
  assert _leaf_paths(variables['cache']) == {"['decoder']['cache_index']"} | {
      f"['decoder']['layer_{i}']['self_attention']['cached_{name}']"
      for i in layers
      for name in ('key', 'value')
  }
  # 'encoder_cache': the source's keys, values and mask, for every layer.
  assert _leaf_paths(variables['encoder_cache']) == {
      f"['decoder']['layer_{i}']['encoder_decoder_attention']['cached_{name}']"
      for i in layers
      for name in ('key', 'value', 'mask')
  }
  self_cache = variables['cache']['decoder']['layer_0']['self_attention']
  cross = variables['encoder_cache']['decoder']['layer_0']['encoder_decoder_attention']
  # Heads-major, [batch, heads, positions, head_dim], as decode-step attention reads them.
  assert self_cache['cached_key'].shape == (2, 4, 5, 8)
  assert cross['cached_key'].shape == cross['cached_value'].shape == (2, 4, 6, 8)
  assert cross['cached_mask'].shape == (2, 1, 1, 6)

  # A step gets no encoder output at all, so it can only be using the cached projection:
  # changing the cached keys must change its logits. It writes 'cache' only.
  def step(encoder_cache):
    return apply(
        model.config,
        {'params': params, 'encoder_cache': encoder_cache, 'cache': variables['cache']},
        None,
        None,
        jnp.full((2, 1), BOS_ID),
        method=Transformer.decode,
        mutable=['cache'],
    )

  logits, new_variables = step(variables['encoder_cache'])
  assert set(new_variables) == {'cache'}
  assert int(new_variables['cache']['decoder']['cache_index']) == 1
  # A different shift for every source position and feature: one shift for all of them would
  # add the same q . shift to each of a query's scores, which softmax cancels.
  changed = jax.tree_util.tree_map_with_path(
      lambda path, x: (
          x + jnp.asarray(rng.normal(size=x.shape), x.dtype)
          if 'cached_key' in jax.tree_util.keystr(path)
          else x
      ),
      variables['encoder_cache'],
  )
  assert np.abs(logits - step(changed)[0]).max() > 1e-3


def test_attention_weights_are_returned_on_request_and_sum_to_one():
  rng = np.random.default_rng(5)
  inputs, targets = tokens(rng, 2, 6), tokens(rng, 2, 4)
  inputs = inputs.at[0, 4:].set(PAD_ID)
  params = init(TINY)
  plain = apply(TINY, {'params': params}, inputs, targets)
  logits, state = apply(TINY, {'params': params}, inputs, targets, mutable=['intermediates'])
  np.testing.assert_allclose(logits, plain, atol=1e-5)
  weights = state['intermediates']['decoder']['layer_1']['encoder_decoder_attention'][
      'attention_weights'
  ][0]
  assert weights.shape == (2, 4, 4, 6)  # [batch, heads, target, source]
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(weights[0, :, :, 4:], 0.0, atol=1e-7)  # Padding gets nothing.
  # The normal path neither computes nor stores them.
  assert (
      'intermediates' not in apply(TINY, {'params': params}, inputs, targets, mutable=['cache'])[1]
  )


def test_dropout_is_active_in_training_including_attention_dropout():
  cfg = dataclasses.replace(TINY, deterministic=False, attention_dropout_rate=0.2)
  rng = np.random.default_rng(6)
  inputs, targets = tokens(rng, 2, 6), tokens(rng, 2, 5)
  params = init(TINY)
  run = lambda seed: apply(
      cfg, {'params': params}, inputs, targets, rngs={'dropout': jax.random.PRNGKey(seed)}
  )
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(run(2), run(2))
  # Attention dropout alone (no other dropout) also changes the output.
  only_attention = dataclasses.replace(cfg, dropout_rate=0.0)
  run_attention = lambda seed: apply(
      only_attention,
      {'params': params},
      inputs,
      targets,
      rngs={'dropout': jax.random.PRNGKey(seed)},
  )
  assert not np.allclose(run_attention(0), run_attention(1))


def test_bfloat16_computation_keeps_float32_params_and_loss():
  cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16)
  rng = np.random.default_rng(7)
  inputs, targets = tokens(rng, *SOURCE), tokens(rng, *TARGET)
  params = init(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  logits = apply(cfg, {'params': params}, inputs, targets)
  assert logits.dtype == jnp.bfloat16
  reference = apply(TINY, {'params': params}, inputs, targets)
  # bfloat16 keeps 8 bits of mantissa: logits of scale ~3 differ by 0.026 at most (measured
  # on two XLA CPU code paths); 0.15 is still far below the logits' spread (std ~1).
  np.testing.assert_allclose(np.asarray(logits, np.float32), reference, atol=0.15)
  metrics = losses.compute_metrics(logits, targets, jnp.ones_like(targets), 0.1)
  assert metrics['loss'].dtype == jnp.float32


def test_every_parameter_has_logical_axis_names():
  for cfg in VARIANTS.values():
    boxed = cached_params(cfg)  # What Transformer(cfg).init gives.
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
    vocabulary = {'batch', 'length', 'embed', 'mlp', 'heads', 'kv', 'vocab', None}
    for leaf in leaves:
      assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= vocabulary


@pytest.mark.parametrize('shared', [True, False])
def test_zero_decoder_start_holds_the_pad_row_at_zero(shared):
  """decoder_start='zero': <pad>'s embedding row starts at zero and gets no gradient, so it
  stays zero through training, and what is stored in it never changes an output."""
  cfg = dataclasses.replace(
      TINY, decoder_start='zero', share_embeddings=shared, tie_output_embedding=shared
  )
  rng = np.random.default_rng(11)
  inputs, targets = tokens(rng, 2, 6), tokens(rng, 2, 5)
  inputs, targets = inputs.at[0, 4:].set(PAD_ID), targets.at[1, 3:].set(PAD_ID)
  params = nn.unbox(init(cfg))
  names = ['shared_embedding'] if shared else ['source_embedding', 'target_embedding']
  for name in names:
    table = np.asarray(params[name]['embedding'])
    assert not table[PAD_ID].any() and table[1:].any(axis=1).all(), name

  def loss(p, cfg):
    logits = Transformer(cfg).apply({'params': p}, inputs, targets)
    return losses.compute_metrics(logits, targets, targets > 0)['loss']

  grads = jax.jit(jax.grad(loss), static_argnums=1)(params, cfg)
  for name in names:
    assert not np.asarray(grads[name]['embedding'][PAD_ID]).any(), name
  # Starting from <pad>'s own embedding ('pad', Hugging Face's way) trains that row.
  grads = jax.jit(jax.grad(loss), static_argnums=1)(
      params, dataclasses.replace(cfg, decoder_start='pad')
  )
  assert np.asarray(grads[names[-1]]['embedding'][PAD_ID]).any()

  filled = {
      **params,
      **{name: {'embedding': params[name]['embedding'].at[PAD_ID].set(5.0)} for name in names},
  }
  np.testing.assert_array_equal(
      apply(cfg, {'params': filled}, inputs, targets),
      apply(cfg, {'params': params}, inputs, targets),
  )


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
  halves = [
      losses.compute_metrics(logits[i : i + 1], targets[i : i + 1], weights[i : i + 1])
      for i in range(2)
  ]
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
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(want, np.float32),
        rtol=rtol,
        atol=rtol * float(jnp.abs(want).max()),
    )


@pytest.mark.parametrize('dtype,rtol', [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize('shape', [(3, 5), (4,)])
def test_tied_output_projection_and_its_gradient_equal_autodiffs(dtype, rtol, shape):
  """`tied_projection.project`'s written-out backward (the logits' gradient read in one layout)
  against autodiff through the plain einsum, for training's [batch, length] and decoding's
  [rows] leading dimensions."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(*shape, 16)), dtype)
  rows = jnp.asarray(rng.normal(size=(37, 16)), dtype)
  cotangent = jnp.asarray(rng.normal(size=(*shape, 37)), dtype)
  plain = lambda x, rows: jnp.einsum('...d,vd->...v', x, rows)
  got, got_vjp = jax.vjp(tied_projection.project, x, rows)
  want, want_vjp = jax.vjp(plain, x, rows)
  assert got.shape == (*shape, 37) and got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  for g, w in zip(got_vjp(cotangent), want_vjp(cotangent), strict=True):
    assert g.shape == w.shape and g.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(g, np.float32),
        np.asarray(w, np.float32),
        rtol=rtol,
        atol=rtol * float(jnp.abs(w.astype(jnp.float32)).max()),
    )


def test_fused_loss_keeps_no_float32_copy_of_the_logits():
  """What the backward pass keeps: the bfloat16 logits and a float32 number a token, not a
  float32 [batch, length, vocab] array."""
  logits = jnp.zeros((4, 8, 1000), jnp.bfloat16)
  targets = jnp.zeros((4, 8), jnp.int32)
  _, residuals = jax.vjp(lambda x: cross_entropy.token_losses(x, targets, 0.1), logits)
  kept = [leaf for leaf in jax.tree.leaves(residuals) if hasattr(leaf, 'shape')]
  large = [leaf for leaf in kept if leaf.size >= logits.size]
  assert large and all(leaf.dtype == jnp.bfloat16 for leaf in large), [
      (leaf.shape, leaf.dtype) for leaf in kept
  ]

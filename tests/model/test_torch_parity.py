"""Parity with an independent reference: `torch.nn.Transformer` with this model's weights.

The reference shares no code with the model: PyTorch's own attention, layer norm and
feed-forward, with the embedding scaling, the paper's sinusoids (computed here in numpy) and
the tied output projection written out below.
"""

import dataclasses
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.config import BOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer

# Imported when this file's first test starts, not when the tests are collected: every test
# process collects every file, and importing PyTorch there cost each process seconds.
torch = None


@pytest.fixture(autouse=True, scope='module')
def _pytorch():
  global torch
  torch = pytest.importorskip(
      'torch',
      reason='PyTorch (CPU build) is a test-only dependency: '
      "pip install -c requirements.txt -e '.[test]'",
  )


D, HEADS, FF, LAYERS, VOCAB = 64, 4, 128, 2, 50
CONFIG = TransformerConfig(
    vocab_size=VOCAB,
    d_model=D,
    num_heads=HEADS,
    d_ff=FF,
    num_encoder_layers=LAYERS,
    num_decoder_layers=LAYERS,
    deterministic=True,
)


def _paper_sinusoids(length: int, d: int) -> np.ndarray:
  pe = np.zeros((length, d), np.float64)
  for pos in range(length):
    for i in range(d // 2):
      pe[pos, 2 * i] = np.sin(pos / 10000 ** (2 * i / d))
      pe[pos, 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / d))
  return pe.astype(np.float32)


def _t(x) -> 'torch.Tensor':
  return torch.from_numpy(np.array(x, np.float32))


def _copy_attention(torch_mha, params):
  qkv = [np.asarray(params[f'{n}_kernel']).reshape(D, D).T for n in ('query', 'key', 'value')]
  bias = [np.asarray(params[f'{n}_bias']).reshape(D) for n in ('query', 'key', 'value')]
  torch_mha.in_proj_weight.data = _t(np.concatenate(qkv, axis=0))
  torch_mha.in_proj_bias.data = _t(np.concatenate(bias))
  torch_mha.out_proj.weight.data = _t(np.asarray(params['out_kernel']).reshape(D, D).T)
  torch_mha.out_proj.bias.data = _t(params['out_bias'])


def _copy_norm(torch_norm, params):
  torch_norm.weight.data = _t(params['scale'])
  torch_norm.bias.data = _t(params['bias'])


def _copy_feed_forward(torch_layer, params):
  torch_layer.linear1.weight.data = _t(np.asarray(params['wi']['kernel']).T)
  torch_layer.linear1.bias.data = _t(params['wi']['bias'])
  torch_layer.linear2.weight.data = _t(np.asarray(params['wo']['kernel']).T)
  torch_layer.linear2.bias.data = _t(params['wo']['bias'])


def _reference_model(cfg: TransformerConfig, params) -> 'torch.nn.Transformer':
  pre = cfg.norm_position == 'pre'
  layer_args = dict(
      d_model=D,
      nhead=HEADS,
      dim_feedforward=FF,
      dropout=0.0,
      activation='relu',
      layer_norm_eps=cfg.layer_norm_epsilon,
      batch_first=True,
      norm_first=pre,
  )
  # The paper's post-norm stacks have no final norm; torch adds one unless told otherwise.
  encoder = torch.nn.TransformerEncoder(
      torch.nn.TransformerEncoderLayer(**layer_args),
      LAYERS,
      norm=torch.nn.LayerNorm(D, eps=cfg.layer_norm_epsilon) if pre else None,
      enable_nested_tensor=False,
  )
  decoder = torch.nn.TransformerDecoder(
      torch.nn.TransformerDecoderLayer(**layer_args),
      LAYERS,
      norm=torch.nn.LayerNorm(D, eps=cfg.layer_norm_epsilon) if pre else None,
  )
  # nn.Transformer re-initialises every matrix it is given: copy the weights in afterwards.
  model = torch.nn.Transformer(
      d_model=D, nhead=HEADS, custom_encoder=encoder, custom_decoder=decoder, batch_first=True
  )
  for i in range(LAYERS):
    p = params['encoder'][f'layer_{i}']
    layer = encoder.layers[i]
    _copy_attention(layer.self_attn, p['self_attention'])
    _copy_norm(layer.norm1, p['self_attention_block']['norm'])
    _copy_feed_forward(layer, p['feed_forward'])
    _copy_norm(layer.norm2, p['feed_forward_block']['norm'])
    p = params['decoder'][f'layer_{i}']
    layer = decoder.layers[i]
    _copy_attention(layer.self_attn, p['self_attention'])
    _copy_norm(layer.norm1, p['self_attention_block']['norm'])
    _copy_attention(layer.multihead_attn, p['encoder_decoder_attention'])
    _copy_norm(layer.norm2, p['encoder_decoder_attention_block']['norm'])
    _copy_feed_forward(layer, p['feed_forward'])
    _copy_norm(layer.norm3, p['feed_forward_block']['norm'])
  if pre:
    _copy_norm(encoder.norm, params['encoder']['final_norm'])
    _copy_norm(decoder.norm, params['decoder']['final_norm'])
  return model.eval()


@pytest.mark.parametrize('norm_position', ['post', 'pre'])
def test_logits_match_torch_transformer(norm_position):
  cfg = dataclasses.replace(CONFIG, norm_position=norm_position)
  rng = np.random.default_rng(0)
  inputs = rng.integers(4, VOCAB, (3, 9))
  inputs[1, 6:] = PAD_ID
  targets = rng.integers(4, VOCAB, (3, 7))
  variables = Transformer(cfg).init(
      jax.random.PRNGKey(1), jnp.asarray(inputs), jnp.asarray(targets)
  )
  params = nn.unbox(variables['params'])
  # Non-trivial norm parameters so that a swapped or missing norm cannot go unnoticed.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x
      + 0.1
      * jax.random.normal(
          jax.random.PRNGKey(zlib.crc32(jax.tree_util.keystr(path).encode()) % 2**31), x.shape
      )
      if 'norm' in jax.tree_util.keystr(path) or 'bias' in jax.tree_util.keystr(path)
      else x,
      params,
  )
  logits = np.asarray(
      Transformer(cfg).apply({'params': params}, jnp.asarray(inputs), jnp.asarray(targets))
  )

  reference = _reference_model(cfg, params)
  embedding = np.asarray(params['shared_embedding']['embedding'])
  pe = _paper_sinusoids(16, D)
  decoder_inputs = np.concatenate([np.full((3, 1), BOS_ID), targets[:, :-1]], axis=1)
  src = embedding[inputs] * np.sqrt(D) + pe[: inputs.shape[1]]
  tgt = embedding[decoder_inputs] * np.sqrt(D) + pe[: targets.shape[1]]
  with torch.no_grad():
    out = reference(
        _t(src),
        _t(tgt),
        tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(targets.shape[1]),
        src_key_padding_mask=torch.from_numpy(inputs == PAD_ID),
        memory_key_padding_mask=torch.from_numpy(inputs == PAD_ID),
        tgt_is_causal=True,
    )
    expected = (out @ _t(embedding).T).numpy()

  relative_error = np.abs(logits - expected).max() / np.abs(expected).max()
  assert relative_error < 1e-5, relative_error

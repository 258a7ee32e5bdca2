"""Model FLOPs (transformer_jax/model/flops.py) against a hand count and the real parameters."""

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.model import flops
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer

# d = 4, d_ff = 8, vocab = 10, one layer a stack.
HAND = TransformerConfig(
    vocab_size=10, d_model=4, num_heads=2, d_ff=8, num_encoder_layers=1, num_decoder_layers=1
)


def test_matmul_params_by_hand():
  p = flops.matmul_params(HAND)
  # Encoder layer 4*16 + 2*4*8 = 128, plus the decoder's cross-attention keys/values 2*16.
  assert p.source == 160
  # Decoder layer 4*16 + 2*16 + 2*4*8 = 160, plus the output projection 4*10.
  assert p.target == 200


def test_example_flops_by_hand():
  # Source 3 tokens, target 2. Weights: 6 * (160*3 + 200*2) = 5280. Attention forward:
  # 4*d * (enc 3*3 + dec self 2*2 + dec cross 2*3) = 16 * 19 = 304, times 3 for training.
  assert flops.example_flops(HAND, 3, 2) == 5280 + 3 * 304
  assert flops.example_flops(HAND, 3, 2, passes=flops.FORWARD) == 2 * 880 + 304
  assert flops.batch_flops(HAND, [3, 3], [2, 2]) == 2 * (5280 + 3 * 304)
  with pytest.raises(ValueError, match='lengths'):
    flops.batch_flops(HAND, [3], [2, 2])


@pytest.mark.parametrize('layers', [(1, 1), (2, 3)])
def test_every_matrix_of_the_model_is_counted_once(layers):
  # Each weight matrix (the tied embedding included) is passed through by exactly one kind
  # of token, so the two counts add up to the model's matrix parameters.
  cfg = TransformerConfig(
      vocab_size=50,
      d_model=16,
      num_heads=2,
      d_ff=24,
      num_encoder_layers=layers[0],
      num_decoder_layers=layers[1],
  )
  tokens = jnp.ones((1, 4), jnp.int32)
  params = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens, tokens))
  leaves = jax.tree_util.tree_leaves_with_path(params['params'])
  # Attention biases are [heads, head_dim]: matrices by shape, but not multiplied.
  matrices = sum(
      x.size for path, x in leaves if x.ndim >= 2 and 'bias' not in jax.tree_util.keystr(path)
  )
  p = flops.matmul_params(cfg)
  assert p.source + p.target == matrices


def test_mfu():
  assert flops.mfu(flops=2e12, seconds=2.0, peak_flops_per_second=4e12) == 0.25

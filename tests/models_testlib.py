"""The tiny models the model tests share, and their parameters and programs made once a
session: eager operations compile one by one at every new shape, so the tests use few
shapes and compiled programs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer

VOCAB = 40
# Two decoder layers, so that cached decoding carries a layer's output into the next; one
# encoder layer, whose stacking test_torch_parity checks (two layers against PyTorch's):
# each layer is a third of a program's compile time.
TINY = TransformerConfig(
    vocab_size=VOCAB,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=2,
    max_len=32,
    deterministic=True,
)
# The shapes of most tests' [batch, length] sources and targets: one set of compiled programs.
SOURCE, TARGET = (3, 9), (3, 7)
VARIANTS = {
    'post_sinusoidal': TINY,
    'pre_norm': dataclasses.replace(TINY, norm_position='pre'),
    'learned': dataclasses.replace(TINY, positional_encoding='learned'),
    'rope': dataclasses.replace(TINY, positional_encoding='rope'),
    'alibi': dataclasses.replace(TINY, positional_encoding='alibi'),
    'separate_embeddings': dataclasses.replace(
        TINY, share_embeddings=False, tie_output_embedding=False
    ),
    'stacked_qkv': dataclasses.replace(TINY, qkv_projection='stacked'),
}


def tokens(rng, batch, length):
  """[batch, length] random ids of real tokens (none of the special ids below 4)."""
  return jnp.asarray(rng.integers(4, VOCAB, (batch, length)), jnp.int32)


def init(cfg):
  """The parameters of `cfg`'s model (boxed with their logical axes), which do not depend on
  the inputs' shapes: made once a config, at one small shape."""
  return jax.tree.map(lambda x: x, cached_params(cfg))  # New dicts: a test may assign into them.


@functools.cache
def cached_params(cfg):
  ids = jnp.full((1, 4), 5, jnp.int32)
  return Transformer(cfg).init(jax.random.PRNGKey(0), ids, ids)['params']


def apply(cfg, variables, *args, method=None, mutable=False, **kwargs):
  """`Transformer(cfg).apply(variables, *args, ...)`, compiled as one program per config,
  method and shapes: applied eagerly, each of its hundreds of operations compiles on its own at
  every new shape (bench/RESULTS.md, section "Where the time goes, by file")."""
  mutable = mutable if isinstance(mutable, bool) else tuple(mutable)
  return compiled_apply(cfg, method, mutable)(variables, *args, **kwargs)


@functools.cache
def compiled_apply(cfg, method, mutable):
  return jax.jit(functools.partial(Transformer(cfg).apply, method=method, mutable=mutable))


def noisy_params(model_config: TransformerConfig, scale: float) -> dict:
  """Random parameters of `model_config` as host arrays, scaled by `scale` and with noise
  added: larger, non-trivial weights, whose outputs depend on the input. The noise is drawn on
  the host: a JAX draw a leaf would add a random-bits program of its own to compile for each
  leaf. The initializer is one jitted program, not hundreds of eager operations."""
  import flax.linen as nn
  import numpy as np

  tokens = jnp.ones((1, 4), jnp.int32)

  @jax.jit
  def make_params():
    return nn.unbox(Transformer(model_config).init(jax.random.key(3), tokens, tokens)['params'])

  return jax.tree_util.tree_map_with_path(
      lambda path, x: (
          np.asarray(x) * scale
          + 0.1 * np.random.default_rng(len(str(path))).standard_normal(x.shape, np.float32)
      ),
      make_params(),
  )

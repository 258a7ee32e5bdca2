"""The benchmark models' sizes, for both sides of a comparison: the paper's base and big as the
shipped configs train them (`configs/`), and the bench's own tiny size for --quick runs and
tests. The JAX side (`jax_side`) and the PyTorch side (`marian`) read them here, so the two
sides of a comparison cannot drift apart."""

from __future__ import annotations

from typing import Any

from configs import wmt14_ende_base
from configs import wmt14_ende_big

# The paper's Table 3 models, as the shipped configs train them.
PAPER_CONFIGS = {'base': wmt14_ende_base.get_config, 'big': wmt14_ende_big.get_config}
# The paper's shared vocabulary and its tokens a side a step, as its configs have them.
PAPER_VOCAB_SIZE = wmt14_ende_base.get_config().vocab_size_target
PAPER_TOKENS_PER_BATCH = wmt14_ende_base.get_config().tokens_per_batch
# A tiny size of `base_config()`, for --quick runs and tests.
TINY_SIZE = dict(
    d_model=64,
    num_heads=4,
    d_ff=256,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout_rate=0.1,
)


def dimensions(model: str) -> dict[str, Any]:
  """'base', 'big' or 'tiny': d_model, num_heads, d_ff and the layers of each stack."""
  config = TINY_SIZE if model == 'tiny' else PAPER_CONFIGS[model]()
  names = ('d_model', 'num_heads', 'd_ff', 'num_encoder_layers', 'num_decoder_layers')
  return {name: config[name] for name in names}

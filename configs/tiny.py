r"""A test-sized model: trains in seconds on a laptop CPU, for tests and quick checks.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny

It trains on the offline corpus, the Bible from English into Spanish (built on first use
from the SWORD modules that `bash scripts/setup_bible.sh` installs); any other dataset
with --config.dataset=NAME (and its languages), e.g. a prepared TFDS WMT.
"""

import ml_collections

from transformer_jax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  config = base_config()
  config.dataset = 'bible_en_es'
  config.target_lang = 'es'
  config.d_model = 32
  config.num_heads = 4
  config.d_ff = 64
  config.num_encoder_layers = 2
  config.num_decoder_layers = 2
  config.max_len = 64
  config.max_source_length = 64
  config.max_target_length = 64
  config.bucket_boundaries = ()  # One batch shape (rows of max_len): one program to compile.
  config.vocab_size_target = 256
  config.tokens_per_batch = 512
  config.num_train_steps = 20
  config.warmup_steps = 10
  config.log_every_steps = 5
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.beam_size = 2
  config.eval_bleu_sentences = 64
  return config

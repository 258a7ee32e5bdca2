r"""The paper's base model on WMT14 English->German (Table 3, 27.3 BLEU on newstest2014).

  python train.py --config=configs/wmt14_ende_base.py --workdir=/tmp/ende_base \
      --config.tfds_data_dir=$HOME/tensorflow_datasets

100k steps of ~25,000 source + 25,000 target tokens; 37,000-token shared BPE vocabulary;
the last 5 checkpoints are averaged for evaluation.
"""

import ml_collections

from transformer_jax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  config = base_config()
  config.dataset = 'wmt14_translate/de-en'
  config.source_lang, config.target_lang = 'en', 'de'
  config.vocab_size_target = 37000
  config.num_train_steps = 100_000
  config.checkpoints_to_average = 5
  return config

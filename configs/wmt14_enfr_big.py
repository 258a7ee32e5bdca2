r"""The paper's big model on WMT14 English->French (41.8 BLEU on newstest2014).

  python train.py --config=configs/wmt14_enfr_big.py --workdir=/tmp/enfr_big \
      --config.tfds_data_dir=$HOME/tensorflow_datasets

As the En-De big model, but dropout 0.1 and a 32,000-token vocabulary (the paper's
word-piece vocabulary; here SentencePiece BPE).
"""

import ml_collections

from configs import wmt14_ende_big


def get_config() -> ml_collections.ConfigDict:
  config = wmt14_ende_big.get_config()
  config.dataset = 'wmt14_translate/fr-en'
  config.source_lang, config.target_lang = 'en', 'fr'
  config.vocab_size_target = 32000
  config.dropout_rate = 0.1
  return config

r"""The paper's big model on WMT14 English->German (Table 3, 28.4 BLEU on newstest2014).

  python train.py --config=configs/wmt14_ende_big.py --workdir=/tmp/ende_big \
      --config.tfds_data_dir=$HOME/tensorflow_datasets

d_model 1024, 16 heads, d_ff 4096, dropout 0.3, 300k steps; the last 20 checkpoints are
averaged for evaluation.
"""

import ml_collections

from configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
  config = wmt14_ende_base.get_config()
  config.d_model = 1024
  config.num_heads = 16
  config.d_ff = 4096
  config.dropout_rate = 0.3
  config.num_train_steps = 300_000
  config.checkpoints_to_average = 20
  return config

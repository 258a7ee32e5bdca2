"""Share of non-padding token slots in one epoch of training batches: buckets vs packing.

  python -m bench.padding --workdir=/tmp/padding_bench   # from the repository root

Measures the Bible corpus (configs/bible_en_es.py; needs scripts/setup_bible.sh) and mock
WMT14 En-De data (tfds.testing.mock_data: random text, so only the mechanics are realistic).
"""

import argparse
import os

import numpy as np
import tensorflow_datasets as tfds

from configs import bible_en_es as bible_config
from transformer_jax import config as config_lib
from transformer_jax import input_pipeline as ip


def epoch_share(data: ip.TrainData) -> tuple[float, float, int]:
  """(source share, target share, distinct shapes) over one epoch of `data`."""
  real = np.zeros(2)
  slots = 0
  shapes = set()
  iterator = iter(data.dataset)
  for _ in range(data.steps_per_epoch):
    batch = next(iterator)
    real += [(batch['inputs_segmentation'] > 0).sum(), (batch['targets_segmentation'] > 0).sum()]
    slots += batch['inputs'].size
    shapes.add(batch['inputs'].shape)
  return real[0] / slots, real[1] / slots, len(shapes)


def measure(name, config, workdir):
  pairs = ip.open_split(config, config.train_split)
  tokenizer = ip.tokenizer_for(config, workdir, pairs)
  for packing in (False, True):
    config.packing = packing
    data = ip.train_dataset(pairs, tokenizer, config)
    source, target, shapes = epoch_share(data)
    print(f'{name:28s} {"packing" if packing else "buckets":8s} tokens/batch='
          f'{config.tokens_per_batch:6d} steps/epoch={data.steps_per_epoch:5d} '
          f'shapes={shapes:3d} non-padding: source {source:.1%} target {target:.1%}')


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', default='/tmp/padding_bench')
  parser.add_argument('--mock_examples', type=int, default=20000)
  args = parser.parse_args()

  config = bible_config.get_config()
  config.tfds_data_dir = os.path.join(args.workdir, 'tfds')
  measure('bible_en_es en->es', config, os.path.join(args.workdir, 'bible'))

  config = config_lib.base_config()  # The paper's setup: 25k tokens, buckets to 256.
  config.vocab_size_target = 8000
  with tfds.testing.mock_data(num_examples=args.mock_examples,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    for tokens in (25000, 4096):
      config.tokens_per_batch = tokens
      measure('mock wmt14_translate/de-en', config, os.path.join(args.workdir, 'wmt'))


if __name__ == '__main__':
  main()

"""The paper's two tasks in one model: English -> German and English -> French (WMT 2014).

  python train.py --config=configs/wmt14_multilingual.py --workdir=$HOME/runs/wmt14_multi
  python evaluate.py --workdir=$HOME/runs/wmt14_multi     # newstest2014 of both, a table
  python translate.py --workdir=$HOME/runs/wmt14_multi --target_lang=fr < input.en

The base model (`configs/wmt14_ende_base.py`) over both prepared TFDS datasets
(`tfds build wmt14_translate/de-en wmt14_translate/fr-en --file_format=array_record`; see
docs/data.md), each source starting with '<2de>' or '<2fr>' (`language_tag='source'`). One
shared vocabulary is trained over the three languages with both tags reserved; the
training split is the two datasets' training pairs one after the other (en-fr has about
8 times the pairs of en-de, and the batches sample them in that proportion).
"""

import ml_collections

from configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
  c = wmt14_ende_base.get_config()
  c.directions = ('wmt14_translate/de-en:en-de', 'wmt14_translate/fr-en:en-fr')
  c.language_tag = 'source'
  return c

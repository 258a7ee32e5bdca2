"""English <-> Spanish in one model on the offline Bible corpus: the main job's model, both ways.

  python train.py --config=configs/bible_en_es_both.py --workdir=/tmp/bible_both
  python evaluate.py --workdir=/tmp/bible_both          # a table: en-es, es-en, the average
  python translate.py --workdir=/tmp/bible_both --target_lang=en < verses.es

The main job's config (`configs/bible_en_es.py`) with both directions of the corpus: each
source starts with '<2es>' or '<2en>' (`language_tag='source'`, Johnson et al. 2017), and
the 8,000-piece vocabulary is trained over both with the two tags reserved. Training batches
mix the directions; a step is the main job's step, so the two directions share its steps
(bench/RESULTS.md, section "CPU: both directions of the offline corpus in one model" has the
comparison with two one-direction models).
"""

import ml_collections

from configs import bible_en_es


def get_config() -> ml_collections.ConfigDict:
  c = bible_en_es.get_config()
  c.directions = ('en-es', 'es-en')
  c.language_tag = 'source'
  return c

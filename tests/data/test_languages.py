"""Several directions in one model: the config's directions, the language tags on the sources,
the shared vocabulary that keeps each tag one piece, and the refusals of what cannot work."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import bible_en_es_both
from configs import wmt14_multilingual
from transformer_jax import config as config_lib
from transformer_jax.data import batching
from transformer_jax.data import corpora
from transformer_jax.data import data_sources
from transformer_jax.data import input_pipeline as ip
from transformer_jax.data import languages
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DataError
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import config_checks


def _text_config(tmp_path, **overrides):
  """Two languages in plain files: 'lo' (lower case) and 'up' (the same words upper case)."""
  files = {}
  words = ['ab', 'cd', 'efg', 'hij', 'klm', 'no']
  for split, count in (('train', 60), ('validation', 6), ('test', 6)):
    paths = [os.path.join(tmp_path, f'{split}.{side}') for side in ('lo', 'up')]
    lines = [' '.join(words[(i + j) % len(words)] for j in range(1 + i % 4)) for i in range(count)]
    with open(paths[0], 'w') as lo, open(paths[1], 'w') as up:
      lo.write(''.join(line + '\n' for line in lines))
      up.write(''.join(line.upper() + '\n' for line in lines))
    files[split] = ','.join(paths)
  config = config_lib.base_config()
  config.dataset = 'text'
  config.source_lang, config.target_lang = 'lo', 'up'
  for split, spec in files.items():
    config.text_files[split] = spec
  config.update(
      dict(
          directions=('lo-up', 'up-lo'),
          language_tag='source',
          vocab_size_target=60,
          tokens_per_batch=256,
          max_source_length=32,
          max_target_length=32,
          bucket_boundaries=(),
      )
  )
  config.update(overrides)
  return config


def test_one_direction_is_the_config_pair_and_needs_no_tag():
  config = config_lib.base_config()
  assert languages.directions(config) == (languages.Direction('wmt14_translate/de-en', 'en', 'de'),)
  assert languages.tags(config) == ()
  assert not languages.is_multilingual(config)


def test_the_configs_parse_into_their_directions():
  both = bible_en_es_both.get_config()
  assert [d.name for d in languages.directions(both)] == ['en-es', 'es-en']
  assert languages.tags(both) == ('<2en>', '<2es>')
  multi = wmt14_multilingual.get_config()
  assert languages.directions(multi) == (
      languages.Direction('wmt14_translate/de-en', 'en', 'de'),
      languages.Direction('wmt14_translate/fr-en', 'en', 'fr'),
  )
  for config in (both, multi):
    config_checks.validate_run(config, training=True)


@pytest.mark.parametrize(
    'overrides,message',
    [
        (dict(directions=('en',)), 'does not name two languages'),
        (dict(directions=('en-es-fr',)), 'does not name two languages'),
        (dict(directions=('en-en',)), 'into itself'),
        (dict(directions=('en-es', 'en-es')), 'names a direction twice'),
        (dict(directions=('en-es', 'es-en'), language_tag=''), 'set --config.language_tag=source'),
        (dict(language_tag='target'), "must be one of ('', 'source')"),
    ],
)
def test_bad_directions_fail_before_anything_is_built(overrides, message):
  config = bible_en_es_both.get_config()
  config.update(overrides)
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    config_checks.validate_run(config, training=True)


def test_a_split_of_several_directions_is_each_one_tagged_in_turn(tmp_path):
  config = _text_config(tmp_path)
  pairs = data_sources.open_split(config, 'train')
  assert len(pairs) == 120
  lo, up = pairs[0][0].removeprefix('<2up> '), pairs[0][1]
  assert pairs[0] == ('<2up> ' + lo, up) and up == lo.upper()
  assert pairs[60] == ('<2lo> ' + up, lo)  # The second direction: the files swapped.
  assert pairs.at([61, 0, 119, 1]) == [pairs[61], pairs[0], pairs[119], pairs[1]]
  assert pairs.range(58, 62) == [pairs[i] for i in range(58, 62)]
  # Untagged (evaluation sets the tag per direction) and one direction alone.
  direction = languages.directions(config)[1]
  alone = data_sources.open_split(config, 'test', direction, tagged=False)
  assert alone[0] == (open_line(config, 'test', 1), open_line(config, 'test', 0))
  assert pairs.fingerprint != data_sources.open_split(config, 'train', tagged=False).fingerprint


def open_line(config, split, side):
  with open(config.text_files[split].split(',')[side]) as f:
    return f.readline().rstrip('\n')


def test_text_directions_name_only_the_two_files_languages(tmp_path):
  config = _text_config(tmp_path, directions=('lo-up', 'lo-fr'))
  with pytest.raises(ConfigError, match="not 'fr'"):
    data_sources.open_split(config, 'train')


def test_the_vocabulary_keeps_each_tag_one_piece_and_training_sees_them(tmp_path):
  config = _text_config(tmp_path)
  data = ip.get_datasets(
      config, RunLayout.of(str(tmp_path / 'run')), process_index=0, process_count=1
  )
  tokenizer = data.tokenizer
  assert 'tagged' in os.path.basename(tokenizer.model_path)
  ids = {tag: tokenizer_lib.piece_id(tokenizer, tag) for tag in ('<2lo>', '<2up>')}
  assert None not in ids.values() and len(set(ids.values())) == 2
  firsts = set()
  for _ in range(data.steps_per_epoch):  # Every source's first piece after the word boundary.
    batch = next(data.train)
    starts = (batch['inputs_positions'] == 1) & (batch['inputs_segmentation'] > 0)
    firsts |= set(batch['inputs'][starts].tolist())
  assert firsts == set(ids.values())


def test_a_given_vocabulary_without_the_tags_is_refused(tmp_path):
  untagged = tokenizer_lib.train_tokenizer(
      ['ab cd efg', 'AB CD EFG'] * 20, str(tmp_path / 'plain.model'), vocab_size=40
  )
  config = _text_config(tmp_path, vocab_path=untagged.model_path)
  with pytest.raises(ConfigError, match='lacks the reserved pieces <2lo>, <2up>'):
    ip.get_datasets(config, RunLayout.of(str(tmp_path / 'run')), process_index=0, process_count=1)


def test_the_papers_two_tasks_in_one_model_read_from_mock_wmt14(tmp_path):
  config = wmt14_multilingual.get_config()
  config.update(
      dict(
          vocab_size_target=120,
          tokens_per_batch=512,
          max_source_length=64,
          max_target_length=64,
          bucket_boundaries=(16, 32),
      )
  )
  with tfds.testing.mock_data(num_examples=32, policy=tfds.testing.MockPolicy.USE_CODE):
    pairs = data_sources.open_split(config, 'train')
    de = tfds.data_source('wmt14_translate/de-en', split='train')
    fr = tfds.data_source('wmt14_translate/fr-en', split='train')
    assert len(pairs) == len(de) + len(fr) == 64
    text = lambda v: v.decode() if isinstance(v, bytes) else v
    assert pairs[0] == ('<2de> ' + text(de[0]['en']), text(de[0]['de']))
    assert pairs[32] == ('<2fr> ' + text(fr[0]['en']), text(fr[0]['fr']))
    data = ip.get_datasets(config, RunLayout.of(str(tmp_path)), process_index=0, process_count=1)
    for tag in ('<2de>', '<2fr>'):
      assert tokenizer_lib.piece_id(data.tokenizer, tag) is not None
    assert len(data_sources.open_split(config, 'test')) == 64


def test_the_target_language_asked_for_picks_the_tag_that_starts_each_source():
  both = bible_en_es_both.get_config()
  assert languages.chosen_target(both, 'en') == 'en'
  assert languages.source_prefix(both, 'en') == '<2en> '
  assert languages.direction_into(both, 'en') == ('es', 'en')
  with pytest.raises(ConfigError, match=r'2 languages \(en, es\); choose one with --target_lang'):
    languages.chosen_target(both, None)
  with pytest.raises(ConfigError, match='--target_lang=fr: this model translates into en, es'):
    languages.chosen_target(both, 'fr')
  one = config_lib.base_config()  # One direction, no tag: its own target, nothing before it.
  assert languages.chosen_target(one, None) == 'de'
  assert languages.source_prefix(one, 'de') == ''


def _tags_drawn(data, ids, batches):
  """How many training examples of each tag `batches` batches hold, and the batches."""
  counts = {tag: 0 for tag in ids}
  taken = []
  for _ in range(batches):
    batch = next(data.train)
    taken.append(batch)
    starts = (batch['inputs_positions'] == 1) & (batch['inputs_segmentation'] > 0)
    for tag, i in ids.items():
      counts[tag] += int((batch['inputs'][starts] == i).sum())
  return counts, taken


def test_weighted_directions_are_drawn_in_proportion_and_resume_exactly(tmp_path):
  config = _text_config(tmp_path, corpus_weights=(3.0, 1.0), packing=True)
  layout = RunLayout.of(str(tmp_path / 'run'))
  data = ip.get_datasets(config, layout, process_index=0, process_count=1)
  ids = {tag: tokenizer_lib.piece_id(data.tokenizer, tag) for tag in ('<2up>', '<2lo>')}
  counts, _ = _tags_drawn(data, ids, 40)
  share = counts['<2up>'] / sum(counts.values())
  assert abs(share - 0.75) < 0.05, counts  # The lo-up direction, weight 3 of 4.
  state = data.train.get_state()
  assert data.source_names == ('lo-up', 'up-lo')
  assert state['drawn'] == [counts['<2up>'], counts['<2lo>']]  # What the metrics report.
  _, expected = _tags_drawn(data, ids, 5)
  resumed = ip.get_datasets(config, layout, process_index=0, process_count=1)
  resumed.train.set_state(state)
  _, again = _tags_drawn(resumed, ids, 5)
  for a, b in zip(expected, again):
    assert all((a[k] == b[k]).all() for k in a)


def test_temperature_flattens_the_directions_shares():
  config = bible_en_es_both.get_config()
  assert corpora.mixture_weights(config, [300, 100]) == pytest.approx((0.75, 0.25))
  config.sampling_temperature = 2.0
  assert corpora.is_mixture(config)
  assert corpora.mixture_weights(config, [400, 100]) == pytest.approx((2 / 3, 1 / 3))
  config.corpus_weights = (1, 4)
  assert corpora.mixture_weights(config, [400, 100]) == pytest.approx((0.2, 0.8))


@pytest.mark.parametrize(
    'overrides,message',
    [
        (dict(corpus_weights=(1.0,)), 'must be 2 positive numbers'),
        (dict(corpus_weights=(1.0, 0.0)), 'must be 2 positive numbers'),
        (dict(corpus_weights=(1.0, -2)), 'must be 2 positive numbers'),
        (dict(sampling_temperature=0.0), 'must be a number > 0'),
        (dict(corpus_weights=(1, 2), packing=False), 'set --config.packing=True'),
    ],
)
def test_bad_weights_fail_before_anything_is_built(overrides, message):
  config = bible_en_es_both.get_config()
  config.update(overrides)
  with pytest.raises(ConfigError, match=message):
    config_checks.validate_run(config, training=True)


def test_a_direction_with_no_data_left_is_refused():
  with pytest.raises(DataError, match='text.train. <2lo> up->lo has no training example left'):
    batching.Mixture.of(
        [np.arange(5), np.arange(0)],
        ['text[train] <2up> lo->up', 'text[train] <2lo> up->lo'],
        [0.5, 0.5],
        seed=0,
    )

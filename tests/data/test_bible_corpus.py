"""Tests for the Bible builder: the zText reader, markup removal, alignment and splits."""

import re
import struct
import zlib

import pytest

from transformer_jax.config import base_config
from transformer_jax.data import bible_corpus
from transformer_jax.data import data_sources


def test_osis_to_text_strips_markup_notes_headings_and_strongs():
  osis = (
      '<div type="x-milestone" subType="x-preverse" sID="pv1"/><title>A heading</title>'
      '<title canonical="true" type="psalm">A <w lemma="strong:H4210">Psalm</w>.</title> '
      '¶ And <w lemma="strong:H0430">God</w> <transChange type="added">said</transChange>'
      ', ¡<w lemma="strong:H1">Let</w>!<note placement="foot"><reference type="annotat'
      'eRef">1.3 </reference>Heb. a note</note> <l level="1" sID="x"/>\\nd LORD'
      '<chapter eID="Gen.1"/>'
  )
  assert bible_corpus.osis_to_text(osis) == 'A Psalm. And God said, ¡Let! LORD'


def _write_ztext(path, verse_texts):
  """A one-block zText testament holding `verse_texts` in its slots."""
  block = b''.join(verse_texts)
  compressed = zlib.compress(block)
  (path / 'ot.bzs').write_bytes(struct.pack('<III', 0, len(compressed), len(block)))
  (path / 'ot.bzz').write_bytes(compressed)
  offsets, offset = [], 0
  for text in verse_texts:
    offsets.append(struct.pack('<IIH', 0, offset, len(text)))
    offset += len(text)
  (path / 'ot.bzv').write_bytes(b''.join(offsets))


def test_reader_decodes_slots_and_rejects_other_versifications(tmp_path):
  _write_ztext(tmp_path, [b'', b'', b'In the beginning', b'', b'x'])
  assert bible_corpus._read_testament(str(tmp_path), 'ot') == [
      b'',
      b'',
      b'In the beginning',
      b'',
      b'x',
  ]
  (tmp_path / 'nt.bzv').write_bytes(b'')
  with pytest.raises(ValueError, match='not in KJV versification'):
    bible_corpus.read_module(str(tmp_path))


def test_missing_module_says_how_to_install(tmp_path):
  with pytest.raises(bible_corpus.SwordModuleNotFoundError) as error:
    bible_corpus.find_module('engKJV2006eb', roots=[str(tmp_path)])
  for needle in (
      'engKJV2006eb',
      str(tmp_path),
      'scripts/setup_bible.sh',
      'apt-get install -y sword-text-kjv sword-text-sparv',
      'SWORD_PATH',
  ):
    assert needle in str(error.value)


def _modules_installed():
  try:
    bible_corpus.find_module(bible_corpus.ENGLISH_MODULE)
    bible_corpus.find_module(bible_corpus.SPANISH_MODULE)
    return True
  except bible_corpus.SwordModuleNotFoundError:
    return False


needs_modules = pytest.mark.skipif(
    not _modules_installed(),
    reason='SWORD modules missing: run `bash scripts/setup_bible.sh` (as root: apt-get).',
)


@pytest.fixture(scope='module')
def prepared(tmp_path_factory) -> str:
  """The real dataset, built once a module (a few seconds): its TFDS data directory."""
  directory = str(tmp_path_factory.mktemp('tfds'))
  bible_corpus.prepare(directory)
  return directory


@pytest.fixture(scope='module')
def splits(prepared):
  """Every split of `prepared`, read back without TensorFlow, each in one batch of reads."""
  builder = bible_corpus.prepare(prepared)  # Finds it prepared.
  out = {}
  for split in ('train', 'validation', 'test'):
    source = builder.as_data_source(split)
    out[split] = {
        r['ref'].decode(): (r['en'].decode(), r['es'].decode())
        for r in source.__getitems__(range(len(source)))
    }
  return out


@needs_modules
def test_known_verses_are_aligned(splits):
  verses = {ref: pair for split in splits.values() for ref, pair in split.items()}
  assert verses['Gen.1.1'] == (
      'In the beginning God created the heaven and the earth.',
      'EN el principio crió Dios los cielos y la tierra.',
  )
  assert verses['John.3.16'][0].startswith('For God so loved the world, that he gave his')
  assert verses['John.3.16'][1].startswith('Porque de tal manera amó Dios al mundo')
  assert verses['Rev.22.21'] == (
      'The grace of our Lord Jesus Christ be with you all. Amen.',
      'La gracia de nuestro Señor Jesucristo sea con todos vosotros. Amén.',
  )
  # The psalm title is part of verse 1 on both sides.
  assert verses['Ps.3.1'][0].startswith('A Psalm of David, when he fled from Absalom')
  assert verses['Ps.3.1'][1].startswith('Salmo de David, cuando huía de delante de Absalom')
  assert splits['test']['Ruth.1.16'][0].startswith('And Ruth said, Intreat me not to leave')
  assert splits['test']['Ruth.1.16'][1].startswith('Y Ruth respondió: No me ruegues')


@needs_modules
def test_splits_are_disjoint_whole_books(splits):
  refs = {name: set(split) for name, split in splits.items()}
  assert not refs['train'] & refs['validation']
  assert not refs['train'] & refs['test']
  assert not refs['validation'] & refs['test']
  for name, split_refs in refs.items():
    assert {bible_corpus.split_of(r.split('.')[0]) for r in split_refs} == {name}
  assert 28_000 < len(refs['train']) < 29_000
  assert 650 < len(refs['validation']) < 800 and 1_300 < len(refs['test']) < 1_450


@needs_modules
def test_text_is_clean_and_misaligned_chapters_are_dropped(splits):
  verses = {ref: pair for split in splits.values() for ref, pair in split.items()}
  for en, es in verses.values():
    for text in (en, es):
      assert text == text.strip() and text
      assert not any(c in text for c in '<>\\¶') and not re.search(r'[HG]\d{4}', text)
  # Spanish verse division differs here (Jonah 1:17 is Spanish 2:1).
  assert not any(ref.startswith(('Jonah.2.', 'Num.13.')) for ref in verses)
  assert 'Jonah.3.1' in splits['train'] and 'Num.14.1' in splits['train']


@needs_modules
def test_open_split_iterates_every_pair_once(prepared):
  # Regression: array-record sources raise ValueError, not IndexError, past the end, so a
  # plain `for pair in split` never stopped.
  config = base_config()
  config.dataset, config.source_lang, config.target_lang = 'bible_en_es', 'en', 'es'
  config.tfds_data_dir = prepared
  pairs = data_sources.open_split(config, 'test')
  listed = list(pairs)
  assert len(listed) == len(pairs) == 1378
  assert listed[-1] == pairs[-1]
  # Batched reads (the vocabulary's sentences, the token store) give the same pairs.
  assert pairs.at([1377, 0, 5, 5]) == [listed[1377], listed[0], listed[5], listed[5]]
  assert pairs.range(1370, 2000) == listed[1370:]

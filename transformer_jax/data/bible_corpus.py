"""The King James Bible (English) and the Reina-Valera 1909 (Spanish), verse-aligned.

A TFDS `GeneratorBasedBuilder` over two public-domain SWORD modules that Debian ships:
`engKJV2006eb` (package `sword-text-kjv`) and `spaRV1909eb` (package `sword-text-sparv`).
Both are in KJV versification, so a verse reference names the same verse in both, and the
builder pairs them by reference. It reads the zText module files directly (zlib blocks plus
two little-endian index files), so neither `diatheke` nor TensorFlow is needed; 31,102
verse slots of both modules decode in about two seconds.

Examples are `{'en': str, 'es': str, 'ref': 'Book.chapter.verse'}` (OSIS book ids).
Text keeps case and punctuation; it drops OSIS markup, Strong's numbers, footnotes,
non-canonical headings and the KJV's paragraph marks. The canonical psalm titles stay
(at the start of verse 1), because the Spanish text has them inside verse 1 too.

Splits (whole books, so that no verse, chapter or near-duplicate passage crosses splits;
books with close parallels elsewhere -- the synoptic gospels, Kings/Chronicles,
Ephesians/Colossians, 2 Peter/Jude -- are kept out of the held-out sets):
  validation: Esther, Song of Solomon, Joel, Nahum, Philippians, James, 1 John (~720 verses)
  test:       Ruth, Ecclesiastes, Micah, Acts (~1,370 verses)
  train:      the other 55 books (~28,600 verses)

Alignment clean-up, applied the same way to every split:
  * A verse empty on either side is skipped and counted.
  * The Spanish module keeps the Spanish verse division in a few chapters (e.g. Jonah 1-2,
    Numbers 13, Job 38-40: Spanish 2:1 is KJV 1:17). A chapter is dropped whole when it has
    an empty verse on either side (the trace of a merge or a shift), or when its verse
    lengths agree better shifted by one verse than in place; about 19 chapters, 450 verses.
  * A pair whose character lengths differ by more than 2x the corpus ratio is dropped
    (a handful: local splits that differ).
What remains is about 30,600 pairs; a few local one-verse shifts may survive.

Prepare (offline, in seconds; the input pipeline does it on first use):
  bash scripts/setup_bible.sh   # installs the two sword-text packages if missing
  python -c "from transformer_jax.data import bible_corpus; bible_corpus.prepare(DATA_DIR)"
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
import math
import os
import re
import statistics
import struct
import zlib

from absl import logging
import tensorflow_datasets as tfds

from transformer_jax.errors import DatasetNotFoundError
from transformer_jax.storage import storage

ENGLISH_MODULE = 'engKJV2006eb'
SPANISH_MODULE = 'spaRV1909eb'
SETUP_COMMAND = 'sudo apt-get install -y sword-text-kjv sword-text-sparv'

VALIDATION_BOOKS = frozenset({'Esth', 'Song', 'Joel', 'Nah', 'Phil', 'Jas', '1John'})
TEST_BOOKS = frozenset({'Ruth', 'Eccl', 'Mic', 'Acts'})

# KJV versification: OSIS book id and the number of verses of each chapter. SWORD compiles
# this table into libsword (canon.h) and does not ship it as data, so it is repeated here;
# `read_module` checks it against the size of each module's verse index.
KJV_VERSIFICATION = (
    (
        'Gen',
        '31 25 24 26 32 22 24 22 29 32 32 20 18 24 21 16 27 33 38 18 34 24 20 '
        '67 34 35 46 22 35 43 55 32 20 31 29 43 36 30 23 23 57 38 34 34 28 34 '
        '31 22 33 26',
    ),
    (
        'Exod',
        '22 25 22 31 23 30 25 32 35 29 10 51 22 31 27 36 16 27 25 26 36 31 33 '
        '18 40 37 21 43 46 38 18 35 23 35 35 38 29 31 43 38',
    ),
    ('Lev', '17 16 17 35 19 30 38 36 24 20 47 8 59 57 33 34 16 30 37 27 24 33 44 23 55 46 34'),
    (
        'Num',
        '54 34 51 49 31 27 89 26 23 36 35 16 33 45 41 50 13 32 22 29 35 41 30 '
        '25 18 65 23 31 40 16 54 42 56 29 34 13',
    ),
    (
        'Deut',
        '46 37 29 49 33 25 26 20 29 22 32 32 18 29 23 22 20 22 21 20 23 30 25 '
        '22 19 19 26 68 29 20 30 52 29 12',
    ),
    ('Josh', '18 24 17 24 15 27 26 35 27 43 23 24 33 15 63 10 18 28 51 9 45 34 16 33'),
    ('Judg', '36 23 31 24 31 40 25 35 57 18 40 15 25 20 20 31 13 31 30 48 25'),
    ('Ruth', '22 23 18 22'),
    (
        '1Sam',
        '28 36 21 22 12 21 17 22 27 27 15 25 23 52 35 23 58 30 24 42 15 23 29 '
        '22 44 25 12 25 11 31 13',
    ),
    ('2Sam', '27 32 39 12 25 23 29 18 13 19 27 31 39 33 37 23 29 33 43 26 22 51 39 25'),
    ('1Kgs', '53 46 28 34 18 38 51 66 28 29 43 33 34 31 34 34 24 46 21 43 29 53'),
    ('2Kgs', '18 25 27 44 27 33 20 29 37 36 21 21 25 29 38 20 41 37 37 21 26 20 37 20 30'),
    (
        '1Chr',
        '54 55 24 43 26 81 40 40 44 14 47 40 14 17 29 43 27 17 19 8 30 19 32 31 31 32 34 21 30',
    ),
    (
        '2Chr',
        '17 18 17 22 14 42 22 18 31 19 23 16 22 15 19 14 19 34 11 37 20 12 21 '
        '27 28 23 9 27 36 27 21 33 25 33 27 23',
    ),
    ('Ezra', '11 70 13 24 17 22 28 36 15 44'),
    ('Neh', '11 20 32 23 19 19 73 18 38 39 36 47 31'),
    ('Esth', '22 23 15 17 14 14 10 17 32 3'),
    (
        'Job',
        '22 13 26 21 27 30 21 22 35 22 20 25 28 22 35 22 16 21 29 29 34 30 17 '
        '25 6 14 23 28 25 31 40 22 33 37 16 33 24 41 30 24 34 17',
    ),
    (
        'Ps',
        '6 12 8 8 12 10 17 9 20 18 7 8 6 7 5 11 15 50 14 9 13 31 6 10 22 12 14 '
        '9 11 12 24 11 22 22 28 12 40 22 13 17 13 11 5 26 17 11 9 14 20 23 19 9 '
        '6 7 23 13 11 11 17 12 8 12 11 10 13 20 7 35 36 5 24 20 28 23 10 12 20 '
        '72 13 19 16 8 18 12 13 17 7 18 52 17 16 15 5 23 11 13 12 9 9 5 8 28 22 '
        '35 45 48 43 13 31 7 10 10 9 8 18 19 2 29 176 7 8 9 4 8 5 6 5 6 8 8 3 '
        '18 3 3 21 26 9 8 24 13 10 7 12 15 21 10 20 14 9 6',
    ),
    (
        'Prov',
        '33 22 35 27 23 35 27 36 18 32 31 28 25 35 33 33 28 24 29 30 31 29 35 '
        '34 28 28 27 28 27 33 31',
    ),
    ('Eccl', '18 26 22 16 20 12 29 17 18 20 10 14'),
    ('Song', '17 17 11 16 16 13 13 14'),
    (
        'Isa',
        '31 22 26 6 30 13 25 22 21 34 16 6 22 32 9 14 14 7 25 6 17 25 18 23 12 '
        '21 13 29 24 33 9 20 24 17 10 22 38 22 8 31 29 25 28 28 25 13 15 22 26 '
        '11 23 15 12 17 13 12 21 14 21 22 11 12 19 12 25 24',
    ),
    (
        'Jer',
        '19 37 25 31 31 30 34 22 26 25 23 17 27 22 21 21 27 23 15 18 14 30 40 '
        '10 38 24 22 17 32 24 40 44 26 22 19 32 21 28 18 16 18 22 13 30 5 28 7 '
        '47 39 46 64 34',
    ),
    ('Lam', '22 22 66 22 22'),
    (
        'Ezek',
        '28 10 27 17 17 14 27 18 11 22 25 28 23 23 8 63 24 32 14 49 32 31 49 27 '
        '17 21 36 26 21 26 18 32 33 31 15 38 28 23 29 49 26 20 27 31 25 24 23 '
        '35',
    ),
    ('Dan', '21 49 30 37 31 28 28 27 27 21 45 13'),
    ('Hos', '11 23 5 19 15 11 16 14 17 15 12 14 16 9'),
    ('Joel', '20 32 21'),
    ('Amos', '15 16 15 13 27 14 17 14 15'),
    ('Obad', '21'),
    ('Jonah', '17 10 10 11'),
    ('Mic', '16 13 12 13 15 16 20'),
    ('Nah', '15 13 19'),
    ('Hab', '17 20 19'),
    ('Zeph', '18 15 20'),
    ('Hag', '15 23'),
    ('Zech', '21 13 10 14 11 15 14 23 17 12 17 14 9 21'),
    ('Mal', '14 17 18 6'),
    (
        'Matt',
        '25 23 17 25 48 34 29 34 38 42 30 50 58 36 39 28 27 35 30 34 46 46 39 51 46 75 66 20',
    ),
    ('Mark', '45 28 35 41 43 56 37 38 50 52 33 44 37 72 47 20'),
    ('Luke', '80 52 38 44 39 49 50 56 62 42 54 59 35 35 32 31 37 43 48 47 38 71 56 53'),
    ('John', '51 25 36 54 47 71 53 59 41 42 57 50 38 31 27 33 26 40 42 31 25'),
    (
        'Acts',
        '26 47 26 37 42 15 60 40 43 48 30 25 52 28 41 40 34 28 41 38 40 30 35 27 27 32 44 31',
    ),
    ('Rom', '32 29 31 25 21 23 25 39 33 21 36 21 14 23 33 27'),
    ('1Cor', '31 16 23 21 13 20 40 13 27 33 34 31 13 40 58 24'),
    ('2Cor', '24 17 18 18 21 18 16 24 15 18 33 21 14'),
    ('Gal', '24 21 29 31 26 18'),
    ('Eph', '23 22 21 32 33 24'),
    ('Phil', '30 30 21 23'),
    ('Col', '29 23 25 18'),
    ('1Thess', '10 20 13 18 28'),
    ('2Thess', '12 17 18'),
    ('1Tim', '20 15 16 16 25 21'),
    ('2Tim', '18 26 17 22'),
    ('Titus', '16 15 15'),
    ('Phlm', '25'),
    ('Heb', '14 18 19 16 14 20 28 13 28 39 40 29 25'),
    ('Jas', '27 26 18 17 20'),
    ('1Pet', '25 25 22 19 14'),
    ('2Pet', '21 22 18'),
    ('1John', '10 29 24 21 21'),
    ('2John', '13'),
    ('3John', '14'),
    ('Jude', '25'),
    ('Rev', '20 29 22 11 14 17 17 13 21 11 19 17 18 20 8 21 18 24 21 15 27 21'),
)
_OLD_TESTAMENT_BOOKS = 39

# Spanish/English character-length ratio of an aligned verse pair, and the factor beyond
# which a pair (or, on average, a chapter) counts as misaligned.
_LENGTH_RATIO = 0.92
_MAX_RATIO_FACTOR = 2.0
_CHAPTER_MAX_COST = 0.3  # Mean |log length ratio| above which a chapter is dropped.
_SHIFT_MARGIN = 0.03  # A chapter is shifted when a +-1 verse offset fits this much better.

Ref = tuple[str, int, int]  # (OSIS book id, chapter, verse)


class SwordModuleNotFoundError(DatasetNotFoundError):
  """A SWORD module is not installed; the message says how to install it."""


def sword_roots() -> list[str]:
  """Directories searched for SWORD modules, in order: $SWORD_PATH, ~/.sword, system."""
  roots = []
  if os.environ.get('SWORD_PATH'):
    roots.extend(os.environ['SWORD_PATH'].split(os.pathsep))
  roots += [os.path.expanduser('~/.sword'), '/usr/share/sword', '/usr/local/share/sword']
  return roots


def find_module(name: str, roots: list[str] | None = None) -> str:
  """Returns the data directory of the zText module `name` (e.g. 'engKJV2006eb').

  Raises:
    SwordModuleNotFoundError: with the directories searched and the install command.
  """
  roots = sword_roots() if roots is None else roots
  for root in roots:
    for directory in (name, name.lower()):  # Debian keeps the case; SWORD installers do not.
      path = os.path.join(root, 'modules', 'texts', 'ztext', directory)
      if os.path.exists(os.path.join(path, 'ot.bzv')):
        return path
  raise SwordModuleNotFoundError(
      f'SWORD module {name} not found under {roots} (modules/texts/ztext/{name}). '
      f'Install it with `bash scripts/setup_bible.sh` (or `{SETUP_COMMAND}`), or point '
      '$SWORD_PATH at a directory that holds the module.'
  )


def _read_testament(path: str, testament: str) -> list[bytes]:
  """Decodes every index slot of one testament of a zText module (ot or nt)."""

  def read(ext):
    with open(os.path.join(path, f'{testament}.{ext}'), 'rb') as f:
      return f.read()

  blocks, verses, data = read('bzs'), read('bzv'), read('bzz')
  # .bzs: one (offset, compressed size, uncompressed size) per zlib block.
  block_index = [struct.unpack_from('<III', blocks, i) for i in range(0, len(blocks), 12)]
  # .bzv: one (block, offset in the uncompressed block, size) per verse slot.
  decoded: dict[int, bytes] = {}
  slots = []
  for i in range(0, len(verses), 10):
    block, offset, size = struct.unpack_from('<IIH', verses, i)
    if size == 0:
      slots.append(b'')
      continue
    if block not in decoded:
      start, compressed, _ = block_index[block]
      decoded[block] = zlib.decompress(data[start : start + compressed])
    slots.append(decoded[block][offset : offset + size])
  return slots


def read_module(path: str) -> dict[Ref, str]:
  """Reads a KJV-versified zText module into {(book, chapter, verse): raw OSIS text}.

  Raises:
    ValueError: the module's verse index does not match KJV versification.
  """
  verses = {}
  testaments = (
      ('ot', KJV_VERSIFICATION[:_OLD_TESTAMENT_BOOKS]),
      ('nt', KJV_VERSIFICATION[_OLD_TESTAMENT_BOOKS:]),
  )
  for testament, books in testaments:
    slots = _read_testament(path, testament)
    # Slot layout: module heading, testament heading, then per book a book heading and,
    # per chapter, a chapter heading followed by the verses.
    chapters = [[int(n) for n in counts.split()] for _, counts in books]
    expected = 2 + sum(1 + len(c) + sum(c) for c in chapters)
    if len(slots) != expected:
      raise ValueError(
          f'{path}/{testament}.bzv has {len(slots)} slots, KJV versification '
          f'needs {expected}: the module is not in KJV versification.'
      )
    index = 2
    for (book, _), counts in zip(books, chapters):
      index += 1
      for chapter, num_verses in enumerate(counts, start=1):
        index += 1
        for verse in range(1, num_verses + 1):
          verses[(book, chapter, verse)] = slots[index].decode('utf-8')
          index += 1
  return verses


_NOTE = re.compile(r'<note\b.*?</note>', re.DOTALL)
_NONCANONICAL_TITLE = re.compile(r'<title(?![^>]*canonical="true")[^>]*>.*?</title>', re.DOTALL)
# Inline elements wrap words (Strong's numbers live in their attributes); the others are
# milestones and blocks, which separate words.
_INLINE_TAG = re.compile(r'</?(?:w|transChange|divineName|q|seg|foreign|reference)\b[^>]*>')
_TAG = re.compile(r'<[^>]*>')
_USFM_MARKER = re.compile(r'\\\+?[a-z]+[0-9]*\*?\s?')  # USFM leftovers such as \nd.
_SPACE = re.compile(r'\s+')
_SPACE_BEFORE_PUNCTUATION = re.compile(r'\s+([,.;:!?)])')


def osis_to_text(osis: str) -> str:
  """Plain text of one verse of OSIS markup: no tags, notes, headings or Strong's numbers."""
  text = _NOTE.sub(' ', osis)
  text = _NONCANONICAL_TITLE.sub(' ', text)
  text = _INLINE_TAG.sub('', text)
  text = _TAG.sub(' ', text)
  text = _USFM_MARKER.sub('', text)
  text = text.replace('\u00b6', ' ')  # The KJV's pilcrow paragraph marks.
  text = _SPACE.sub(' ', text).strip()
  return _SPACE_BEFORE_PUNCTUATION.sub(r'\1', text)


def _log_ratio(english: str, spanish: str) -> float:
  # Smoothed so that very short verses do not dominate.
  return abs(math.log((len(spanish) + 20) / (len(english) + 20)) - math.log(_LENGTH_RATIO))


def _misaligned_chapters(english: Mapping[Ref, str], spanish: Mapping[Ref, str]) -> set:
  """Chapters whose Spanish verse division departs from KJV versification."""
  by_chapter = collections.defaultdict(list)
  for book, chapter, verse in english:
    by_chapter[(book, chapter)].append(verse)

  def cost(book, chapter, shift):
    costs = [
        _log_ratio(english[(book, chapter, v)], spanish[(book, chapter, v + shift)])
        for v in by_chapter[(book, chapter)]
        if english[(book, chapter, v)] and spanish.get((book, chapter, v + shift))
    ]
    return statistics.mean(costs) if costs else math.inf

  misaligned = set()
  for (book, chapter), verses in by_chapter.items():
    if any(not english[(book, chapter, v)] or not spanish[(book, chapter, v)] for v in verses):
      misaligned.add((book, chapter))
      continue
    in_place = cost(book, chapter, 0)
    shifted = min(cost(book, chapter, 1), cost(book, chapter, -1))
    if in_place > _CHAPTER_MAX_COST or shifted < in_place - _SHIFT_MARGIN:
      misaligned.add((book, chapter))
  return misaligned


def split_of(book: str) -> str:
  """The split ('train', 'validation' or 'test') that holds every verse of `book`."""
  if book in TEST_BOOKS:
    return 'test'
  if book in VALIDATION_BOOKS:
    return 'validation'
  return 'train'


def aligned_verses(
    roots: list[str] | None = None,
) -> tuple[list[tuple[Ref, str, str]], collections.Counter]:
  """Reads both modules and returns the aligned pairs and what was dropped.

  Args:
    roots: SWORD directories to search; default `sword_roots()`.

  Returns:
    ([(ref, english, spanish)] in canonical order, Counter of dropped verses by reason).
  """
  english = {
      ref: osis_to_text(t) for ref, t in read_module(find_module(ENGLISH_MODULE, roots)).items()
  }
  spanish = {
      ref: osis_to_text(t) for ref, t in read_module(find_module(SPANISH_MODULE, roots)).items()
  }
  misaligned = _misaligned_chapters(english, spanish)
  dropped = collections.Counter()
  pairs = []
  for ref, en in english.items():
    es = spanish[ref]
    if ref[:2] in misaligned:
      dropped['misaligned chapter'] += 1
    elif not en or not es:
      dropped['empty'] += 1
    elif _log_ratio(en, es) > math.log(_MAX_RATIO_FACTOR):
      dropped['length ratio'] += 1
    else:
      pairs.append((ref, en, es))
  return pairs, dropped


class BibleEnEs(tfds.core.GeneratorBasedBuilder):
  """KJV English / Reina-Valera 1909 Spanish verse pairs (see the module docstring)."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Whole-book splits; misaligned chapters dropped.'}

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=__doc__,
        features=tfds.features.FeaturesDict(
            {
                'en': tfds.features.Text(),
                'es': tfds.features.Text(),
                'ref': tfds.features.Text(),
            }
        ),
        supervised_keys=('en', 'es'),
        homepage='https://crosswire.org/sword/modules/',
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing to download: the text comes from installed SWORD modules.
    pairs, dropped = aligned_verses()
    logging.info('bible_en_es: %d aligned pairs; dropped %s', len(pairs), dict(dropped))
    by_split = collections.defaultdict(list)
    for pair in pairs:
      by_split[split_of(pair[0][0])].append(pair)
    return {
        name: self._generate_examples(by_split[name]) for name in ('train', 'validation', 'test')
    }

  def _generate_examples(self, pairs) -> Iterator[tuple[str, dict[str, str]]]:
    for (book, chapter, verse), en, es in pairs:
      ref = f'{book}.{chapter}.{verse}'
      yield ref, {'en': en, 'es': es, 'ref': ref}


def prepare(data_dir: str | None = None) -> BibleEnEs:
  """Builds the dataset in array_record format under `data_dir` if it is not there yet.

  Args:
    data_dir: TFDS data directory; None for TFDS's default.

  Returns:
    The prepared builder; read it with `builder.as_data_source(split)`.

  Raises:
    SwordModuleNotFoundError: the SWORD modules are not installed (the message says how).
  """
  builder = BibleEnEs(data_dir=data_dir or None, file_format='array_record')
  if data_dir and storage.is_remote(data_dir):
    if not builder.is_prepared():
      # Built on a local disk (TFDS would rename a directory, which Cloud Storage cannot do
      # at once) and uploaded with dataset_info.json last: TFDS takes that file as the sign
      # that a prepared dataset is complete, so a reader never sees half of one.
      local = prepare(storage.local_cache(data_dir))
      storage.upload(
          os.fspath(local.data_dir),
          os.fspath(builder.data_dir),
          '--config.tfds_data_dir',
          last=('dataset_info.json',),
      )
      builder = BibleEnEs(data_dir=data_dir, file_format='array_record')
    return builder
  builder.download_and_prepare()
  return builder

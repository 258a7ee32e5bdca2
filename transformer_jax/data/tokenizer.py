"""Vocabularies: a shared SentencePiece model (trained once on the training split, cached,
reused), or an imported model's two (`SplitTokenizer`).

Special ids are fixed for the whole project (see `config.py`): 0 <pad>, 1 <s> (BOS),
2 </s> (EOS), 3 <unk>. Padding never shares an id with <unk>. `encode` appends EOS and
never adds BOS: the decoder shifts targets right itself.

A vocabulary is one file, whatever its kind (`load_tokenizer` tells them apart), so that a
checkpoint carries it whole and the token store knows when it changed.
"""

from __future__ import annotations

import base64
from collections.abc import Container, Iterable, Sequence
import hashlib
import json
import os
import re
import tempfile
from typing import Any, cast

from absl import logging
import sentencepiece as spm

from transformer_jax.config import BOS_ID
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.errors import ConfigError
from transformer_jax.errors import DataError
from transformer_jax.storage import storage


def tokenization(model: bytes) -> bytes:
  """A serialized SentencePiece model without what training left in it that does not change
  how it cuts text (the trainer's file names: its input files and `model_prefix`, a
  temporary path): two models cut alike exactly when these bytes are equal."""
  from sentencepiece import sentencepiece_model_pb2

  proto = cast(Any, sentencepiece_model_pb2).ModelProto()  # Generated; no type stubs.
  proto.ParseFromString(model)
  proto.trainer_spec.ClearField('model_prefix')
  proto.trainer_spec.ClearField('input')
  return proto.SerializeToString(deterministic=True)


class Tokenizer:
  """A SentencePiece model with the project's special ids."""

  def __init__(self, model_path: str):
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
    if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
      raise ConfigError(
          f'{model_path} has special ids (pad, bos, eos, unk) = {ids}, the project needs '
          f'{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}; delete it (or clear --config.vocab_path) '
          'to train a matching one.'
      )
    with open(model_path, 'rb') as f:
      self.fingerprint = hashlib.sha256(f.read()).hexdigest()[:16]

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def pieces(self) -> list[str]:
    """Every id's piece, in id order."""
    return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

  def sentencepiece_models(self) -> dict[str, bytes]:
    """The serialized SentencePiece model of each side ('source', 'target')."""
    with open(self.model_path, 'rb') as f:
      model = f.read()
    return {'source': model, 'target': model}

  def encode(self, text: str, side: str = 'source') -> list[int]:
    """Ids of `text`, ending with EOS_ID. `side`: 'source' or 'target' (one model serves
    both here)."""
    return self._sp.encode(text, add_eos=True)

  def encode_batch(self, texts: Sequence[str], side: str = 'source') -> list[list[int]]:
    """Ids of each text, each ending with EOS_ID."""
    return self._sp.encode(list(texts), add_eos=True)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first EOS; PAD and BOS are ignored."""
    return self._sp.decode(_until_eos(ids, (PAD_ID, BOS_ID)))


def _until_eos(ids: Iterable[int], skipped: Container[int]) -> list[int]:
  """`ids` up to the first EOS, without those in `skipped`."""
  kept = []
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    if i not in skipped:
      kept.append(i)
  return kept


SPLIT_FORMAT = 'transformer_jax.split_sentencepiece/1'
_LANGUAGE_CODE = re.compile('>>.+<<')  # As Hugging Face's MarianTokenizer matches it.


class SplitTokenizer(Tokenizer):
  """Separate source and target SentencePiece models over one id map (Marian's vocabulary).

  SentencePiece cuts the text into pieces, each side with its own model; the pieces' ids
  come from one list shared by both sides (unknown pieces are <unk>), as Hugging Face's
  `MarianTokenizer` does with `source.spm`, `target.spm` and `vocab.json`. Decoding skips
  the special pieces (<pad>, </s>, <unk>) as its `skip_special_tokens` does; id 1 is BOS only
  in a vocabulary whose piece 1 is '<s>' (a model whose decoder starts from <pad> may use
  id 1 for an ordinary piece).

  The file is JSON: {"format", "pieces": [piece of id 0, 1, ...], "source_model" and
  "target_model": the SentencePiece models, base64} (`write_split_vocabulary`).
  """

  def __init__(self, model_path: str):
    self.model_path = model_path
    with open(model_path, 'rb') as f:
      data = f.read()
    self.fingerprint = hashlib.sha256(data).hexdigest()[:16]
    try:
      bundle = json.loads(data)
      if bundle.get('format') != SPLIT_FORMAT:
        raise ValueError(f'format {bundle.get("format")!r} is not {SPLIT_FORMAT!r}')
      self._pieces = list(bundle['pieces'])
      self._model_bytes = {
          side: base64.b64decode(bundle[f'{side}_model']) for side in ('source', 'target')
      }
      self._models = {
          side: spm.SentencePieceProcessor(model_proto=model)
          for side, model in self._model_bytes.items()
      }
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
      raise ConfigError(
          f'{model_path} is not a readable split vocabulary ({e}); import the '
          'model again to rewrite it.'
      ) from None
    expected = {PAD_ID: '<pad>', EOS_ID: '</s>', UNK_ID: '<unk>'}
    if any(self._pieces[i] != piece for i, piece in expected.items()):
      raise ConfigError(
          f'{model_path} has pieces {self._pieces[:4]} at ids 0-3; the project '
          'needs <pad> at 0, </s> at 2 and <unk> at 3.'
      )
    self._ids = {piece: i for i, piece in enumerate(self._pieces)}
    self._skipped = {PAD_ID, EOS_ID, UNK_ID} | (
        {BOS_ID} if self._pieces[BOS_ID] == '<s>' else set()
    )

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  def pieces(self) -> list[str]:
    return list(self._pieces)

  def sentencepiece_models(self) -> dict[str, bytes]:
    return dict(self._model_bytes)

  def encode(self, text: str, side: str = 'source') -> list[int]:
    return self.encode_batch([text], side)[0]

  def encode_batch(self, texts: Sequence[str], side: str = 'source') -> list[list[int]]:
    # A leading language code (">>fr<<" in multilingual models) is one piece of its own.
    codes = [_LANGUAGE_CODE.match(text) for text in texts]
    pieces = self._models[side].encode(
        [_LANGUAGE_CODE.sub('', text) for text in texts], out_type=str
    )
    return [
        [self._ids.get(p, UNK_ID) for p in ([code.group(0)] if code else []) + row] + [EOS_ID]
        for code, row in zip(codes, pieces)
    ]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first EOS, without special pieces, by the target model."""
    pieces = [self._pieces[i] for i in _until_eos(ids, self._skipped)]
    # As `MarianTokenizer`: pieces the target model lacks come out as they are, so every
    # word boundary left is turned into a space.
    return self._models['target'].decode_pieces(pieces).replace('\u2581', ' ').strip()


def write_split_vocabulary(
    path: str, pieces: Sequence[str], source_model: bytes, target_model: bytes
) -> SplitTokenizer:
  """Writes a `SplitTokenizer` file atomically and loads it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  data = {
      'format': SPLIT_FORMAT,
      'pieces': list(pieces),
      'source_model': base64.b64encode(source_model).decode('ascii'),
      'target_model': base64.b64encode(target_model).decode('ascii'),
  }
  storage.write_file(path, json.dumps(data, ensure_ascii=False))
  return SplitTokenizer(path)


def load_tokenizer(path: str) -> Tokenizer:
  """The vocabulary in `path`: a SentencePiece model or a `SplitTokenizer` file."""
  with open(path, 'rb') as f:
    is_json = f.read(1) == b'{'  # A SentencePiece model is a protobuf, never JSON.
  return SplitTokenizer(path) if is_json else Tokenizer(path)


def train_tokenizer(
    sentences: Iterable[str],
    model_path: str,
    *,
    vocab_size: int,
    model_type: str = 'bpe',
    reserved: Sequence[str] = (),
) -> Tokenizer:
  """Trains a SentencePiece model on `sentences` and writes it atomically to `model_path`.

  Args:
    sentences: training text, one sentence each (source and target sides mixed).
    model_path: where the `.model` file goes; its directory is created.
    vocab_size: the size asked for; on a small corpus it may come out smaller.
    model_type: 'bpe' or 'unigram'.
    reserved: pieces that are always one piece wherever they occur (the language tags, ids
      4, 5, ... in this order).

  Returns:
    The trained tokenizer.
  """
  if model_type not in ('bpe', 'unigram'):
    raise ConfigError(f"vocab_model_type={model_type!r} must be 'bpe' or 'unigram'.")
  sentences = [s for s in (s.strip() for s in sentences) if s]
  if not sentences:
    raise DataError(
        f'No non-empty sentence to train the vocabulary {model_path} on; the '
        'training split is empty or blank.'
    )
  directory = os.path.dirname(os.path.abspath(model_path))
  os.makedirs(directory, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    prefix = os.path.join(tmp, 'spm')
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(sentences),
          model_prefix=prefix,
          vocab_size=vocab_size,
          model_type=model_type,
          pad_id=PAD_ID,
          bos_id=BOS_ID,
          eos_id=EOS_ID,
          unk_id=UNK_ID,
          user_defined_symbols=list(reserved),
          character_coverage=1.0,
          # Small corpora cannot fill a large vocabulary; take what they give.
          hard_vocab_limit=False,
          # Every sentence (SentencePiece refuses a size of 1-100; 0 also means all).
          input_sentence_size=len(sentences) if len(sentences) > 100 else 0,
          num_threads=os.cpu_count() or 1,
          minloglevel=2,
      )
    except RuntimeError as e:  # SentencePiece reports a bad size or corpus this way.
      raise ConfigError(
          f'SentencePiece cannot train a {vocab_size}-piece {model_type} '
          f'vocabulary on this data ({e}); set --config.vocab_size_target to a '
          'size the corpus supports (the paper: 37000 for WMT14 En-De).'
      ) from None
    # Without the temporary path: the same data gives the same bytes (and fingerprint).
    with open(prefix + '.model', 'rb') as f:
      model = tokenization(f.read())
    with open(prefix + '.model', 'wb') as f:
      f.write(model)
    os.replace(prefix + '.model', model_path)  # Atomic: readers never see half a file.
  tokenizer = Tokenizer(model_path)
  logging.info(
      'Trained a %s vocabulary of %d pieces on %d sentences: %s',
      model_type,
      tokenizer.vocab_size,
      len(sentences),
      model_path,
  )
  return tokenizer


def load_or_train_tokenizer(
    model_path: str,
    sentences_fn,
    *,
    vocab_size: int,
    model_type: str = 'bpe',
    reserved: Sequence[str] = (),
) -> Tokenizer:
  """Loads `model_path`, or trains it on `sentences_fn()` first when it does not exist.

  Args:
    model_path: the cached `.model` file.
    sentences_fn: called only when training is needed; returns an iterable of sentences.
    vocab_size: see `train_tokenizer`.
    model_type: see `train_tokenizer`.
    reserved: see `train_tokenizer`; a loaded vocabulary must have each as one piece.

  Raises:
    ConfigError: a loaded vocabulary lacks a reserved piece.
  """
  if os.path.exists(model_path):
    logging.info('Loading the vocabulary %s', model_path)
    tokenizer = load_tokenizer(model_path)
    check_reserved(tokenizer, reserved, model_path)
    return tokenizer
  return train_tokenizer(
      sentences_fn(), model_path, vocab_size=vocab_size, model_type=model_type, reserved=reserved
  )


def piece_id(tokenizer: Tokenizer, piece: str) -> int | None:
  """The id of `piece` when the vocabulary cuts it as that one piece (after the word
  boundary '\u2581' SentencePiece puts before a text), else None."""
  pieces = tokenizer.pieces()
  ids = [i for i in tokenizer.encode(piece)[:-1] if pieces[i] != '\u2581']
  return ids[0] if len(ids) == 1 and pieces[ids[0]] == piece else None


def check_reserved(tokenizer: Tokenizer, reserved: Sequence[str], path: str) -> None:
  """Raises ConfigError naming those of `reserved` that `tokenizer` does not keep as one
  piece (a vocabulary trained without the run's language tags)."""
  missing = [piece for piece in reserved if piece_id(tokenizer, piece) is None]
  if missing:
    plural = 's' if len(missing) > 1 else ''
    raise ConfigError(
        f'The vocabulary {path} lacks the reserved piece{plural} {", ".join(missing)} (one '
        "piece each: a language tag this run's directions need, or '<BT>' for "
        'back_translation_tag); it was trained without them. Clear --config.vocab_path to '
        'train one with them, train the run that makes the vocabulary with the same '
        'directions, language_tag and back_translation_tag, or drop them here.'
    )

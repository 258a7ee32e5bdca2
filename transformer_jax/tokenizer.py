"""A shared SentencePiece vocabulary: trained once on the training split, cached, reused.

Special ids are fixed for the whole project (see `config.py`): 0 <pad>, 1 <s> (BOS),
2 </s> (EOS), 3 <unk>. Padding never shares an id with <unk>. `encode` appends EOS and
never adds BOS: the decoder shifts targets right itself.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence

from absl import logging
import sentencepiece as spm

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.errors import ConfigError, DataError


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
          'to train a matching one.')
    with open(model_path, 'rb') as f:
      self.fingerprint = hashlib.sha256(f.read()).hexdigest()[:16]

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def pieces(self) -> list[str]:
    """Every id's piece, in id order."""
    return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, ending with EOS_ID."""
    return self._sp.encode(text, add_eos=True)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text, each ending with EOS_ID."""
    return self._sp.encode(list(texts), add_eos=True)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first EOS; PAD and BOS are ignored."""
    pieces = []
    for i in ids:
      i = int(i)
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        pieces.append(i)
    return self._sp.decode(pieces)


def train_tokenizer(sentences: Iterable[str], model_path: str, *, vocab_size: int,
                    model_type: str = 'bpe') -> Tokenizer:
  """Trains a SentencePiece model on `sentences` and writes it atomically to `model_path`.

  Args:
    sentences: training text, one sentence each (source and target sides mixed).
    model_path: where the `.model` file goes; its directory is created.
    vocab_size: the size asked for; on a small corpus it may come out smaller.
    model_type: 'bpe' or 'unigram'.

  Returns:
    The trained tokenizer.
  """
  if model_type not in ('bpe', 'unigram'):
    raise ConfigError(f"vocab_model_type={model_type!r} must be 'bpe' or 'unigram'.")
  sentences = [s for s in (s.strip() for s in sentences) if s]
  if not sentences:
    raise DataError(f'No non-empty sentence to train the vocabulary {model_path} on; the '
                    'training split is empty or blank.')
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
          pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
          character_coverage=1.0,
          # Small corpora cannot fill a large vocabulary; take what they give.
          hard_vocab_limit=False,
          input_sentence_size=len(sentences),
          num_threads=os.cpu_count() or 1,
          minloglevel=2,
      )
    except RuntimeError as e:  # SentencePiece reports a bad size or corpus this way.
      raise ConfigError(f'SentencePiece cannot train a {vocab_size}-piece {model_type} '
                        f'vocabulary on this data ({e}); set --config.vocab_size_target to a '
                        'size the corpus supports (the paper: 37000 for WMT14 En-De).') from None
    os.replace(prefix + '.model', model_path)  # Atomic: readers never see half a file.
  tokenizer = Tokenizer(model_path)
  logging.info('Trained a %s vocabulary of %d pieces on %d sentences: %s', model_type,
               tokenizer.vocab_size, len(sentences), model_path)
  return tokenizer


def load_or_train_tokenizer(model_path: str, sentences_fn, *, vocab_size: int,
                            model_type: str = 'bpe') -> Tokenizer:
  """Loads `model_path`, or trains it on `sentences_fn()` first when it does not exist.

  Args:
    model_path: the cached `.model` file.
    sentences_fn: called only when training is needed; returns an iterable of sentences.
    vocab_size: see `train_tokenizer`.
    model_type: see `train_tokenizer`.
  """
  if os.path.exists(model_path):
    logging.info('Loading the vocabulary %s', model_path)
    return Tokenizer(model_path)
  return train_tokenizer(sentences_fn(), model_path, vocab_size=vocab_size,
                         model_type=model_type)

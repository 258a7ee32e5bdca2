"""Tests for the SentencePiece vocabulary: fixed special ids, EOS handling, caching."""

import numpy as np
import pytest
import sentencepiece as spm

from transformer_jax.config import BOS_ID
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.data import tokenizer as tokenizer_lib

WORDS = (
    'the house is red and the river is long while a small bird sings over green '
    'fields near old towns la casa es roja y el rio es largo'
).split()


def _corpus(n=400, seed=0):
  rng = np.random.default_rng(seed)
  return [' '.join(rng.choice(WORDS, size=rng.integers(3, 15))) for _ in range(n)]


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp('vocab') / 'spm.model'
  return tokenizer_lib.train_tokenizer(_corpus(), str(path), vocab_size=120)


def test_special_ids_are_fixed_and_pad_is_not_unk(tok):
  sp = spm.SentencePieceProcessor(model_file=tok.model_path)
  assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
  assert PAD_ID != UNK_ID
  assert [sp.id_to_piece(i) for i in range(4)] == ['<pad>', '<s>', '</s>', '<unk>']


def test_encode_ends_with_eos_and_round_trips(tok):
  text = 'the small bird sings over the river'
  ids = tok.encode(text)
  assert ids[-1] == EOS_ID and BOS_ID not in ids and PAD_ID not in ids
  assert tok.decode(ids) == text
  assert tok.encode_batch([text, 'la casa']) == [ids, tok.encode('la casa')]


def test_decode_stops_at_eos_and_ignores_pad_and_bos(tok):
  ids = tok.encode('the house is red')
  noisy = [BOS_ID] + ids + [PAD_ID, *tok.encode('green fields')[:-1], PAD_ID]
  assert tok.decode(noisy) == 'the house is red'
  assert tok.decode(np.array(ids + [PAD_ID] * 3)) == 'the house is red'


def test_unknown_characters_map_to_unk(tok):
  assert UNK_ID in tok.encode('ж')


def test_cached_model_is_reused_without_training(tok, tmp_path):
  def fail():
    raise AssertionError('must not retrain a cached vocabulary')

  again = tokenizer_lib.load_or_train_tokenizer(tok.model_path, fail, vocab_size=120)
  assert again.fingerprint == tok.fingerprint
  path = tmp_path / 'new.model'
  fresh = tokenizer_lib.load_or_train_tokenizer(
      str(path), _corpus, vocab_size=120, model_type='unigram'
  )
  assert path.exists() and fresh.encode('the house')[-1] == EOS_ID


def test_model_with_other_special_ids_is_rejected(tmp_path):
  prefix = str(tmp_path / 'default')
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_corpus()), model_prefix=prefix, vocab_size=40, minloglevel=2
  )  # unk=0, pad=-1: Flax WMT's.
  with pytest.raises(ValueError, match='special ids'):
    tokenizer_lib.Tokenizer(prefix + '.model')


def test_bad_arguments_fail_clearly(tmp_path):
  with pytest.raises(ValueError, match='vocab_model_type'):
    tokenizer_lib.train_tokenizer(
        _corpus(), str(tmp_path / 'x.model'), vocab_size=50, model_type='word-ish'
    )
  with pytest.raises(ValueError, match='No non-empty sentence'):
    tokenizer_lib.train_tokenizer(['', '  '], str(tmp_path / 'y.model'), vocab_size=50)


def test_the_same_sentences_train_the_same_bytes_in_any_directory(tok, tmp_path):
  """No temporary path of the training stays in the model: two runs trained on the same data
  share a vocabulary byte for byte (an ensemble needs one), and a model that still carries
  one cuts text as it does without it."""
  again = tokenizer_lib.train_tokenizer(_corpus(), str(tmp_path / 'b' / 'x.model'), vocab_size=120)
  assert again.fingerprint == tok.fingerprint
  assert again.sentencepiece_models() == tok.sentencepiece_models()
  from sentencepiece import sentencepiece_model_pb2

  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(tok.sentencepiece_models()['source'])
  proto.trainer_spec.model_prefix = '/tmp/elsewhere/tmpabc/spm'
  moved = proto.SerializeToString()
  assert moved != tok.sentencepiece_models()['source']
  assert tokenizer_lib.tokenization(moved) == tok.sentencepiece_models()['source']
  other = tokenizer_lib.train_tokenizer(
      _corpus(seed=1), str(tmp_path / 'c' / 'x.model'), vocab_size=120
  )
  assert tokenizer_lib.tokenization(other.sentencepiece_models()['source']) != (
      tokenizer_lib.tokenization(moved)
  )

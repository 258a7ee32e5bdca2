"""CTranslate2 exports of this project's checkpoints, against `ctranslate2.Translator` itself.

Each variant of the model CTranslate2 can run (post- and pre-norm; interleaved, concatenated,
learned and rotary positions; each activation; the three decoder starts; untied embeddings;
the target side's output vocabulary; a layer norm epsilon of its own) is a random tiny
checkpoint, exported by `ctranslate2.export_model` and loaded by CTranslate2 on the CPU:
greedy outputs must be this project's token for token, and CTranslate2's scores of them this
project's log-probabilities. A mapping or an option that differs anywhere changes them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models_testlib
from test_marian import SOURCE_TEXT  # The tiny corpus the Marian tests train on.
from test_marian import TARGET_TEXT
import train_testlib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.checkpoints import loading
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.decoding import translator
from transformer_jax.errors import ConfigError
from transformer_jax.errors import OutputExistsError
from transformer_jax.interop import ctranslate2 as ct2_export
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout

ctranslate2 = pytest.importorskip(
    'ctranslate2',
    reason="ctranslate2 is a test-only dependency: pip install -c requirements.txt -e '.[test]'",
)

# What is translated: the sources, others, and a character no piece has (<unk>).
SENTENCES = SOURCE_TEXT + ['the dog sings at the river', 'a book on the mat', 'warm Ω today']
MAX_DECODE_LEN = 24  # Every output's limit, here and in CTranslate2.


def _translator(directory: str, **kwargs) -> ctranslate2.Translator:
  # One thread: the tests' processes already keep the cores busy, and CTranslate2's threads
  # spin waiting for one another when they do.
  return ctranslate2.Translator(directory, device='cpu', intra_threads=1, **kwargs)


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
  root = tmp_path_factory.mktemp('vocab')
  return train_tokenizer(
      SOURCE_TEXT * 10 + TARGET_TEXT * 10, str(root / 'vocab.model'), vocab_size=48
  )


def _checkpoint(root, tokenizer, *, eos_bias: float = 0.0, **fields) -> str:
  """A random model of this project written as a checkpoint (what a training run leaves),
  with larger, non-trivial weights: outputs that depend on the input. With
  `output_vocabulary='target'` its output layer scores the target text's pieces."""
  from configs import tiny

  config = tiny.get_config()
  config.update(
      dict(
          dataset='text',
          vocab_path=tokenizer.model_path,
          source_lang='en',
          target_lang='fr',
          max_len=64,
          **fields,
      )
  )
  output_ids = None
  if config.output_vocabulary == 'target':
    pieces = {i for text in TARGET_TEXT for i in tokenizer.encode(text, 'target')}
    output_ids = sorted(pieces | {EOS_ID, UNK_ID})
  model_config = TransformerConfig.from_config(config, tokenizer.vocab_size, output_ids=output_ids)
  params = models_testlib.noisy_params(model_config, 1.5)
  for name in ('shared_embedding', 'source_embedding', 'target_embedding'):
    if model_config.decoder_start == 'zero' and name in params:  # As training keeps it.
      params[name]['embedding'][PAD_ID] = 0
  if eos_bias:
    params['decoder']['logits_bias'][EOS_ID] += eos_bias
  workdir = str(root / 'run')
  checkpointing.write_params_checkpoint(
      RunLayout.of(workdir).checkpoints,
      7,
      params,
      checkpointing.make_meta(config, tokenizer, output_ids),
  )
  return workdir


def _log_probs(checkpoint: loading.InferenceCheckpoint, inputs, targets) -> np.ndarray:
  """[batch, length, vocab] float32: each target token's log-probabilities given the ones
  before, as this project's search sees them (-inf outside the output ids), with <pad> left
  out of the softmax, as the export leaves it out."""
  config = dataclasses.replace(checkpoint.model_config, output_ids=None)  # Every id's logit.
  logits = jax.jit(Transformer(config).apply)({'params': checkpoint.params}, inputs, targets)
  logits = np.array(logits, np.float32)
  allowed = np.zeros(config.vocab_size, bool)
  allowed[list(checkpoint.model_config.output_ids or range(config.vocab_size))] = True
  allowed[PAD_ID] = False
  logits[..., ~allowed] = -np.inf
  return np.asarray(jax.nn.log_softmax(logits))


def _ours(checkpoint: loading.InferenceCheckpoint, inputs: np.ndarray) -> list[list[int]]:
  """This project's greedy outputs, EOS included where reached."""
  options = translator.DecodeOptions(
      beam_size=1, length_penalty=0.0, max_decode_extra_length=MAX_DECODE_LEN
  )
  search = jax.jit(
      functools.partial(
          translator.search,
          checkpoint.model_config,
          options=options,
          max_decode_len=MAX_DECODE_LEN,
          grow=False,  # One loop to compile.
      )
  )
  sequences, _, _ = search(checkpoint.params, jnp.asarray(inputs))
  outputs = []
  for row in np.asarray(sequences[:, 0]).tolist():
    outputs.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
  return outputs


def _padded(rows: list[list[int]]) -> np.ndarray:
  width = max(map(len, rows))
  return np.asarray([row + [PAD_ID] * (width - len(row)) for row in rows], np.int32)


def _sources(directory: str) -> list[list[str]]:
  """What a user gives CTranslate2: the pieces source.spm cuts each text into (it appends
  </s> itself)."""
  import sentencepiece as spm

  cutter = spm.SentencePieceProcessor(model_file=os.path.join(directory, 'source.spm'))
  return [cutter.encode(text, out_type=str) for text in SENTENCES]


def _assert_translates_as_here(workdir: str, directory: str) -> dict[str, float]:
  """CTranslate2's greedy outputs from `directory` are this project's from `workdir`, and
  its scores of them this project's log-probabilities; returns what was measured."""
  checkpoint = loading.load(workdir)
  tokenizer = checkpoint.tokenizer
  with open(os.path.join(directory, 'shared_vocabulary.json'), encoding='utf-8') as f:
    vocabulary = json.load(f)
  assert vocabulary == tokenizer.pieces()  # This project's ids.
  ids = {piece: i for i, piece in enumerate(vocabulary)}
  sources = _sources(directory)
  for text, source in zip(SENTENCES, sources):
    assert [ids.get(p, UNK_ID) for p in source] + [EOS_ID] == tokenizer.encode(text)
  inputs = _padded([tokenizer.encode(text) for text in SENTENCES])

  ours = _ours(checkpoint, inputs)
  targets = _padded(ours)
  log_probs = _log_probs(checkpoint, inputs, targets)
  # No step chose between two tokens closer than 1e-3 in log-probability: the outputs then
  # do not depend on the last bits of a CPU's floats, which differ from machine to machine.
  for row, output in enumerate(ours):
    for step in range(len(output)):
      top = np.sort(log_probs[row, step])[-2:]
      assert top[1] - top[0] > 1e-3, f'near-tie at row {row}, step {step}'

  model = _translator(directory)
  results = model.translate_batch(
      sources, beam_size=1, min_decoding_length=0, max_decoding_length=MAX_DECODE_LEN
  )
  theirs = [[ids[p] for p in result.hypotheses[0]] for result in results]
  assert theirs == [[t for t in output if t != EOS_ID] for output in ours]
  # Outputs that follow their sources, and not all of them empty.
  assert len({tuple(o) for o in ours}) > len(ours) // 2 and max(map(len, ours)) > 1

  scored = model.score_batch(sources, [[vocabulary[t] for t in o if t != EOS_ID] for o in ours])
  errors = []
  for row, (output, result) in enumerate(zip(ours, scored)):
    expected = log_probs[row, np.arange(len(output)), output]
    got = np.asarray(result.log_probs[: len(output)])  # Scored to EOS, reached or not.
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=5e-4)
    errors.append(np.abs(got - expected).max())
  return {'max_score_error': float(max(errors)), 'ended': sum(o[-1] == EOS_ID for o in ours)}


VARIANTS = {
    # The paper's: post-norm, interleaved sinusoids, ReLU, one embedding matrix; its layer
    # norms' epsilon is far from CTranslate2's default (1e-5), so it counts.
    'post_norm_sinusoidal': dict(layer_norm_epsilon=0.5),
    # The main job's (configs/bible_en_es.py): pre-norm, rotary positions, the target side's
    # output vocabulary.
    'pre_norm_rotary_target_vocabulary': dict(
        norm_position='pre', positional_encoding='rope', output_vocabulary='target'
    ),
    # Marian's options: concatenated sinusoids, gelu, a logits bias, a zero start vector.
    'concatenated_gelu_bias_zero_start': dict(
        sinusoid_layout='concatenated',
        activation='gelu',
        logits_bias=True,
        decoder_start='zero',
        eos_bias=6.0,
    ),
    # Learned positions, swish, <pad> first, three matrices (source, target, output).
    'pre_norm_learned_untied_pad_start': dict(
        norm_position='pre',
        positional_encoding='learned',
        activation='swish',
        decoder_start='pad',
        share_embeddings=False,
        tie_output_embedding=False,
    ),
}


@pytest.mark.parametrize('variant', VARIANTS)
def test_exported_model_translates_and_scores_in_ctranslate2_as_here(tokenizer, tmp_path, variant):
  workdir = _checkpoint(tmp_path, tokenizer, **VARIANTS[variant])
  directory = ct2_export.export_model(workdir, str(tmp_path / 'ct2'))
  measured = _assert_translates_as_here(workdir, directory)
  if variant.startswith('concatenated'):
    # Some outputs end at EOS, the others at the limit.
    assert 0 < measured['ended'] < len(SENTENCES), measured


def test_main_jobs_model_exports_with_its_decoding_and_a_warning(tokenizer, tmp_path, caplog):
  """The main job's decoding: what CTranslate2 has goes to translate_options.json, and
  no_adjacent_repeat_size, which it lacks, is named in a warning."""
  workdir = _checkpoint(
      tmp_path,
      tokenizer,
      norm_position='pre',
      positional_encoding='rope',
      output_vocabulary='target',
      beam_size=3,
      length_penalty=0.8,
      length_penalty_form='power',
      no_repeat_ngram_size=3,
      no_adjacent_repeat_size=8,
  )
  checkpoint = loading.load(workdir)
  with caplog.at_level(logging.WARNING):
    directory = ct2_export.export_model(checkpoint, str(tmp_path / 'ct2'))  # Loaded already.
  assert 'no_adjacent_repeat_size=8 (CTranslate2 has no option for it' in caplog.text
  assert 'max_decode_extra_length=50' in caplog.text
  assert 'length_penalty_form' not in caplog.text  # The 'power' form is CTranslate2's.
  assert sorted(os.listdir(directory)) == [
      'config.json',
      'model.bin',
      'shared_vocabulary.json',
      'source.spm',
      'target.spm',
      ct2_export.OPTIONS_FILE,
  ]
  with open(os.path.join(directory, ct2_export.OPTIONS_FILE), encoding='utf-8') as f:
    options = json.load(f)
  assert options == {
      'beam_size': 3,
      'min_decoding_length': 0,
      'length_penalty': 0.8,
      'no_repeat_ngram_size': 3,
  }
  model = _translator(directory)
  results = model.translate_batch(_sources(directory), **options)
  assert len(results) == len(SENTENCES) and all(r.hypotheses[0] for r in results)
  with pytest.raises(OutputExistsError, match='already holds a model'):
    ct2_export.export_model(checkpoint, directory)


def test_gnmt_length_penalty_is_named_and_left_out(tokenizer, tmp_path, caplog):
  workdir = _checkpoint(tmp_path, tokenizer, length_penalty=0.6, length_penalty_form='gnmt')
  with caplog.at_level(logging.WARNING):
    directory = ct2_export.export_model(workdir, str(tmp_path / 'ct2'))
  assert "length_penalty=0.6 with length_penalty_form='gnmt'" in caplog.text
  with open(os.path.join(directory, ct2_export.OPTIONS_FILE), encoding='utf-8') as f:
    assert 'length_penalty' not in json.load(f)


def test_translate_options_hold_learned_positions_to_their_table():
  decoding = dict(
      beam_size=4,
      length_penalty=0.0,
      length_penalty_form='gnmt',
      no_repeat_ngram_size=0,
      no_adjacent_repeat_size=0,
      max_decode_extra_length=50,
  )
  learned = TransformerConfig(vocab_size=48, positional_encoding='learned', max_len=96)
  options, lacking = ct2_export.translate_options(decoding, learned)
  # Without a length penalty the two forms agree: alpha 0 is carried.
  assert options == {
      'beam_size': 4,
      'min_decoding_length': 0,
      'length_penalty': 0.0,
      'max_input_length': 96,
      'max_decoding_length': 96,
  }
  assert [text.split(' ')[0] for text in lacking] == ['max_decode_extra_length=50']
  options, _ = ct2_export.translate_options(decoding, TransformerConfig(vocab_size=48))
  assert 'max_input_length' not in options  # Sinusoids are written for POSITIONS.


@pytest.mark.parametrize('quantization', ['int8', 'float16'])
def test_quantized_export_loads_and_translates(tokenizer, tmp_path, quantization):
  # Not compared with this project's outputs: int8 and float16 weights change the logits.
  workdir = _checkpoint(tmp_path, tokenizer, norm_position='pre', positional_encoding='rope')
  directory = ct2_export.export_model(
      workdir, str(tmp_path / quantization), quantization=quantization
  )
  model = _translator(directory, compute_type='auto')
  results = model.translate_batch(
      _sources(directory), beam_size=2, max_decoding_length=MAX_DECODE_LEN
  )
  assert len(results) == len(SENTENCES)
  assert all(len(r.hypotheses) == 1 for r in results)


def test_unknown_quantization_is_refused_with_the_choices(tmp_path):
  with pytest.raises(ConfigError, match="quantization='int4' .* int8, int8_float32"):
    ct2_export.export_model(str(tmp_path / 'run'), str(tmp_path / 'out'), quantization='int4')


def test_export_refuses_alibi_naming_the_field_and_the_alternatives(tokenizer, tmp_path):
  workdir = _checkpoint(tmp_path, tokenizer, positional_encoding='alibi')
  with pytest.raises(ConfigError) as error:
    ct2_export.export_model(workdir, str(tmp_path / 'out'))
  assert "positional_encoding='alibi' (CTranslate2's encoder has no ALiBi" in str(error.value)
  assert "'sinusoidal', 'learned', 'rope'" in str(error.value)
  assert not os.path.exists(tmp_path / 'out')


def _run_command(monkeypatch, capsys, *flags: str) -> tuple[int, str]:
  """export_ctranslate2.py run in this process as from a shell (a subprocess would start
  Python and JAX again): (exit code, stderr). The process-wide hooks the command sets are put
  back afterwards."""
  import threading

  from transformer_jax.commands import export_ctranslate2

  monkeypatch.setattr(threading, 'excepthook', threading.excepthook)
  monkeypatch.setattr(sys, 'unraisablehook', sys.unraisablehook)
  monkeypatch.setattr(storage, '_limit', dict(storage._limit))  # `storage.limit_waits`.
  script = os.path.join(train_testlib.REPO, 'export_ctranslate2.py')
  monkeypatch.setattr(sys, 'argv', [script, *flags])
  with pytest.raises(SystemExit) as exit_:
    export_ctranslate2.run()
  return exit_.value.code, capsys.readouterr().err


def test_command_on_a_bad_workdir_exits_2_in_one_paragraph(
    tokenizer, tmp_path, monkeypatch, capsys
):
  code, stderr = _run_command(
      monkeypatch, capsys, f'--workdir={tmp_path / "none"}', f'--output_dir={tmp_path / "out"}'
  )
  assert code == 2 and 'Traceback' not in stderr, stderr
  message = stderr.strip().splitlines()[-1]
  assert message.startswith('export_ctranslate2.py: error: ') and 'does not exist' in message
  # A work directory whose model CTranslate2 cannot run: the same, naming the field.
  workdir = _checkpoint(tmp_path, tokenizer, positional_encoding='alibi')
  code, stderr = _run_command(
      monkeypatch, capsys, f'--workdir={workdir}', f'--output_dir={tmp_path / "out"}'
  )
  assert code == 2 and 'Traceback' not in stderr, stderr
  message = stderr.strip().splitlines()[-1]
  assert message.startswith('export_ctranslate2.py: error: This model cannot be exported')
  assert "positional_encoding='alibi'" in message
  assert not os.path.exists(tmp_path / 'out')


@pytest.mark.slow
def test_the_trained_fixture_translates_in_ctranslate2_as_here(run_dir, tmp_path):
  """The tiny trained model (tests/decoding/test_translator.py) on its test sources: every
  greedy output whose choices are no near-tie is CTranslate2's token for token."""
  from test_translator import _test_sources

  checkpoint = loading.load(run_dir)
  directory = ct2_export.export_model(checkpoint, str(tmp_path / 'ct2'))
  tokenizer = checkpoint.tokenizer
  texts = _test_sources(run_dir)[0][:24]
  inputs = _padded([tokenizer.encode(text) for text in texts])
  ours = _ours(checkpoint, inputs)
  log_probs = _log_probs(checkpoint, inputs, _padded(ours))
  clear = [
      row
      for row, output in enumerate(ours)
      if all(np.diff(np.sort(log_probs[row, s])[-2:])[0] > 1e-3 for s in range(len(output)))
  ]
  assert len(clear) >= len(texts) // 2, f'{len(clear)} of {len(texts)} rows without near-ties'
  with open(os.path.join(directory, 'shared_vocabulary.json'), encoding='utf-8') as f:
    vocabulary = json.load(f)
  import sentencepiece as spm

  cutter = spm.SentencePieceProcessor(model_file=os.path.join(directory, 'source.spm'))
  results = _translator(directory).translate_batch(
      [cutter.encode(text, out_type=str) for text in texts],
      beam_size=1,
      min_decoding_length=0,
      max_decoding_length=MAX_DECODE_LEN,
  )
  ids = {piece: i for i, piece in enumerate(vocabulary)}
  theirs = [[ids[p] for p in result.hypotheses[0]] for result in results]
  for row in clear:
    assert theirs[row] == [t for t in ours[row] if t != EOS_ID], (row, texts[row])
  assert max(len(ours[row]) for row in clear) > 2  # Translations, not empty outputs.

"""Hugging Face Marian models in this project: the model options Marian needs, against
`MarianMTModel` itself (random weights, built here; nothing is downloaded).

Each Marian option is a config field (`sinusoid_layout`, `logits_bias`, `activation`,
`decoder_start`, `layer_norm_epsilon`); `marian.params_from_state_dict` maps the weights.
The reference is transformers' own PyTorch code, so a mapping or an option that differs from
Marian's anywhere changes the logits.
"""

import functools
import importlib.util
import json
import logging
import os
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models_testlib
import train_testlib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.checkpoints import loading
from transformer_jax.config import ConfigError
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.decoding import translator
from transformer_jax.decoding import translator as translator_lib
from transformer_jax.errors import OutputExistsError
from transformer_jax.interop import marian
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import sinusoidal_positions
from transformer_jax.model.models import Transformer
from transformer_jax.storage.layout import RunLayout

# Imported when this file's first test starts, not when the tests are collected: every test process
# collects every file, and importing PyTorch and transformers there cost each process seconds.
torch = transformers = None


@pytest.fixture(autouse=True, scope='module')
def _pytorch():
  global torch, transformers
  torch = pytest.importorskip(
      'torch',
      reason='PyTorch (CPU build) is a test-only dependency: '
      "pip install -c requirements.txt -e '.[test]'",
  )
  transformers = pytest.importorskip(
      'transformers',
      reason="transformers is a test-only dependency: pip install -c requirements.txt -e '.[test]'",
  )


VOCAB, D, MAX_LEN = 60, 64, 64


def random_marian(activation: str = 'swish', eos_bias: float = 0.0, seed: int = 0, **kwargs):
  """A random `MarianMTModel` with this project's special ids (pad 0, eos 2; Marian starts the
  decoder from pad) and non-trivial norms and logits bias."""
  torch.manual_seed(seed)
  config = transformers.MarianConfig(
      vocab_size=VOCAB,
      d_model=D,
      encoder_layers=2,
      decoder_layers=2,
      encoder_attention_heads=4,
      decoder_attention_heads=4,
      encoder_ffn_dim=128,
      decoder_ffn_dim=128,
      activation_function=activation,
      max_position_embeddings=MAX_LEN,
      scale_embedding=True,
      pad_token_id=PAD_ID,
      eos_token_id=EOS_ID,
      decoder_start_token_id=PAD_ID,
      forced_eos_token_id=None,
      bos_token_id=None,
      dropout=0.0,
      attention_dropout=0.0,
      activation_dropout=0.0,
      init_std=0.3,  # Logits that depend on the input, not on the bias alone.
      **kwargs,
  )
  model = transformers.MarianMTModel(config).eval()
  generator = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      if 'layer_norm' in name or name.endswith('.bias'):
        tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    model.final_logits_bias.copy_(
        0.1 * torch.randn(model.final_logits_bias.shape, generator=generator)
    )
    model.final_logits_bias[0, EOS_ID] += eos_bias
  return model


def imported(model) -> tuple[TransformerConfig, dict]:
  fields = marian.config_fields(model.config.to_dict())
  config = TransformerConfig(**fields, deterministic=True)
  state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
  return config, jax.tree.map(jnp.asarray, marian.params_from_state_dict(state, config))


def sources(seed: int = 0, rows: int = 3, length: int = 9) -> np.ndarray:
  ids = np.random.default_rng(seed).integers(4, VOCAB, (rows, length))
  ids[:, -1] = EOS_ID
  ids[1, 5:] = PAD_ID
  ids[1, 4] = EOS_ID
  return ids


def test_concatenated_sinusoids_are_marians_position_table():
  model = random_marian()
  table = model.model.encoder.embed_positions.weight.detach().numpy()  # [MAX_LEN, D]
  ours = sinusoidal_positions(jnp.arange(MAX_LEN)[None], D, 'concatenated')[0]
  np.testing.assert_allclose(ours, table, atol=2e-5)
  interleaved = sinusoidal_positions(jnp.arange(MAX_LEN)[None], D)[0]
  np.testing.assert_array_equal(interleaved[:, 0::2], ours[:, : D // 2])


@pytest.mark.parametrize('activation', ['swish', 'gelu', 'relu'])
def test_imported_marian_gives_marians_logits(activation):
  model = random_marian(activation)
  config, params = imported(model)
  assert (
      config.activation,
      config.sinusoid_layout,
      config.decoder_start,
      config.logits_bias,
      config.layer_norm_epsilon,
  ) == (
      {'swish': 'swish', 'gelu': 'gelu', 'relu': 'relu'}[activation],
      'concatenated',
      'pad',
      True,
      1e-5,
  )
  # Every parameter of the model is mapped, with its shape, and nothing else.
  expected = jax.eval_shape(
      lambda: nn.unbox(
          Transformer(config).init(
              jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
          )['params']
      )
  )
  assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, expected)

  inputs = sources()
  targets = np.random.default_rng(1).integers(4, VOCAB, (3, 7))
  targets[:, -1] = EOS_ID
  logits = np.asarray(Transformer(config).apply({'params': params}, inputs, targets))
  decoder_inputs = np.concatenate([np.full((3, 1), PAD_ID), targets[:, :-1]], axis=1)
  with torch.no_grad():
    expected = model(
        input_ids=torch.from_numpy(inputs),
        attention_mask=torch.from_numpy((inputs != PAD_ID).astype(np.int64)),
        decoder_input_ids=torch.from_numpy(decoder_inputs),
    ).logits.numpy()
  relative_error = np.abs(logits - expected).max() / np.abs(expected).max()
  assert relative_error < 1e-5, relative_error


def _ours(config, params, inputs, beam_size, max_len, alpha=0.0, form='power'):
  options = translator.DecodeOptions(
      beam_size=beam_size,
      length_penalty=alpha,
      length_penalty_form=form,
      max_decode_extra_length=max_len,
  )
  search = jax.jit(
      functools.partial(translator.search, config, options=options, max_decode_len=max_len)
  )
  sequences, scores, _ = search(params, jnp.asarray(inputs))
  return np.asarray(sequences[:, 0]), np.asarray(scores[:, 0])


def _generate(model, **kwargs) -> np.ndarray:
  """`model.generate`'s sequences. For greedy search, also checks that no step chose between
  two tokens closer than 1e-3 in logit: the fixtures' outputs then do not depend on the last
  bits of a CPU's floats, which differ from machine to machine."""
  with torch.no_grad():
    out = model.generate(
        do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs
    )
  if kwargs.get('num_beams', 1) == 1:
    eos = model.generation_config.eos_token_id
    for row, sequence in enumerate(out.sequences[:, 1:].tolist()):
      steps = sequence.index(eos) + 1 if eos in sequence else len(sequence)
      for step in range(steps):
        top = torch.topk(out.scores[step][row].float(), 2).values
        assert float(top[0] - top[1]) > 1e-3, f'near-tie at row {row}, step {step}'
  return out.sequences.numpy()


def _theirs(model, inputs, max_len, **kwargs):
  out = _generate(
      model,
      input_ids=torch.from_numpy(inputs),
      attention_mask=torch.from_numpy((inputs != PAD_ID).astype(np.int64)),
      max_new_tokens=max_len,
      bad_words_ids=[[PAD_ID]],
      **kwargs,
  )[
      :, 1:
  ]  # No start.
  return np.pad(out, ((0, 0), (0, max_len - out.shape[1])), constant_values=PAD_ID)


def _strip(row) -> list[int]:
  row = list(row)
  return row[: row.index(EOS_ID) + 1] if EOS_ID in row else [t for t in row if t != PAD_ID]


@pytest.mark.parametrize('eos_bias', [0.0, 3.0])
def test_imported_marian_greedy_search_gives_generates_outputs(eos_bias):
  model = random_marian('swish', eos_bias=eos_bias, seed=3)
  config, params = imported(model)
  inputs = sources(seed=5, rows=4)
  ours, _ = _ours(config, params, inputs, beam_size=1, max_len=16)
  theirs = _theirs(model, inputs, 16, num_beams=1)
  assert [_strip(r) for r in ours] == [_strip(r) for r in theirs]
  assert len({tuple(_strip(r)) for r in ours}) == len(ours)  # Outputs follow the inputs.
  if eos_bias:
    assert any(EOS_ID in r for r in ours)  # Both stop at EOS, not only at the limit.


def test_imported_marian_beam_search_gives_generates_best_hypothesis():
  # Hugging Face with early_stopping='never' searches until no running beam can beat the
  # finished ones, with the length penalty |Y|^alpha, as this project's beam search does.
  # One difference: at the length limit, Hugging Face ranks the beams still running together
  # with the finished hypotheses, where this project puts every finished hypothesis first
  # (the paper's and tensor2tensor's choice: a translation ends with EOS). So rows agree
  # whenever Hugging Face's best has finished; where it has not, it is a truncated output.
  model = random_marian('swish', eos_bias=3.0, seed=3)
  config, params = imported(model)
  inputs = sources(seed=5, rows=4)
  ours, _ = _ours(config, params, inputs, beam_size=4, max_len=16, alpha=0.6)
  theirs = _theirs(model, inputs, 16, num_beams=4, length_penalty=0.6, early_stopping='never')
  ours, theirs = [_strip(r) for r in ours], [_strip(r) for r in theirs]
  assert all(r[-1] == EOS_ID for r in ours)
  agree = [t[-1] == EOS_ID for t in theirs]
  assert [o for o, a in zip(ours, agree) if a] == [t for t, a in zip(theirs, agree) if a]
  assert all(len(t) == 16 for t, a in zip(theirs, agree) if not a)
  assert sum(agree) >= 3 and len({tuple(o) for o in ours}) == len(ours)


def test_marian_config_that_cannot_be_imported_is_refused_with_the_reason():
  config = random_marian().config.to_dict()
  for change, words in (
      (dict(activation_function='gelu_new'), 'activation_function'),
      (dict(scale_embedding=False), 'scale_embedding'),
      (dict(decoder_ffn_dim=256), 'decoder_ffn_dim'),
      (dict(model_type='bart'), 'model_type'),
  ):
    with pytest.raises(ConfigError, match=words):
      marian.config_fields({**config, **change})


@pytest.mark.parametrize(
    'field,value',
    [
        ('activation', 'tanh'),
        ('sinusoid_layout', 'split'),
        ('decoder_start', 'eos'),
        ('logits_bias', 'yes'),
    ],
)
def test_model_option_fields_refuse_unknown_values(field, value):
  with pytest.raises(ConfigError, match=field):
    TransformerConfig(vocab_size=VOCAB, **{field: value})


# --- A whole model directory, as OPUS-MT publishes them (built here, offline). ---

SOURCE_TEXT = [
    'the cat sat on the mat',
    'a dog ran in the park',
    'the bird sings at dawn',
    'my friend reads a book',
    'we walk to the river',
    'the sun is warm today',
]
TARGET_TEXT = [
    'le chat est assis sur le tapis',
    'un chien court dans le parc',
    "l'oiseau chante a l'aube",
    'mon ami lit un livre',
    'nous marchons vers la riviere',
    "le soleil est chaud aujourd'hui",
]


def _train_spm(path_prefix: str, lines: list[str]) -> str:
  import sentencepiece as spm

  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines * 20),
      model_prefix=path_prefix,
      vocab_size=40,
      model_type='unigram',
      minloglevel=2,
      hard_vocab_limit=False,
  )
  return path_prefix + '.model'


@pytest.fixture(scope='module')
def opus_mt_dir(tmp_path_factory):
  """A random Marian model saved as Hugging Face saves OPUS-MT models: eos 0, unk 1, pad
  last and the decoder starting from it, swish, its own source and target SentencePiece."""
  root = tmp_path_factory.mktemp('opus')
  models = {
      side: _train_spm(str(root / side), text)
      for side, text in (('source', SOURCE_TEXT), ('target', TARGET_TEXT))
  }
  import sentencepiece as spm

  pieces = []
  for path in models.values():
    processor = spm.SentencePieceProcessor(model_file=path)
    pieces += [
        processor.id_to_piece(i)
        for i in range(processor.get_piece_size())
        if not processor.is_control(i) and not processor.is_unknown(i)
    ]
  vocab = {'</s>': 0, '<unk>': 1}
  for piece in pieces:
    vocab.setdefault(piece, len(vocab))
  vocab['<pad>'] = len(vocab)
  (root / 'vocab.json').write_text(json.dumps(vocab))
  tokenizer = transformers.MarianTokenizer(
      source_spm=models['source'],
      target_spm=models['target'],
      vocab=str(root / 'vocab.json'),
      source_lang='en',
      target_lang='fr',
  )
  size, pad = len(vocab), vocab['<pad>']
  torch.manual_seed(7)
  config = transformers.MarianConfig(
      vocab_size=size,
      d_model=D,
      encoder_layers=2,
      decoder_layers=2,
      encoder_attention_heads=4,
      decoder_attention_heads=4,
      encoder_ffn_dim=128,
      decoder_ffn_dim=128,
      activation_function='swish',
      max_position_embeddings=128,
      scale_embedding=True,
      pad_token_id=pad,
      eos_token_id=0,
      decoder_start_token_id=pad,
      forced_eos_token_id=None,
      bos_token_id=None,
      init_std=0.3,
  )
  model = transformers.MarianMTModel(config).eval()
  with torch.no_grad():
    model.final_logits_bias[0, 0] += 1.0  # Some outputs end before the limit.
    model.model.shared.weight[pad] = 0.0  # As in OPUS-MT models: Marian starts from zeros.
  model.generation_config.bad_words_ids = [[pad]]
  directory = root / 'opus-mt-en-fr'
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return directory, model, tokenizer


EXTRA = 10
OPUS_SENTENCES = SOURCE_TEXT + ['the dog sings', 'a word it has never seen: zyx', '>>fr<< the cat']


@pytest.mark.slow
def test_imported_opus_mt_directory_translates_as_hugging_face_does(opus_mt_dir, tmp_path):
  directory, model, tokenizer = opus_mt_dir
  workdir = tmp_path / 'imported'
  marian.import_model(str(directory), str(workdir))
  translator, checkpoint = translator_lib.load_translator(
      str(workdir), beam_size=1, max_decode_extra_length=EXTRA
  )
  # OPUS-MT's <pad> row is zero: Marian starts from a zero vector, and so does the import.
  assert checkpoint.model_config.decoder_start == 'zero'
  assert checkpoint.tokenizer.vocab_size == model.config.vocab_size
  sentences = OPUS_SENTENCES

  # The same pieces, in this project's ids.
  vocab = tokenizer.get_vocab()
  order = marian.vocabulary_order(vocab, model.config.to_dict())
  for text in sentences:
    theirs = tokenizer(text).input_ids
    assert checkpoint.tokenizer.encode(text) == [order.index(i) for i in theirs]

  ours, _ = translator.translate(sentences)
  theirs = []
  for text in sentences:  # Each with this project's limit: source length + EXTRA.
    batch = tokenizer([text], return_tensors='pt')
    generated = _generate(
        model, **batch, num_beams=1, max_new_tokens=batch.input_ids.shape[1] + EXTRA
    )
    theirs += tokenizer.batch_decode(generated, skip_special_tokens=True)
  assert ours == theirs
  assert len(set(ours)) > len(ours) // 2  # Translations that follow their sources.


def test_import_refuses_a_used_workdir_and_an_incomplete_directory(opus_mt_dir, tmp_path):
  directory, _, _ = opus_mt_dir
  workdir = tmp_path / 'imported'
  marian.import_model(str(directory), str(workdir))
  with pytest.raises(OutputExistsError, match='already has checkpoints'):
    marian.import_model(str(directory), str(workdir))
  broken = tmp_path / 'broken'
  shutil.copytree(directory, broken)
  (broken / 'target.spm').unlink()
  with pytest.raises(ConfigError, match='target.spm does not exist'):
    marian.import_model(str(broken), str(tmp_path / 'other'))


def test_import_into_an_empty_directory_and_a_retry_after_a_failure(opus_mt_dir, tmp_path):
  """`mkdir W` then an import into W works; a model with a damaged source.spm is blamed on
  that file, leaves W as it was (empty), and the retry with a good model works."""
  directory, _, _ = opus_mt_dir
  broken = tmp_path / 'broken'
  shutil.copytree(directory, broken)
  (broken / 'source.spm').write_bytes(b'not a sentencepiece model')
  workdir = tmp_path / 'W'
  workdir.mkdir()
  with pytest.raises(ConfigError, match=f'{broken}/source.spm is not a SentencePiece model'):
    marian.import_model(str(broken), str(workdir))
  assert os.listdir(workdir) == [] and sorted(os.listdir(tmp_path)) == ['W', 'broken']
  marian.import_model(str(directory), str(workdir))
  assert sorted(os.listdir(workdir)) == ['checkpoints', 'finetune_config.py', 'marian_vocab.json']
  meta, _ = checkpointing.read_meta(RunLayout.of(str(workdir)).checkpoints)
  assert meta['tokenizer']['path'] == str(workdir / 'marian_vocab.json')  # Not the staging.
  assert loading.load(str(workdir)).tokenizer.vocab_size == meta['vocab_size']
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'notes.txt').write_text('mine')
  with pytest.raises(OutputExistsError, match='is not empty'):
    marian.import_model(str(directory), str(other))


@pytest.mark.slow
def test_imported_model_fine_tunes_from_its_config_file(opus_mt_dir, tmp_path):
  directory, model, _ = opus_mt_dir
  imported_dir = tmp_path / 'imported'
  marian.import_model(str(directory), str(imported_dir))
  files = {}
  for split in ('train', 'validation'):
    for side, lines in (('src', SOURCE_TEXT), ('tgt', TARGET_TEXT)):
      (tmp_path / f'{split}.{side}').write_text('\n'.join(lines) + '\n')
    files[split] = f'{tmp_path}/{split}.src,{tmp_path}/{split}.tgt'
  spec = importlib.util.spec_from_file_location(
      'finetune', imported_dir / marian.FINETUNE_CONFIG_FILE
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for split, value in files.items():
    config.text_files[split] = value
  config.update(
      dict(
          num_train_steps=2,
          warmup_steps=1,
          tokens_per_batch=128,
          bucket_boundaries=(),
          max_source_length=32,
          max_target_length=32,
          eval_every_steps=0,
          log_every_steps=1,
          checkpoint_every_steps=2,
          eval_bleu_sentences=0,
          best_checkpoint_metric='',
      )
  )
  from transformer_jax.training import train_loop

  result = train_loop.train_and_evaluate(config, str(tmp_path / 'tuned'))
  assert int(result.state.step) == 2
  # It started from the imported parameters and moved from them.
  start, _ = checkpointing.restore_params(RunLayout.of(str(imported_dir)).checkpoints, 0)
  moved = jax.tree.map(
      lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
      jax.device_get(result.state.params),
      jax.device_get(start),
  )
  assert 0 < max(jax.tree.leaves(moved)) < 1.0
  translator, checkpoint = translator_lib.load_translator(str(tmp_path / 'tuned'))
  assert checkpoint.tokenizer.vocab_size == model.config.vocab_size
  assert len(translator.translate(['the cat sat'])[0]) == 1


@pytest.mark.slow
def test_import_command_reports_a_bad_directory_in_one_paragraph(tmp_path):
  result = train_testlib.run_command(
      [
          sys.executable,
          os.path.join(train_testlib.REPO, 'import_marian.py'),
          f'--model_dir={tmp_path}',
          f'--workdir={tmp_path / "out"}',
      ],
      timeout=300,
      env=train_testlib.subprocess_env(),
  )
  assert result.returncode == 2, result.stderr
  assert 'config.json does not exist' in result.stderr
  assert 'Traceback' not in result.stderr


# --- Export: this project's checkpoints as Marian directories, and back. ---


def _own_checkpoint(root, output_ids=None, **fields) -> str:
  """A random post-norm model of this project with its own SentencePiece vocabulary,
  written as a checkpoint (what a training run leaves; `output_ids` go to its meta)."""
  from configs import tiny

  tokenizer = train_tokenizer(
      SOURCE_TEXT * 10 + TARGET_TEXT * 10, str(root / 'vocab.model'), vocab_size=48
  )
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
  model_config = TransformerConfig.from_config(config, tokenizer.vocab_size)
  params = models_testlib.noisy_params(model_config, 3.0)
  if model_config.decoder_start == 'zero':  # As training keeps it (`models.Embed`).
    params['shared_embedding']['embedding'][PAD_ID] = 0
  workdir = str(root / 'run')
  checkpointing.write_params_checkpoint(
      RunLayout.of(workdir).checkpoints,
      7,
      params,
      checkpointing.make_meta(config, tokenizer, output_ids),
  )
  return workdir


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp('export')
  # Decoding options of its own (none of them the default): the round trip keeps them.
  workdir = _own_checkpoint(
      root,
      beam_size=2,
      length_penalty=0.8,
      length_penalty_form='power',
      max_decode_extra_length=7,
      no_repeat_ngram_size=3,
      no_adjacent_repeat_size=5,
  )
  return workdir, marian.export_model(workdir, str(root / 'marian'))


def _hf_greedy(model, tokenizer, sentences):
  outputs = []
  for text in sentences:  # Each with this project's limit: source length + EXTRA.
    batch = tokenizer([text], return_tensors='pt')
    generated = _generate(
        model, **batch, num_beams=1, max_new_tokens=batch.input_ids.shape[1] + EXTRA
    )
    outputs.append(generated[0].tolist())
  return outputs


@pytest.mark.slow
def test_exported_model_translates_in_hugging_face_as_here(exported):
  workdir, directory = exported
  # Both searches without the export's no_repeat_ngram_size: this random model meets near-ties
  # (logits 3e-4 apart) once repeats are banned, and those fall either way on another CPU.
  # (Hugging Face has no no_adjacent_repeat_size at all.)
  translator, checkpoint = translator_lib.load_translator(
      workdir,
      beam_size=1,
      max_decode_extra_length=EXTRA,
      no_repeat_ngram_size=0,
      no_adjacent_repeat_size=0,
  )
  model = transformers.MarianMTModel.from_pretrained(directory).eval()
  model.generation_config.no_repeat_ngram_size = 0
  tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
  sentences = SOURCE_TEXT + ['the dog sings at the river']
  size = checkpoint.model_config.vocab_size

  def ours(marian_ids):  # The export puts <pad> last and the others one lower.
    return [0 if i == size - 1 else i + 1 for i in marian_ids]

  for text in sentences:
    assert ours(tokenizer(text).input_ids) == checkpoint.tokenizer.encode(text)
  hyps, _ = translator.translate_n_best(sentences)
  theirs = _hf_greedy(model, tokenizer, sentences)
  for (hyp,), ids in zip(hyps, theirs):
    assert ours(ids)[0] == checkpoint.model_config.decoder_start_id
    assert _strip(hyp.tokens) == _strip(ours(ids[1:]))
  assert len({tuple(_strip(h.tokens)) for (h,) in hyps}) > len(hyps) // 2


def _ct2_translates_as_here(workdir, exported_dir, tmp_path, sentences):
  import ctranslate2  # The test extra's.

  converted = ctranslate2.converters.TransformersConverter(exported_dir).convert(
      str(tmp_path / 'ct2')
  )
  ct2 = ctranslate2.Translator(converted, device='cpu')
  translator, checkpoint = translator_lib.load_translator(
      workdir, beam_size=1, max_decode_extra_length=EXTRA
  )
  pieces = checkpoint.tokenizer.pieces()
  hyps, _ = translator.translate_n_best(sentences)
  for text, (hyp,) in zip(sentences, hyps):
    source = [pieces[i] for i in checkpoint.tokenizer.encode(text)]
    # min_decoding_length=0: CTranslate2 otherwise never gives an empty output (its default
    # is 1); this project and Hugging Face end at an EOS chosen first.
    result = ct2.translate_batch(
        [source], beam_size=1, min_decoding_length=0, max_decoding_length=len(source) + EXTRA
    )[0]
    assert result.hypotheses[0] == [pieces[i] for i in _strip(hyp.tokens) if i != EOS_ID]
  assert len({tuple(_strip(h.tokens)) for (h,) in hyps}) > len(hyps) // 2


@pytest.mark.slow
def test_exported_model_converts_to_ctranslate2_and_translates_as_here(opus_mt_dir, tmp_path):
  # CTranslate2's Marian converter starts the decoder from a zero vector, as Marian does:
  # exact for a model whose decoder starts from a zero <pad> row, as OPUS-MT models do.
  directory, _, _ = opus_mt_dir
  workdir = str(tmp_path / 'imported')
  marian.import_model(str(directory), workdir)
  exported_dir = marian.export_model(workdir, str(tmp_path / 'marian'))
  # Without near-ties (checked against Hugging Face above).
  _ct2_translates_as_here(workdir, exported_dir, tmp_path, OPUS_SENTENCES)


@pytest.mark.slow
def test_own_model_trained_to_start_from_zero_exports_exactly_to_both(tmp_path, caplog):
  """decoder_start='zero' is what CTranslate2 assumes of every Marian model: such a model of
  this project translates there, and in Hugging Face, as here; one that starts from <s>
  is exported with a warning that CTranslate2 would differ."""
  workdir = _own_checkpoint(tmp_path, decoder_start='zero')
  with caplog.at_level(logging.WARNING):
    exported_dir = marian.export_model(workdir, str(tmp_path / 'marian'))
  assert 'CTranslate2 would not' not in caplog.text
  sentences = SOURCE_TEXT + ['the dog sings at the river']
  _ct2_translates_as_here(workdir, exported_dir, tmp_path, sentences)
  marian.import_model(exported_dir, str(tmp_path / 'back'))
  assert loading.load(str(tmp_path / 'back')).model_config.decoder_start == 'zero'

  with caplog.at_level(logging.WARNING):
    marian.export_model(_own_checkpoint(tmp_path / 'bos'), str(tmp_path / 'bos_marian'))
  assert 'CTranslate2 would not' in caplog.text and 'decoder_start=zero' in caplog.text


@pytest.mark.slow
def test_export_then_import_gives_the_same_parameters_bit_for_bit(exported, tmp_path):
  workdir, directory = exported
  # Every file of the export has the mode a new file gets here (safetensors' own is 0600).
  umask = os.umask(0)
  os.umask(umask)
  modes = {
      name: os.stat(os.path.join(directory, name)).st_mode & 0o777 for name in os.listdir(directory)
  }
  assert set(modes.values()) == {0o666 & ~umask}, modes
  marian.import_model(directory, str(tmp_path / 'back'))
  original = loading.load(workdir)
  back = loading.load(str(tmp_path / 'back'))
  for field in (
      'd_model',
      'num_heads',
      'd_ff',
      'activation',
      'sinusoid_layout',
      'logits_bias',
      'decoder_start',
      'share_embeddings',
      'tie_output_embedding',
  ):
    assert getattr(back.model_config, field) == getattr(original.model_config, field), field
  jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
      back.params,
      original.params,
  )
  assert back.tokenizer.pieces() == original.tokenizer.pieces()
  assert back.tokenizer.encode('the cat sat') == original.tokenizer.encode('the cat sat')
  # What Marian has no field for comes back too: layer norm's epsilon and the decoding.
  assert back.model_config.layer_norm_epsilon == original.model_config.layer_norm_epsilon
  assert original.model_config.layer_norm_epsilon != marian.MARIAN_LAYER_NORM_EPSILON
  for name in marian.DECODING_FIELDS:
    assert back.config[name] == original.config[name], name
  assert (original.config.beam_size, original.config.length_penalty) == (2, 0.8)
  # Hugging Face reads the beam and the ('power') length penalty from the export.
  with open(os.path.join(directory, 'generation_config.json'), encoding='utf-8') as f:
    generation = json.load(f)
  assert (generation['num_beams'], generation['length_penalty']) == (2, 0.8)
  assert generation['no_repeat_ngram_size'] == original.config.no_repeat_ngram_size == 3


def test_export_says_when_hugging_face_uses_another_layer_norm_epsilon(exported, tmp_path, caplog):
  workdir, _ = exported
  with caplog.at_level(logging.WARNING):
    marian.export_model(workdir, str(tmp_path / 'again'))
  assert (
      "layer_norm_epsilon=1e-06 to the variance; Hugging Face's MarianMTModel and "
      'CTranslate2 add 1e-05' in caplog.text
  ), caplog.text
  assert (
      "The run decodes with no_adjacent_repeat_size=5, which Hugging Face's generate and "
      'CTranslate2 have no option for' in caplog.text
  ), caplog.text


def test_a_foreign_model_directory_gives_its_stated_beam_and_length_penalty(tmp_path):
  config = {'model_type': 'marian', 'num_beams': 6}
  assert marian.imported_decoding(str(tmp_path), config) == {'beam_size': 6}
  (tmp_path / 'generation_config.json').write_text(
      json.dumps({'num_beams': 5, 'length_penalty': 1.2, 'no_repeat_ngram_size': 3})
  )
  assert marian.imported_decoding(str(tmp_path), config) == {
      'beam_size': 5,
      'length_penalty': 1.2,
      'length_penalty_form': 'power',
      'no_repeat_ngram_size': 3,
  }
  assert marian.imported_decoding(str(tmp_path / 'none'), {'model_type': 'marian'}) == {}


def test_import_then_export_gives_the_marian_weights_back(opus_mt_dir, tmp_path):
  directory, model, _ = opus_mt_dir
  marian.import_model(str(directory), str(tmp_path / 'imported'))
  out = marian.export_model(str(tmp_path / 'imported'), str(tmp_path / 'again'))
  again = transformers.MarianMTModel.from_pretrained(out).state_dict()
  # Both vocabularies have <pad> last; the pieces between may come in another order.
  original_ids = json.loads((directory / 'vocab.json').read_text())
  exported_ids = json.loads((tmp_path / 'again' / 'vocab.json').read_text())
  assert sorted(original_ids) == sorted(exported_ids)
  rows = np.argsort([original_ids[piece] for piece in sorted(exported_ids, key=exported_ids.get)])
  for name, tensor in model.state_dict().items():
    expected, got = tensor.numpy(), again[name].numpy()
    if 'embed_positions' in name:
      np.testing.assert_allclose(got, expected, atol=2e-5)
      continue
    if name == 'final_logits_bias':
      got = got[:, rows]
    elif name in ('lm_head.weight', 'model.shared.weight') or 'embed_tokens' in name:
      got = got[rows]
    np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.slow
def test_import_and_export_on_a_bucket_match_the_local_ones(opus_mt_dir, bucket, tmp_path):
  """A Marian directory imported from a bucket into a bucket (its checkpoint written there
  last) holds the parameters of a local import, and its export to a bucket the bytes of a
  local export, config.json uploaded last; what a killed export left is replaced by the
  retry, and anything else in the output directory refuses the export."""
  import gcsfs

  directory, _, _ = opus_mt_dir
  fs = gcsfs.GCSFileSystem()
  fs.put(str(directory), f'{bucket}/opus', recursive=True)
  workdir = f'{bucket}/imported'
  assert marian.import_model(f'{bucket}/opus', workdir) == f'{workdir}/checkpoints/0'
  marian.import_model(str(directory), str(tmp_path / 'imported'))
  ours, theirs = loading.load(workdir), loading.load(str(tmp_path / 'imported'))
  jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
      ours.params,
      theirs.params,
  )
  meta, _ = checkpointing.read_meta(RunLayout.of(workdir).checkpoints)
  assert meta['imported_from'] == f'{bucket}/opus'
  assert meta['tokenizer']['path'] == f'{workdir}/marian_vocab.json'
  assert f"c.init_from = '{workdir}'" in fs.cat(f'{workdir}/finetune_config.py').decode()

  out = f'{bucket}/export'
  assert marian.export_model(workdir, out) == out
  marian.export_model(str(tmp_path / 'imported'), str(tmp_path / 'export'))
  names = sorted(os.listdir(tmp_path / 'export'))
  assert sorted(p.rsplit('/', 1)[1] for p in fs.find(out)) == names
  for name in names:
    assert fs.cat(f'{out}/{name}') == (tmp_path / 'export' / name).read_bytes(), name
  objects = fs.find(out, detail=True)
  assert max(objects, key=lambda p: int(objects[p]['generation'])).endswith('/config.json')
  with pytest.raises(OutputExistsError, match='already holds a model'):
    marian.export_model(workdir, out)
  fs.rm(f'{out}/config.json')  # Killed before its last upload.
  marian.export_model(workdir, out)
  assert fs.exists(f'{out}/config.json')
  fs.pipe(f'{bucket}/other/notes.txt', b'mine')
  with pytest.raises(OutputExistsError, match='holds notes.txt'):
    marian.export_model(workdir, f'{bucket}/other')
  assert fs.find(f'{bucket}/other') == [f'{bucket[5:]}/other/notes.txt']


def test_export_refuses_what_marian_lacks_naming_the_field(tmp_path):
  # The main job's model: the three fields at once, each named.
  workdir = _own_checkpoint(
      tmp_path,
      output_ids=(2, 3, 5, 8, 13),
      norm_position='pre',
      positional_encoding='rope',
      output_vocabulary='target',
  )
  with pytest.raises(ConfigError) as error:
    marian.export_model(workdir, str(tmp_path / 'out'))
  assert "norm_position='pre'" in str(error.value)
  assert "positional_encoding='rope'" in str(error.value)
  assert "output_vocabulary='target' (an output layer of 5 of the 48" in str(error.value)
  assert not os.path.exists(tmp_path / 'out')

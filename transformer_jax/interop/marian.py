"""Hugging Face Marian (OPUS-MT) models: their config and weights in this project's terms.

A Marian model in Hugging Face's layout (`MarianMTModel`) is the paper's post-norm
Transformer with a few differences, each a config field here:

  * positions are [sines | cosines] (`sinusoid_layout='concatenated'`);
  * the logits get a bias, `final_logits_bias` (`logits_bias=True`);
  * the feed-forward nonlinearity may be swish or gelu (`activation`);
  * the decoder starts from the pad token (`decoder_start='pad'`), whose embedding is zero in
    OPUS-MT models, where Marian itself starts from a zero vector (`decoder_start='zero'`);
  * layer norm's epsilon is 1e-5 (`layer_norm_epsilon`; an export of a model with another
    says so, and records its own for the import back).

An export also records how the run decodes (DECODING_FIELDS; Hugging Face's `num_beams`,
`length_penalty` where the run's is the 'power' form, which is Hugging Face's, and
`no_repeat_ngram_size` where it is set; `no_adjacent_repeat_size` has no equivalent there,
which the export says), and an import restores them.

Weights: Hugging Face's `nn.Linear` stores [out, in]; this project's kernels are [in, out],
with the attention's heads as their own axis ([d_model, heads, head_dim] for the query, key
and value kernels, [heads, head_dim, d_model] for the output one).

`import_model` reads a whole model directory (config.json, the weights in safetensors or
pytorch_model.bin, source.spm, target.spm, vocab.json) and writes a work directory that
evaluate.py, translate.py and train.py (`init_from`) take. This project's special ids are
fixed (0 pad, 2 eos, 3 unk; 1 is BOS where the decoder starts from it), so the import
reorders the vocabulary: those four first, then every other id in Marian's order. With
`decoder_start='pad'` or `'zero'` id 1 is an ordinary piece (the first of the others).
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import os
import tempfile
from typing import Any

from absl import logging
import numpy as np
import sentencepiece as spm

from transformer_jax import config as config_lib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.config import ConfigError
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.data.tokenizer import write_split_vocabulary
from transformer_jax.errors import OutputExistsError
from transformer_jax.model.config import TransformerConfig
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import config_checks

VOCABULARY_FILE = 'marian_vocab.json'  # In the work directory: `tokenizer.SplitTokenizer`.
FINETUNE_CONFIG_FILE = 'finetune_config.py'  # In the work directory: train.py --config=.
# Run config fields the import sets: the model's, and what its vocabulary and data need.
_RUN_FIELDS = (
    'source_lang',
    'target_lang',
    'dataset',
    'vocab_path',
    'max_source_length',
    'max_target_length',
)
# How the run decodes: an export records them, and an import of that export restores them.
DECODING_FIELDS = (
    'beam_size',
    'length_penalty',
    'length_penalty_form',
    'max_decode_extra_length',
    'no_repeat_ngram_size',
    'no_adjacent_repeat_size',
)
# Hugging Face's Marian layers use nn.LayerNorm's default, and config.json has no field for it.
MARIAN_LAYER_NORM_EPSILON = 1e-5

# The key of config.json under which an export records the fields Marian has no name for.
EXPORT_KEY = 'transformer_jax'
# Hugging Face's names of the activations this project has.
_ACTIVATIONS = {'relu': 'relu', 'swish': 'swish', 'silu': 'swish', 'gelu': 'gelu'}


def config_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """This project's model config fields for a Marian `config.json` (as a dict).

  Raises:
    ConfigError: the model uses something this project does not have; the message names it.
  """

  def need(condition: bool, what: str) -> None:
    if not condition:
      raise ConfigError(f'This Marian model cannot be imported: {what}.')

  get = hf_config.get
  need(
      get('model_type', 'marian') == 'marian',
      f"config.json has model_type={get('model_type')!r}, not 'marian'",
  )
  activation = get('activation_function', 'swish')
  need(
      activation in _ACTIVATIONS,
      f'activation_function={activation!r} is not one of {sorted(_ACTIVATIONS)}',
  )
  need(
      get('scale_embedding', False),
      'scale_embedding is false (this project always scales embeddings by sqrt(d_model))',
  )
  need(not get('normalize_before', False), 'normalize_before is true (pre-norm Marian)')
  for ours, enc, dec in (
      ('num_heads', 'encoder_attention_heads', 'decoder_attention_heads'),
      ('d_ff', 'encoder_ffn_dim', 'decoder_ffn_dim'),
  ):
    need(
        get(enc) == get(dec),
        f'{enc}={get(enc)} and {dec}={get(dec)} differ (this project has one {ours})',
    )
  pad, start = get('pad_token_id'), get('decoder_start_token_id', get('pad_token_id'))
  # What an export from this project records of itself (Marian has no field for it).
  own = get(EXPORT_KEY) or {}
  return dict(
      vocab_size=int(get('vocab_size')),
      d_model=int(get('d_model')),
      num_heads=int(get('encoder_attention_heads')),
      d_ff=int(get('encoder_ffn_dim')),
      num_encoder_layers=int(get('encoder_layers')),
      num_decoder_layers=int(get('decoder_layers')),
      dropout_rate=float(get('dropout', 0.1)),
      attention_dropout_rate=float(get('attention_dropout', 0.0)),
      norm_position='post',
      # An export from this project records its own; Marian's is fixed.
      layer_norm_epsilon=float(own.get('layer_norm_epsilon', MARIAN_LAYER_NORM_EPSILON)),
      share_embeddings=bool(get('share_encoder_decoder_embeddings', True)),
      tie_output_embedding=bool(get('tie_word_embeddings', True)),
      positional_encoding='sinusoidal',
      sinusoid_layout=own.get('sinusoid_layout', 'concatenated'),
      activation=_ACTIVATIONS[activation],
      logits_bias=bool(own.get('logits_bias', True)),
      decoder_start=own.get('decoder_start', 'pad' if start == pad else 'bos'),
      max_len=int(get('max_position_embeddings', 512)),
  )


def _linear(state: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {'kernel': state[f'{name}.weight'].T, 'bias': state[f'{name}.bias']}


def _norm(state: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {'norm': {'scale': state[f'{name}.weight'], 'bias': state[f'{name}.bias']}}


def _attention(
    state: Mapping[str, np.ndarray], name: str, config: TransformerConfig
) -> dict[str, np.ndarray]:
  d, heads, head_dim = config.d_model, config.num_heads, config.head_dim
  params = {}
  for ours, theirs in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
    params[f'{ours}_kernel'] = state[f'{name}.{theirs}.weight'].T.reshape(d, heads, head_dim)
    params[f'{ours}_bias'] = state[f'{name}.{theirs}.bias'].reshape(heads, head_dim)
  params['out_kernel'] = state[f'{name}.out_proj.weight'].T.reshape(heads, head_dim, d)
  params['out_bias'] = state[f'{name}.out_proj.bias']
  return params


def params_from_state_dict(
    state: Mapping[str, np.ndarray], config: TransformerConfig
) -> dict[str, Any]:
  """This project's parameter tree from a `MarianMTModel` state dict (numpy arrays).

  The token ids stay the model's own: row i of every vocabulary matrix is Marian's id i.
  """

  def layer(prefix: str, decoder: bool) -> dict[str, Any]:
    params = {
        'self_attention': _attention(state, f'{prefix}.self_attn', config),
        'self_attention_block': _norm(state, f'{prefix}.self_attn_layer_norm'),
        'feed_forward': {
            'wi': _linear(state, f'{prefix}.fc1'),
            'wo': _linear(state, f'{prefix}.fc2'),
        },
        'feed_forward_block': _norm(state, f'{prefix}.final_layer_norm'),
    }
    if decoder:
      params['encoder_decoder_attention'] = _attention(state, f'{prefix}.encoder_attn', config)
      params['encoder_decoder_attention_block'] = _norm(state, f'{prefix}.encoder_attn_layer_norm')
    return params

  params: dict[str, Any] = {
      'encoder': {
          f'layer_{i}': layer(f'model.encoder.layers.{i}', False)
          for i in range(config.num_encoder_layers)
      },
      'decoder': {
          f'layer_{i}': layer(f'model.decoder.layers.{i}', True)
          for i in range(config.num_decoder_layers)
      },
  }
  if config.share_embeddings:
    params['shared_embedding'] = {'embedding': state['model.shared.weight']}
  else:
    params['source_embedding'] = {'embedding': state['model.encoder.embed_tokens.weight']}
    params['target_embedding'] = {'embedding': state['model.decoder.embed_tokens.weight']}
  if not config.tie_output_embedding:
    params['decoder']['output_projection'] = {'kernel': state['lm_head.weight'].T}
  if config.logits_bias:
    params['decoder']['logits_bias'] = state['final_logits_bias'].reshape(-1)
  return params


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    raise ConfigError(
        f'{path} does not exist; a Marian model directory has config.json, '
        'vocab.json, source.spm, target.spm and the weights '
        '(model.safetensors or pytorch_model.bin).'
    ) from None
  except (OSError, ValueError) as e:
    raise ConfigError(f'{path} is not readable JSON ({e}).') from None


def read_state_dict(model_dir: str) -> dict[str, np.ndarray]:
  """The weights of a Hugging Face model directory, as float32 numpy arrays."""
  path = os.path.join(model_dir, 'model.safetensors')
  if os.path.exists(path):
    from safetensors.numpy import load_file

    try:
      state = load_file(path)
    except Exception as e:  # A damaged file, any reason.
      raise ConfigError(f'{path} is not a readable safetensors file ({e}).') from None
  else:
    path = os.path.join(model_dir, 'pytorch_model.bin')
    if not os.path.exists(path):
      raise ConfigError(f'{model_dir} has neither model.safetensors nor pytorch_model.bin.')
    try:
      import torch
    except ImportError:
      raise ConfigError(
          f'{path} is a PyTorch file, which needs torch to read: pip install '
          'torch (the CPU build is enough), or save the model with '
          'safetensors.'
      ) from None
    state = {
        k: v.float().numpy()
        for k, v in torch.load(path, map_location='cpu', weights_only=True).items()
    }
  return {name: np.asarray(value, np.float32) for name, value in state.items()}


def vocabulary_order(vocab: Mapping[str, int], hf_config: Mapping[str, Any]) -> list[int]:
  """Marian's ids in this project's order: pad, start (or the first other id), eos, unk,
  then the others ascending. Entry i is the Marian id that becomes id i."""
  size = int(hf_config['vocab_size'])
  ids = sorted(vocab.values())
  if ids != list(range(size)):
    raise ConfigError(
        f'vocab.json has {len(vocab)} entries with ids {ids[:3]}...{ids[-3:]}; '
        f'config.json says vocab_size={size}: they must be the ids 0 to '
        f'{size - 1}, each once.'
    )
  specials = {}
  for name, piece in (('pad', '<pad>'), ('eos', '</s>'), ('unk', '<unk>')):
    if piece not in vocab:
      raise ConfigError(f'vocab.json has no {piece} piece; a Marian vocabulary needs it.')
    specials[name] = vocab[piece]
  for name in ('pad', 'eos'):
    given = hf_config.get(f'{name}_token_id')
    if given is not None and given != specials[name]:
      raise ConfigError(
          f'config.json has {name}_token_id={given}, but vocab.json puts '
          f'{"<pad>" if name == "pad" else "</s>"} at {specials[name]}.'
      )
  start = hf_config.get('decoder_start_token_id', specials['pad'])
  taken = {specials['pad'], specials['eos'], specials['unk'], start}
  others = [i for i in range(size) if i not in taken]
  first = start if start != specials['pad'] else others.pop(0)
  order = [specials['pad'], first, specials['eos'], specials['unk']] + others
  assert sorted(order) == list(range(size)), (order, size)
  return order


def _reorder_vocabulary(params: dict[str, Any], order: np.ndarray) -> dict[str, Any]:
  """Rows (or, for the output kernel, columns) of every vocabulary array in the new order."""
  params = dict(params)
  for name in ('shared_embedding', 'source_embedding', 'target_embedding'):
    if name in params:
      params[name] = {'embedding': params[name]['embedding'][order]}
  decoder = dict(params['decoder'])
  if 'logits_bias' in decoder:
    decoder['logits_bias'] = decoder['logits_bias'][order]
  if 'output_projection' in decoder:
    decoder['output_projection'] = {'kernel': decoder['output_projection']['kernel'][:, order]}
  params['decoder'] = decoder
  return params


def import_model(model_dir: str, workdir: str, *, imported_from: str | None = None) -> str:
  """Imports a Hugging Face Marian model directory as a checkpoint of `workdir`.

  Writes `workdir/checkpoints/0/` (the parameters and the run config) and
  `workdir/marian_vocab.json` (the vocabulary), which evaluate.py and translate.py read as
  any run's, and train.py starts from with `--config.init_from=workdir`.

  On Cloud Storage (`model_dir` or `workdir` gs://) the model is read from a local copy, and
  the checkpoint is written last, straight to the bucket (orbax marks it complete there).

  Args:
    imported_from: what the checkpoint's meta names as the source (default `model_dir`).

  Returns:
    The checkpoint directory.

  Raises:
    ConfigError: something in `model_dir` is missing, unreadable or not a Marian model this
      project can run; the message says what.
    OutputExistsError: `workdir` already has a checkpoint, or other files.
  """
  if storage.is_remote(model_dir):  # Read from a local copy.
    with tempfile.TemporaryDirectory() as local:
      storage.download(model_dir, os.path.join(local, 'model'), '--model_dir')
      return import_model(os.path.join(local, 'model'), workdir, imported_from=model_dir)
  layout = RunLayout.of(workdir)
  if storage.is_directory(layout.checkpoints) and checkpointing.list_steps(layout.checkpoints):
    raise OutputExistsError(f'{workdir} already has checkpoints; import into a new --workdir.')
  if not storage.is_remote(workdir) and os.path.isdir(workdir) and os.listdir(workdir):
    raise OutputExistsError(f'{workdir} is not empty; import into a new or empty --workdir.')
  hf_config = _read_json(os.path.join(model_dir, 'config.json'))
  vocab = _read_json(os.path.join(model_dir, 'vocab.json'))
  fields = config_fields(hf_config)
  spm_bytes = {}
  for side in ('source', 'target'):
    path = os.path.join(model_dir, f'{side}.spm')
    if not os.path.exists(path):
      raise ConfigError(
          f'{path} does not exist; a Marian model directory has source.spm and '
          'target.spm (SentencePiece models).'
      )
    with open(path, 'rb') as f:
      spm_bytes[side] = f.read()
    try:
      spm.SentencePieceProcessor(model_proto=spm_bytes[side])
    except (RuntimeError, TypeError, ValueError) as e:
      raise ConfigError(
          f'{path} is not a SentencePiece model ({" ".join(str(e).split())}); '
          'copy it again from the model.'
      ) from None
  order = np.asarray(vocabulary_order(vocab, hf_config))
  model_config = TransformerConfig(**fields)
  state = read_state_dict(model_dir)
  try:
    params = params_from_state_dict(state, model_config)
  except KeyError as e:
    raise ConfigError(
        f'The weights in {model_dir} lack {e}: not a MarianMTModel with this config.json.'
    ) from None
  params = _reorder_vocabulary(params, order)
  fields['decoder_start'] = _decoder_start(fields, hf_config, params)

  # Everything is written into a temporary directory that becomes `workdir` at the end: a
  # failed or killed import leaves nothing there, and a retry starts afresh. (On Cloud
  # Storage its files are uploaded, then the checkpoint is written: a killed import leaves
  # no checkpoint, and a retry replaces the files.)
  remote = storage.is_remote(workdir)
  with storage.writing_directory(workdir) as staging:
    meta = _write_import(
        staging,
        workdir,
        model_dir,
        storage.resolve(imported_from or model_dir),
        hf_config,
        vocab,
        order,
        fields,
        params,
        spm_bytes,
        model_config,
    )
    if not remote:
      checkpointing.write_params_checkpoint(RunLayout.of(staging).checkpoints, 0, params, meta)
  if remote:
    checkpointing.write_params_checkpoint(layout.checkpoints, 0, params, meta)
  return f'{layout.checkpoints}/0'


def _write_import(
    staging: str,
    workdir: str,
    model_dir: str,
    imported_from: str,
    hf_config: Mapping[str, Any],
    vocab: Mapping[str, int],
    order: np.ndarray,
    fields: dict[str, Any],
    params: Any,
    spm_bytes: Mapping[str, bytes],
    model_config: TransformerConfig,
) -> dict[str, Any]:
  """`import_model`'s vocabulary and fine-tuning config, written into `staging`, naming
  their paths in `workdir`; returns the checkpoint's meta."""
  pieces_by_id = {i: piece for piece, i in vocab.items()}
  tokenizer = write_split_vocabulary(
      os.path.join(staging, VOCABULARY_FILE),
      [pieces_by_id[i] for i in order],
      spm_bytes['source'],
      spm_bytes['target'],
  )
  config = config_lib.base_config()
  config.update(fields)
  config.update(imported_decoding(model_dir, hf_config))
  tokenizer_config = {}
  if os.path.exists(os.path.join(model_dir, 'tokenizer_config.json')):
    tokenizer_config = _read_json(os.path.join(model_dir, 'tokenizer_config.json'))
  config.source_lang = tokenizer_config.get('source_lang') or 'src'
  config.target_lang = tokenizer_config.get('target_lang') or 'tgt'
  config.dataset = 'text'
  config.vocab_path = f'{storage.resolve(workdir)}/{VOCABULARY_FILE}'
  config.max_source_length = config.max_target_length = min(
      config.max_source_length, model_config.max_len
  )
  config_checks.validate_run(config, vocab_size=tokenizer.vocab_size)
  meta = checkpointing.make_meta(config, tokenizer)
  meta['tokenizer']['path'] = config.vocab_path
  meta['imported_from'] = imported_from
  _write_finetune_config(
      os.path.join(staging, FINETUNE_CONFIG_FILE),
      imported_from,
      workdir,
      {name: config[name] for name in tuple(fields) + _RUN_FIELDS + DECODING_FIELDS},
  )
  return meta


def imported_decoding(model_dir: str, hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """The decoding options a model directory states: all of them where this project exported
  it; else Hugging Face's `num_beams`, its `length_penalty` (score / length**penalty, this
  project's 'power' form) and its `no_repeat_ngram_size` (the same rule: Marian's decoder
  starts from <pad>, which is never generated, so no n-gram holds it), from
  generation_config.json or config.json. Others keep this project's defaults."""
  own = (hf_config.get(EXPORT_KEY) or {}).get('decoding')
  if own:
    return {name: own[name] for name in DECODING_FIELDS if name in own}
  stated = dict(hf_config)
  if os.path.exists(os.path.join(model_dir, 'generation_config.json')):
    stated.update(_read_json(os.path.join(model_dir, 'generation_config.json')))
  decoding = {}
  if isinstance(stated.get('num_beams'), int) and stated['num_beams'] >= 1:
    decoding['beam_size'] = stated['num_beams']
  if isinstance(stated.get('length_penalty'), (int, float)):
    decoding.update(length_penalty=float(stated['length_penalty']), length_penalty_form='power')
  no_repeat = stated.get('no_repeat_ngram_size')
  if isinstance(no_repeat, int) and not isinstance(no_repeat, bool) and no_repeat > 0:
    decoding['no_repeat_ngram_size'] = no_repeat
  return decoding


def _decoder_start(
    fields: Mapping[str, Any], hf_config: Mapping[str, Any], params: Mapping[str, Any]
) -> str:
  """'zero' for a model that starts from a <pad> whose embedding is zero (OPUS-MT models:
  Marian starts from a zero vector), so that fine-tuning keeps it zero; else as imported."""
  recorded = (hf_config.get(EXPORT_KEY) or {}).get('decoder_start')
  if recorded or fields['decoder_start'] != 'pad':
    return fields['decoder_start']
  table = (params.get('shared_embedding') or params['target_embedding'])['embedding']
  return 'pad' if np.any(table[PAD_ID]) else 'zero'


def _write_finetune_config(
    path: str, model_dir: str, workdir: str, fields: Mapping[str, Any]
) -> None:
  """A config file for train.py that fine-tunes the imported model (`init_from`)."""
  lines = [f'  c.{name} = {value!r}\n' for name, value in fields.items()]
  text = (
      f'"""Fine-tunes the Marian model imported from {model_dir}:\n\n'
      f'  python train.py --config={storage.resolve(workdir)}/{FINETUNE_CONFIG_FILE} \\\n'
      '      --config.text_files.train=TRAIN.SRC,TRAIN.TGT \\\n'
      '      --config.text_files.validation=DEV.SRC,DEV.TGT --workdir=NEW_WORKDIR\n\n'
      "The model fields are the imported model's (a change to one that shapes a parameter\n"
      "is refused); the schedule, batch size and everything else are base_config()'s, so\n"
      'set what a fine-tuning run needs (learning_rate_scale, warmup_steps,\n'
      'num_train_steps, tokens_per_batch) on the command line or in a copy of this file.\n'
      '"""\n\n'
      'from transformer_jax import config as config_lib\n\n\n'
      'def get_config():\n'
      '  c = config_lib.base_config()\n'
      + ''.join(lines)
      + f'  c.init_from = {storage.resolve(workdir)!r}\n'
      '  return c\n'
  )
  storage.write_file(path, text)


# --- Export: a checkpoint of this project as a Marian model directory. ---

_HF_ACTIVATIONS = {'relu': 'relu', 'swish': 'swish', 'gelu': 'gelu'}


def state_dict_from_params(
    params: Mapping[str, Any], config: TransformerConfig
) -> dict[str, np.ndarray]:
  """A `MarianMTModel` state dict (float32 numpy) from this project's parameters: the inverse
  of `params_from_state_dict`, with the position tables Marian stores as weights."""
  d = config.d_model
  state: dict[str, np.ndarray] = {}

  def linear(name, p):
    state[f'{name}.weight'] = np.asarray(p['kernel']).T
    state[f'{name}.bias'] = np.asarray(p['bias'])

  def norm(name, p):
    state[f'{name}.weight'] = np.asarray(p['norm']['scale'])
    state[f'{name}.bias'] = np.asarray(p['norm']['bias'])

  def attention(name, p):
    for ours, theirs in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
      state[f'{name}.{theirs}.weight'] = np.asarray(p[f'{ours}_kernel']).reshape(d, d).T
      state[f'{name}.{theirs}.bias'] = np.asarray(p[f'{ours}_bias']).reshape(d)
    state[f'{name}.out_proj.weight'] = np.asarray(p['out_kernel']).reshape(d, d).T
    state[f'{name}.out_proj.bias'] = np.asarray(p['out_bias'])

  from transformer_jax.model.models import sinusoidal_positions

  table = np.asarray(
      sinusoidal_positions(np.arange(config.max_len)[None], d, config.sinusoid_layout)[0]
  )
  for stack, layers in (
      ('encoder', config.num_encoder_layers),
      ('decoder', config.num_decoder_layers),
  ):
    state[f'model.{stack}.embed_positions.weight'] = table
    for i in range(layers):
      p, name = params[stack][f'layer_{i}'], f'model.{stack}.layers.{i}'
      attention(f'{name}.self_attn', p['self_attention'])
      norm(f'{name}.self_attn_layer_norm', p['self_attention_block'])
      if stack == 'decoder':
        attention(f'{name}.encoder_attn', p['encoder_decoder_attention'])
        norm(f'{name}.encoder_attn_layer_norm', p['encoder_decoder_attention_block'])
      linear(f'{name}.fc1', p['feed_forward']['wi'])
      linear(f'{name}.fc2', p['feed_forward']['wo'])
      norm(f'{name}.final_layer_norm', p['feed_forward_block'])
  if config.share_embeddings:
    shared = np.asarray(params['shared_embedding']['embedding'])
    state['model.shared.weight'] = shared
    source = target = shared
  else:
    source = np.asarray(params['source_embedding']['embedding'])
    target = np.asarray(params['target_embedding']['embedding'])
  state['model.encoder.embed_tokens.weight'] = source
  state['model.decoder.embed_tokens.weight'] = target
  state['lm_head.weight'] = (
      target
      if config.tie_output_embedding
      else np.asarray(params['decoder']['output_projection']['kernel']).T
  )
  bias = (
      np.asarray(params['decoder']['logits_bias'])
      if config.logits_bias
      else np.zeros(config.vocab_size, np.float32)
  )
  state['final_logits_bias'] = bias.reshape(1, -1)
  return {name: np.ascontiguousarray(value, np.float32) for name, value in state.items()}


def exportable(config: TransformerConfig) -> None:
  """Raises ConfigError unless Marian has everything `config` uses, naming every field it
  lacks."""
  lacking = [
      f'{name}={value!r}, and Marian has only {allowed!r}'
      for name, value, allowed in (
          ('norm_position', config.norm_position, 'post'),
          ('positional_encoding', config.positional_encoding, 'sinusoidal'),
      )
      if value != allowed
  ]
  if config.output_ids is not None:
    lacking.append(
        f"output_vocabulary='target' (an output layer of {config.output_size} of the "
        f"{config.vocab_size} pieces), and Marian scores them all ('all')"
    )
  if lacking:
    raise ConfigError(
        f'This model cannot be exported to Marian: {"; ".join(lacking)} (a model trained '
        'with other values has nothing to map them to; docs/finetuning.md trains one that '
        'exports).'
    )


def _hf_config(config: TransformerConfig, decoding: Mapping[str, Any]) -> dict[str, Any]:
  """config.json of `MarianMTModel` for `config`, this project's special ids kept; what
  Marian has no field for under EXPORT_KEY."""
  start = exported_id(config.decoder_start_id, config.vocab_size)
  return {
      'architectures': ['MarianMTModel'],
      'model_type': 'marian',
      'vocab_size': config.vocab_size,
      'd_model': config.d_model,
      'encoder_layers': config.num_encoder_layers,
      'decoder_layers': config.num_decoder_layers,
      'encoder_attention_heads': config.num_heads,
      'decoder_attention_heads': config.num_heads,
      'encoder_ffn_dim': config.d_ff,
      'decoder_ffn_dim': config.d_ff,
      'activation_function': _HF_ACTIVATIONS[config.activation],
      'dropout': config.dropout_rate,
      'attention_dropout': config.attention_dropout_rate,
      'activation_dropout': 0.0,
      'encoder_layerdrop': 0.0,
      'decoder_layerdrop': 0.0,
      'max_position_embeddings': config.max_len,
      'scale_embedding': True,
      'share_encoder_decoder_embeddings': config.share_embeddings,
      'tie_word_embeddings': config.tie_output_embedding,
      'pad_token_id': exported_id(PAD_ID, config.vocab_size),
      'eos_token_id': exported_id(EOS_ID, config.vocab_size),
      'decoder_start_token_id': start,
      'bos_token_id': None,
      'forced_eos_token_id': None,
      'init_std': 0.02,
      'is_encoder_decoder': True,
      'use_cache': True,
      'num_beams': decoding['beam_size'],
      'max_length': config.max_len,
      EXPORT_KEY: {
          'sinusoid_layout': config.sinusoid_layout,
          'logits_bias': config.logits_bias,
          'decoder_start': config.decoder_start,
          'layer_norm_epsilon': config.layer_norm_epsilon,
          'decoding': dict(decoding),
      },
  }


def exported_id(i: int, vocab_size: int) -> int:
  """Marian's id of this project's id `i` in an export: <pad> goes last, as Marian's and
  CTranslate2's converter (which drops the last row as <pad>) have it; the others keep
  their order, one lower. `vocabulary_order` undoes it on import."""
  return vocab_size - 1 if i == PAD_ID else i - 1


def check_new_model_directory(output_dir: str, marker: str) -> None:
  """Raises `OutputExistsError` unless `output_dir` is new or empty: an export never mixes
  its files with others. `marker`: the file that makes a directory a model."""
  if storage.exists(f'{output_dir}/{marker}'):
    raise OutputExistsError(
        f'{output_dir} already holds a model ({marker}); choose a new --output_dir.'
    )
  if not storage.is_remote(output_dir) and os.path.isdir(output_dir) and os.listdir(output_dir):
    raise OutputExistsError(f'{output_dir} is not empty; choose a new or empty --output_dir.')


def export_model(workdir: str, output_dir: str, *, step: int | str | None = None) -> str:
  """Writes a checkpoint of `workdir` as a Marian model directory in Hugging Face's layout.

  `MarianMTModel.from_pretrained` and `MarianTokenizer.from_pretrained` load it, and
  CTranslate2's `TransformersConverter` converts it (see `write_model`).

  Returns:
    `output_dir`.

  Raises:
    ConfigError: the model uses what Marian lacks (pre-norm, positions other than
      sinusoidal, an output layer over some pieces only), named with the field.
    OutputExistsError: `output_dir` already holds a model, or other files.
  """
  from transformer_jax.checkpoints import loading

  meta, _ = checkpointing.read_meta(RunLayout.of(workdir).checkpoints, step)
  exportable(
      TransformerConfig.from_config(
          config_lib.from_saved(meta['config']),
          meta['vocab_size'],
          output_ids=meta.get('output_ids'),
      )
  )
  check_new_model_directory(output_dir, 'config.json')
  checkpoint = loading.load(workdir, step=step)
  run = checkpoint.config
  # The files appear together, when all are written (a killed export leaves none); on Cloud
  # Storage config.json, which makes a directory a model, comes last.
  with storage.writing_directory(output_dir, last=('config.json',)) as staging:
    write_model(
        staging,
        checkpoint.params,
        checkpoint.model_config,
        checkpoint.tokenizer.pieces(),
        checkpoint.tokenizer.sentencepiece_models(),
        source_lang=run.source_lang,
        target_lang=run.target_lang,
        decoding={name: run[name] for name in DECODING_FIELDS},
    )
  return output_dir


def write_model(
    output_dir: str,
    params: Any,
    config: TransformerConfig,
    pieces: list[str],
    sentencepiece_models: Mapping[str, bytes],
    *,
    source_lang: str,
    target_lang: str,
    decoding: Mapping[str, Any],
) -> str:
  """Writes `params` of `config` as a Marian model directory in Hugging Face's layout.

  <pad> goes last, as in Marian's own vocabularies (`exported_id`); the position table is
  written as the weights Marian keeps it in, so the paper's interleaved layout works too.
  Greedy outputs in `MarianMTModel` are this project's exactly; in CTranslate2 where the
  decoder starts from a zero vector, as CTranslate2 assumes of every Marian model
  (`decoder_start='zero'`, or a zero start row: a warning says when it is not).

  Args:
    pieces: the vocabulary, this project's id i is `pieces[i]`.
    sentencepiece_models: 'source' and 'target' model bytes, written as source.spm and
      target.spm ({} writes none: a directory for the model alone, as the bench's).
    decoding: how the run decodes (DECODING_FIELDS; those left out: the defaults).
  """
  import jax
  from safetensors.numpy import save_file

  exportable(config)
  order = np.roll(np.arange(config.vocab_size), -1)  # Marian id j is this project's order[j].
  params = dict(jax.tree.map(np.asarray, jax.device_get(params)))
  if config.decoder_start == 'zero':  # Its <pad> rows count as zero (`models.Embed`).
    for name in ('shared_embedding', 'source_embedding', 'target_embedding'):
      if name in params:
        table = np.array(params[name]['embedding'])
        table[PAD_ID] = 0
        params[name] = {'embedding': table}
  params = _reorder_vocabulary(params, order)
  state = state_dict_from_params(params, config)
  start = exported_id(config.decoder_start_id, config.vocab_size)
  if np.any(state['model.decoder.embed_tokens.weight'][start]):
    logging.warning(
        'CTranslate2 would not translate this export as this project does: its Marian '
        'converter starts the decoder from a zero vector, and this model starts from the '
        "embedding of %s, which is not zero (Hugging Face's MarianMTModel is exact). Models "
        'trained with --config.decoder_start=zero export exactly to both.',
        '<pad>' if config.decoder_start_id == PAD_ID else 'id 1 (<s>)',
    )
  if config.layer_norm_epsilon != MARIAN_LAYER_NORM_EPSILON:
    logging.warning(
        "This model's layer norms add layer_norm_epsilon=%g to the variance; Hugging Face's "
        'MarianMTModel and CTranslate2 add %g (Marian has no field for it), so their scores '
        "differ from this project's in the last digits and a close choice of the search may "
        'differ. Importing this export back restores %g (it is recorded under %r in '
        'config.json).',
        config.layer_norm_epsilon,
        MARIAN_LAYER_NORM_EPSILON,
        config.layer_norm_epsilon,
        EXPORT_KEY,
    )
  base = config_lib.base_config()
  decoding = {name: base[name] for name in DECODING_FIELDS} | dict(decoding)
  if decoding['no_adjacent_repeat_size']:
    logging.warning(
        "The run decodes with no_adjacent_repeat_size=%d, which Hugging Face's generate and "
        'CTranslate2 have no option for: their outputs may say a span twice in a row where '
        "this project's do not. Importing this export back restores it (it is recorded "
        'under %r in config.json).',
        decoding['no_adjacent_repeat_size'],
        EXPORT_KEY,
    )
  os.makedirs(output_dir, exist_ok=True)
  weights = os.path.join(output_dir, 'model.safetensors')
  save_file(state, weights, metadata={'format': 'pt'})
  # safetensors creates its file readable by its owner only (0600); give it the mode its
  # siblings get, so a model directory shared with others is readable whole.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(weights, 0o666 & ~umask)
  hf_config = _hf_config(config, decoding)
  # Hugging Face's length penalty is this project's 'power' form; 'gnmt' has no equivalent.
  length_penalty = (
      {'length_penalty': decoding['length_penalty']}
      if decoding['length_penalty_form'] == 'power'
      else {}
  )
  files = {
      'config.json': hf_config,
      'generation_config.json': {
          key: hf_config[key]
          for key in (
              'decoder_start_token_id',
              'eos_token_id',
              'pad_token_id',
              'forced_eos_token_id',
          )
      }
      | {
          'bad_words_ids': [[hf_config['pad_token_id']]],
          'max_length': config.max_len,
          'num_beams': decoding['beam_size'],
      }
      | length_penalty
      | (
          {'no_repeat_ngram_size': decoding['no_repeat_ngram_size']}
          if decoding['no_repeat_ngram_size']
          else {}
      ),
      'vocab.json': {pieces[i]: j for j, i in enumerate(order)},
      'tokenizer_config.json': {
          'tokenizer_class': 'MarianTokenizer',
          'source_lang': source_lang,
          'target_lang': target_lang,
          'model_max_length': config.max_len,
          'eos_token': '</s>',
          'unk_token': '<unk>',
          'pad_token': '<pad>',
      },
  }
  for name, content in files.items():
    with open(os.path.join(output_dir, name), 'w', encoding='utf-8') as f:
      json.dump(content, f, ensure_ascii=False, indent=1)
  for side, model in sentencepiece_models.items():
    with open(os.path.join(output_dir, f'{side}.spm'), 'wb') as f:
      f.write(model)
  return output_dir

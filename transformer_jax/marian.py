"""Hugging Face Marian (OPUS-MT) models: their config and weights in this project's terms.

A Marian model in Hugging Face's layout (`MarianMTModel`) is the paper's post-norm
Transformer with a few differences, each a config field here:

  * positions are [sines | cosines] (`sinusoid_layout='concatenated'`);
  * the logits get a bias, `final_logits_bias` (`logits_bias=True`);
  * the feed-forward nonlinearity may be swish or gelu (`activation`);
  * the decoder starts from the pad token (`decoder_start='pad'`);
  * layer norm's epsilon is 1e-5 (`layer_norm_epsilon`).

Weights: Hugging Face's `nn.Linear` stores [out, in]; this project's kernels are [in, out],
with the attention's heads as their own axis ([d_model, heads, head_dim] for the query, key
and value kernels, [heads, head_dim, d_model] for the output one).

`import_model` reads a whole model directory (config.json, the weights in safetensors or
pytorch_model.bin, source.spm, target.spm, vocab.json) and writes a work directory that
evaluate.py, translate.py and train.py (`init_from`) take. This project's special ids are
fixed (0 pad, 2 eos, 3 unk; 1 is BOS where the decoder starts from it), so the import
reorders the vocabulary: those four first, then every other id in Marian's order. With
`decoder_start='pad'` id 1 is an ordinary piece (the first of the others).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from transformer_jax import checkpointing
from transformer_jax import config as config_lib
from transformer_jax.config import ConfigError, TransformerConfig
from transformer_jax.errors import OutputExistsError
from transformer_jax.tokenizer import write_split_vocabulary

VOCABULARY_FILE = 'marian_vocab.json'  # In the work directory: `tokenizer.SplitTokenizer`.
FINETUNE_CONFIG_FILE = 'finetune_config.py'  # In the work directory: train.py --config=.
# Run config fields the import sets: the model's, and what its vocabulary and data need.
_RUN_FIELDS = ('source_lang', 'target_lang', 'dataset', 'vocab_path', 'max_source_length',
               'max_target_length')

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
  need(get('model_type', 'marian') == 'marian',
       f"config.json has model_type={get('model_type')!r}, not 'marian'")
  activation = get('activation_function', 'swish')
  need(activation in _ACTIVATIONS,
       f'activation_function={activation!r} is not one of {sorted(_ACTIVATIONS)}')
  need(get('scale_embedding', False),
       'scale_embedding is false (this project always scales embeddings by sqrt(d_model))')
  need(not get('normalize_before', False), 'normalize_before is true (pre-norm Marian)')
  for ours, enc, dec in (('num_heads', 'encoder_attention_heads', 'decoder_attention_heads'),
                         ('d_ff', 'encoder_ffn_dim', 'decoder_ffn_dim')):
    need(get(enc) == get(dec), f'{enc}={get(enc)} and {dec}={get(dec)} differ '
         f'(this project has one {ours})')
  pad, start = get('pad_token_id'), get('decoder_start_token_id', get('pad_token_id'))
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
      layer_norm_epsilon=1e-5,  # Hugging Face's Marian layers use nn.LayerNorm's default.
      share_embeddings=bool(get('share_encoder_decoder_embeddings', True)),
      tie_output_embedding=bool(get('tie_word_embeddings', True)),
      positional_encoding='sinusoidal',
      sinusoid_layout='concatenated',
      activation=_ACTIVATIONS[activation],
      logits_bias=True,
      decoder_start='pad' if start == pad else 'bos',
      max_len=int(get('max_position_embeddings', 512)),
  )


def _linear(state: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {'kernel': state[f'{name}.weight'].T, 'bias': state[f'{name}.bias']}


def _norm(state: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {'norm': {'scale': state[f'{name}.weight'], 'bias': state[f'{name}.bias']}}


def _attention(state: Mapping[str, np.ndarray], name: str,
               config: TransformerConfig) -> dict[str, np.ndarray]:
  d, heads, head_dim = config.d_model, config.num_heads, config.head_dim
  params = {}
  for ours, theirs in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
    params[f'{ours}_kernel'] = state[f'{name}.{theirs}.weight'].T.reshape(d, heads, head_dim)
    params[f'{ours}_bias'] = state[f'{name}.{theirs}.bias'].reshape(heads, head_dim)
  params['out_kernel'] = state[f'{name}.out_proj.weight'].T.reshape(heads, head_dim, d)
  params['out_bias'] = state[f'{name}.out_proj.bias']
  return params


def params_from_state_dict(state: Mapping[str, np.ndarray],
                           config: TransformerConfig) -> dict[str, Any]:
  """This project's parameter tree from a `MarianMTModel` state dict (numpy arrays).

  The token ids stay the model's own: row i of every vocabulary matrix is Marian's id i.
  """
  def layer(prefix: str, decoder: bool) -> dict[str, Any]:
    params = {
        'self_attention': _attention(state, f'{prefix}.self_attn', config),
        'self_attention_block': _norm(state, f'{prefix}.self_attn_layer_norm'),
        'feed_forward': {'wi': _linear(state, f'{prefix}.fc1'),
                         'wo': _linear(state, f'{prefix}.fc2')},
        'feed_forward_block': _norm(state, f'{prefix}.final_layer_norm'),
    }
    if decoder:
      params['encoder_decoder_attention'] = _attention(state, f'{prefix}.encoder_attn', config)
      params['encoder_decoder_attention_block'] = _norm(
          state, f'{prefix}.encoder_attn_layer_norm')
    return params

  params: dict[str, Any] = {
      'encoder': {f'layer_{i}': layer(f'model.encoder.layers.{i}', False)
                  for i in range(config.num_encoder_layers)},
      'decoder': {f'layer_{i}': layer(f'model.decoder.layers.{i}', True)
                  for i in range(config.num_decoder_layers)},
  }
  if config.share_embeddings:
    params['shared_embedding'] = {'embedding': state['model.shared.weight']}
  else:
    params['source_embedding'] = {'embedding': state['model.encoder.embed_tokens.weight']}
    params['target_embedding'] = {'embedding': state['model.decoder.embed_tokens.weight']}
  if not config.tie_output_embedding:
    params['decoder']['output_projection'] = {'kernel': state['lm_head.weight'].T}
  params['decoder']['logits_bias'] = state['final_logits_bias'].reshape(-1)
  return params


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    raise ConfigError(f'{path} does not exist; a Marian model directory has config.json, '
                      'vocab.json, source.spm, target.spm and the weights '
                      '(model.safetensors or pytorch_model.bin).') from None
  except (OSError, ValueError) as e:
    raise ConfigError(f'{path} is not readable JSON ({e}).') from None


def read_state_dict(model_dir: str) -> dict[str, np.ndarray]:
  """The weights of a Hugging Face model directory, as float32 numpy arrays."""
  path = os.path.join(model_dir, 'model.safetensors')
  if os.path.exists(path):
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    try:
      state = load_file(path)
    except Exception as e:  # pylint: disable=broad-except  # A damaged file, any reason.
      raise ConfigError(f'{path} is not a readable safetensors file ({e}).') from None
  else:
    path = os.path.join(model_dir, 'pytorch_model.bin')
    if not os.path.exists(path):
      raise ConfigError(f'{model_dir} has neither model.safetensors nor pytorch_model.bin.')
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ConfigError(f'{path} is a PyTorch file, which needs torch to read: pip install '
                        'torch (the CPU build is enough), or save the model with '
                        'safetensors.') from None
    state = {k: v.float().numpy() for k, v in
             torch.load(path, map_location='cpu', weights_only=True).items()}
  return {name: np.asarray(value, np.float32) for name, value in state.items()}


def vocabulary_order(vocab: Mapping[str, int], hf_config: Mapping[str, Any]) -> list[int]:
  """Marian's ids in this project's order: pad, start (or the first other id), eos, unk,
  then the others ascending. Entry i is the Marian id that becomes id i."""
  size = int(hf_config['vocab_size'])
  ids = sorted(vocab.values())
  if ids != list(range(size)):
    raise ConfigError(f'vocab.json has {len(vocab)} entries with ids {ids[:3]}...{ids[-3:]}; '
                      f'config.json says vocab_size={size}: they must be the ids 0 to '
                      f'{size - 1}, each once.')
  specials = {}
  for name, piece in (('pad', '<pad>'), ('eos', '</s>'), ('unk', '<unk>')):
    if piece not in vocab:
      raise ConfigError(f'vocab.json has no {piece} piece; a Marian vocabulary needs it.')
    specials[name] = vocab[piece]
  for name in ('pad', 'eos'):
    given = hf_config.get(f'{name}_token_id')
    if given is not None and given != specials[name]:
      raise ConfigError(f'config.json has {name}_token_id={given}, but vocab.json puts '
                        f'{"<pad>" if name == "pad" else "</s>"} at {specials[name]}.')
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
  decoder['logits_bias'] = decoder['logits_bias'][order]
  if 'output_projection' in decoder:
    decoder['output_projection'] = {'kernel': decoder['output_projection']['kernel'][:, order]}
  params['decoder'] = decoder
  return params


def import_model(model_dir: str, workdir: str) -> str:
  """Imports a Hugging Face Marian model directory as a checkpoint of `workdir`.

  Writes `workdir/checkpoints/0/` (the parameters and the run config) and
  `workdir/marian_vocab.json` (the vocabulary), which evaluate.py and translate.py read as
  any run's, and train.py starts from with `--config.init_from=workdir`.

  Returns:
    The checkpoint directory.

  Raises:
    ConfigError: something in `model_dir` is missing, unreadable or not a Marian model this
      project can run; the message says what.
    OutputExistsError: `workdir` already has a checkpoint.
  """
  hf_config = _read_json(os.path.join(model_dir, 'config.json'))
  vocab = _read_json(os.path.join(model_dir, 'vocab.json'))
  fields = config_fields(hf_config)
  spm_bytes = {}
  for side in ('source', 'target'):
    path = os.path.join(model_dir, f'{side}.spm')
    if not os.path.exists(path):
      raise ConfigError(f'{path} does not exist; a Marian model directory has source.spm and '
                        'target.spm (SentencePiece models).')
    with open(path, 'rb') as f:
      spm_bytes[side] = f.read()
  if checkpointing.list_steps(workdir) if os.path.isdir(workdir) else False:
    raise OutputExistsError(f'{workdir} already has checkpoints; import into a new '
                            '--workdir.')
  order = np.asarray(vocabulary_order(vocab, hf_config))
  model_config = TransformerConfig(**fields)
  state = read_state_dict(model_dir)
  try:
    params = params_from_state_dict(state, model_config)
  except KeyError as e:
    raise ConfigError(f'The weights in {model_dir} lack {e}: not a MarianMTModel with this '
                      'config.json.') from None
  params = _reorder_vocabulary(params, order)

  pieces_by_id = {i: piece for piece, i in vocab.items()}
  tokenizer = write_split_vocabulary(
      os.path.join(workdir, VOCABULARY_FILE), [pieces_by_id[i] for i in order],
      spm_bytes['source'], spm_bytes['target'])
  config = config_lib.base_config()
  config.update(fields)
  tokenizer_config = {}
  if os.path.exists(os.path.join(model_dir, 'tokenizer_config.json')):
    tokenizer_config = _read_json(os.path.join(model_dir, 'tokenizer_config.json'))
  config.source_lang = tokenizer_config.get('source_lang') or 'src'
  config.target_lang = tokenizer_config.get('target_lang') or 'tgt'
  config.dataset = 'text'
  config.vocab_path = tokenizer.model_path
  config.max_source_length = config.max_target_length = min(
      config.max_source_length, model_config.max_len)
  config_lib.validate(config, vocab_size=tokenizer.vocab_size)
  meta = checkpointing.make_meta(config, tokenizer)
  meta['imported_from'] = os.path.abspath(model_dir)
  path = checkpointing.write_params_checkpoint(workdir, 0, params, meta)
  _write_finetune_config(os.path.join(workdir, FINETUNE_CONFIG_FILE), model_dir, workdir,
                         {name: config[name] for name in tuple(fields) + _RUN_FIELDS})
  return path


def _write_finetune_config(path: str, model_dir: str, workdir: str,
                           fields: Mapping[str, Any]) -> None:
  """A config file for train.py that fine-tunes the imported model (`init_from`)."""
  lines = [f'  c.{name} = {value!r}\n' for name, value in fields.items()]
  text = (
      f'"""Fine-tunes the Marian model imported from {model_dir}:\n\n'
      f'  python train.py --config={path} \\\n'
      '      --config.text_files.train=TRAIN.SRC,TRAIN.TGT \\\n'
      '      --config.text_files.validation=DEV.SRC,DEV.TGT --workdir=NEW_WORKDIR\n\n'
      'The model fields are the imported model\'s (a change to one that shapes a parameter\n'
      'is refused); the schedule, batch size and everything else are base_config()\'s, so\n'
      'set what a fine-tuning run needs (learning_rate_scale, warmup_steps,\n'
      'num_train_steps, tokens_per_batch) on the command line or in a copy of this file.\n'
      '"""\n\n'
      'from transformer_jax import config as config_lib\n\n\n'
      'def get_config():\n'
      '  c = config_lib.base_config()\n'
      + ''.join(lines) +
      f'  c.init_from = {os.path.abspath(workdir)!r}\n'
      '  return c\n')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)

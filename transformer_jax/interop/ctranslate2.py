"""CTranslate2 models: a checkpoint of this project as a `ctranslate2.Translator` directory.

The model is described with CTranslate2's own specification API
(`ctranslate2.specs.TransformerSpec` of a `TransformerEncoderSpec` and a
`TransformerDecoderSpec`), field by field from the model config, so every variant that
CTranslate2 can run exports, the ones Marian lacks included:

  * `norm_position`: 'post' or 'pre' (`pre_norm`; pre-norm's final norms are the stacks'
    `layer_norm`);
  * `positional_encoding`: 'sinusoidal' and 'learned' are the stacks' position tables
    (`position_encodings.encodings`; CTranslate2's built-in sinusoids are not this
    project's, so these are written out, in either `sinusoid_layout`, for `POSITIONS`
    positions; a learned table has `max_len`, which `OPTIONS_FILE` holds inputs and outputs
    to); 'rope' is CTranslate2's rotary embedding over the whole head with the halves split
    (`rotary_dim=0`, `rotary_interleave=False`, `rotary_base=10000`) in self-attention;
    'alibi' is refused (`exportable`): CTranslate2's encoder has no ALiBi;
  * `activation` (relu, swish, gelu: CTranslate2's RELU, SWISH, GELU), `logits_bias` (the
    projection's bias), `layer_norm_epsilon` (the model's config.json), tied and shared
    embeddings (CTranslate2 stores each array once);
  * `decoder_start`: the decoder starts from <s> ('bos') or <pad> ('pad') as the
    `decoder_start_token`, or from a zero vector ('zero', `start_from_zero_embedding`);
  * `output_vocabulary='target'` (`output_ids`): CTranslate2's projection scores the whole
    vocabulary, so the ids outside `output_ids` get a bias of `NEVER`, which softmax takes to
    zero: the probabilities of the others are this project's. <pad>, which this project's
    searches never choose, gets it too.

The ids are this project's (0 <pad>, 1 <s>, 2 </s>, 3 <unk>): the vocabulary is the
checkpoint's pieces in id order (one `shared_vocabulary.json`), and CTranslate2 appends </s>
to each source itself (`add_source_eos`), so a source is SentencePiece's pieces of the text
(`source.spm` beside the model), as `Tokenizer.encode` cuts it. Greedy outputs are this
project's; scores are too, without <pad>'s probability in the softmax.

How the run decodes goes into `OPTIONS_FILE`, keyword arguments of
`Translator.translate_batch`: the beam, the length penalty where the run's is the 'power'
form (CTranslate2's), `no_repeat_ngram_size` where set, and `min_decoding_length=0`
(CTranslate2's default 1 never lets an output be empty). What it cannot carry
(`no_adjacent_repeat_size`, the 'gnmt' length penalty, the output limit relative to the
source) is named in a logged warning.

Weights: this project's kernels are [in, out], with the attention's heads as their own axis
([d_model, heads, head_dim] for the query, key and value kernels, [heads, head_dim, d_model]
for the output one); CTranslate2's linear layers are [out, in], self-attention's query, key
and value stacked in one, encoder-decoder attention's key and value in one.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import os
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import config as config_lib
from transformer_jax.checkpoints import checkpointing
from transformer_jax.checkpoints import loading
from transformer_jax.config import EOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.config import UNK_ID
from transformer_jax.errors import ConfigError
from transformer_jax.errors import UserError
from transformer_jax.interop.marian import check_new_model_directory
from transformer_jax.interop.marian import DECODING_FIELDS
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import sinusoidal_positions
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout

# Keyword arguments of `Translator.translate_batch`: how the run decodes, what CTranslate2 has.
OPTIONS_FILE = 'translate_options.json'
# Sinusoidal positions written out: CTranslate2's default input limit (`max_input_length`).
POSITIONS = 1024
# The bias of ids the model never outputs: the most negative float16, which softmax takes to
# zero in every type CTranslate2 computes in.
NEVER = float(np.finfo(np.float16).min)
# CTranslate2's names of this project's activations (`common_spec.Activation`).
_ACTIVATIONS = {'relu': 'RELU', 'swish': 'SWISH', 'gelu': 'GELU'}  # gelu: the exact one.
# What CTranslate2 cannot run: a field, its values that it lacks, why, and the values it has.
_REFUSED = {
    'positional_encoding': (
        ('alibi',),
        "CTranslate2's encoder has no ALiBi; its decoder's serves decoder-only models",
        ('sinusoidal', 'learned', 'rope'),
    ),
}


def _ct2() -> Any:
  """The `ctranslate2` package, or a `UserError` saying how to install it."""
  try:
    import ctranslate2  # type: ignore[import-untyped]
  except ImportError:
    raise UserError(
        "The CTranslate2 export needs the ctranslate2 package: pip install 'ctranslate2>=4.5,<5' "
        '(a CPU build is enough to export).'
    ) from None
  return ctranslate2


def quantizations() -> tuple[str, ...]:
  """The weight types CTranslate2 can store a model in (`--quantization`)."""
  return tuple(_ct2().specs.model_spec.ACCEPTED_MODEL_TYPES)


def exportable(config: TransformerConfig) -> None:
  """Raises ConfigError unless CTranslate2 can run everything `config` uses, naming every
  field it cannot and the values that export."""
  lacking = [
      f'{name}={getattr(config, name)!r} ({why}; it has {", ".join(map(repr, instead))})'
      for name, (refused, why, instead) in _REFUSED.items()
      if getattr(config, name) in refused
  ]
  if lacking:
    raise ConfigError(
        f'This model cannot be exported to CTranslate2: {"; ".join(lacking)}. A model trained '
        'with one of the values it has exports; its parameters cannot be mapped to another.'
    )


def _own(x: Any) -> np.ndarray:
  """A float32 copy of `x` for the spec alone: quantization rewrites its arrays in place."""
  return np.array(x, np.float32, order='C')


def _linear(spec: Any, kernel: Any, bias: Any = None) -> None:
  """A CTranslate2 linear layer from a [in, out] kernel."""
  spec.weight = _own(np.asarray(kernel).T)
  if bias is not None:
    spec.bias = _own(bias)


def _norm(spec: Any, params: Mapping[str, Any]) -> None:
  spec.gamma = _own(params['scale'])
  spec.beta = _own(params['bias'])


def _attention(spec: Any, params: Mapping[str, Any], d_model: int, self_attention: bool) -> None:
  """Self-attention: linear[0] is [query; key; value]; encoder-decoder attention: linear[0]
  the query, linear[1] [key; value]. The last is the output projection."""
  kernel = lambda name: np.asarray(params[f'{name}_kernel']).reshape(d_model, d_model)
  bias = lambda name: np.asarray(params[f'{name}_bias']).reshape(d_model)
  groups = [('query', 'key', 'value')] if self_attention else [('query',), ('key', 'value')]
  for linear, names in zip(spec.linear, groups):
    _linear(
        linear,
        np.concatenate([kernel(n) for n in names], axis=1),
        np.concatenate([bias(n) for n in names]),
    )
  _linear(
      spec.linear[-1],
      np.asarray(params['out_kernel']).reshape(d_model, d_model),
      params['out_bias'],
  )


def _layer(spec: Any, params: Mapping[str, Any], config: TransformerConfig, decoder: bool) -> None:
  d = config.d_model
  _attention(spec.self_attention, params['self_attention'], d, self_attention=True)
  _norm(spec.self_attention.layer_norm, params['self_attention_block']['norm'])
  if decoder:
    _attention(spec.attention, params['encoder_decoder_attention'], d, self_attention=False)
    _norm(spec.attention.layer_norm, params['encoder_decoder_attention_block']['norm'])
  _linear(
      spec.ffn.linear_0,
      params['feed_forward']['wi']['kernel'],
      params['feed_forward']['wi']['bias'],
  )
  _linear(
      spec.ffn.linear_1,
      params['feed_forward']['wo']['kernel'],
      params['feed_forward']['wo']['bias'],
  )
  _norm(spec.ffn.layer_norm, params['feed_forward_block']['norm'])


def _positions(stack: Mapping[str, Any], config: TransformerConfig) -> np.ndarray | None:
  """The table a stack adds to its embeddings ([positions, d_model]), or None (rotary)."""
  if config.positional_encoding == 'learned':
    return _own(stack['positions']['position_embedding'])
  if config.positional_encoding == 'sinusoidal':
    positions = jnp.arange(max(POSITIONS, config.max_len))[None]
    return _own(sinusoidal_positions(positions, config.d_model, config.sinusoid_layout)[0])
  return None


def output_bias(params: Mapping[str, Any], config: TransformerConfig) -> np.ndarray:
  """[vocab_size] float32: the logits' bias (zero without `logits_bias`), `NEVER` for <pad>
  and for the ids outside `output_ids`."""
  bias = np.zeros(config.vocab_size, np.float32)
  if config.logits_bias:
    bias += np.asarray(params['decoder']['logits_bias'], np.float32)
  if config.output_ids is not None:
    outside = np.ones(config.vocab_size, bool)
    outside[list(config.output_ids)] = False
    bias[outside] = NEVER
  bias[PAD_ID] = NEVER
  return bias


def model_spec(params: Any, config: TransformerConfig, pieces: list[str]) -> Any:
  """The `ctranslate2.specs.TransformerSpec` of `params` of `config`, validated.

  Args:
    params: the parameter tree (numpy or JAX arrays, on the host or the devices).
    config: the model config.
    pieces: the vocabulary, this project's id i is `pieces[i]`.

  Raises:
    ConfigError: the model uses what CTranslate2 lacks (`exportable`).
  """
  exportable(config)
  ct2 = _ct2()
  specs = ct2.specs
  params = jax.device_get(params)
  rotary = (
      dict(rotary_dim=0, rotary_interleave=False, rotary_base=10000.0)
      if config.positional_encoding == 'rope'
      else {}
  )
  common = dict(
      pre_norm=config.norm_position == 'pre',
      activation=getattr(specs.common_spec.Activation, _ACTIVATIONS[config.activation]),
      **rotary,
  )
  encoder = specs.TransformerEncoderSpec(config.num_encoder_layers, config.num_heads, **common)
  decoder = specs.TransformerDecoderSpec(config.num_decoder_layers, config.num_heads, **common)
  spec = specs.TransformerSpec(encoder, decoder)

  if config.share_embeddings:
    source = target = params['shared_embedding']['embedding']
  else:
    source = params['source_embedding']['embedding']
    target = params['target_embedding']['embedding']
  source, target = _own(source), _own(target)
  if config.decoder_start == 'zero':  # Its <pad> rows count as zero (`models.Embed`).
    source[PAD_ID] = target[PAD_ID] = 0
  encoder.embeddings[0].weight = source
  decoder.embeddings.weight = target
  decoder.start_from_zero_embedding = config.decoder_start == 'zero'
  for stack_spec, name, layers in (
      (encoder, 'encoder', config.num_encoder_layers),
      (decoder, 'decoder', config.num_decoder_layers),
  ):
    stack = params[name]
    table = _positions(stack, config)
    if table is not None:
      stack_spec.position_encodings.encodings = table
    for i in range(layers):
      _layer(stack_spec.layer[i], stack[f'layer_{i}'], config, decoder=name == 'decoder')
    if config.norm_position == 'pre':
      _norm(stack_spec.layer_norm, stack['final_norm'])
  decoder.projection.weight = (
      _own(target)
      if config.tie_output_embedding
      else _own(np.asarray(params['decoder']['output_projection']['kernel']).T)
  )
  decoder.projection.bias = output_bias(params, config)

  spec.config.unk_token = pieces[UNK_ID]
  spec.config.eos_token = pieces[EOS_ID]
  spec.config.bos_token = spec.config.decoder_start_token = pieces[config.decoder_start_id]
  spec.config.add_source_eos = True
  spec.config.layer_norm_epsilon = config.layer_norm_epsilon
  spec.register_source_vocabulary(list(pieces))
  spec.register_target_vocabulary(list(pieces))
  spec.validate()
  return spec


def translate_options(
    decoding: Mapping[str, Any], config: TransformerConfig
) -> tuple[dict[str, Any], list[str]]:
  """`Translator.translate_batch`'s keyword arguments for how the run decodes
  (DECODING_FIELDS), and what of it CTranslate2 has no option for, each named with why.

  With learned positions, inputs and outputs are held to the table's `max_len` positions
  (`max_input_length`, `max_decoding_length`): CTranslate2 stops with an error past them.
  """
  options: dict[str, Any] = {'beam_size': int(decoding['beam_size']), 'min_decoding_length': 0}
  if config.positional_encoding == 'learned':
    options.update(max_input_length=config.max_len, max_decoding_length=config.max_len)
  lacking = []
  alpha, form = float(decoding['length_penalty']), decoding['length_penalty_form']
  if form == 'power' or alpha == 0:  # |Y|^alpha: CTranslate2's; with alpha 0 both are 1.
    options['length_penalty'] = alpha
  else:
    lacking.append(
        f'length_penalty={alpha:g} with length_penalty_form={form!r}, ((5 + |Y|) / 6)^alpha '
        "(CTranslate2's length_penalty is |Y|^alpha, this project's 'power' form: it is left "
        'at its default, 1; pass length_penalty= to translate_batch for another)'
    )
  if decoding['no_repeat_ngram_size']:
    options['no_repeat_ngram_size'] = int(decoding['no_repeat_ngram_size'])
  if decoding['no_adjacent_repeat_size']:
    lacking.append(
        f"no_adjacent_repeat_size={decoding['no_adjacent_repeat_size']} (CTranslate2 has no "
        "option for it: its outputs may say a span twice in a row where this project's do not)"
    )
  lacking.append(
      f"max_decode_extra_length={decoding['max_decode_extra_length']} (an output limit of the "
      "source's length plus that; CTranslate2's max_decoding_length is one number for every "
      'sentence, 256 unless given)'
  )
  return options, lacking


def write_model(
    output_dir: str,
    params: Any,
    config: TransformerConfig,
    pieces: list[str],
    sentencepiece_models: Mapping[str, bytes],
    *,
    decoding: Mapping[str, Any],
    quantization: str | None = None,
) -> str:
  """Writes `params` of `config` as a CTranslate2 model directory (local).

  The directory gets CTranslate2's model.bin, config.json and shared_vocabulary.json, the
  SentencePiece models as source.spm and target.spm, and `OPTIONS_FILE`.

  Args:
    pieces: the vocabulary, this project's id i is `pieces[i]`.
    sentencepiece_models: 'source' and 'target' model bytes ({} writes none).
    decoding: how the run decodes (DECODING_FIELDS; those left out: the defaults).
    quantization: the weights' type (`quantizations()`); None keeps float32.

  Returns:
    `output_dir`.
  """
  spec = model_spec(params, config, pieces)
  base = config_lib.base_config()
  decoding = {name: base[name] for name in DECODING_FIELDS} | dict(decoding)
  options, lacking = translate_options(decoding, config)
  logging.warning(
      'CTranslate2 decodes this export without what it has no option for: %s. The rest of '
      'how the run decodes is in %s (keyword arguments of translate_batch).',
      '; '.join(lacking),
      OPTIONS_FILE,
  )
  spec.optimize(quantization=quantization)
  os.makedirs(output_dir, exist_ok=True)
  spec.save(output_dir)
  with open(os.path.join(output_dir, OPTIONS_FILE), 'w', encoding='utf-8') as f:
    json.dump(options, f, indent=1)
  for side, model in sentencepiece_models.items():
    with open(os.path.join(output_dir, f'{side}.spm'), 'wb') as f:
      f.write(model)
  return output_dir


def check_quantization(quantization: str | None) -> None:
  """Raises `ConfigError` for a `quantization` CTranslate2 does not have, naming those it has."""
  if quantization is not None and quantization not in quantizations():
    raise ConfigError(
        f'quantization={quantization!r} is not a weight type of CTranslate2; choose one of '
        f'{", ".join(quantizations())} (or none: float32).'
    )


def export_model(
    source: str | loading.InferenceCheckpoint,
    output_dir: str,
    *,
    step: int | str | None = None,
    average_last: int = 0,
    quantization: str | None = None,
) -> str:
  """Writes a checkpoint as a CTranslate2 model directory, which `ctranslate2.Translator`
  loads (see `write_model` for its files).

  Args:
    source: a work directory (its checkpoint `step`, or the average of its last
      `average_last`, as `loading.load` reads them), or a loaded checkpoint.
    output_dir: a new or empty directory (local or gs://).
    quantization: the weights' type (`quantizations()`: int8, int8_float32, float16, ...);
      None keeps float32.

  Returns:
    `output_dir`.

  Raises:
    ConfigError: the model uses what CTranslate2 lacks (`exportable`), or `quantization`
      is not one of CTranslate2's.
    UserError: ctranslate2 is not installed.
    OutputExistsError: `output_dir` already holds a model, or other files.
  """
  check_quantization(quantization)
  if isinstance(source, str):
    # Refused before the parameters are read.
    meta, _ = checkpointing.read_meta(
        RunLayout.of(source).checkpoints, None if average_last else step
    )
    exportable(
        TransformerConfig.from_config(
            config_lib.from_saved(meta['config']),
            meta['vocab_size'],
            output_ids=meta.get('output_ids'),
        )
    )
  elif step is not None or average_last:
    raise ValueError('step and average_last choose a checkpoint of a work directory.')
  check_new_model_directory(output_dir, 'model.bin')
  checkpoint = (
      loading.load(source, step=step, average_last=average_last)
      if isinstance(source, str)
      else source
  )
  run = checkpoint.config
  # The files appear together, when all are written (a killed export leaves none); on Cloud
  # Storage model.bin, which makes a directory a model, comes last.
  with storage.writing_directory(output_dir, last=('model.bin',)) as staging:
    write_model(
        staging,
        checkpoint.params,
        checkpoint.model_config,
        checkpoint.tokenizer.pieces(),
        checkpoint.tokenizer.sentencepiece_models(),
        decoding={name: run[name] for name in DECODING_FIELDS},
        quantization=quantization,
    )
  return output_dir

"""The frozen model config: everything the model modules read, built once from a run config.

The `ConfigDict` of a run (`config.base_config`) is turned into a `TransformerConfig` at the
boundary (`TransformerConfig.from_config`); the model's modules only ever see this frozen
dataclass. Other modes (decoding, a different dtype) derive with `dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import config as config_lib
from transformer_jax.config import ACTIVATIONS
from transformer_jax.config import ATTENTION_IMPLEMENTATIONS
from transformer_jax.config import DECODER_STARTS
from transformer_jax.config import EOS_ID
from transformer_jax.config import LAYER_NORM_STATISTICS
from transformer_jax.config import LOGITS_SUMS
from transformer_jax.config import NORM_POSITIONS
from transformer_jax.config import PAD_ID
from transformer_jax.config import POSITIONAL_ENCODINGS
from transformer_jax.config import POST_NORM_KERNELS
from transformer_jax.config import QKV_PROJECTIONS
from transformer_jax.config import REMAT_POLICIES
from transformer_jax.config import SINUSOID_LAYOUTS
from transformer_jax.config import UNK_ID
from transformer_jax.errors import ConfigError
from transformer_jax.model.kernels import kernel_choice


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Everything the model modules read. Built once from the `ConfigDict`."""

  vocab_size: int
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  norm_position: str = 'post'
  layer_norm_epsilon: float = 1e-6
  layer_norm_statistics: str = 'one_pass'
  logits_sum: str = 'reduce'
  # 'xla', 'pallas' (compiled by Triton) or 'pallas_interpret' (Pallas's interpreter).
  post_norm_kernel: str = 'xla'
  qkv_projection: str = 'separate'
  share_embeddings: bool = True
  tie_output_embedding: bool = True
  positional_encoding: str = 'sinusoidal'
  sinusoid_layout: str = 'interleaved'
  activation: str = 'relu'
  logits_bias: bool = False
  # The ids the output layer scores, ascending (`output_vocabulary='target'`); None: all.
  # Training's logits then have len(output_ids) entries (targets map into them with
  # `output_positions`), decoding's the whole vocabulary, -inf outside them.
  output_ids: tuple[int, ...] | None = None
  decoder_start: str = 'bos'
  max_len: int = 256
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention_implementation: str | None = None
  # Rows are right-padded and unpacked: attention gets sequence lengths and a causal flag
  # (`attention.Lengths`) instead of a dense mask. Training and scoring only: decode mode
  # (one query a step over a cache) always uses dense masks and XLA's kernel.
  attention_lengths: bool = False
  remat_policy: str = 'none'
  deterministic: bool = False  # True: no dropout (evaluation, decoding).
  decode: bool = False  # True: one token a call, reading and writing the key/value cache.

  def __post_init__(self):
    _require(
        isinstance(self.vocab_size, int) and self.vocab_size > 3,
        f'vocab_size={self.vocab_size!r} must be an int > 3 (ids 0-3 are '
        'pad, bos, eos, unk); set --config.vocab_size or train a vocabulary.',
    )
    for name in ('d_model', 'num_heads', 'd_ff', 'max_len'):
      value = getattr(self, name)
      _require(
          isinstance(value, int) and value > 0,
          f'{name}={value!r} must be a positive int; set --config.{name}.',
      )
    for name in ('num_encoder_layers', 'num_decoder_layers'):
      value = getattr(self, name)
      _require(
          isinstance(value, int) and value >= 1,
          f'{name}={value!r} must be an int >= 1; set --config.{name}.',
      )
    _require(
        self.d_model % self.num_heads == 0,
        f'd_model={self.d_model} is not divisible by num_heads={self.num_heads}; '
        'choose num_heads that divides d_model (the paper: 512/8, 1024/16).',
    )
    _require(
        self.positional_encoding != 'rope' or self.head_dim % 2 == 0,
        f'rope needs an even head dimension, got d_model/num_heads={self.head_dim}.',
    )
    _require(self.d_model % 2 == 0, f'd_model={self.d_model} must be even.')
    for name in ('dropout_rate', 'attention_dropout_rate'):
      value = getattr(self, name)
      _require(
          isinstance(value, (int, float)) and 0.0 <= value < 1.0,
          f'{name}={value!r} must be in [0, 1); set --config.{name}=0.1 for example.',
      )
    _require(
        self.norm_position in NORM_POSITIONS,
        f'norm_position={self.norm_position!r} is not one of {NORM_POSITIONS}.',
    )
    _require(
        self.layer_norm_statistics in LAYER_NORM_STATISTICS,
        f'layer_norm_statistics={self.layer_norm_statistics!r} is not one of '
        f'{LAYER_NORM_STATISTICS}.',
    )
    _require(
        self.logits_sum in LOGITS_SUMS,
        f'logits_sum={self.logits_sum!r} is not one of {LOGITS_SUMS}.',
    )
    _require(
        self.qkv_projection in QKV_PROJECTIONS[1:],
        f'qkv_projection={self.qkv_projection!r} is not one of {QKV_PROJECTIONS}.',
    )
    _require(
        self.post_norm_kernel in POST_NORM_KERNELS + ('pallas_interpret',),
        f'post_norm_kernel={self.post_norm_kernel!r} is not one of {POST_NORM_KERNELS}.',
    )
    if self.post_norm_kernel != 'xla':
      _require(
          self.norm_position == 'post',
          "post_norm_kernel='pallas' fuses a post-norm sub-layer's residual and norm; "
          f"with norm_position={self.norm_position!r} set post_norm_kernel='xla'.",
      )
      _require(
          self.d_model & (self.d_model - 1) == 0,
          f"post_norm_kernel='pallas' needs a power-of-two d_model (Triton's blocks), "
          f"got {self.d_model}; set post_norm_kernel='xla'.",
      )
    _require(
        self.positional_encoding in POSITIONAL_ENCODINGS,
        f'positional_encoding={self.positional_encoding!r} is not one of '
        f'{POSITIONAL_ENCODINGS}; set --config.positional_encoding to one of them.',
    )
    _require(
        self.layer_norm_epsilon > 0, f'layer_norm_epsilon={self.layer_norm_epsilon!r} must be > 0.'
    )
    for name, choices in (
        ('sinusoid_layout', SINUSOID_LAYOUTS),
        ('activation', ACTIVATIONS),
        ('decoder_start', tuple(DECODER_STARTS)),
    ):
      value = getattr(self, name)
      _require(
          value in choices,
          f'{name}={value!r} is not one of {choices}; set --config.{name} to one of them.',
      )
    _require(
        isinstance(self.logits_bias, bool),
        f'logits_bias={self.logits_bias!r} must be True or False.',
    )
    if self.output_ids is not None:
      ids = self.output_ids
      _require(
          isinstance(ids, tuple)
          and all(isinstance(i, int) for i in ids)
          and list(ids) == sorted(set(ids))
          and {EOS_ID, UNK_ID} <= set(ids)
          and PAD_ID not in ids
          and ids[-1] < self.vocab_size,
          f'output_ids must be ascending ids below vocab_size={self.vocab_size} with EOS '
          f'({EOS_ID}) and UNK ({UNK_ID}) and without PAD ({PAD_ID}); got {len(ids)} ids '
          f'{ids[:6]}...',
      )
    _require(
        self.attention_implementation in (None,) + ATTENTION_IMPLEMENTATIONS[1:],
        f'attention_implementation={self.attention_implementation!r} must be '
        "'' (automatic), 'xla' or 'cudnn'.",
    )
    _require(
        self.remat_policy in REMAT_POLICIES,
        f'remat_policy={self.remat_policy!r} is not one of {REMAT_POLICIES}.',
    )

  @property
  def output_size(self) -> int:
    """Logits a token gets in training: len(output_ids), or the vocabulary."""
    return self.vocab_size if self.output_ids is None else len(self.output_ids)

  def output_positions(self) -> np.ndarray:
    """[vocab_size] int32: each id's index in `output_ids` (UNK's for ids outside them)."""
    if self.output_ids is None:
      return np.arange(self.vocab_size, dtype=np.int32)
    positions = np.full(self.vocab_size, self.output_ids.index(UNK_ID), np.int32)
    positions[list(self.output_ids)] = np.arange(len(self.output_ids), dtype=np.int32)
    return positions

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def decoder_start_id(self) -> int:
    """The id fed to the decoder first (training's shifted targets and every search)."""
    return DECODER_STARTS[self.decoder_start]

  @classmethod
  def from_config(
      cls,
      config: ml_collections.ConfigDict,
      vocab_size: int | None = None,
      *,
      platform: str | None = None,
      output_ids: Sequence[int] | None = None,
      **overrides: Any,
  ) -> TransformerConfig:
    """Validates and freezes the model fields of `config`.

    Every field of this dataclass that the run config has is copied as it is; the rest are
    derived here: the vocabulary size, the output ids, the dtype and the kernels, which
    `kernel_choice.for_platform` resolves for the platform.

    Args:
      config: the run's `ConfigDict` (see `config.base_config`).
      vocab_size: the tokenizer's size; used when `config.vocab_size` is 0.
      platform: where the model runs ('cpu', 'gpu', 'tpu'), for `dtype='auto'` and the
        kernels; default JAX's default backend.
      output_ids: with `output_vocabulary='target'`, the ids the output layer scores (the
        training data's, `input_pipeline.target_side_ids`; a checkpoint's meta); ignored with
        'all'. Without them (compiling ahead of time, config checks) it scores all.
      **overrides: fields to replace (e.g. `deterministic=True`).

    Returns:
      The frozen model config.

    Raises:
      ConfigError: a field cannot work; the message says which and how to fix it.
    """
    dtype_name = config.dtype
    _require(
        dtype_name in config_lib.DTYPE_CHOICES,
        f'dtype={dtype_name!r} is not one of {config_lib.DTYPE_CHOICES}; '
        + (
            'float16 needs loss scaling, which this project does not do: use bfloat16 '
            '(same speed, float32 range). '
            if dtype_name == 'float16'
            else ''
        )
        + "'auto' is bfloat16 on GPU/TPU and float32 on CPU.",
    )
    platform = platform or jax.default_backend()
    if dtype_name == 'auto':
      dtype_name = 'bfloat16' if platform in config_lib.ACCELERATOR_PLATFORMS else 'float32'
    size = config.vocab_size or vocab_size
    _require(
        size is not None and size > 0,
        'vocab_size is 0 and no tokenizer size was given; set --config.vocab_size.',
    )
    kernels = kernel_choice.for_platform(config, platform, dtype_name)
    fields = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
    fields.update(
        vocab_size=int(size),
        output_ids=(
            tuple(int(i) for i in output_ids)
            if output_ids is not None and config.output_vocabulary == 'target'
            else None
        ),
        dtype=config_lib.DTYPES[dtype_name],
        logits_sum=kernels.logits_sum,
        post_norm_kernel=kernels.post_norm_kernel,
        qkv_projection=kernels.qkv_projection,
        attention_implementation=kernels.attention.implementation,
        attention_lengths=kernels.attention.lengths,
    )
    fields.update(overrides)
    return cls(**fields)

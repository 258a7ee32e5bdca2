"""Which kernels a model's attention and post-norm use on a platform, and why.

`TransformerConfig.from_config` resolves the config's automatic choices here
(`for_platform`) for the platform it runs on: cuDNN's fused attention on a GPU where it can
serve (which needs the cuDNN library, asked through JAX), else XLA's; the Pallas post-norm
kernel compiled for GPUs and interpreted on a CPU; the stacked or separate projections and the
loss's sum. train.py and compile.py log the reason.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from transformer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
  """Which attention kernel training uses, and why (train.py and compile.py log `reason`).

  Attributes:
    implementation: for `jax.nn.dot_product_attention`: 'xla', 'cudnn' or None (JAX's
      choice, which is XLA).
    lengths: feed sequence lengths and a causal flag instead of a dense mask.
    reason: one line for the log.
  """

  implementation: str | None
  lengths: bool
  reason: str


def cudnn_version() -> int | None:
  """The cuDNN library's version as JAX sees it (e.g. 92800), or None without one."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo

    return int(fused_attention_stablehlo.check_cudnn_version())
  except Exception:  # No CUDA plugin, no library, or a JAX that moved it: all mean "none".
    return None


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The kernels a model gets on one platform (`for_platform`).

  Attributes:
    attention: which attention kernel, and why.
    post_norm_kernel: 'xla', 'pallas' (compiled by Triton) or 'pallas_interpret'.
    logits_sum: how the loss sums the output layer's exponentials: 'linear' (a product with
      a vector of ones, which GPUs run as a matrix product) or 'reduce' (XLA's reduction).
    qkv_projection: 'stacked' (one [d_model, 3, ...] product for self-attention's queries,
      keys and values) or 'separate' (three).
  """

  attention: AttentionChoice
  post_norm_kernel: str
  logits_sum: str
  qkv_projection: str


def for_platform(config: ml_collections.ConfigDict, platform: str, dtype_name: str) -> Kernels:
  """Resolves the config's automatic ('') kernel fields for `platform`.

  GPUs get the stacked projection and the linear sum (one large matrix product each, where
  a GPU's matrix units are fastest); other platforms the separate projections and XLA's
  reduction, which XLA:CPU and TPUs run at least as fast.
  """
  gpu = platform in ('gpu', 'cuda')
  return Kernels(
      attention=attention_choice(config, platform, dtype_name),
      post_norm_kernel=post_norm_kernel(config.post_norm_kernel, platform),
      logits_sum=config.logits_sum or ('linear' if gpu else 'reduce'),
      qkv_projection=config.qkv_projection or ('stacked' if gpu else 'separate'),
  )


def post_norm_kernel(choice: str, platform: str) -> str:
  """'pallas' compiles for GPUs and interprets on CPU; Mosaic TPU kernels are not written."""
  if choice != 'pallas' or platform in ('gpu', 'cuda'):
    return choice
  if platform != 'cpu':
    raise ConfigError(
        f"post_norm_kernel='pallas' is a Triton kernel for GPUs, not {platform}; "
        "set post_norm_kernel='xla' (XLA fuses these ops on TPUs)."
    )
  return 'pallas_interpret'


def attention_choice(
    config: ml_collections.ConfigDict, platform: str, dtype_name: str
) -> AttentionChoice:
  """Resolves `config.attention_implementation` for `platform` and the computation dtype.

  '' (automatic) takes cuDNN's fused kernel on a GPU when it can serve: a cuDNN library,
  16-bit compute, a head dimension that is a multiple of 8 up to 128, no attention dropout
  and no ALiBi bias (both need the explicit softmax), unpacked rows (JAX's cuDNN call takes
  no segment ids). Otherwise XLA, with the reason; on a CPU the explicit softmax. Unpacked
  rows give cuDNN sequence lengths and a causal flag, never a mask.
  """
  requested = config.attention_implementation
  packed = bool(config.get('packing', False))
  if requested == 'xla':
    return AttentionChoice('xla', False, 'XLA attention, as configured')
  if requested == 'explicit':
    return AttentionChoice('explicit', False, 'explicit softmax attention, as configured')
  if requested == 'cudnn':
    how = 'a dense mask, as packed rows need' if packed else 'sequence lengths and a causal flag'
    return AttentionChoice('cudnn', not packed, f'cuDNN fused attention, as configured, fed {how}')
  if platform == 'cpu':
    # jax.nn.dot_product_attention's XLA path spends longer in the softmax and masks there
    # (bench/RESULTS.md, section "CPU training: the explicit softmax against `jax.nn`'s XLA
    # attention").
    return AttentionChoice('explicit', False, 'explicit softmax attention (automatic on cpu)')
  if platform not in ('gpu', 'cuda'):
    return AttentionChoice(None, False, f'XLA attention (automatic on {platform})')
  head_dim = config.d_model // max(1, config.num_heads)
  blockers = []
  if dtype_name != 'bfloat16':
    blockers.append(f'dtype {dtype_name} (cuDNN attention needs bfloat16)')
  if head_dim % 8 or head_dim > 128:
    blockers.append(f'head dimension {head_dim} (cuDNN needs a multiple of 8, at most 128)')
  if config.attention_dropout_rate > 0:
    blockers.append('attention_dropout_rate > 0')
  if config.positional_encoding == 'alibi':
    blockers.append('ALiBi bias')
  if packed:
    blockers.append("packed rows (no segment ids in JAX's cuDNN call)")
  if not blockers and cudnn_version() is None:
    blockers.append('no cuDNN library found')
  if blockers:
    return AttentionChoice('xla', False, 'XLA attention: cuDNN cannot serve ' + '; '.join(blockers))
  return AttentionChoice(
      'cudnn',
      True,
      'cuDNN fused attention (automatic on GPU), fed sequence lengths and a causal flag',
  )

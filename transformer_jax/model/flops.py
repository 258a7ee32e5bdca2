"""Model FLOPs of the encoder-decoder Transformer and model FLOPs utilization (MFU).

The count follows the PaLM paper's convention (Chowdhery et al. 2022, appendix B): a token
costs 2 FLOPs per matrix-multiply parameter it passes through in the forward pass and 4 more
in the backward pass (6 in all for training), plus the attention score and value products,
counted over the full key length (no discount for the causal mask). Rematerialized work is
not model work, so remat does not change the count. Bias additions, layer norms, softmax,
dropout and the embedding lookup are left out (they are not matrix multiplies).

An encoder-decoder splits the parameters between the two kinds of token:

  * a source token passes through every encoder layer (q, k, v, o: 4 d^2; feed-forward:
    2 d d_ff) and through the key and value projections of every decoder layer's
    encoder-decoder attention (2 d^2 each);
  * a target token passes through every decoder layer (self-attention: 4 d^2; the query and
    output projections of encoder-decoder attention: 2 d^2; feed-forward: 2 d d_ff) and
    through the pre-softmax projection (d * vocab, the tied embedding counted here; d *
    len(output_ids) where the output layer scores only those);
  * attention adds 2 * 2 * kv_length * d forward FLOPs per query token and layer: encoder
    self-attention over the source, decoder self-attention over the target, decoder
    encoder-decoder attention over the source.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses

from transformer_jax.model.config import TransformerConfig

FORWARD = 2  # FLOPs per parameter and token: one multiply-add.
TRAINING = 6  # Forward (2) + backward (4: gradients of activations and of weights).


@dataclasses.dataclass(frozen=True)
class MatmulParams:
  """Matrix-multiply parameters a token passes through, by kind of token.

  Attributes:
    source: parameters each source token passes through.
    target: parameters each target token passes through.
  """

  source: int
  target: int


def matmul_params(cfg: TransformerConfig) -> MatmulParams:
  """The parameters per source and per target token (see the module docstring)."""
  d, f = cfg.d_model, cfg.d_ff
  encoder_layer = 4 * d * d + 2 * d * f
  cross_key_value = 2 * d * d
  decoder_layer = 4 * d * d + 2 * d * d + 2 * d * f
  return MatmulParams(
      source=cfg.num_encoder_layers * encoder_layer + cfg.num_decoder_layers * cross_key_value,
      target=cfg.num_decoder_layers * decoder_layer + d * cfg.output_size,
  )


def example_flops(
    cfg: TransformerConfig, source_length: int, target_length: int, passes: int = TRAINING
) -> float:
  """Model FLOPs of one sentence pair.

  Args:
    cfg: the model config.
    source_length: the pair's non-padding source tokens.
    target_length: the pair's non-padding target tokens.
    passes: `TRAINING` (6) for a training step, `FORWARD` (2) for a forward pass.

  Returns:
    The FLOPs, as a float.
  """
  p = matmul_params(cfg)
  s, t, d = source_length, target_length, cfg.d_model
  weights = passes * (p.source * s + p.target * t)
  # Per query token and layer: Q K^T and A V, 2 * kv_length * d FLOPs each, forward.
  attention_forward = (
      4 * d * (cfg.num_encoder_layers * s * s + cfg.num_decoder_layers * (t * t + t * s))
  )
  return float(weights + passes // 2 * attention_forward)


def batch_flops(
    cfg: TransformerConfig,
    source_lengths: Sequence[int],
    target_lengths: Sequence[int],
    passes: int = TRAINING,
) -> float:
  """Model FLOPs of a batch, from the non-padding lengths of its sentence pairs."""
  if len(source_lengths) != len(target_lengths):
    raise ValueError(
        f'{len(source_lengths)} source lengths but {len(target_lengths)} '
        'target lengths; give one of each per sentence pair.'
    )
  return sum(example_flops(cfg, s, t, passes) for s, t in zip(source_lengths, target_lengths))


# Dense bf16 peak FLOP/s of one device by `jax.Device.device_kind`: the datasheets' figures,
# which training's MFU is divided by (bench/ divides by the matmul rate it measures).
PEAK_FLOPS = {
    'TPU v4': 275e12,
    'TPU v5 lite': 197e12,
    'TPU v5e': 197e12,
    'TPU v5p': 459e12,
    'TPU v5': 459e12,
    'TPU v6 lite': 918e12,
    'TPU v6e': 918e12,
    'NVIDIA A100-SXM4-40GB': 312e12,
    'NVIDIA A100-SXM4-80GB': 312e12,
    'NVIDIA H100 80GB HBM3': 989e12,
    'NVIDIA H200': 989e12,
}


def peak_flops(device_kind: str) -> float | None:
  """The datasheet's dense bf16 FLOP/s of one device of this kind; None if unknown."""
  return PEAK_FLOPS.get(device_kind)


def mfu(flops: float, seconds: float, peak_flops_per_second: float) -> float:
  """Model FLOPs utilization: achieved model FLOPs per second over the device's peak."""
  return flops / seconds / peak_flops_per_second

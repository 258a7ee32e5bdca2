"""Encoder-decoder attention of one translated sentence, drawn as a heatmap.

The weights come from a teacher-forced full forward pass over the source and the output (the
decoder input is BOS + output[:-1]), with the model's attention weights collected as
intermediates: row t is the attention used to predict output token t. Axes are labelled with
the SentencePiece pieces of the source and of the output. matplotlib draws with the Agg
backend (files only, no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import sentencepiece as spm

from transformer_jax.config import EOS_ID
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.models import Transformer
from transformer_jax.storage import storage

PyTree = Any


def cross_attention(
    model_config: TransformerConfig,
    params: PyTree,
    source_ids: Sequence[int],
    output_ids: Sequence[int],
    layer: int = -1,
) -> np.ndarray:
  """The encoder-decoder attention weights of one decoder layer for one sentence pair.

  Args:
    model_config: the model's config.
    params: its parameters.
    source_ids: the source, ending with EOS.
    output_ids: the translation, ending with EOS (added here if missing).
    layer: the decoder layer, 0-based; negative counts from the last.

  Returns:
    float32 [heads, output_length, source_length]; each row sums to 1.

  Raises:
    ValueError: no such layer.
  """
  num_layers = model_config.num_decoder_layers
  if not -num_layers <= layer < num_layers:
    raise ValueError(
        f'layer={layer} does not exist: the decoder has {num_layers} layers '
        f'(0..{num_layers - 1}, or -1 for the last).'
    )
  layer %= num_layers
  output_ids = list(output_ids)
  if not output_ids or output_ids[-1] != EOS_ID:
    output_ids.append(EOS_ID)
  inputs = jnp.asarray([list(source_ids)], jnp.int32)
  targets = jnp.asarray([output_ids], jnp.int32)
  model = Transformer(dataclasses.replace(model_config, decode=False, deterministic=True))
  _, state = model.apply({'params': params}, inputs, targets, mutable=['intermediates'])
  weights = state['intermediates']['decoder'][f'layer_{layer}']['encoder_decoder_attention'][
      'attention_weights'
  ][
      0
  ]  # [1, heads, target, source]
  return np.asarray(weights[0], np.float32)


def pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
  """The SentencePiece piece of each id ('</s>' for EOS), for axis labels."""
  processor = spm.SentencePieceProcessor(model_file=tokenizer.model_path)
  return [processor.id_to_piece(int(i)) for i in ids]


def plot(
    weights: np.ndarray,
    source_labels: Sequence[str],
    output_labels: Sequence[str],
    path: str,
    heads: str | int = 'mean',
    title: str = '',
) -> Any:
  """Draws attention weights as a heatmap and saves it (format from the file suffix).

  Args:
    weights: [heads, output_length, source_length].
    source_labels: one label per source position (x axis).
    output_labels: one label per output position (y axis).
    path: the image file, e.g. 'attention.png'.
    heads: 'mean' (averaged over heads), 'all' (one panel per head) or a head index.
    title: shown above the plot.

  Returns:
    The matplotlib figure (already saved; close it with `plt.close(fig)` when done).

  Raises:
    ValueError: the labels or the head do not fit the weights.
  """
  num_heads, out_len, src_len = weights.shape
  if len(source_labels) != src_len or len(output_labels) != out_len:
    raise ValueError(
        f'Weights are [{num_heads}, {out_len}, {src_len}] but there are '
        f'{len(output_labels)} output and {len(source_labels)} source labels.'
    )
  if heads == 'mean':
    panels = [(weights.mean(axis=0), 'mean over heads')]
  elif heads == 'all':
    panels = [(weights[h], f'head {h}') for h in range(num_heads)]
  else:
    head = int(heads)
    if not 0 <= head < num_heads:
      raise ValueError(
          f'head {head} does not exist; the model has {num_heads} '
          f"(0..{num_heads - 1}), or use 'mean' or 'all'."
      )
    panels = [(weights[head], f'head {head}')]

  columns = min(len(panels), 4)
  rows = -(-len(panels) // columns)
  cell = 0.32  # Inches per token, so labels stay readable for long sentences.
  width = max(4.0, 1.5 + cell * src_len) * columns
  height = max(3.0, 1.5 + cell * out_len) * rows
  fig, axes = plt.subplots(rows, columns, figsize=(width, height), squeeze=False)
  for ax in axes.flat[len(panels) :]:
    ax.axis('off')
  for ax, (matrix, name) in zip(axes.flat, panels):
    image = ax.imshow(
        matrix, cmap='viridis', vmin=0.0, vmax=1.0, aspect='auto', interpolation='nearest'
    )
    ax.set_xticks(range(src_len), labels=list(source_labels), rotation=90, fontsize=8)
    ax.set_yticks(range(out_len), labels=list(output_labels), fontsize=8)
    ax.set_xlabel('source')
    ax.set_ylabel('output')
    ax.set_title(name, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  # Written through a temporary file, so the suffix names the format.
  with storage.writing(path, 'wb') as f:
    fig.savefig(f, dpi=120, format=os.path.splitext(path)[1].lstrip('.').lower() or 'png')
  return fig


def draw(
    model_config: TransformerConfig,
    params: PyTree,
    tokenizer: Tokenizer,
    source_ids: Sequence[int],
    output_ids: Sequence[int],
    path: str,
    *,
    layer: int = -1,
    heads: str | int = 'mean',
) -> np.ndarray:
  """Computes one sentence pair's encoder-decoder attention and saves it as a heatmap.

  Args:
    model_config: the model's config.
    params: its parameters.
    tokenizer: its vocabulary (for the labels).
    source_ids: the source, ending with EOS.
    output_ids: the translation (EOS appended if missing).
    path: the image file.
    layer: the decoder layer (negative: from the last).
    heads: 'mean', 'all' or a head index.

  Returns:
    The weights drawn, [heads, output_length, source_length].
  """
  output_ids = list(output_ids)
  if not output_ids or output_ids[-1] != EOS_ID:
    output_ids.append(EOS_ID)
  weights = cross_attention(model_config, params, source_ids, output_ids, layer)
  layer_index = layer % model_config.num_decoder_layers
  fig = plot(
      weights,
      pieces(tokenizer, source_ids),
      pieces(tokenizer, output_ids),
      path,
      heads=heads,
      title=f'encoder-decoder attention, decoder layer {layer_index}',
  )
  plt.close(fig)
  return weights

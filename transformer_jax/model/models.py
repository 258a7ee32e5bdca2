"""The encoder-decoder Transformer of "Attention Is All You Need", as Flax linen modules.

Read top to bottom: embeddings and positions, the feed-forward block, the residual sub-layer,
the encoder and decoder layers, the encoder stack, the output layer, the decoder stack, and
`Transformer` with `encode`, `decode` and the training call. Every parameter and the main
activations carry logical axis names (`batch, length, embed, mlp, heads, kv, vocab`); how they
map onto a device mesh is decided elsewhere, by rules. What is written for speed on one
platform (the tied projection's backward, the fused post-norm, the attention kernels, the
loss's backward) is in `kernels/`, called by what it computes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import BOS_ID
from transformer_jax.config import PAD_ID
from transformer_jax.model.attention import MultiHeadAttention
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.kernels import fused_norm
from transformer_jax.model.kernels import tied_projection
from transformer_jax.model.kernels.dot_product_attention import Lengths

Array = jax.Array

# The keys of a training batch: `Transformer.__call__`'s arguments, so a batch is applied as
# `model.apply(variables, **batch)`. Every array is int32 [rows, length].
BATCH_KEYS = (
    'inputs',
    'targets',
    'inputs_positions',
    'targets_positions',
    'inputs_segmentation',
    'targets_segmentation',
)

_REMAT_POLICIES = {
    'full': None,  # Save nothing: recompute the whole layer in the backward pass.
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_with_no_batch_dims': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def sinusoidal_positions(positions: Array, d_model: int, layout: str = 'interleaved') -> Array:
  """The paper's PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

  'interleaved' lays them out as the paper writes them; 'concatenated' puts all the sines
  first, then all the cosines, as tensor2tensor and Marian do. Computed from the positions,
  so any length and packed rows work.

  Args:
    positions: [batch, length] integer positions.
    d_model: model width (even).
    layout: 'interleaved' | 'concatenated' (`config.SINUSOID_LAYOUTS`).

  Returns:
    [batch, length, d_model] float32.
  """
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, d_model, 2, dtype=np.float32) / d_model))
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, length, d/2]
  if layout == 'concatenated':
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [batch, length, d/2, 2]
  return pe.reshape(positions.shape + (d_model,))


class Embed(nn.Module):
  """A token embedding whose matrix can also serve as the pre-softmax projection.

  With `decoder_start='zero'` the row of <pad> is held at zero: it starts at zero, lookups of
  <pad> give zero and its logit is zero, so no gradient reaches it and it stays zero through
  training. The decoder then starts from a zero vector (plus position 0), as Marian and
  CTranslate2 start every Marian model and tensor2tensor its own.
  """

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    # N(0, d^-1/2) so that the sqrt(d)-scaled embeddings have unit variance.
    normal = nn.initializers.normal(stddev=cfg.d_model**-0.5)

    def init(rng, shape, dtype):
      table = normal(rng, shape, dtype)
      return table.at[PAD_ID].set(0) if self._zero_pad else table

    self.embedding = self.param(
        'embedding',
        nn.with_logical_partitioning(init, ('vocab', 'embed')),
        (cfg.vocab_size, cfg.d_model),
        cfg.param_dtype,
    )

  @property
  def _zero_pad(self) -> bool:
    return self.config.decoder_start == 'zero'

  def __call__(self, tokens: Array) -> Array:
    """[batch, length] ids -> [batch, length, d_model] embeddings times sqrt(d_model)."""
    cfg = self.config
    x = jnp.take(jnp.asarray(self.embedding, cfg.dtype), tokens, axis=0)
    if self._zero_pad:
      x = jnp.where((tokens == PAD_ID)[..., None], jnp.zeros((), x.dtype), x)
    return x * jnp.asarray(np.sqrt(cfg.d_model), cfg.dtype)

  def _rows(self, ids: np.ndarray | None) -> Array:
    """The embedding's rows of `ids` (None: all) in the computation dtype."""
    table = jnp.asarray(self.embedding, self.config.dtype)
    return table if ids is None else jnp.take(table, ids, axis=0)

  def attend(self, x: Array, ids: np.ndarray | None = None) -> Array:
    """[batch, length, d_model] -> [batch, length, vocab] logits against the embedding;
    [..., len(ids)] against the rows of `ids` only (which hold no PAD)."""
    logits = tied_projection.project(x, self._rows(ids))
    return logits.at[..., PAD_ID].set(0) if self._zero_pad and ids is None else logits

  def attend_sums(self, ids: np.ndarray | None = None) -> Array:
    """[d_model] float32: y times it is the sum over the vocabulary (or `ids`) of
    `attend(y, ids)`."""
    rows = self._rows(ids).astype(jnp.float32)
    total = jnp.sum(rows, axis=0)
    return total - rows[PAD_ID] if self._zero_pad and ids is None else total


class AddPositions(nn.Module):
  """Adds sinusoidal or learned positions to the embeddings (nothing for RoPE and ALiBi)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array) -> Array:
    cfg = self.config
    if cfg.positional_encoding == 'sinusoidal':
      return x + sinusoidal_positions(positions, cfg.d_model, cfg.sinusoid_layout).astype(cfg.dtype)
    if cfg.positional_encoding == 'learned':
      table = self.param(
          'position_embedding',
          nn.with_logical_partitioning(
              nn.initializers.normal(stddev=cfg.d_model**-0.5), (None, 'embed')
          ),
          (cfg.max_len, cfg.d_model),
          cfg.param_dtype,
      )
      return x + jnp.take(jnp.asarray(table, cfg.dtype), positions, axis=0)
    return x  # RoPE and ALiBi act inside attention.


_NORM_SCALE_INIT = nn.with_logical_partitioning(nn.initializers.ones_init(), ('embed',))
_NORM_BIAS_INIT = nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',))


def layer_norm(config: TransformerConfig, name: str) -> nn.LayerNorm:
  """Layer normalisation with statistics in float32 and logically named parameters, in one
  pass over the input or two (`config.layer_norm_statistics`)."""
  return nn.LayerNorm(
      epsilon=config.layer_norm_epsilon,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      use_fast_variance=config.layer_norm_statistics == 'one_pass',
      scale_init=_NORM_SCALE_INIT,
      bias_init=_NORM_BIAS_INIT,
      name=name,
  )


_ACTIVATIONS = {
    'relu': nn.relu,
    'swish': nn.swish,  # x * sigmoid(x), also called SiLU.
    'gelu': lambda x: nn.gelu(x, approximate=False),
}


class FeedForward(nn.Module):
  """The position-wise feed-forward block, max(0, x W1 + b1) W2 + b2 (or another activation,
  `config.activation`, in place of max(0, .))."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = lambda features, axes, name: nn.Dense(
        features,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]),
    )
    h = _ACTIVATIONS[cfg.activation](dense(cfg.d_ff, ('embed', 'mlp'), 'wi')(x))
    h = nn.with_logical_constraint(h, ('batch', 'length', 'mlp'))
    y = dense(cfg.d_model, ('mlp', 'embed'), 'wo')(h)  # [batch, length, d_model]
    return nn.with_logical_constraint(y, ('batch', 'length', 'embed'))


class SubLayer(nn.Module):
  """Residual wrapper: LayerNorm(x + Dropout(f(x))) (post-norm, the paper) or
  x + Dropout(f(LayerNorm(x))) (pre-norm)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, sublayer, *args, **kwargs) -> Array:
    cfg = self.config
    if cfg.norm_position == 'pre':
      y = sublayer(layer_norm(cfg, 'norm')(x), *args, **kwargs)
      return x + nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    y = sublayer(x, *args, **kwargs)
    if cfg.post_norm_kernel != 'xla':  # One Pallas kernel each way for the three steps below.
      return fused_norm.add_and_norm(cfg, x, y, (_NORM_SCALE_INIT, _NORM_BIAS_INIT))
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    return layer_norm(cfg, 'norm')(x + y)


class EncoderLayer(nn.Module):
  """Self-attention, then feed-forward, each a residual sub-layer."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array, positions: Array) -> Array:
    cfg = self.config
    attention = MultiHeadAttention(cfg, is_self_attention=True, name='self_attention')
    x = SubLayer(cfg, name='self_attention_block')(
        x, lambda h: attention(h, h, mask, positions, positions)
    )
    x = SubLayer(cfg, name='feed_forward_block')(x, FeedForward(cfg, name='feed_forward'))
    return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, then feed-forward."""

  config: TransformerConfig

  @nn.compact
  def __call__(
      self,
      y: Array,
      encoded: Array | None,
      self_mask: Array | None,
      cross_mask: Array | None,
      positions: Array,
      decode_index: Array | None = None,
  ) -> Array:
    cfg = self.config
    self_attention = MultiHeadAttention(
        cfg, is_self_attention=True, in_decoder=True, name='self_attention'
    )
    cross_attention = MultiHeadAttention(
        cfg, is_self_attention=False, in_decoder=True, name='encoder_decoder_attention'
    )
    y = SubLayer(cfg, name='self_attention_block')(
        y, lambda h: self_attention(h, h, self_mask, positions, positions, decode_index)
    )
    y = SubLayer(cfg, name='encoder_decoder_attention_block')(
        y, lambda h: cross_attention(h, encoded, cross_mask)
    )
    y = SubLayer(cfg, name='feed_forward_block')(y, FeedForward(cfg, name='feed_forward'))
    return nn.with_logical_constraint(y, ('batch', 'length', 'embed'))


def _layer_class(cls, config: TransformerConfig):
  """The layer class, wrapped in `nn.remat` with the configured policy."""
  if config.remat_policy == 'none':
    return cls
  return nn.remat(cls, policy=_REMAT_POLICIES[config.remat_policy], prevent_cse=True)


class Encoder(nn.Module):
  """The encoder stack: embeddings + positions, dropout, N encoder layers."""

  config: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(self, inputs: Array, positions: Array, mask: Array) -> Array:
    """[batch, length] ids -> [batch, length, d_model] encoder output."""
    cfg = self.config
    x = AddPositions(cfg, name='positions')(self.embed(inputs), positions)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    layer = _layer_class(EncoderLayer, cfg)
    for i in range(cfg.num_encoder_layers):
      x = layer(cfg, name=f'layer_{i}')(x, mask, positions)
    if cfg.norm_position == 'pre':
      x = layer_norm(cfg, 'final_norm')(x)
    return x


class OutputLayer(nn.Module):
  """The pre-softmax linear transformation: [batch, length, d_model] -> logits.

  Tied to the target embedding (the paper, section 3.4) or its own matrix; with
  `config.output_ids` (a shortlist of the target side's pieces) it scores only those in
  training, and in decoding gives -inf to the rest. Shares the decoder's scope
  (`nn.share_scope`), so its parameters are the decoder's `output_projection` and
  `logits_bias`.
  """

  config: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(self, y: Array) -> Array:
    cfg = self.config
    ids = None if cfg.output_ids is None else np.asarray(cfg.output_ids, np.int32)
    if cfg.tie_output_embedding:
      logits = self.embed.attend(y, ids)
      column_sums = lambda: self.embed.attend_sums(ids)
    else:
      logits, column_sums = self._untied(y, ids)
    logits, bias_sum = self._bias(logits, ids)
    if self.is_mutable_collection('logit_sums'):
      # Each token's logits summed over the vocabulary, from their linear map of y
      # (`kernels.cross_entropy.token_losses_given_sums`): no pass over the logits.
      sums = jnp.einsum('bld,d->bl', y.astype(jnp.float32), column_sums()) + bias_sum
      self.sow('logit_sums', 'sums', sums)
    if ids is not None and cfg.decode:
      # The search sees the whole vocabulary; what the layer does not score cannot be chosen.
      full = jnp.full(logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, logits.dtype)
      logits = full.at[..., ids].set(logits)
    return nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))

  def _untied(self, y: Array, ids: np.ndarray | None):
    """The output layer's own matrix: logits and a function giving its column sums."""
    cfg = self.config
    projection = nn.Dense(
        cfg.vocab_size,
        use_bias=False,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(), ('embed', 'vocab')
        ),
        name='output_projection',
    )
    # Every column is multiplied; a shortlist then keeps its own (the tied layer, the
    # default, multiplies only those).
    logits = projection(y)
    if ids is not None:
      logits = jnp.take(logits, ids, axis=-1)

    def column_sums():
      kernel = jnp.asarray(nn.meta.unbox(projection.variables['params']['kernel']), cfg.dtype)
      kernel = kernel if ids is None else jnp.take(kernel, ids, axis=1)
      return jnp.sum(kernel.astype(jnp.float32), axis=1)

    return logits, column_sums

  def _bias(self, logits: Array, ids: np.ndarray | None) -> tuple[Array, Array | float]:
    """Logits plus `config.logits_bias`'s bias (Marian's models have one), and its sum."""
    cfg = self.config
    if not cfg.logits_bias:
      return logits, 0.0
    bias = self.param(
        'logits_bias',
        nn.with_logical_partitioning(nn.initializers.zeros_init(), ('vocab',)),
        (cfg.vocab_size,),
        cfg.param_dtype,
    )
    bias = jnp.asarray(bias, cfg.dtype)
    bias = bias if ids is None else jnp.take(bias, ids)
    return logits + bias, jnp.sum(bias.astype(jnp.float32))


class Decoder(nn.Module):
  """The decoder stack: embeddings + positions, dropout, N decoder layers, logits."""

  config: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(
      self,
      decoder_inputs: Array,
      encoded: Array | None,
      positions: Array | None,
      self_mask: Array | None,
      cross_mask: Array | None,
  ) -> Array:
    """Decoder inputs [batch, length] -> logits [batch, length, vocab] (training with
    `config.output_ids`: [batch, length, len(output_ids)], in their order).

    In a decode step (`config.decode` and a cache exists) `decoder_inputs` is [batch, 1],
    the position comes from the cache index and `encoded` and the masks are not needed.
    """
    cfg = self.config
    positions, decode_index = self._step_positions(decoder_inputs, positions)
    y = AddPositions(cfg, name='positions')(self.embed(decoder_inputs), positions)
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    y = nn.with_logical_constraint(y, ('batch', 'length', 'embed'))
    layer = _layer_class(DecoderLayer, cfg)
    for i in range(cfg.num_decoder_layers):
      y = layer(cfg, name=f'layer_{i}')(y, encoded, self_mask, cross_mask, positions, decode_index)
    if cfg.norm_position == 'pre':
      y = layer_norm(cfg, 'final_norm')(y)
    output_layer = OutputLayer(cfg, self.embed, name='output_layer')
    nn.share_scope(self, output_layer)
    return output_layer(y)

  def _step_positions(
      self, decoder_inputs: Array, positions: Array | None
  ) -> tuple[Array | None, Array | None]:
    """(positions, the cache index): in a decode step every row is at the cache index, which
    then moves on; otherwise the positions as given and no index."""
    if not self.config.decode:
      return positions, None
    is_initialized = self.has_variable('cache', 'cache_index')
    index = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
    if not is_initialized:
      return positions, None
    decode_index = index.value
    index.value = decode_index + 1
    return jnp.full(decoder_inputs.shape, decode_index, jnp.int32), decode_index


def _default_positions_and_segments(
    tokens: Array, positions: Array | None, segmentation: Array | None
) -> tuple[Array, Array]:
  """Unpacked rows: positions 0..length-1, segment 1 on real tokens and 0 on padding."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  if segmentation is None:
    segmentation = (tokens != PAD_ID).astype(jnp.int32)
  return positions, segmentation


def _attention_mask(q_segments: Array, kv_segments: Array) -> Array:
  """[batch, 1, q, kv]: both real (segment > 0) and in the same packed segment."""
  same = q_segments[:, :, None] == kv_segments[:, None, :]
  real = (q_segments[:, :, None] > 0) & (kv_segments[:, None, :] > 0)
  return (same & real)[:, None, :, :]


def _lengths(segments: Array) -> Array:
  """[batch] real tokens of each right-padded unpacked row."""
  return (segments > 0).sum(axis=-1, dtype=jnp.int32)


def shift_right(targets: Array, segmentation: Array, start_id: int = BOS_ID) -> Array:
  """Decoder inputs: targets shifted right, with `start_id` at the start of every segment."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=start_id)[:, :-1]
  previous_segment = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(segmentation != previous_segment, start_id, shifted)


class Transformer(nn.Module):
  """The encoder-decoder Transformer.

  Batches follow one convention: `inputs` and `targets` are [batch, length] ids ending with
  EOS and padded with PAD; `*_positions` restart at 0 for every packed segment; and
  `*_segmentation` numbers the packed examples 1, 2, ... with 0 on padding. Positions and
  segmentation may be omitted for unpacked rows.
  """

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      source_embed = target_embed = Embed(cfg, name='shared_embedding')
    else:
      source_embed = Embed(cfg, name='source_embedding')
      target_embed = Embed(cfg, name='target_embedding')
    self.encoder = Encoder(cfg, source_embed)
    self.decoder = Decoder(cfg, target_embed)

  def encode(
      self,
      inputs: Array,
      inputs_positions: Array | None = None,
      inputs_segmentation: Array | None = None,
  ) -> Array:
    """[batch, source_length] ids -> [batch, source_length, d_model]."""
    positions, segments = _default_positions_and_segments(
        inputs, inputs_positions, inputs_segmentation
    )
    if self.config.attention_lengths and not self.config.decode:
      lengths = _lengths(segments)
      return self.encoder(inputs, positions, Lengths(lengths, lengths))
    return self.encoder(inputs, positions, _attention_mask(segments, segments))

  def decode(
      self,
      encoded: Array | None,
      inputs: Array | None,
      targets: Array,
      targets_positions: Array | None = None,
      inputs_segmentation: Array | None = None,
      targets_segmentation: Array | None = None,
  ) -> Array:
    """Logits for `targets` given the encoder output.

    Training and scoring: `targets` [batch, target_length] are the unshifted targets; this
    shifts them right itself. Decode mode (`config.decode`): the first call, with
    `mutable=['cache', 'encoder_cache']`, creates the caches for `targets.shape` (see
    `init_cache`); each later call, a decode step, takes the previous output token
    [batch, 1] as `targets`, passes None for `encoded` and `inputs`, reads 'encoder_cache'
    and updates 'cache' (`mutable=['cache']`).

    Returns:
      [batch, target_length, vocab] logits in the computation dtype (training and scoring
      with `config.output_ids`: `config.output_size` of them, the targets' indices given by
      `config.output_positions()`).
    """
    cfg = self.config
    if cfg.decode:
      if encoded is None:  # A step over an existing cache.
        return self.decoder(targets, None, None, None, None)
      # Cache creation: a key-only source mask, kept by encoder-decoder attention in
      # 'encoder_cache'.
      source_mask = (inputs != PAD_ID)[:, None, None, :]
      positions = jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape)
      causal = nn.make_causal_mask(targets, dtype=jnp.bool_)
      return self.decoder(targets, encoded, positions, causal, source_mask)
    positions, target_segments = _default_positions_and_segments(
        targets, targets_positions, targets_segmentation
    )
    _, source_segments = _default_positions_and_segments(inputs, None, inputs_segmentation)
    decoder_inputs = shift_right(targets, target_segments, cfg.decoder_start_id)
    if cfg.attention_lengths:
      source, target = _lengths(source_segments), _lengths(target_segments)
      return self.decoder(
          decoder_inputs, encoded, positions, Lengths(target, target, True), Lengths(target, source)
      )
    causal = nn.make_causal_mask(targets, dtype=jnp.bool_)
    self_mask = _attention_mask(target_segments, target_segments) & causal
    cross_mask = _attention_mask(target_segments, source_segments)
    return self.decoder(decoder_inputs, encoded, positions, self_mask, cross_mask)

  def init_cache(self, encoded: Array, inputs: Array, max_decode_length: int) -> Array:
    """Creates the decode caches (call on a decode-mode model with
    `mutable=['cache', 'encoder_cache']`).

    Two variable collections, every leaf but the scalar `cache_index` batch-major:

      * 'cache', what a decode step changes: each decoder layer's self-attention
        `cached_key` and `cached_value` [batch, heads, max_decode_length, head_dim], with
        room for `max_decode_length` tokens, and the scalar `cache_index` (int32 [], shared
        by all rows). Steps take it with `mutable=['cache']`; beam search reorders its rows.
      * 'encoder_cache', what no step changes: each layer's encoder-decoder attention
        `cached_key` and `cached_value` [batch, heads, source_length, head_dim], `encoded`
        projected here, once, and `cached_mask` [batch, 1, 1, source_length], the source's
        padding mask. Steps only read it, and all beams of a sentence share it.

    Under `jax.jit` the returned logits are unused and the pass that produces them is
    compiled away.
    """
    dummy = jnp.zeros((inputs.shape[0], max_decode_length), jnp.int32)
    return self.decode(encoded, inputs, dummy)

  def __call__(
      self,
      inputs: Array,
      targets: Array,
      inputs_positions: Array | None = None,
      targets_positions: Array | None = None,
      inputs_segmentation: Array | None = None,
      targets_segmentation: Array | None = None,
  ) -> Array:
    """Training-time forward pass: [batch, target_length, config.output_size] logits."""
    encoded = self.encode(inputs, inputs_positions, inputs_segmentation)
    return self.decode(
        encoded, inputs, targets, targets_positions, inputs_segmentation, targets_segmentation
    )

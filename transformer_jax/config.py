"""Configuration: every field, its allowed values, its checks, and the frozen model config.

Every config file in `configs/` starts from `base_config()` and overrides fields. This module
owns what is known about the fields: their defaults (`base_config`), the allowed values of
each choice (the tuples below), which fields a resumed run may change (`RESUMABLE_FIELDS`),
what a checkpoint written before a field existed means by its absence (`LEGACY_VALUES`,
applied by `from_saved`), and `validate(config)`, the check of those fields that every command
runs (through `config_checks.validate_run`, with the optimizer's and decoding's) before anything
compiles. It imports nothing of the package but `errors`. The `ConfigDict` is turned into a
`TransformerConfig` once, at the boundary (`TransformerConfig.from_config`); modules only ever
see the frozen dataclass. Other modes
(decoding, a different dtype) derive with `dataclasses.replace`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections

from transformer_jax.errors import ConfigError  # Re-exported.

# Fixed special ids, shared by the tokenizer, the input pipeline, the model and the decoder.
# Padding has its own id and never doubles as <unk> (the Flax WMT example's mistake).
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

POSITIONAL_ENCODINGS = ('sinusoidal', 'learned', 'rope', 'alibi')
# How sinusoidal positions lay out their sines and cosines: alternating, as the paper writes
# PE(pos, 2i) and PE(pos, 2i+1), or [all sines | all cosines] (tensor2tensor, Marian).
SINUSOID_LAYOUTS = ('interleaved', 'concatenated')
NORM_POSITIONS = ('post', 'pre')
# How layer norms take their statistics: mean and mean square in one pass over the input
# (variance = E[x^2] - E[x]^2, in float32), or the mean first, then the squared deviations.
LAYER_NORM_STATISTICS = ('one_pass', 'two_pass')
LOGITS_SUMS = ('', 'linear', 'reduce')  # '': automatic (`TransformerConfig.from_config`).
POST_NORM_KERNELS = ('xla', 'pallas')
QKV_PROJECTIONS = ('', 'separate', 'stacked')  # '': automatic (`TransformerConfig.from_config`).
# The feed-forward nonlinearity: the paper's ReLU, or Marian's others ('swish' is
# x * sigmoid(x); 'gelu' is the exact, erf-based one).
ACTIVATIONS = ('relu', 'swish', 'gelu')
# What the output layer scores: every piece of the vocabulary (the paper), or the pieces on the
# target side of the training split plus EOS and UNK (`TransformerConfig.output_ids`).
OUTPUT_VOCABULARIES = ('all', 'target')
# The decoder's first input, by the id fed: BOS (this project); PAD, with its learned embedding
# (Hugging Face's MarianMTModel); or a zero vector (Marian itself, CTranslate2, tensor2tensor),
# fed as PAD with <pad>'s embedding row held at zero.
DECODER_STARTS = {'bos': BOS_ID, 'pad': PAD_ID, 'zero': PAD_ID}
# Computation dtypes. 'auto': bfloat16 on GPU and TPU, float32 on CPU (where bfloat16 is
# emulated and slower). float16 is refused: without loss scaling its 5-bit exponent
# underflows small gradients to zero.
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
DTYPE_CHOICES = ('auto',) + tuple(DTYPES)
ACCELERATOR_PLATFORMS = ('gpu', 'cuda', 'rocm', 'tpu')
REMAT_POLICIES = ('none', 'full', 'dots', 'dots_with_no_batch_dims')
# '': automatic (`kernel_choice`); 'xla' and 'cudnn' go to `jax.nn.dot_product_attention`,
# 'explicit' forms the softmax weights in the model's own code.
ATTENTION_IMPLEMENTATIONS = ('', 'xla', 'cudnn', 'explicit')
NONFINITE_MODES = ('skip', 'stop')
DROPOUT_RNG_IMPLS = ('rbg', 'unsafe_rbg', 'threefry2x32')
LENGTH_PENALTY_FORMS = ('gnmt', 'power')
# Validation metrics the best checkpoints can be kept by, and whether higher is better.
BEST_CHECKPOINT_METRICS = {'bleu': True, 'chrf': True, 'loss': False, '': True}
VOCAB_MODEL_TYPES = ('bpe', 'unigram')

# Config fields a resumed run may change: they do not alter the math of the steps or the
# data stream (the schedule of logging and saving, the device layout, the computation dtype
# and how layer norms take their statistics, where files live, how to decode). Any other
# difference stops the resume.
# ('shuffle_buffer' is a removed field that older checkpoints still hold.)
RESUMABLE_FIELDS = frozenset(
    {
        'num_train_steps',
        'log_every_steps',
        'eval_every_steps',
        'eval_batches',
        'checkpoint_every_steps',
        'keep_checkpoints',
        'keep_checkpoint_period',
        'mesh',
        'logical_axis_rules',
        'grad_accum_steps',
        'remat_policy',
        'dtype',
        'layer_norm_statistics',
        'logits_sum',
        'post_norm_kernel',
        'qkv_projection',
        'attention_implementation',
        'nonfinite',
        'max_skipped_steps_in_a_row',
        'tfds_data_dir',
        'text_files',
        'vocab_path',
        'data_threads',
        'prepare_workers',
        'prefetch_batches',
        'shuffle_buffer',
        'beam_size',
        'length_penalty',
        'length_penalty_form',
        'no_repeat_ngram_size',
        'no_adjacent_repeat_size',
        'max_decode_extra_length',
        'decode_batch_size',
        'checkpoints_to_average',
        'eval_bleu_sentences',
        'best_checkpoint_metric',
        'keep_best_checkpoints',
        'ema_for_evaluation',
        'early_stopping_patience',
        'init_from',
        'init_from_step',
        'init_from_map_vocab',
        'profile_steps',
    }
)

# Fields added after checkpoints were already being written, with the value that reproduces
# what a run did before the field existed. A saved config without the field means this value
# (`from_saved`), so an older run resumes when the config asks for the old behaviour.
LEGACY_VALUES = {
    'dropout_rng_impl': 'threefry2x32',
    'ema_decay': 0.0,
    'lr_cooldown_steps': 0,
    'lr_schedule': 'rsqrt',
}


def base_config() -> ml_collections.ConfigDict:
  """Defaults for every field: the paper's base model on WMT14 En-De.

  Returns:
    An unlocked `ConfigDict`; config files override fields and return it.
  """
  c = ml_collections.ConfigDict()

  # --- Model (the paper's base model, Table 3). ---
  c.vocab_size = 0  # 0: take the size of the SentencePiece model (data.vocab_size).
  c.d_model = 512  # Width of the embeddings and of every layer's output.
  c.num_heads = 8  # Attention heads a layer (each d_model / num_heads wide).
  c.d_ff = 2048  # Inner width of the position-wise feed-forward block.
  c.num_encoder_layers = 6  # Encoder layers (N).
  c.num_decoder_layers = 6  # Decoder layers (N).
  c.dropout_rate = 0.1  # On every sub-layer output and on embeddings + positions.
  c.attention_dropout_rate = 0.0  # On attention weights; the paper has none.
  c.label_smoothing = 0.1  # eps_ls: the target mass spread evenly over the vocabulary.
  c.norm_position = 'post'  # 'post' (paper) | 'pre' (adds a final norm to each stack).
  c.layer_norm_epsilon = 1e-6  # Added to the variance in every layer norm.
  # 'one_pass' | 'two_pass' (LAYER_NORM_STATISTICS): the same to float32 rounding; one pass
  # makes one pass over the activations fewer, and the main job's step faster on CPU
  # (bench/RESULTS.md, section "CPU training: the main job's size and base").
  c.layer_norm_statistics = 'one_pass'
  # '' | 'linear' | 'reduce' (LOGITS_SUMS): how label smoothing gets each token's sum of
  # logits over the vocabulary: the decoder output times the output projection's column
  # sums (no pass over the logits), or a reduction over them; the same to rounding. '':
  # 'linear' on GPUs (one pass over the logits fewer), 'reduce' elsewhere (XLA:TPU fuses the
  # sum with another; on CPU no difference measured; bench/RESULTS.md, section "Compile-only: the
  # training step's kernels on 1xH100 and v5e-1").
  c.logits_sum = ''
  # 'xla' | 'pallas' (POST_NORM_KERNELS): a post-norm sub-layer's LayerNorm(x + Dropout(y))
  # as XLA's kernels, or as one Pallas kernel each way (`fused_norm`: Triton on GPUs, an
  # interpreter on CPU, for tests; not on TPUs). The same to rounding and the same dropout
  # masks; 'pallas' needs norm_position='post' and a power-of-two d_model. Off by default: on
  # a GPU it made base's step faster and big's slower (bench/RESULTS.md, section "one change at a
  # time").
  c.post_norm_kernel = 'xla'
  # '' | 'separate' | 'stacked' (QKV_PROJECTIONS): attention's query, key and value
  # projections (encoder-decoder attention: key and value) as a matmul each, or as one over
  # the kernels stacked at use (the parameters do not change); the same to rounding. '':
  # 'stacked' on GPUs (the backward's products merge into fewer kernels), 'separate'
  # elsewhere (XLA:TPU's step moves more bytes stacked; on CPU no difference measured;
  # bench/RESULTS.md, section "Compile-only: a Pallas post-norm kernel, stacked q/k/v and a packed
  # optimizer").
  c.qkv_projection = ''
  c.share_embeddings = True  # One matrix for source and target embeddings.
  c.tie_output_embedding = True  # Pre-softmax projection = the target embedding.
  c.positional_encoding = 'sinusoidal'  # 'sinusoidal' | 'learned' | 'rope' | 'alibi'.
  c.sinusoid_layout = 'interleaved'  # 'interleaved' (paper) | 'concatenated' (Marian).
  c.activation = 'relu'  # Feed-forward nonlinearity: 'relu' (paper) | 'swish' | 'gelu'.
  c.logits_bias = False  # A learned bias on the output logits (Marian's final_logits_bias).
  # 'all' | 'target' (OUTPUT_VOCABULARIES): the output layer scores every piece (the paper),
  # or only the pieces that occur on the target side of the training split, plus EOS and UNK
  # (a shortlist found once from the token ids and saved with each checkpoint; a reference
  # piece outside it counts as UNK in validation). With one vocabulary for two languages the
  # other language's pieces cost output-layer time and are never right: the Bible corpus's
  # Spanish side uses 5,312 of its 8,000 pieces. The parameters are the same either way.
  c.output_vocabulary = 'all'
  # The decoder's first input: 'bos' | 'pad' (<pad>'s embedding, as MarianMTModel) | 'zero' (a
  # zero vector, as Marian, CTranslate2 and tensor2tensor: <pad>'s embedding held at zero).
  c.decoder_start = 'bos'
  c.max_len = 256  # Longest sequence (in tokens) the position tables cover.
  # Computation dtype: 'auto' (bfloat16 on GPU/TPU, float32 on CPU) | 'bfloat16' | 'float32'.
  # Parameters, optimizer state, softmax and loss stay float32.
  c.dtype = 'auto'
  # '' (automatic: cuDNN's fused kernel on GPU where it can serve, the explicit softmax on
  # CPU, else XLA) | 'xla' | 'cudnn' | 'explicit'.
  c.attention_implementation = ''
  c.remat_policy = 'none'  # 'none' | 'full' | 'dots' | 'dots_with_no_batch_dims'.

  # --- Data. ---
  c.dataset = 'wmt14_translate/de-en'  # A TFDS name, 'bible_en_es', or 'text'.
  c.source_lang = 'en'  # The dataset's field (language) translated from.
  c.target_lang = 'de'  # The dataset's field (language) translated into.
  # Several directions in one model, each 'SRC-TGT' (over `dataset`) or 'DATASET:SRC-TGT',
  # e.g. ('en-es', 'es-en'); () translates source_lang -> target_lang (docs/data.md).
  c.directions = ()
  # How the model is told the target language: 'source' starts every source with '<2xx>', a
  # reserved piece per target language (Johnson et al. 2017); '' adds none (one target only).
  c.language_tag = ''
  # More training corpora (docs/data.md): directories written by translate_corpus.py
  # (back-translation, distillation) or 'SRC-TGT:SOURCE_FILE,TARGET_FILE' plain text files;
  # each translates one of the run's directions.
  c.extra_corpora = ()
  # False: train on extra_corpora alone (the directions' validation and test splits still
  # score the run), e.g. a student on its teacher's translations.
  c.train_on_directions = True
  # '<BT>' starts the source of every back-translated example (tagged back-translation,
  # Caswell et al. 2019), and the vocabulary keeps it as one piece.
  c.back_translation_tag = False
  # Each training source's share of the examples drawn: one positive number a source, the
  # directions' training splits, then extra_corpora, in order; normalized. (): by
  # size^(1 / sampling_temperature).
  c.corpus_weights = ()
  # Without corpus_weights: p ~ size^(1/T) over the sources (1: by their sizes, as their
  # concatenation; larger flattens toward uniform, as multilingual systems upsample).
  c.sampling_temperature = 1.0
  c.tfds_data_dir = ''  # '' uses TFDS's default (~/tensorflow_datasets or $TFDS_DATA_DIR).
  c.train_split = 'train'  # The split trained on (and the vocabulary's sample).
  c.eval_split = 'validation'  # newstest2013 for wmt14_translate.
  c.test_split = 'test'  # newstest2014 for wmt14_translate.
  # For dataset='text': one 'SOURCE_FILE,TARGET_FILE' pair per split, one sentence a line.
  c.text_files = ml_collections.ConfigDict({'train': '', 'validation': '', 'test': ''})
  c.vocab_size_target = 37000  # SentencePiece vocabulary size (shared source/target).
  c.vocab_model_type = 'bpe'  # SentencePiece model type: 'bpe' | 'unigram'.
  c.vocab_path = ''  # '' trains (once) and caches the model in the work directory.
  c.vocab_train_sentences = 2_000_000  # Sentences sampled to train the vocabulary.
  c.max_source_length = 256  # Training drops longer examples (and says how many).
  c.max_target_length = 256  # As max_source_length, for the target side.
  c.tokens_per_batch = 25000  # Token slots a side (source; target alike) a step, all devices.
  # Row lengths of the training batches (one compiled step shape each; max_source_length and
  # max_target_length close the list).
  c.bucket_boundaries = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
  c.packing = False  # Pack several examples per row instead of length buckets.
  c.data_seed = 0  # Seeds the batch order and the vocabulary's sample of sentences.
  c.data_threads = 2  # grain threads that cut bucketed training batches from the token ids.
  # Processes that tokenize a split the first time it is used (0: one per CPU core).
  c.prepare_workers = 0
  # Batches built and copied to the devices ahead of the step that takes them.
  c.prefetch_batches = 2

  # --- Training. ---
  c.seed = 0  # Seeds the initial parameters and the dropout masks.
  # PRNG of the dropout masks. 'rbg' (XLA's RngBitGenerator; keys still derived by
  # threefry) made a CPU step with dropout faster than 'threefry2x32', whose bits are
  # computed as ordinary XLA ops (bench/RESULTS.md, section "The main job: every measured
  # run"). JAX promises 'rbg' bits neither across backends nor across meshes (the tests' CPU
  # meshes agree); 'threefry2x32' promises both.
  c.dropout_rng_impl = 'rbg'
  c.num_train_steps = 100_000  # Optimizer steps of the run (may change on resume).
  c.warmup_steps = 4000  # Steps of linear warmup of the learning rate.
  c.learning_rate_scale = 1.0  # Multiplies d_model^-0.5 * min(step^-0.5, step*warmup^-1.5).
  # After the warmup: 'rsqrt' (the paper) | 'constant' (hold the peak; with a cooldown, the
  # warmup-stable-decay schedule).
  c.lr_schedule = 'rsqrt'
  c.lr_cooldown_steps = 0  # Linear fall to ~0 over the run's last N steps (0: the paper).
  c.adam_b1 = 0.9  # Adam's beta1.
  c.adam_b2 = 0.98  # Adam's beta2.
  c.adam_eps = 1e-9  # Adam's epsilon.
  c.weight_decay = 0.0  # Decoupled weight decay (AdamW); 0: plain Adam, the paper.
  c.grad_clip_norm = 0.0  # 0: no clipping.
  c.grad_accum_steps = 1  # Microbatches a step; the token budget is split among them.
  c.nonfinite = 'skip'  # What a non-finite loss/gradient does: 'skip' the update | 'stop'.
  # With 'skip': a run whose updates are skipped this many steps in a row has diverged, and
  # stops with an error (checked at each log line; 0: never).
  c.max_skipped_steps_in_a_row = 20
  # Keep an exponential moving average of the parameters besides them (float32, sharded as
  # they are, in the checkpoint): after each applied update ema = decay * ema + (1 - decay) *
  # params, starting from the initial parameters. Validation (and so the best checkpoints)
  # then uses the average. 0: none; in [0, 1), e.g. 0.999.
  c.ema_decay = 0.0
  # With ema_decay: evaluate.py, translate.py, checkpoint averaging and init_from read the
  # average instead of the trained parameters from this run's checkpoints.
  c.ema_for_evaluation = False
  c.log_every_steps = 100  # Steps between training log lines and metrics rows.
  # 'A:B' traces steps A+1 to B (counted from step 0) with jax.profiler into
  # <workdir>/profile, for TensorBoard's profile tab or Perfetto; '' traces nothing.
  c.profile_steps = ''
  c.eval_every_steps = 1000  # Steps between validation evaluations (0: none).
  c.eval_batches = 0  # 0: the whole validation split.
  c.checkpoint_every_steps = 1000  # Steps between checkpoints (asynchronous saves).
  c.keep_checkpoints = 5  # The latest checkpoints kept (0: all).
  c.keep_checkpoint_period = 0  # Also keep every M-th step forever (0: none).
  # At every evaluation, translate the first N validation sentences with the decoding
  # options below and log sacreBLEU and chrF (0: loss and perplexity only).
  c.eval_bleu_sentences = 512
  # Keep the `keep_best_checkpoints` best checkpoints by this validation metric besides the
  # latest ones: 'bleu' | 'chrf' | 'loss' | '' (none). Each evaluation saves a checkpoint;
  # `evaluate.py --step=best` picks the best.
  c.best_checkpoint_metric = 'bleu'
  c.keep_best_checkpoints = 1  # How many best checkpoints (best_checkpoint_metric) to keep.
  # Stop the run after this many validations in a row that do not improve on the best
  # best_checkpoint_metric (0: never); a rerun of a stopped run trains no further.
  c.early_stopping_patience = 0
  # Fine-tuning: start from the parameters of another run's checkpoint (its work directory,
  # or one written by average_checkpoints.py) instead of random ones. The optimizer state,
  # the schedule and the data order start afresh; the vocabulary is the checkpoint's. The
  # model's shape fields must match it. '' starts from random parameters.
  c.init_from = ''
  c.init_from_step = ''  # '' the latest checkpoint, a step number, or 'best'.
  # Fine-tune with this run's own vocabulary (vocab_path, or one trained on its data): pieces
  # the checkpoint's vocabulary also has keep their embeddings, the others start random.
  c.init_from_map_vocab = False
  # Devices along each mesh axis: 'data' (replicated parameters), 'fsdp' (parameters and Adam
  # state split, ZeRO-3), 'tensor' (heads, feed-forward width, vocabulary split); -1 takes
  # the remaining devices.
  c.mesh = ml_collections.ConfigDict({'data': -1, 'fsdp': 1, 'tensor': 1})
  # The model's axis names, each mapped onto mesh axes (None: not split).
  c.logical_axis_rules = (
      ('batch', ('data', 'fsdp')),
      ('length', None),
      ('embed', 'fsdp'),
      ('mlp', 'tensor'),
      ('heads', 'tensor'),
      ('kv', None),
      ('vocab', 'tensor'),
  )

  # --- Decoding and evaluation. ---
  c.beam_size = 4  # Beam width of the search (1: greedy).
  c.length_penalty = 0.6  # alpha.
  c.length_penalty_form = 'gnmt'  # 'gnmt': ((5+|Y|)/6)^alpha | 'power': |Y|^alpha.
  # n > 0: no output repeats an n-gram of its own tokens (fairseq's and Hugging Face's
  # no_repeat_ngram_size; searches leave out the tokens that would); 0: off, the paper.
  c.no_repeat_ngram_size = 0
  # n > 0: no output says a span of up to n tokens twice in a row (a piece doubled inside a
  # word, `te te te`; a phrase back to back, `con Dios con Dios`; the search leaves out the
  # token that would complete one); 0: off, the paper. Repeats apart stay allowed.
  c.no_adjacent_repeat_size = 0
  # Each sentence's output limit = its source length (tokens, EOS included) + this; with
  # learned positions at most max_len (decoding warns about the sentences it cuts).
  c.max_decode_extra_length = 50
  c.decode_batch_size = 32  # Sentences translated together.
  c.checkpoints_to_average = 5  # The paper averages 5 (base) or 20 (big).
  return c


def profile_range(config: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """`profile_steps` as (A, B): trace from after step A to after step B; None for ''."""
  text = config.profile_steps
  if text == '':
    return None
  parts = text.split(':') if isinstance(text, str) else []
  _require(
      len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) < int(parts[1]),
      f"profile_steps={text!r} must be 'A:B' with whole numbers A < B (steps A+1 to B are "
      "traced, e.g. '10:15'), or '' for none.",
  )
  return int(parts[0]), int(parts[1])


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def _int_at_least(config: ml_collections.ConfigDict, name: str, low: int, hint: str) -> None:
  value = config[name]
  _require(
      isinstance(value, int) and not isinstance(value, bool) and value >= low,
      f'{name}={value!r} must be an int >= {low}{hint}; set --config.{name}.',
  )


def validate(
    config: ml_collections.ConfigDict, *, vocab_size: int | None = None, training: bool = False
) -> None:
  """Checks the fields this module owns (all but the optimizer's and decoding's, which their
  dataclasses check: `config_checks.validate_run` runs all); cheap, run before compiling.

  Args:
    config: a run config (see `base_config`).
    vocab_size: the tokenizer's size, when known; otherwise `vocab_size_target` stands in.
    training: also refuse what would train but not as asked (a batch budget below one
      row, positions shorter than the training lengths); a saved run's config, loaded to
      translate, is not refused for those.

  Raises:
    ConfigError: the first field that cannot work, with what to set instead.
  """
  for name in (
      'num_train_steps',
      'log_every_steps',
      'checkpoint_every_steps',
      'grad_accum_steps',
      'tokens_per_batch',
      'max_source_length',
      'max_target_length',
      'decode_batch_size',
      'checkpoints_to_average',
      'data_threads',
  ):
    _int_at_least(config, name, 1, '')
  for name in (
      'eval_every_steps',
      'eval_batches',
      'keep_checkpoints',
      'keep_checkpoint_period',
      'max_skipped_steps_in_a_row',
      'prepare_workers',
      'prefetch_batches',
  ):
    _int_at_least(config, name, 0, ' (0 turns it off)')
  _int_at_least(config, 'eval_bleu_sentences', 0, ' (0 turns it off)')
  _int_at_least(config, 'keep_best_checkpoints', 1, '')
  metric = config.best_checkpoint_metric
  _require(
      metric in BEST_CHECKPOINT_METRICS,
      f'best_checkpoint_metric={metric!r} must be one of '
      f"{tuple(BEST_CHECKPOINT_METRICS)} ('' keeps no best checkpoint).",
  )
  _require(
      metric not in ('bleu', 'chrf') or config.eval_bleu_sentences > 0,
      f'best_checkpoint_metric={metric!r} needs validation translations, but '
      'eval_bleu_sentences=0; set --config.eval_bleu_sentences (e.g. 512), or '
      "--config.best_checkpoint_metric=loss (or '' for none).",
  )
  decay = config.ema_decay
  _require(
      isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0.0 <= decay < 1.0,
      f'ema_decay={decay!r} must be in [0, 1) (0 keeps no average; e.g. 0.999); set '
      '--config.ema_decay.',
  )
  _require(
      isinstance(config.ema_for_evaluation, bool) and (not config.ema_for_evaluation or decay),
      f'ema_for_evaluation={config.ema_for_evaluation!r} must be a bool, and True only with '
      '--config.ema_decay > 0 (the average it would evaluate).',
  )
  _int_at_least(config, 'early_stopping_patience', 0, ' (0 turns it off)')
  _require(
      not config.early_stopping_patience or (config.eval_every_steps and metric),
      f'early_stopping_patience={config.early_stopping_patience} counts validations without '
      f'an improvement of best_checkpoint_metric, but eval_every_steps='
      f'{config.eval_every_steps} and best_checkpoint_metric={metric!r}; set '
      '--config.eval_every_steps and --config.best_checkpoint_metric (e.g. loss), or '
      '--config.early_stopping_patience=0.',
  )
  profile_range(config)
  step = config.init_from_step
  _require(
      isinstance(step, str) and (step in ('', 'best') or step.isdigit()),
      f"init_from_step={step!r} must be '' (the latest), a step number or 'best'.",
  )
  _require(
      not step or config.init_from,
      f'init_from_step={step!r} needs --config.init_from, the work directory to start from.',
  )
  _require(
      isinstance(config.init_from_map_vocab, bool)
      and (not config.init_from_map_vocab or config.init_from),
      f'init_from_map_vocab={config.init_from_map_vocab!r} must be a bool, and True '
      'only with --config.init_from.',
  )
  _int_at_least(
      config, 'vocab_size_target', 8, ' (4 ids are taken by pad, bos, eos, unk; the paper: 37000)'
  )
  _require(
      config.output_vocabulary in OUTPUT_VOCABULARIES,
      f'output_vocabulary={config.output_vocabulary!r} must be one of {OUTPUT_VOCABULARIES}.',
  )
  _require(
      config.vocab_model_type in VOCAB_MODEL_TYPES,
      f'vocab_model_type={config.vocab_model_type!r} must be one of {VOCAB_MODEL_TYPES}.',
  )
  _require(
      config.nonfinite in NONFINITE_MODES,
      f'nonfinite={config.nonfinite!r} must be one of {NONFINITE_MODES}: '
      "'skip' drops the update and counts it, 'stop' ends the run.",
  )
  _require(
      config.dropout_rng_impl in DROPOUT_RNG_IMPLS,
      f'dropout_rng_impl={config.dropout_rng_impl!r} must be one of {DROPOUT_RNG_IMPLS}; '
      "'rbg' is fast, 'threefry2x32' the same on every mesh.",
  )
  _require(
      isinstance(config.label_smoothing, (int, float)) and 0.0 <= config.label_smoothing < 1.0,
      f'label_smoothing={config.label_smoothing!r} must be in [0, 1) (the paper: 0.1).',
  )
  _require(
      config.attention_implementation in ATTENTION_IMPLEMENTATIONS,
      f'attention_implementation={config.attention_implementation!r} must be one of '
      f"{ATTENTION_IMPLEMENTATIONS} ('' chooses by platform).",
  )
  boundaries = tuple(config.bucket_boundaries)
  _require(
      all(isinstance(b, int) and b > 0 for b in boundaries)
      and list(boundaries) == sorted(set(boundaries)),
      f'bucket_boundaries={boundaries!r} must be positive ints in increasing order, '
      'e.g. (8, 16, 32, 64, 128, 256).',
  )
  longest = max(config.max_source_length, config.max_target_length)
  if config.positional_encoding == 'learned':
    _require(
        config.max_len >= longest,
        f'max_len={config.max_len} is shorter than max_source_length='
        f'{config.max_source_length}/max_target_length={config.max_target_length}, but '
        'learned positions have no embedding past max_len (every step would be NaN); '
        f'set --config.max_len={longest} or lower the lengths.',
    )
  if training:
    _require(
        config.max_len >= longest,
        f'max_len={config.max_len} is shorter than max_source_length='
        f'{config.max_source_length}/max_target_length={config.max_target_length}: the '
        'model would train on sentences up to that length, and then translate (validation '
        'BLEU, evaluate.py, translate.py) only the first max_len tokens of each source; '
        f'set --config.max_len={longest} or lower the lengths to {config.max_len}.',
    )
    _require(
        config.tokens_per_batch >= longest,
        f'tokens_per_batch={config.tokens_per_batch} is less than one row of the longest '
        f'training sentences ({longest} tokens: max_source_length/max_target_length); '
        'a batch always holds at least one row a data shard, so batches of long '
        f'sentences would be up to {longest / config.tokens_per_batch:.0f}x the budget. '
        f'Set --config.tokens_per_batch to at least {longest} (the paper: 25000), or '
        'lower the lengths.',
    )


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
  merged = dict(base)
  for key, value in update.items():
    if isinstance(value, dict) and isinstance(merged.get(key), dict) and value:
      merged[key] = _merged(merged[key], value)
    else:
      merged[key] = value
  return merged


def from_saved(saved: dict[str, Any]) -> ml_collections.ConfigDict:
  """The locked run config of a checkpoint's `meta['config']`, with every field.

  Fields the checkpoint predates take their `LEGACY_VALUES` (the behaviour it was trained
  with) or, if none is listed, today's default; fields that no longer exist are kept.
  """
  defaults = _merged(base_config().to_dict(), LEGACY_VALUES)
  config = ml_collections.ConfigDict(_merged(defaults, saved))
  config.lock()
  return config

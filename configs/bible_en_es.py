"""English -> Spanish on the offline Bible corpus (KJV / Reina-Valera 1909), small model.

The README's main job (`bash scripts/main_job.sh`) trains this config, on text that needs no
download; docs/main_job.md has its result, its curve and how it was tuned.

  bash scripts/setup_bible.sh   # once: installs the SWORD modules if they are missing
  python train.py --config=configs/bible_en_es.py --workdir=/tmp/bible_en_es

The first run builds the TFDS dataset (seconds) and an 8,000-piece shared BPE vocabulary
(under a minute) and caches both. Spanish -> English: add
`--config.source_lang=es --config.target_lang=en`.
"""

import ml_collections

from transformer_jax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()

  c.dataset = 'bible_en_es'
  c.source_lang = 'en'
  c.target_lang = 'es'
  c.vocab_size_target = 8000
  c.vocab_model_type = 'bpe'
  # Verses are 30-40 tokens on average; 128 keeps all but a handful.
  c.max_source_length = 128
  c.max_target_length = 128
  # With packed rows these shape only validation and decoding, where each bucket is one
  # more program to compile (about 4.5 s for a beam search on 2 cores): two buckets evaluate
  # the test books in 39 s instead of 60, validation costs the same, the output is identical.
  c.bucket_boundaries = (48, 128)
  # Several examples a row: 8% padding instead of 20% with buckets, one compiled shape.
  c.packing = True
  # Small batches, many updates: on a 2-core CPU the run is compute-bound, and more updates
  # of fewer tokens learn faster per minute than the paper's 25,000-token steps.
  c.tokens_per_batch = 1024

  # A small pre-norm model with rotary positions and without dropout, many small updates, the
  # peak rate held until a linear cooldown: what docs/main_job.md's tuning settled for 2 CPU
  # cores.
  c.d_model = 128
  c.num_heads = 4
  c.d_ff = 512
  c.num_encoder_layers = 2
  c.num_decoder_layers = 2
  c.norm_position = 'pre'
  # Rotary positions in self-attention (relative) instead of the paper's sinusoids added to the
  # embeddings: validation perplexity 12.69 against 15.66 after the same 3,050 steps, test
  # sacreBLEU 25.05 against 22.30, for about 1% of the step.
  c.positional_encoding = 'rope'
  # The output layer scores only the 5,312 pieces of the Spanish side (and EOS, UNK) of the
  # 8,000 the two languages share: the same test sacreBLEU (24.06 against 24.03 on a Zen 3),
  # the step 1.15x faster alone and train.py 1.07x (the input pipeline shares the two cores;
  # bench/RESULTS.md).
  c.output_vocabulary = 'target'
  c.dropout_rate = 0.0
  c.max_len = 256
  c.warmup_steps = 300
  c.learning_rate_scale = 0.7  # Peak 0.0036 at step 300,
  c.lr_schedule = 'constant'  # held until the cooldown.
  # 2,500 steps: the whole job in 9m14s-10m24s on a 2-core Zen 3, over ten minutes only in
  # its slowest hours (2,750 gave 0.7 more test sacreBLEU in 10m45s-11m; docs/main_job.md).
  c.num_train_steps = 2500
  c.lr_cooldown_steps = 750  # The last 30%.

  c.log_every_steps = 25
  # Validation loss and perplexity halfway and at the end: each later one and its save cost
  # about 2.7 s of training on 2 cores (the first also compiles its step), so validating
  # every 500 steps took 8-9 s more.
  c.eval_every_steps = 1250
  # No validation translations: they cost as much as 700 steps (compiling the beam search,
  # then about 15 s each on 2 cores), and evaluate.py translates the test books right after
  # training. The last checkpoint, at the end of the cooldown, is the best by loss.
  c.eval_bleu_sentences = 0
  c.best_checkpoint_metric = 'loss'
  # A checkpoint at each validation, both kept: each save costs about 0.7 s of training on 2
  # cores. Ctrl-C and SIGTERM save one wherever the run is.
  c.checkpoint_every_steps = 1250
  c.keep_checkpoints = 5
  c.decode_batch_size = 64
  # No span of up to 8 tokens said twice in a row (`te te te`, `con Dios con Dios`): about
  # one test translation in eight did, the references never; validation sacreBLEU 26.39
  # against 26.06 without it (docs/evaluating.md).
  c.no_adjacent_repeat_size = 8
  return c

"""Input pipeline: tokenizing once, cutting batches, and how long training waits for them.

  python -m bench.input_pipeline                               # about 2 minutes
  python -m bench.input_pipeline --prepare_pairs=4500000       # WMT14 En-De's size too

On the offline Bible corpus (configs/bible_en_es.py; needs scripts/setup_bible.sh), with its
config's batch (2,048 token slots a side, rows up to 128 tokens) and the paper's (25,000, up
to 256):

  * preparation: pairs/s tokenizing the training split into the token store with one
    process, and with --prepare_pairs, pairs/s over a corpus of that many pairs made by
    repeating the Bible (text files) with --workers processes, and per process;
  * batching: real (non-padding) source + target tokens/s that one thread cuts from the
    prepared ids, bucketed and packed, over --epochs epochs, with their padding shares;
  * training: the share of step time the loop waited for data in a short run of a small
    model (d_model 64) on 2,048-token packed batches, with prefetch and without.

Prints one line per measure and writes them as JSON with --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from configs import bible_en_es as bible_config
from transformer_jax.data import batching
from transformer_jax.data import data_sources
from transformer_jax.data import token_store
from transformer_jax.data import vocab_cache
from transformer_jax.storage.layout import RunLayout


def _epoch_rate(data: batching.TrainData, epochs: int, packed: bool) -> dict[str, float]:
  """Real tokens/s of one thread cutting `epochs` epochs, and the padding shares."""
  iterator = iter(data.dataset)
  real = np.zeros(2)
  slots = batches = 0
  start = time.perf_counter()
  if packed:  # Until the epoch counter has moved `epochs` times.
    while iterator.get_state()['epoch'] < epochs:
      batch = next(iterator)
      real += [(batch['inputs_segmentation'] > 0).sum(), (batch['targets_segmentation'] > 0).sum()]
      slots += batch['inputs'].size
      batches += 1
  else:  # grain with data_threads=1: one thread cuts the batches.
    for _ in range(epochs * data.steps_per_epoch):
      batch = next(iterator)
      real += [(batch['inputs_segmentation'] > 0).sum(), (batch['targets_segmentation'] > 0).sum()]
      slots += batch['inputs'].size
      batches += 1
  seconds = time.perf_counter() - start
  return {
      'batches': batches,
      'seconds': round(seconds, 3),
      'real_tokens_per_s': real.sum() / seconds,
      'source_non_padding': real[0] / slots,
      'target_non_padding': real[1] / slots,
  }


def _repeated_corpus(
    pairs: data_sources.ParallelText, count: int, directory: str
) -> tuple[str, str]:
  """Text files of `count` pairs: the Bible's pairs over and over."""
  os.makedirs(directory, exist_ok=True)
  paths = (os.path.join(directory, f'{count}.src'), os.path.join(directory, f'{count}.tgt'))
  if all(os.path.exists(p) for p in paths):
    return paths
  lines = [pairs[i] for i in range(len(pairs))]
  sources = ''.join(s.replace('\n', ' ') + '\n' for s, _ in lines).encode()
  targets = ''.join(t.replace('\n', ' ') + '\n' for _, t in lines).encode()
  whole, rest = divmod(count, len(lines))
  for path, text, rows in (
      (paths[0], sources, [s for s, _ in lines]),
      (paths[1], targets, [t for _, t in lines]),
  ):
    with open(path + '.tmp', 'wb') as f:
      for _ in range(whole):
        f.write(text)
      f.write(''.join(r.replace('\n', ' ') + '\n' for r in rows[:rest]).encode())
    os.replace(path + '.tmp', path)
  return paths


def _train_wait(workdir: str, prefetch: int, steps: int) -> dict[str, float]:
  """data_wait_share and tokens/s of a short run (the logged intervals after compiling)."""
  from transformer_jax.training import train_loop

  config = bible_config.get_config()
  config.tfds_data_dir = os.path.join(workdir, 'tfds')
  config.vocab_path = os.path.join(workdir, 'bible', 'vocab.model')
  config.d_model, config.d_ff, config.num_heads = 64, 256, 4
  config.num_encoder_layers = config.num_decoder_layers = 2
  config.num_train_steps = steps
  config.lr_cooldown_steps = 0
  config.log_every_steps = max(1, steps // 4)
  config.eval_every_steps = 0
  config.checkpoint_every_steps = steps * 10
  config.prefetch_batches = prefetch
  run_dir = tempfile.mkdtemp(dir=workdir, prefix=f'train_prefetch{prefetch}_')
  with contextlib.redirect_stderr(open(os.devnull, 'w')):
    train_loop.train_and_evaluate(config, run_dir)
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if '"train"' in line]
  timed = rows[1:]  # The first interval holds the compile.
  return {
      'prefetch_batches': prefetch,
      'steps': steps,
      'data_wait_share': float(np.mean([r['data_wait_share'] for r in timed])),
      'tokens_per_s': float(np.mean([r['tokens_per_second'] for r in timed])),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', default='/tmp/input_pipeline_bench')
  parser.add_argument('--tokens_per_batch', type=int, default=25000)
  parser.add_argument('--max_length', type=int, default=256)
  parser.add_argument('--epochs', type=int, default=2)
  parser.add_argument(
      '--prepare_pairs',
      type=int,
      default=0,
      help='also prepare a repeated-Bible corpus of this many pairs',
  )
  parser.add_argument('--workers', type=int, default=os.cpu_count() or 1)
  parser.add_argument(
      '--train_steps', type=int, default=200, help='steps of each short training run (0: skip them)'
  )
  parser.add_argument('--json', default='')
  args = parser.parse_args(argv)
  os.makedirs(args.workdir, exist_ok=True)
  results: dict[str, object] = {'cpu_cores': os.cpu_count()}

  config = bible_config.get_config()
  config.tfds_data_dir = os.path.join(args.workdir, 'tfds')
  config.vocab_path = os.path.join(args.workdir, 'bible', 'vocab.model')
  config.data_threads = 1
  pairs = data_sources.open_split(config, 'train')
  tokenizer = vocab_cache.tokenizer_for(config, RunLayout.of(args.workdir), pairs)

  directory = os.path.join(args.workdir, 'one_process_store')
  shutil.rmtree(directory, ignore_errors=True)
  start = time.perf_counter()
  store = token_store.prepare(pairs, tokenizer, directory, data_fingerprint='bench', workers=1)
  seconds = time.perf_counter() - start
  results['prepare_one_process'] = {
      'pairs': len(pairs),
      'seconds': round(seconds, 2),
      'pairs_per_s': len(pairs) / seconds,
  }
  print(
      f'prepare, 1 process: {len(pairs):,} pairs in {seconds:.1f} s = '
      f'{len(pairs) / seconds:,.0f} pairs/s',
      flush=True,
  )

  setups = {
      'bible config': (
          bible_config.get_config().tokens_per_batch,
          bible_config.get_config().max_source_length,
          tuple(bible_config.get_config().bucket_boundaries),
      ),
      'paper batch': (
          args.tokens_per_batch,
          args.max_length,
          tuple(b for b in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < args.max_length),
      ),
  }
  for setup, (tokens, length, boundaries) in setups.items():
    config.tokens_per_batch = tokens
    config.max_source_length = config.max_target_length = length
    config.bucket_boundaries = boundaries
    for packed in (False, True):
      config.packing = packed
      data = batching.train_dataset(store, config)
      rate = _epoch_rate(data, args.epochs, packed)
      name = 'packed' if packed else 'bucketed'
      results[f'{setup}, {name}'] = dict(rate, tokens_per_batch=tokens, max_length=length)
      print(
          f'{setup} ({tokens} tokens, rows to {length}), {name}: {rate["batches"]} batches, '
          f'{rate["real_tokens_per_s"]:,.0f} real tokens/s (one thread); non-padding '
          f'source {rate["source_non_padding"]:.1%}, target {rate["target_non_padding"]:.1%}',
          flush=True,
      )

  if args.prepare_pairs:
    source, target = _repeated_corpus(
        pairs, args.prepare_pairs, os.path.join(args.workdir, 'repeated')
    )
    config.dataset = 'text'
    config.text_files = {'train': f'{source},{target}'}
    big = data_sources.open_split(config, 'train')
    directory = os.path.join(args.workdir, f'store_{args.prepare_pairs}')
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    token_store.prepare(
        big, tokenizer, directory, data_fingerprint=big.fingerprint, workers=args.workers
    )
    seconds = time.perf_counter() - start
    results['prepare_many'] = {
        'pairs': len(big),
        'workers': args.workers,
        'seconds': round(seconds, 1),
        'pairs_per_s': len(big) / seconds,
        'pairs_per_s_per_process': len(big) / seconds / args.workers,
    }
    print(
        f'prepare, {args.workers} processes: {len(big):,} pairs in {seconds:.0f} s = '
        f'{len(big) / seconds:,.0f} pairs/s, {len(big) / seconds / args.workers:,.0f} per '
        'process',
        flush=True,
    )

  if args.train_steps:
    for prefetch in (0, 2):
      run = _train_wait(args.workdir, prefetch, args.train_steps)
      results[f'train_prefetch_{prefetch}'] = run
      print(
          f'training, prefetch {prefetch}: waited for data {run["data_wait_share"]:.1%} of '
          f'step time; {run["tokens_per_s"]:,.0f} tokens/s',
          flush=True,
      )

  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  sys.exit(main())

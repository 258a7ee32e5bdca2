r"""Tokenizes a config's splits once, ahead of training (train.py does it on first use too).

  python prepare_data.py --config=configs/wmt14_ende_base.py --workdir=$HOME/runs/ende_base \
      --config.tfds_data_dir=$HOME/tensorflow_datasets

Trains the vocabulary if there is none yet, then writes each split's token ids beside it
(`transformer_jax.data.token_store`), with one process per CPU core (--workers). Stores that match
the data and the vocabulary are kept; stale ones are rebuilt. An interrupted run resumes from
the parts it had written.

A gs:// work directory: the vocabulary and the token ids are made in a local cache directory
and published to the bucket, where train.py's hosts find them.

Several hosts sharing the work directory's filesystem: run the same command on each with
--num_hosts=H --host_index=I (after the vocabulary exists: run it once without them first).
Host I tokenizes parts I, I+H, ...; whichever host finds every part written merges them, and
a host that finishes early says the merge waits for the others (rerun it, or let train.py
merge, once they are done).

Exit codes: 0 done (or waiting for other hosts' parts); 2 a config, data or work-directory
problem, explained in one paragraph.
"""

import os
import time

from absl import flags
from ml_collections import config_flags

from transformer_jax.commands import cli
from transformer_jax.data import corpora
from transformer_jax.data import data_sources
from transformer_jax.data import token_store
from transformer_jax.data import vocab_cache
from transformer_jax.storage import paths
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout
from transformer_jax.training import config_checks

_CONFIG = config_flags.DEFINE_config_file(
    'config',
    None,
    'A config file (configs/*.py); override fields with --config.FIELD=VALUE.',
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    'workdir',
    None,
    'Where train.py will run (the vocabulary '
    'lives in its vocab/ unless --config.vocab_path says).',
)
_SPLITS = flags.DEFINE_list(
    'splits', None, "Splits to prepare (default: the config's " 'train, eval and test splits).'
)
_WORKERS = flags.DEFINE_integer('workers', 0, 'Processes on this host (0: one per core).')
_NUM_HOSTS = flags.DEFINE_integer('num_hosts', 1, 'Hosts sharing the preparation.')
_HOST_INDEX = flags.DEFINE_integer('host_index', 0, 'This host, 0..num_hosts-1.')


def main(argv: list[str]) -> None:
  del argv  # Unused.
  if _CONFIG.value is None:
    cli.fail('--config is required, e.g. --config=configs/wmt14_ende_base.py.')
  if not _WORKDIR.value:
    cli.fail('--workdir is required: the directory train.py will use.')
  if not 0 <= _HOST_INDEX.value < _NUM_HOSTS.value:
    cli.fail(
        f'--host_index={_HOST_INDEX.value} must be in 0..{_NUM_HOSTS.value - 1} '
        f'(--num_hosts={_NUM_HOSTS.value}).'
    )
  if _WORKERS.value < 0:
    cli.fail(f'--workers={_WORKERS.value} must be >= 0 (0: one per core).')
  config = _CONFIG.value
  config_checks.validate_run(config, training=True)
  remote = storage.is_remote(_WORKDIR.value)
  if remote and _NUM_HOSTS.value > 1:
    cli.fail(
        f'--num_hosts={_NUM_HOSTS.value} shares the parts through a filesystem every host '
        f'mounts, which --workdir={_WORKDIR.value} is not; run the command once, on one '
        "host (it publishes to the bucket what train.py's hosts then download)."
    )
  paths.check_output_directory(_WORKDIR.value, '--workdir')
  workers = _WORKERS.value or os.cpu_count() or 1
  splits = _SPLITS.value or list(
      dict.fromkeys((config.train_split, config.eval_split, config.test_split))
  )
  corpora.check(config)
  train = data_sources.open_training(config)
  layout = RunLayout.of(_WORKDIR.value)
  tokenizer = vocab_cache.tokenizer_for(config, layout, train)
  print(f'vocabulary: {tokenizer.model_path} ({tokenizer.vocab_size} pieces)')
  for split in splits:
    pairs = train if split == config.train_split else data_sources.open_split(config, split)
    directory = vocab_cache.store_directory(config, layout, tokenizer, pairs)
    start = time.perf_counter()
    if remote:  # Made locally, then published to the bucket.
      store = vocab_cache.tokenized(pairs, tokenizer, config, layout, workers)
    else:
      store = token_store.prepare(
          pairs,
          tokenizer,
          directory,
          data_fingerprint=pairs.fingerprint,
          workers=workers,
          host_index=_HOST_INDEX.value,
          host_count=_NUM_HOSTS.value,
      )
    seconds = time.perf_counter() - start
    if store is None:
      print(
          f"{split}: this host's parts are written ({seconds:.0f} s); the merge waits for "
          "the other hosts' parts: rerun once they finish (train.py also merges)."
      )
      continue
    tokens = store.meta['tokens']
    print(
        f'{split}: {len(store):,} pairs, {tokens[0]:,} source and {tokens[1]:,} target '
        f'tokens, {store.meta["blank"]} with a blank side -> {directory}'
        f'{f" (published to {_WORKDIR.value})" if remote else ""} ({seconds:.0f} s, '
        f'up to {workers} process{"" if workers == 1 else "es"})'
    )


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

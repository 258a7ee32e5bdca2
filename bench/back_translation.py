r"""Tagged back-translation in a simulated low-resource setting, on the offline Bible corpus.

  python -m bench.back_translation --out=/tmp/bt_bench [--steps=2500] [--beam_size=1]

A quarter of the training books (every fourth, in canonical order) is the bitext; the other
books' Spanish side is the monolingual text; the validation and test books are untouched.
Four steps, each the commands a user runs:

  1. es->en on the bitext (the reverse model; its vocabulary keeps '<BT>').
  2. translate_corpus.py --kind=back_translation: it translates the monolingual Spanish.
  3. en->es on the bitext alone (the baseline), in the same vocabulary.
  4. en->es on the bitext + the tagged back-translation, drawn 1:1, as many steps; and
     the same untagged (no '<BT>'), as Caswell et al. 2019 compare.

Then evaluate.py gives each en->es model's test sacreBLEU. The table (and results.json in
--out) has the BLEU and the minutes of every step. It takes about half an hour on 2 CPU
cores; bench/RESULTS.md records what it gave.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _books(tfds_data_dir: str | None) -> dict[str, list[dict[str, str]]]:
  """The Bible corpus's examples of each split, in order."""
  from transformer_jax.data import bible_corpus

  builder = bible_corpus.prepare(tfds_data_dir)
  splits = {}
  for split in ('train', 'validation', 'test'):
    source = builder.as_data_source(split)
    splits[split] = [
        {k: (v.decode() if isinstance(v, bytes) else v) for k, v in source[i].items()}
        for i in range(len(source))
    ]
  return splits


def write_data(out: str, tfds_data_dir: str | None = None) -> dict[str, str]:
  """The low-resource files under out/data; {name: path or 'SRC,TGT' pair}."""
  data = os.path.join(out, 'data')
  os.makedirs(data, exist_ok=True)
  splits = _books(tfds_data_dir)
  order = list(dict.fromkeys(e['ref'].split('.')[0] for e in splits['train']))
  bitext_books = set(order[::4])
  files = {}

  def write(name, lines):
    path = os.path.join(data, name)
    with open(path, 'w', encoding='utf-8') as f:
      f.write(''.join(' '.join(line.split()) + '\n' for line in lines))
    return path

  bitext = [e for e in splits['train'] if e['ref'].split('.')[0] in bitext_books]
  mono = [e for e in splits['train'] if e['ref'].split('.')[0] not in bitext_books]
  for name, examples in (('train', bitext), *((s, splits[s]) for s in ('validation', 'test'))):
    files[name] = ','.join(
        write(f'{name}.{lang}', [e[lang] for e in examples]) for lang in ('en', 'es')
    )
  files['mono'] = write('mono.es', [e['es'] for e in mono])
  files['counts'] = json.dumps(
      {
          'bitext_books': len(bitext_books),
          'books': len(order),
          'bitext': len(bitext),
          'mono': len(mono),
      }
  )
  return files


def run_step(argv: list[str], log: str, done: str | None = None) -> float:
  """Runs a command (its output to `log`); its seconds (those of the first run when `done`,
  a file the command writes last, is there already: a rerun of the bench adds only what is
  new). Raises on a failure."""
  timing = log + '.seconds'
  if done and os.path.exists(done) and os.path.exists(timing):
    with open(timing) as f:
      return float(f.read())
  start = time.perf_counter()
  with open(log, 'w') as f:
    result = subprocess.run(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
  if result.returncode:
    with open(log) as f:
      raise SystemExit(f'{" ".join(argv)} failed ({result.returncode}):\n{f.read()[-3000:]}')
  seconds = time.perf_counter() - start
  with open(timing, 'w') as f:
    f.write(f'{seconds}\n')
  return seconds


def _swap(pair: str) -> str:
  return ','.join(reversed(pair.split(',')))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--steps', type=int, default=2500)
  parser.add_argument('--beam_size', type=int, default=1, help='Of the back-translation.')
  args = parser.parse_args()
  out = os.path.abspath(args.out)
  files = write_data(out)
  counts = json.loads(files['counts'])
  print('data:', counts, flush=True)
  python = sys.executable
  cooldown = int(args.steps * 0.3)
  common = [
      '--config=configs/bible_en_es.py',
      '--config.dataset=text',
      f'--config.num_train_steps={args.steps}',
      f'--config.lr_cooldown_steps={cooldown}',
      f'--config.eval_every_steps={args.steps}',
  ]

  def text_files(train: str, reverse: bool) -> list[str]:
    names = {'train': train, 'validation': files['validation'], 'test': files['test']}
    return [f'--config.text_files.{k}={_swap(v) if reverse else v}' for k, v in names.items()]

  seconds = {}
  reverse = os.path.join(out, 'es_en')
  seconds['reverse'] = run_step(
      [
          python, 'train.py', *common, *text_files(files['train'], True),
          '--config.source_lang=es', '--config.target_lang=en',
          '--config.back_translation_tag=True', f'--workdir={reverse}',
      ],
      os.path.join(out, 'es_en.log'),
      os.path.join(reverse, 'metrics.jsonl'),
  )  # fmt: skip
  [vocab] = glob.glob(os.path.join(reverse, 'vocab', '*.model'))
  bt = os.path.join(out, 'bt')
  seconds['back_translation'] = run_step(
      [
          python, 'translate_corpus.py', f'--workdir={reverse}', f'--input={files["mono"]}',
          '--kind=back_translation', f'--output_dir={bt}', f'--beam_size={args.beam_size}',
          '--chunk_lines=2048',
      ],
      os.path.join(out, 'bt.log'),
      os.path.join(out, 'bt', 'corpus.json'),
  )  # fmt: skip
  forward = text_files(files['train'], False) + [f'--config.vocab_path={vocab}']
  with_bt = [f"--config.extra_corpora=('{bt}',)", '--config.corpus_weights=(1.0, 1.0)']
  runs = {
      'bitext': [],
      'bitext+bt': [*with_bt, '--config.back_translation_tag=True'],
      'bitext+bt untagged': with_bt,
  }
  bleu: dict[str, float] = {}
  for name, extra in runs.items():
    train_and_evaluate(out, name, [*common, *forward, *extra], seconds, bleu)
  report(out, {'counts': counts, 'steps': args.steps, 'bleu': bleu, 'seconds': seconds})


def train_and_evaluate(
    out: str, name: str, flags: list[str], seconds: dict[str, float], bleu: dict[str, float]
) -> str:
  """train.py with `flags`, then evaluate.py on its test split (each skipped when done in an
  earlier invocation); their seconds and the test sacreBLEU go into `seconds` and `bleu`."""
  slug = name.replace('+', '_').replace(' ', '_')
  workdir = os.path.join(out, slug)
  evaluation = os.path.join(workdir, 'eval')
  seconds[name] = run_step(
      [sys.executable, 'train.py', *flags, f'--workdir={workdir}'],
      os.path.join(out, f'{slug}.log'),
      evaluation,
  )
  seconds[f'{name} evaluate'] = run_step(
      [sys.executable, 'evaluate.py', f'--workdir={workdir}', f'--output_dir={evaluation}'],
      os.path.join(out, f'{slug}.eval.log'),
      evaluation,
  )
  [metrics] = glob.glob(os.path.join(evaluation, '*.metrics.json'))
  with open(metrics) as f:
    bleu[name] = json.load(f)['bleu']
  return workdir


def report(out: str, results: dict) -> None:
  """Writes out/results.json and prints the tables."""
  with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2)
  print('| step | seconds |\n|---|---|')
  for name, value in results['seconds'].items():
    print(f'| {name} | {value:.0f} |')
  print('\n| en->es model | test sacreBLEU |\n|---|---|')
  for name, value in results['bleu'].items():
    print(f'| {name} | {value:.2f} |')


if __name__ == '__main__':
  main()

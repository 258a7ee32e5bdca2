r"""Sequence-level distillation (Kim and Rush 2016) on the offline Bible corpus.

  python -m bench.distillation --out=/tmp/distill_bench [--steps=2500] [--beam_size=4]

  1. The teacher: the main job's model (configs/bible_en_es.py), en->es on every training book.
  2. translate_corpus.py --split=train --kind=distillation: the teacher's translations of
     its own training split (beam search).
  3. A student with half the layers (1 encoder and 1 decoder layer), on the references.
  4. The same student on the teacher's translations alone (train_on_directions=False).

Then evaluate.py gives each model's test sacreBLEU. The table (and results.json in --out)
has the BLEU and the minutes of every step; bench/RESULTS.md records what it gave.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from bench import back_translation


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--steps', type=int, default=2500)
  parser.add_argument('--beam_size', type=int, default=4, help='Of the distillation.')
  args = parser.parse_args()
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  python = sys.executable
  common = [
      '--config=configs/bible_en_es.py',
      f'--config.num_train_steps={args.steps}',
      f'--config.lr_cooldown_steps={int(args.steps * 0.3)}',
      f'--config.eval_every_steps={args.steps}',
  ]
  seconds: dict[str, float] = {}
  bleu: dict[str, float] = {}

  def train_and_evaluate(name: str, *flags: str) -> str:
    return back_translation.train_and_evaluate(out, name, [*common, *flags], seconds, bleu)

  teacher = train_and_evaluate('teacher')
  [vocab] = glob.glob(os.path.join(teacher, 'vocab', '*.model'))
  distilled = os.path.join(out, 'distilled')
  seconds['distillation'] = back_translation.run_step(
      [
          python, 'translate_corpus.py', f'--workdir={teacher}', '--split=train',
          '--kind=distillation', f'--output_dir={distilled}', f'--beam_size={args.beam_size}',
          '--chunk_lines=2048',
      ],
      os.path.join(out, 'distillation.log'),
      os.path.join(distilled, 'corpus.json'),
  )  # fmt: skip
  student = ['--config.num_encoder_layers=1', '--config.num_decoder_layers=1']
  train_and_evaluate('student_references', *student, f'--config.vocab_path={vocab}')
  train_and_evaluate(
      'student_distilled',
      *student,
      f"--config.extra_corpora=('{distilled}',)",
      '--config.train_on_directions=False',
  )
  back_translation.report(out, {'steps': args.steps, 'bleu': bleu, 'seconds': seconds})


if __name__ == '__main__':
  main()

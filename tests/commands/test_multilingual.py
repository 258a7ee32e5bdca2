"""Two directions in one model, end to end: train.py on a toy corpus of two "languages" (lower
and upper case, `train_testlib.write_case_text`) both ways with source-side language tags,
then evaluate.py's table of every direction and translate.py's --target_lang. The outputs'
case says which language the model produced, a property of a trained model that holds on any
CPU (no BLEU of this machine is asserted)."""

from __future__ import annotations

import json
import os

import pytest

import train_testlib

pytestmark = pytest.mark.slow  # Trains through a subprocess.

STEPS = 1500


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('multilingual')
  files = train_testlib.write_case_text(str(root))
  config = train_testlib.write_config_file(
      str(root / 'config.py'),
      files,
      source_lang='lo',
      target_lang='up',
      directions=('lo-up', 'up-lo'),
      language_tag='source',
      d_model=64,
      d_ff=128,
      warmup_steps=50,
      num_train_steps=STEPS,
      checkpoint_every_steps=STEPS,
      log_every_steps=STEPS // 4,
  )
  workdir = str(root / 'run')
  result = train_testlib.run_train(config, workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  return root, files, workdir


def _command(script, *flags, input=None):
  return train_testlib.run_command(
      [train_testlib.sys.executable, os.path.join(train_testlib.REPO, script), *flags],
      env=train_testlib.subprocess_env(),
      input=input,
  )


def _in_case(lines, case):
  """The share of `lines` with letters that are all in `case` ('upper' or 'lower')."""
  good = [line for line in lines if line.strip() and getattr(line, f'is{case}')()]
  return len(good) / len(lines)


def test_evaluate_scores_each_direction_in_its_language_and_averages(run):
  root, _, workdir = run
  result = _command('evaluate.py', f'--workdir={workdir}', '--noprogress')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  table = lines[next(i for i, line in enumerate(lines) if line.startswith('direction')) :]
  assert [row.split()[0] for row in table] == ['direction', 'test.lo-up', 'test.up-lo', 'average']
  bleus = [float(row.split()[1]) for row in table[1:]]
  assert bleus[2] == pytest.approx((bleus[0] + bleus[1]) / 2, abs=0.01)
  results = os.path.join(workdir, 'eval', f'step_{STEPS}')
  for direction, case, tag in (('lo-up', 'upper', '<2up>'), ('up-lo', 'lower', '<2lo>')):
    with open(os.path.join(results, f'test.{direction}.metrics.json')) as f:
      metrics = json.load(f)
    assert (metrics['source_lang'], metrics['target_lang']) == tuple(direction.split('-'))
    assert metrics['language_tag'] == tag
    with open(os.path.join(results, f'test.{direction}.hyp.txt')) as f:
      hypotheses = f.read().splitlines()
    assert len(hypotheses) == 40
    assert _in_case(hypotheses, case) >= 0.9, hypotheses


def test_translate_into_the_language_asked_for(run):
  root, files, workdir = run
  for side, target, case in ((0, 'up', 'upper'), (1, 'lo', 'lower')):
    with open(files['test'].split(',')[side]) as f:
      source = f.read()
    result = _command(
        'translate.py', f'--workdir={workdir}', f'--target_lang={target}', '--quiet', input=source
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = result.stdout.splitlines()
    assert len(outputs) == len(source.splitlines())
    assert _in_case(outputs, case) >= 0.9, outputs


@pytest.mark.parametrize(
    'script,flags,message',
    [
        ('translate.py', ['--text=abc'], 'choose one with --target_lang'),
        ('translate.py', ['--text=abc', '--target_lang=fr'], 'translates into lo, up only'),
        ('evaluate.py', ['--target_lang=fr'], 'translates into lo, up only'),
    ],
)
def test_a_missing_or_unknown_target_language_is_one_clear_line(run, script, flags, message):
  _, _, workdir = run
  result = _command(script, f'--workdir={workdir}', *flags)
  assert result.returncode == 2, result.stderr[-3000:]
  assert message in result.stderr and 'Traceback' not in result.stderr


def test_evaluate_with_a_target_language_scores_only_the_directions_into_it(run, tmp_path):
  _, _, workdir = run
  result = _command(
      'evaluate.py',
      f'--workdir={workdir}',
      '--target_lang=lo',
      f'--output_dir={tmp_path}',
      '--noprogress',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == ['test.up-lo.hyp.txt', 'test.up-lo.metrics.json']


def test_rerank_scores_with_a_multilingual_model_in_the_languages_given(run, tmp_path):
  _, files, workdir = run
  source = files['test'].split(',')[0]
  n_best = _command(
      'translate.py',
      f'--workdir={workdir}',
      '--target_lang=up',
      '--n_best=2',
      '--beam_size=2',
      f'--input={source}',
      '--quiet',
  )
  assert n_best.returncode == 0, n_best.stderr[-3000:]
  (tmp_path / 'nbest').write_text(n_best.stdout)
  flags = [f'--source={source}', f'--n_best={tmp_path / "nbest"}', f'--reverse={workdir}']
  refused = _command('rerank.py', *flags)
  assert refused.returncode == 2 and '--source_lang' in refused.stderr, refused.stderr[-3000:]
  result = _command('rerank.py', *flags, '--source_lang=lo')
  assert result.returncode == 0, result.stderr[-3000:]
  outputs = result.stdout.splitlines()
  assert len(outputs) == 40 and _in_case(outputs, 'upper') >= 0.9, outputs

"""The WMT-system commands on the trained fixture: translate.py's forced prefixes and
ensembles, score.py, rerank.py and evaluate.py's ensembles, with their bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from test_translator import TRAIN_STEPS
import train_testlib
from transformer_jax.storage.layout import RunLayout

SOURCES = ['the cat sees a dog', 'small child', 'water runs', 'a man eats']


def _run(
    script: str, *flags: str, run_dir: str, stdin: str = '', devices: int = 1
) -> tuple[int, str, str]:
  cache = os.path.join(os.path.dirname(run_dir), 'jax_cache')
  result = train_testlib.run_command(
      [sys.executable, script, f'--compilation_cache_dir={cache}', *flags],
      env=train_testlib.subprocess_env(devices),
      input=stdin,
      timeout=300,
  )
  return result.returncode, result.stdout, result.stderr


def _ok(
    script: str, *flags: str, run_dir: str, stdin: str = '', devices: int = 1
) -> tuple[str, str]:
  code, out, err = _run(script, *flags, run_dir=run_dir, stdin=stdin, devices=devices)
  assert code == 0, err[-3000:]
  return out, err


def _refused(script: str, *flags: str, run_dir: str, message: str) -> str:
  code, _, err = _run(script, *flags, run_dir=run_dir)
  assert code == 2 and 'Traceback' not in err, err[-3000:]
  assert message in err, err[-3000:]
  return err


def _n_best(output: str) -> list[tuple[int, str, float, float]]:
  rows = []
  for line in output.splitlines():
    index, text, log_prob, score = line.split(' ||| ')
    rows.append((int(index), text, float(log_prob.split()[1]), float(score)))
  return rows


@pytest.fixture(scope='module')
def runs(run_dir, tmp_path_factory):
  """The fixture's run, and a copy of it whose latest checkpoint is its first: another
  model with the same vocabulary. Also the source file."""
  root = tmp_path_factory.mktemp('decoding_cli')
  other = str(root / 'earlier')
  shutil.copytree(run_dir, other)
  checkpoints = RunLayout.of(other).checkpoints
  for step in TRAIN_STEPS[1:]:
    shutil.rmtree(os.path.join(checkpoints, str(step)))
  source = root / 'test.src'
  source.write_text('\n'.join(SOURCES) + '\n')
  return run_dir, other, str(source), root


@pytest.mark.slow
def test_prefixes_start_each_output_and_a_bad_one_fails_only_its_line(runs):
  run_dir, _, source, root = runs
  free, _ = _ok('translate.py', f'--workdir={run_dir}', f'--input={source}', run_dir=run_dir)
  first_words = [line.split()[0] for line in free.splitlines()]
  # A prefix for every line starts every output.
  out, _ = _ok(
      'translate.py',
      f'--workdir={run_dir}',
      f'--input={source}',
      f'--prefix={first_words[0]}',
      run_dir=run_dir,
  )
  assert len(out.splitlines()) == len(SOURCES)
  assert all(line.startswith(first_words[0]) for line in out.splitlines()), out
  # One a line: an empty one is none, one too long fails its line alone.
  prefixes = root / 'prefixes.txt'
  prefixes.write_text('\n'.join(['wasser wasser', '', 'ein ' * 40, first_words[3]]) + '\n')
  out, err = _ok(
      'translate.py',
      f'--workdir={run_dir}',
      f'--input={source}',
      f'--prefixes={prefixes}',
      run_dir=run_dir,
  )
  lines = out.splitlines()
  assert len(lines) == len(SOURCES)
  assert lines[0].startswith('wasser wasser') and lines[2] == ''
  # A line without a prefix is searched as without the file (the rows are independent).
  assert lines[1] == free.splitlines()[1] and lines[3].startswith(first_words[3])
  assert 'line 3: ' in err and 'writing an empty line' in err, err[-2000:]
  # A prefix file of another length is refused before the model loads.
  short = root / 'short.txt'
  short.write_text('ein\n')
  _refused(
      'translate.py',
      f'--workdir={run_dir}',
      f'--input={source}',
      f'--prefixes={short}',
      run_dir=run_dir,
      message=f'has {len(SOURCES)} lines but --prefixes={short} has 1: give one prefix a line',
  )


@pytest.mark.slow
def test_an_ensemble_translates_and_scores_its_outputs_as_score_py_does(runs):
  run_dir, other, source, root = runs
  members = (f'--workdir={run_dir}', f'--workdir={other}', '--weights=2,1')
  out, _ = _ok(
      'translate.py', *members, f'--input={source}', '--n_best=2', '--beam_size=3', run_dir=run_dir
  )
  rows = _n_best(out)
  assert [r[0] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3]
  alone = _n_best(
      _ok(
          'translate.py',
          f'--workdir={run_dir}',
          f'--input={source}',
          '--n_best=2',
          '--beam_size=3',
          run_dir=run_dir,
      )[0]
  )
  assert [r[2] for r in rows] != [r[2] for r in alone]  # Another model's log-probabilities.
  # Sharded over two devices (the batch split between them), the same ensemble's outputs.
  sharded, _ = _ok(
      'translate.py',
      *members,
      f'--input={source}',
      '--n_best=2',
      '--beam_size=3',
      run_dir=run_dir,
      devices=2,
  )
  assert [r[:2] for r in _n_best(sharded)] == [r[:2] for r in rows]
  for got, expected in zip(_n_best(sharded), rows):
    assert got[2] == pytest.approx(expected[2], abs=1e-3)
  # score.py scores each (source, hypothesis) under the same ensemble as the search did.
  pairs = root / 'pairs.tsv'
  pairs.write_text(''.join(f'{SOURCES[i]}\t{text}\n' for i, text, _, _ in rows) + 'no tab here\n')
  scored, err = _ok('score.py', *members, f'--input={pairs}', '--per_token', run_dir=run_dir)
  lines = [line.split('\t') for line in scored.splitlines()]
  assert len(lines) == len(rows) + 1
  for (_, _, log_prob, score), (got_log_prob, got_score, tokens, per_token) in zip(rows, lines):
    assert float(got_log_prob) == pytest.approx(log_prob, abs=2e-3)
    assert float(got_score) == pytest.approx(score, abs=2e-3)
    assert len(per_token.split()) == int(tokens)
    values = [float(v) for v in per_token.split()]  # Printed to 4 significant digits.
    assert sum(values) == pytest.approx(log_prob, abs=2e-3 + 5e-4 * sum(map(abs, values)))
  assert lines[-1] == ['nan', 'nan', '0', '']  # As many columns as the others.
  assert f'line {len(rows) + 1}: not scored: 1 tab-separated column(s)' in err, err[-2000:]
  # Weights that do not number the models, and files that are not pairs.
  _refused(
      'translate.py',
      f'--workdir={run_dir}',
      f'--workdir={other}',
      '--weights=1',
      run_dir=run_dir,
      message='1 weight(s) [1.0] for 2 model(s)',
  )
  _refused(
      'score.py',
      f'--workdir={run_dir}',
      f'--source={source}',
      f'--target={pairs}',
      run_dir=run_dir,
      message=f'has {len(SOURCES)} lines but --target={pairs} has {len(rows) + 1}',
  )


@pytest.mark.slow
def test_rerank_with_the_forward_model_alone_keeps_the_best_and_tuning_prints_weights(runs):
  run_dir, other, source, root = runs
  n_best = root / 'test.nbest'
  out, _ = _ok(
      'translate.py',
      f'--workdir={run_dir}',
      f'--input={source}',
      '--n_best=3',
      '--beam_size=3',
      f'--output={n_best}',
      run_dir=run_dir,
  )
  rows = _n_best(n_best.read_text())
  # Only the model's own score (recomputed by a forward pass): the search's best, where it
  # leads by more than the two computations' rounding.
  out, _ = _ok(
      'rerank.py',
      f'--source={source}',
      f'--n_best={n_best}',
      f'--forward={run_dir}',
      '--weights=score=0,forward=1',
      run_dir=run_dir,
  )
  picked = out.splitlines()
  assert len(picked) == len(SOURCES)
  for i, line in enumerate(picked):
    hypotheses = [r for r in rows if r[0] == i]
    if hypotheses[0][3] - hypotheses[1][3] > 1e-2:
      assert line == hypotheses[0][1]
    assert line in [h[1] for h in hypotheses]
  # Tuned on these lines against their second hypotheses: weights and BLEU on stderr.
  references = root / 'references.txt'
  references.write_text(''.join(r[1] + '\n' for r in rows if rows.index(r) % 3 == 1))
  out, err = _ok(
      'rerank.py',
      f'--source={source}',
      f'--n_best={n_best}',
      f'--reverse={other}',
      f'--tune_source={source}',
      f'--tune_n_best={n_best}',
      f'--tune_reference={references}',
      '--tune_trials=20',
      '--print_scores',
      run_dir=run_dir,
  )
  assert 'rerank.py: tuned --weights=score=1,reverse=' in err, err[-2000:]
  assert f'on the {len(SOURCES)} tuning sentences (score alone: ' in err
  assert len(out.splitlines()) == len(rows)
  assert all('reverse=' in line for line in out.splitlines())
  # A weight for a model that was not given; a line that is not an n-best line.
  _refused(
      'rerank.py',
      f'--source={source}',
      f'--n_best={n_best}',
      f'--reverse={other}',
      '--weights=score=1,forward=0.5',
      run_dir=run_dir,
      message='a reranking weight for forward, which is not a feature here',
  )
  _refused(
      'rerank.py',
      f'--source={source}',
      f'--n_best={source}',
      f'--reverse={other}',
      run_dir=run_dir,
      message='line 1 is not an n-best line',
  )


@pytest.mark.slow
def test_evaluate_an_ensemble_writes_its_own_results_naming_its_members(runs):
  run_dir, other, _, _ = runs
  _, err = _ok(
      'evaluate.py',
      f'--workdir={run_dir}',
      f'--workdir={other}',
      '--weights=3,1',
      '--max_sentences=2',
      run_dir=run_dir,
  )
  evaluations = RunLayout.of(run_dir).evaluations
  tags = [t for t in os.listdir(evaluations) if t.startswith('ensemble2_step_400_')]
  assert len(tags) == 1, (os.listdir(evaluations), err[-2000:])
  (metrics,) = [f for f in os.listdir(os.path.join(evaluations, tags[0])) if f.endswith('json')]
  with open(os.path.join(evaluations, tags[0], metrics)) as f:
    info = json.load(f)
  found = json.dumps(info)
  assert '"weight": 0.75' in found and '"weight": 0.25' in found, found[:2000]
  assert os.path.realpath(other) in found

"""Scoring, checkpoint averaging, and the evaluate.py / average_checkpoints.py commands."""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
import sacrebleu

from test_translator import TRAIN_STEPS
import train_testlib
from transformer_jax.checkpoints import averaging
from transformer_jax.checkpoints import checkpointing
from transformer_jax.checkpoints import loading
from transformer_jax.decoding import evaluation
from transformer_jax.storage.layout import RunLayout

REPO = train_testlib.REPO


def _run(*args: str, cache_dir: str | None = None, timeout: int = 300):
  command = [sys.executable, *args]
  if cache_dir:
    command.append(f'--compilation_cache_dir={cache_dir}')
  env = train_testlib.subprocess_env()
  return train_testlib.run_command(command, env=env, timeout=timeout)


def test_compound_splitting_follows_tensor2tensor():
  assert evaluation.split_compounds('rich-text format') == 'rich ##AT##-##AT## text format'
  # Perl's s{(\S)-(\S)}{...}g does not overlap matches; neither does this.
  assert evaluation.split_compounds('a-b-c') == 'a ##AT##-##AT## b-c'
  assert evaluation.split_compounds('a - b') == 'a - b'
  assert (
      evaluation.tokenize_for_bleu('Hello, world-wide "web".')
      == 'Hello , world ##AT##-##AT## wide " web " .'
  )


def test_scores_match_sacrebleu_and_tokenized_bleu_credits_compound_parts():
  references = ['The rich-text format is old.', 'A dog runs in the park today.']
  hypotheses = ['The rich text format is old.', 'A dog runs in a park today.']
  metrics = evaluation.score(hypotheses, references)
  assert metrics['bleu'] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
  assert metrics['chrf'] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
  assert 'tok:13a' in metrics['bleu_signature']
  assert f'version:{sacrebleu.__version__}' in metrics['bleu_signature']
  assert 'nc:6' in metrics['chrf_signature']
  # 'rich-text' is one token for 13a but three after compound splitting, two of them right.
  assert metrics['tokenized_bleu'] > metrics['bleu']
  perfect = evaluation.score(references, references)
  assert perfect['bleu'] == pytest.approx(100.0)
  assert perfect['tokenized_bleu'] == pytest.approx(100.0)
  with pytest.raises(ValueError, match='one hypothesis per reference'):
    evaluation.score(hypotheses[:1], references)


def test_paired_bootstrap_separates_a_better_system():
  references = [f'sentence number {i} has some words in it' for i in range(40)]
  good = list(references[:36]) + ['sentence number x'] * 4
  bad = [f'number {i} words' for i in range(40)]
  result = evaluation.paired_bootstrap(good, bad, references, num_samples=200)
  assert set(result) == {'bleu', 'chrf'}
  assert result['bleu']['system'] > result['bleu']['baseline']
  assert result['bleu']['p_value'] < 0.05 and result['chrf']['p_value'] < 0.05
  assert 'bs:200' in result['bleu']['signature']


def test_the_average_of_the_last_checkpoints_is_their_mean_in_their_dtypes(tmp_path):
  """Parameters of any tree, any dtype: summed in float32, returned in each leaf's dtype."""
  from configs import tiny
  from transformer_jax.data.tokenizer import train_tokenizer

  tokenizer = train_tokenizer(
      [f'word{i} other{i % 7} thing' for i in range(200)],
      str(tmp_path / 'spm.model'),
      vocab_size=60,
  )
  meta = checkpointing.make_meta(tiny.get_config(), tokenizer)
  rng, workdir, saved = np.random.default_rng(0), str(tmp_path / 'run'), {}
  for step in (1, 2, 3):
    saved[step] = {
        'dense': {'kernel': rng.normal(size=(3, 4)).astype(np.float32)},
        'norm': {'scale': rng.normal(size=(4,)).astype(jax.numpy.bfloat16)},
    }
    checkpointing.write_params_checkpoint(
        RunLayout.of(workdir).checkpoints, step, saved[step], meta
    )
  assert averaging.last_steps(RunLayout.of(workdir).checkpoints, 2) == [2, 3]
  averaged = averaging.average_params(RunLayout.of(workdir).checkpoints, [2, 3])
  for path in (('dense', 'kernel'), ('norm', 'scale')):
    got = averaged[path[0]][path[1]]
    want = [saved[s][path[0]][path[1]] for s in (2, 3)]
    assert got.dtype == want[0].dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        (want[0].astype(np.float32) + want[1].astype(np.float32)) / 2,
        rtol=1e-2 if got.dtype != np.float32 else 1e-6,
    )
  with pytest.raises(ValueError, match='No checkpoint steps'):
    averaging.average_params(RunLayout.of(workdir).checkpoints, [])


@pytest.mark.slow
def test_averaging_writes_a_loadable_checkpoint_of_the_mean(run_dir, tmp_path):
  steps = averaging.last_steps(RunLayout.of(run_dir).checkpoints, 2)
  assert steps == list(TRAIN_STEPS[-2:])
  expected = jax.tree.map(
      lambda a, b: (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2,
      *[checkpointing.restore_params(RunLayout.of(run_dir).checkpoints, s)[0] for s in steps],
  )
  averaged = averaging.average_params(RunLayout.of(run_dir).checkpoints, steps)
  jax.tree.map(
      lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7), averaged, expected
  )

  out = str(tmp_path / 'avg')
  path, written_steps = averaging.average_checkpoints(run_dir, out, 2)
  assert written_steps == steps and path.endswith(f'checkpoints/{steps[-1]}')
  loaded = loading.load(out)
  assert loaded.step == steps[-1] and loaded.steps == steps
  jax.tree.map(
      lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7), loaded.params, expected
  )
  original = loading.load(run_dir)
  assert loaded.tokenizer.fingerprint == original.tokenizer.fingerprint
  assert loaded.model_config == original.model_config
  meta, _ = checkpointing.read_meta(RunLayout.of(out).checkpoints)
  assert meta['averaged_steps'] == steps
  # An in-memory average (evaluate.py --average_last) equals the written one.
  in_memory = loading.load(run_dir, average_last=2)
  assert in_memory.steps == steps and in_memory.step == steps[-1]
  jax.tree.map(np.testing.assert_array_equal, in_memory.params, loaded.params)

  with pytest.raises(FileExistsError):
    averaging.average_checkpoints(run_dir, out, 2)
  with pytest.raises(ValueError, match='must differ'):
    averaging.average_checkpoints(run_dir, run_dir, 2)
  with pytest.raises(ValueError, match='only 3'):
    averaging.last_steps(RunLayout.of(run_dir).checkpoints, 5)
  with pytest.raises(ValueError, match='not both'):
    loading.load(run_dir, step=100, average_last=2)


@pytest.mark.slow
def test_average_and_evaluate_commands(run_dir, tmp_path):
  out = str(tmp_path / 'avg')
  result = _run(
      'average_checkpoints.py',
      f'--workdir={run_dir}',
      f'--output_workdir={out}',
      '--num_checkpoints=2',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'{TRAIN_STEPS[-2:]}'.replace('(', '[').replace(')', ']') in result.stdout

  root = os.path.dirname(run_dir)
  references = open(os.path.join(root, 'test.de'), encoding='utf-8').read().splitlines()
  baseline = tmp_path / 'baseline.txt'
  baseline.write_text(''.join(r.split(' ')[0] + '\n' for r in references), encoding='utf-8')
  result = _run(
      'evaluate.py',
      f'--workdir={out}',
      f'--compare_to={baseline}',
      '--bootstrap_samples=100',
      cache_dir=os.path.join(root, 'jax_cache'),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'sacreBLEU' in result.stdout and 'sentences/s' in result.stdout
  # stderr is a pipe here: no progress bar (no carriage returns in log files), and no
  # sacreBLEU warning about tokenized input (tokenized BLEU is tokenized on purpose).
  assert '\r' not in result.stderr and 'detokenize' not in result.stderr, result.stderr

  directory = os.path.join(out, 'eval', f'avg2_step_{TRAIN_STEPS[-2]}-{TRAIN_STEPS[-1]}')
  with open(os.path.join(directory, 'test.metrics.json'), encoding='utf-8') as f:
    metrics = json.load(f)
  with open(os.path.join(directory, 'test.hyp.txt'), encoding='utf-8') as f:
    hypotheses = f.read().split('\n')[:-1]
  assert len(hypotheses) == len(references) == metrics['decoding']['sentences']
  assert metrics['bleu'] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
  # The fixture model has learned its word substitution: single checkpoints scored
  # BLEU 76-91 on these 24 sentences over 4 trainings (3 seeds, 2 XLA code paths).
  assert metrics['bleu'] > 30
  assert metrics['checkpoint_steps'] == list(TRAIN_STEPS[-2:])
  assert metrics['decoding']['beam_size'] == 2
  assert metrics['decoding']['tokens_per_second'] > 0
  assert metrics['paired_bootstrap']['bleu']['p_value'] < 0.05


@pytest.mark.parametrize(
    'flags,message',
    [
        (['--workdir=/nonexistent/run'], 'does not exist'),
        (['--step=100', '--average_last=2'], 'not both'),
        (['--beam_size=many'], 'invalid flags'),
        (['--step=999'], 'no checkpoint for step 999'),
    ],
)
@pytest.mark.slow
def test_evaluate_command_rejects_bad_requests_with_exit_code_2(run_dir, flags, message):
  if not any(f.startswith('--workdir') for f in flags):
    flags = [f'--workdir={run_dir}'] + flags
  result = _run('evaluate.py', *flags)
  assert result.returncode == 2, result.stderr[-3000:]
  assert message in result.stderr
  assert 'Traceback' not in result.stderr


@pytest.mark.slow
def test_averaging_takes_the_steps_that_exist_when_training_rotates_one_away(
    run_dir, tmp_path, monkeypatch, caplog
):
  """evaluate.py --average_last=N beside a running training job: a step it listed is
  deleted before it is read (the job keeps only its last keep_checkpoints). The load takes
  the last N that exist then, and says why; it never calls the checkpoint damaged."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(run_dir, workdir)
  listed = averaging.last_steps
  rotated = []

  def list_then_rotate(directory, num):
    steps = listed(directory, num)
    if not rotated:  # The training job deletes the oldest of them meanwhile.
      rotated.append(steps[0])
      shutil.rmtree(os.path.join(directory, str(steps[0])))
    return steps

  monkeypatch.setattr(averaging, 'last_steps', list_then_rotate)
  loaded = loading.load(workdir, average_last=2)
  assert rotated == [TRAIN_STEPS[-2]]
  assert loaded.steps == [TRAIN_STEPS[-3], TRAIN_STEPS[-1]]
  assert f'Checkpoint(s) [{TRAIN_STEPS[-2]}]' in caplog.text
  assert 'rotated them away' in caplog.text and 'damaged' not in caplog.text


@pytest.mark.slow
def test_evaluate_checks_its_outputs_before_translating(run_dir, tmp_path):
  """--output_dir that is a file, and an output that is an input (the previous hypotheses
  compared against): exit 2 before any sentence is translated; the input is intact."""
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  result = _run('evaluate.py', f'--workdir={run_dir}', f'--output_dir={a_file}')
  assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert f'--output_dir={a_file} is a file; give a directory' in result.stderr

  root = os.path.dirname(run_dir)
  out = tmp_path / 'out'
  out.mkdir()
  previous = out / 'test.en.hyp.txt'  # The hypotheses' name for --source_file=.../test.en.
  previous.write_text('the previous system\n' * 24, encoding='utf-8')
  result = _run(
      'evaluate.py',
      f'--workdir={run_dir}',
      f'--output_dir={out}',
      f'--source_file={root}/test.en',
      f'--reference_file={root}/test.de',
      f'--compare_to={previous}',
      '--progress=false',
  )
  assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert f'the output {previous} is also --compare_to={previous}' in result.stderr
  assert 'Translating' not in result.stderr
  assert previous.read_text() == 'the previous system\n' * 24
  assert sorted(os.listdir(out)) == ['test.en.hyp.txt']

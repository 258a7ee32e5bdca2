"""translate.py: one output line per input line whatever the input; the attention heatmap."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest

from test_translator import MAX_LEN
import train_testlib
from transformer_jax.commands import line_io
from transformer_jax.decoding import attention_plot
from transformer_jax.decoding import translator as translator_lib

REPO = train_testlib.REPO

# Each entry is one input line's bytes (without its '\n').
MIXED_LINES = [
    b'the cat sees a dog',
    b'',
    ' '.join(['the big red house'] * 10).encode(),  # Far more than max_len tokens.
    'die Katze 日本語のテキスト Ελληνικά العربية 🐈'.encode(),
    b'a man \xff\xfe eats \xc3',  # Invalid UTF-8.
    b'   \t ',
    b'water runs\r',  # A CRLF line ending.
    'red\x0cblue\u2028tree \x85 house'.encode(),  # Characters that str.splitlines splits on.
    b'\x00',
    b'small child',
]


@pytest.fixture(scope='module')
def loaded(run_dir):
  translator, checkpoint = translator_lib.load_translator(run_dir)
  return translator, checkpoint


@pytest.fixture(scope='module')
def mixed_file(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp('input') / 'mixed.txt'
  path.write_bytes(b'\n'.join(MIXED_LINES))  # The last line has no newline.
  return str(path)


def _translate(
    *flags: str, run_dir: str, stdin: bytes | None = None, devices: int = 1
) -> subprocess.CompletedProcess:
  env = train_testlib.subprocess_env(devices)
  cache = os.path.join(os.path.dirname(run_dir), 'jax_cache')
  return train_testlib.run_command(
      [
          sys.executable,
          'translate.py',
          f'--workdir={run_dir}',
          f'--compilation_cache_dir={cache}',
          *flags,
      ],
      env=env,
      input=stdin if stdin is not None else b'',
      text=False,
      timeout=300,
  )


@pytest.fixture(scope='module')
def file_run(run_dir, mixed_file, tmp_path_factory):
  output = tmp_path_factory.mktemp('output') / 'out.txt'
  result = _translate(f'--input={mixed_file}', f'--output={output}', run_dir=run_dir)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  return output.read_bytes(), result.stderr.decode()


@pytest.mark.slow
def test_every_input_line_gives_one_output_line_in_order(loaded, file_run):
  translator, _ = loaded
  output, stderr = file_run
  assert output.endswith(b'\n')
  lines = output.decode('utf-8').split('\n')[:-1]
  assert len(lines) == len(MIXED_LINES)
  assert lines[1] == '' and lines[5] == ''
  # Each line is what the model gives for that line, so nothing shifted.
  texts = [line_io.decode_line(raw)[0] for raw in MIXED_LINES]
  expected, stats = translator.translate(texts)
  assert lines == expected
  assert stats.truncated == (2,)
  assert lines[0] and len(set(lines)) >= 6  # Real, differing translations.
  assert 'line 3: longer than max_len=24' in stderr
  assert 'line 5: invalid UTF-8' in stderr
  assert 'line 1:' not in stderr and 'line 4:' not in stderr
  assert f'{len(MIXED_LINES)} lines' in stderr and 'sentences/s' in stderr


@pytest.mark.slow
def test_stdin_on_two_devices_gives_the_same_lines(run_dir, mixed_file, file_run):
  with open(mixed_file, 'rb') as f:
    data = f.read()
  result = _translate('--quiet', '--batch_size=4', run_dir=run_dir, stdin=data, devices=2)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert result.stdout == file_run[0]
  assert b'sentences/s' not in result.stderr


@pytest.mark.slow
def test_attention_heatmap_of_one_sentence(run_dir, file_run, tmp_path):
  image = tmp_path / 'attention.png'
  result = _translate(
      '--text=the cat sees a dog',
      f'--attention_plot={image}',
      '--attention_heads=all',
      '--attention_layer=0',
      run_dir=run_dir,
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert MIXED_LINES[0] == b'the cat sees a dog'
  assert result.stdout == file_run[0].split(b'\n')[0] + b'\n'
  assert image.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_a_heatmap_shows_each_head_or_their_mean_with_the_labels(tmp_path):
  weights = np.random.default_rng(0).dirichlet(np.ones(3), size=(2, 4))  # [heads, out, src]
  source, output = ['a', 'b', '</s>'], ['x', 'y', 'z', '</s>']
  fig = attention_plot.plot(
      weights, source, output, str(tmp_path / 'all.png'), heads='all', title='layer 0'
  )
  panels = [ax for ax in fig.axes if ax.images]
  assert len(panels) == 2 and (tmp_path / 'all.png').read_bytes()[:4] == b'\x89PNG'
  for head, ax in enumerate(panels):
    np.testing.assert_array_equal(ax.images[0].get_array(), weights[head])
    assert [t.get_text() for t in ax.get_xticklabels()] == source
  plt.close(fig)
  fig = attention_plot.plot(weights, source, output, str(tmp_path / 'one.svg'), heads=1)
  assert (tmp_path / 'one.svg').read_text().lstrip().startswith('<?xml')
  plt.close(fig)
  with pytest.raises(ValueError, match='but there are 4 output and 2 source labels'):
    attention_plot.plot(weights, source[:2], output, str(tmp_path / 'bad.png'))


@pytest.mark.slow
def test_cross_attention_weights_and_labels(loaded, tmp_path):
  translator, checkpoint = loaded
  source = checkpoint.tokenizer.encode('the cat sees a dog')
  output = checkpoint.tokenizer.encode('die katze sieht ein hund')
  weights = attention_plot.cross_attention(
      checkpoint.model_config, checkpoint.params, source, output, layer=-1
  )
  assert weights.shape == (4, len(output), len(source))  # [heads, output, source]
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  labels = attention_plot.pieces(checkpoint.tokenizer, source)
  assert labels[-1] == '</s>' and ''.join(labels[:-1]).replace('\u2581', ' ').strip() == (
      'the cat sees a dog'
  )
  output_labels = attention_plot.pieces(checkpoint.tokenizer, output)
  fig = attention_plot.plot(weights, labels, output_labels, str(tmp_path / 'a.png'), heads='mean')
  ax = fig.axes[0]
  assert [t.get_text() for t in ax.get_xticklabels()] == labels
  assert [t.get_text() for t in ax.get_yticklabels()] == output_labels
  np.testing.assert_allclose(ax.images[0].get_array(), weights.mean(0), atol=1e-6)
  plt.close(fig)
  with pytest.raises(ValueError, match='layer=5 does not exist'):
    attention_plot.cross_attention(
        checkpoint.model_config, checkpoint.params, source, output, layer=5
    )
  with pytest.raises(ValueError, match='head 9 does not exist'):
    attention_plot.plot(weights, labels, output_labels, str(tmp_path / 'b.png'), heads=9)
  assert translator.max_source_length == MAX_LEN


@pytest.mark.parametrize(
    'flags,message',
    [
        (['--workdir=/nonexistent/run'], 'does not exist'),
        (['--attention_plot=x.png'], 'give it as --text'),
        (['--no_such_flag=1'], 'invalid flags'),
        (['--input=/nonexistent/input.txt'], 'does not exist'),
        (['--temperature=0.5'], 'add --sampling'),
        (['--n_best=3', '--beam_size=2'], 'raise --beam_size to at least 3'),
        (['--n_best=5'], 'raise beam_size to at least 5'),  # The run's beam size: 2.
        (['--step=latest'], "must be a step number or 'best'"),
        (['--step=best'], 'saved with validation bleu'),  # The fixture has no metrics.
    ],
)
@pytest.mark.slow
def test_bad_requests_exit_with_code_2(run_dir, flags, message):
  env = train_testlib.subprocess_env()
  if not any(f.startswith('--workdir') for f in flags):
    flags = [f'--workdir={run_dir}'] + flags
  result = train_testlib.run_command([sys.executable, 'translate.py', *flags], env=env, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert message in result.stderr and 'Traceback' not in result.stderr


def _shell(command: str, run_dir: str) -> subprocess.CompletedProcess:
  cache = os.path.join(os.path.dirname(run_dir), 'jax_cache')
  translate = f'{sys.executable} translate.py --workdir={run_dir} --compilation_cache_dir={cache}'
  return subprocess.run(
      ['bash', '-c', 'set -o pipefail; ' + command.format(translate=translate)],
      cwd=REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=300,
  )


def _n_best_lines(output: str) -> list[tuple[int, str, float, float]]:
  rows = []
  for line in output.splitlines():
    index, text, log_prob, score = line.split(' ||| ')
    assert log_prob.startswith('LogProb= ')
    rows.append((int(index), text, float(log_prob.split()[1]), float(score)))
  return rows


@pytest.mark.slow
def test_n_best_and_sampling_write_k_scored_lines_per_input(run_dir):
  stdin = b'the cat sees a dog\n\nsmall child\n'
  beam = _translate('--n_best=2', run_dir=run_dir, stdin=stdin)
  assert beam.returncode == 0, beam.stderr.decode()[-3000:]
  rows = _n_best_lines(beam.stdout.decode())
  assert [r[0] for r in rows] == [0, 0, 1, 1, 2, 2]
  assert rows[2][1:] == rows[3][1:] == ('', 0.0, 0.0)  # The blank line.
  for first, second in (rows[0:2], rows[4:6]):
    assert first[1] and first[1] != second[1] and first[3] >= second[3]
    assert first[2] < 0 and second[2] < 0  # Log-probabilities.
  best = _translate('--print_scores', run_dir=run_dir, stdin=stdin)
  assert [r[:2] for r in _n_best_lines(best.stdout.decode())] == [r[:2] for r in rows[::2]]

  samples = _translate(
      '--sampling', '--n_best=3', '--top_k=5', '--seed=7', run_dir=run_dir, stdin=stdin
  )
  assert samples.returncode == 0, samples.stderr.decode()[-3000:]
  rows = _n_best_lines(samples.stdout.decode())
  assert [r[0] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
  assert all(r[1] for r in rows if r[0] != 1) and all(r[2] < 0 for r in rows if r[0] != 1)


@pytest.mark.slow
def test_closed_stdin_is_no_input(run_dir):
  result = _shell('{translate} <&-', run_dir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == '' and 'Traceback' not in result.stderr


@pytest.mark.slow
def test_a_closed_output_pipe_ends_quietly(run_dir, tmp_path):
  lines = tmp_path / 'many.txt'
  lines.write_text('the cat sees a dog\nsmall child\n' * 20)
  # One line a chunk, so the reader is gone long before the last line is written.
  result = _shell(f'{{translate}} --input={lines} --chunk_lines=1 | head -1', run_dir)
  assert result.stdout.count('\n') == 1 and result.stdout.strip(), result.stdout
  assert 'Traceback' not in result.stderr and 'Error' not in result.stderr, result.stderr
  assert result.returncode in (0, 141), result.stderr[-3000:]  # 141: like SIGPIPE's death.


@pytest.mark.slow
def test_output_paths_are_checked_before_the_model_loads(run_dir, tmp_path):
  """Each bad path: exit 2, one paragraph naming it and the fix, and nothing lost."""
  text = tmp_path / 'input.txt'
  text.write_text('the cat sees a dog\n', encoding='utf-8')
  os.link(text, tmp_path / 'linked.txt')
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  cases = [
      ([f'--input={text}', f'--output={text}'], f'--output={text} is also --input={text}'),
      ([f'--input={text}', f'--output={tmp_path / "linked.txt"}'], 'is also --input='),
      (
          ['--text=hi', f'--output={tmp_path / "no_such_dir" / "out.txt"}'],
          f'its directory {tmp_path / "no_such_dir"} does not exist; create it first',
      ),
      (['--text=hi', f'--output={tmp_path}'], 'is a directory; give a file name'),
      ([f'--input={tmp_path}'], f'--input={tmp_path} is a directory; give a file'),
      ([f'--workdir={a_file}'], f"--workdir={a_file} is a file; give a training run's"),
      (['--text=hi', f'--attention_plot={tmp_path / "plot.xyz"}'], 'suffix of an image format'),
      (
          ['--text=hi', f'--output={text}', f'--attention_plot={text}'],
          f'--attention_plot={text} is also --output={text}',
      ),
  ]
  for flags, message in cases:
    if not any(f.startswith('--workdir') for f in flags):
      flags = [f'--workdir={run_dir}'] + flags
    result = train_testlib.run_command(
        [sys.executable, 'translate.py', *flags], env=train_testlib.subprocess_env(), timeout=120
    )
    assert result.returncode == 2, (flags, result.stderr[-3000:])
    assert 'Traceback' not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('translate.py: error: ') and message in last, (message, last)
  assert text.read_text(encoding='utf-8') == 'the cat sees a dog\n'


@pytest.mark.slow
def test_an_output_file_is_replaced_whole(run_dir, mixed_file, tmp_path):
  """--output over an existing file: the new lines replace it in one rename, no temporary
  is left, and a killed writer's temporary there is cleaned up by the next run."""
  output = tmp_path / 'out.txt'
  output.write_text('an older translation\n' * 3)
  leftover = tmp_path / f'.out.txt.tmp-{train_testlib.dead_pid()}-0123abcd-{socket.gethostname()}'
  leftover.write_text('half a translation')
  result = _translate(f'--input={mixed_file}', f'--output={output}', run_dir=run_dir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(output.read_bytes().split(b'\n')) == len(MIXED_LINES) + 1
  assert os.listdir(tmp_path) == ['out.txt']

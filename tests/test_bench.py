"""`python -m bench.run --quick`: the decoding comparison runs one model in every system.

The JAX side exports its model (`marian.write_model`); Hugging Face's `MarianMTModel` loads
the directory and CTranslate2 converts it, so greedy search must give our tokens in both
(a tiny random model; a near-tie on another CPU may split one sentence, never most).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import train_testlib


@pytest.mark.skipif(importlib.util.find_spec('transformers') is None,
                    reason='the references are test and bench extras')
def test_quick_decoding_bench_runs_our_exported_model_in_every_system(tmp_path):
  out = tmp_path / 'bench.json'
  result = subprocess.run(
      [sys.executable, '-m', 'bench.run', '--quick', '--only=decode', f'--json={out}',
       f'--log_dir={tmp_path / "logs"}'], cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  decode = json.loads(out.read_text())['decode']
  batch = decode['shape']['batch']
  systems = ['jax', 'hf'] + (['ct2'] if importlib.util.find_spec('ctranslate2') else [])
  for search in ('greedy', 'beam4'):
    for name in systems:
      entry = decode[search][name]
      assert entry['tokens_per_s'] > 0 and entry['memory_per_sentence_bytes'] >= 0, name
    for name in systems[1:]:
      same = decode[search][name]['same_tokens_as_ours']
      assert same >= (batch - 1 if search == 'greedy' else batch // 2), (search, name, same)
    assert decode[search]['speedup_vs_hf'] > 0
  assert 'same as ours' in result.stdout and 'MiB/sentence' in result.stdout

"""A short seeded slice of the fault campaign (scripts/fault_campaign.py): a change that breaks
recovery from a kill, a stop or a pause at a random moment fails here. The full campaign is
the command; its figures are in bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import train_testlib

pytestmark = pytest.mark.slow  # trains through subprocesses, killed and restarted.


def test_a_seeded_slice_of_the_campaign_recovers_from_every_fault(tmp_path):
  result = subprocess.run(
      [
          sys.executable,
          os.path.join(train_testlib.REPO, 'scripts', 'fault_campaign.py'),
          f'--out={tmp_path}',
          '--runs=2',
          '--seed=2026',
          '--steps=4',
          '--max_faults=2',
          '--window=5',  # The reference is run once (its cold compile is no measure).
      ],
      cwd=train_testlib.REPO,
      env=train_testlib.subprocess_env(),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  with open(tmp_path / 'summary.json') as f:
    summary = json.load(f)
  assert summary['runs'] == 2 and summary['failed_runs'] == []
  assert sum(summary['faults_injected'].values()) >= 1, summary
  # A run that passes keeps its schedule and starts, not its work directory.
  with open(tmp_path / 'runs' / '0' / 'result.json') as f:
    run = json.load(f)
  assert (
      run['faults'] and run['problems'] == [] and not (tmp_path / 'runs' / '0' / 'workdir').exists()
  )

#!/usr/bin/env bash
# The main job on a fresh machine: set up, train English->Spanish on the offline Bible
# corpus, evaluate on its held-out books (sacreBLEU, chrF), translate a few sentences.
# Leaves a checkpoint in $WORKDIR that evaluate.py and translate.py accept.
#
#   bash scripts/main_job.sh                 # WORKDIR defaults to ./workdir/bible_en_es
#   WORKDIR=/tmp/run bash scripts/main_job.sh --config.num_train_steps=200   # extra flags go to train.py
#
# Ctrl-C during training saves a checkpoint and stops the job; rerunning it resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${WORKDIR:-workdir/bible_en_es}

echo "== Setting up (Debian packages of the Bible corpus, Python packages)"
bash scripts/setup.sh

echo "== Training (configs/bible_en_es.py) in $WORKDIR; rerunning resumes"
python train.py --config=configs/bible_en_es.py --workdir="$WORKDIR" "$@"

echo "== Evaluating on the held-out books (Ruth, Ecclesiastes, Micah, Acts)"
python evaluate.py --workdir="$WORKDIR"

echo "== Translating a few sentences"
python translate.py --workdir="$WORKDIR" --quiet <<'SENTENCES'
In the beginning was the Word, and the Word was with God.
And God said, Let there be light: and there was light.
Blessed are the peacemakers: for they shall be called the children of God.
The train leaves the station at noon.

SENTENCES
echo "== Done. Checkpoints, metrics and hypotheses are in $WORKDIR"

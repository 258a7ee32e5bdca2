r"""Translates a test set with a trained checkpoint and scores it.

  python evaluate.py --workdir=/tmp/tiny
  python evaluate.py --workdir=$HOME/runs/ende_base --average_last=5      # the paper (base)
  python evaluate.py --workdir=$HOME/runs/ende_big --average_last=20 \
      --compare_to=other_system.txt                                       # paired bootstrap
  python evaluate.py --workdir=DIR --step=best       # the best validation BLEU of the run
  python evaluate.py --workdir=RUN1 --workdir=RUN2 --weights=0.6,0.4   # an ensemble
  python evaluate.py --workdir=DIR --step=100000 --source_file=newstest2014.en \
      --reference_file=newstest2014.de --beam_size=4 --length_penalty=0.6

Reports sacreBLEU (with its signature) and chrF on detokenized output, tokenized BLEU with
compound splitting (to compare with the paper), sentences/s and tokens/s; writes
`<split>.hyp.txt` and `<split>.metrics.json` (for --source_file=newstest2014.en:
`newstest2014.en.hyp.txt` and `newstest2014.en.metrics.json`) to
WORKDIR/eval/<step_N | avgK_step_A-B>/ (or --output_dir); an ensemble's (several --workdir,
optionally --weights) to the first's WORKDIR/eval/ensembleM_<that>_<hash of the members and
weights>/. Decoding options default to the run's config.

Exit codes: 0 done; 1 an unexpected error; 2 a flag, work directory, checkpoint or data problem
(explained in one paragraph; the traceback only with --verbose).
"""

import os

from absl import flags
from absl import logging

from transformer_jax.commands import cli
from transformer_jax.commands import line_io
from transformer_jax.storage import paths
from transformer_jax.storage import storage
from transformer_jax.storage.layout import RunLayout

_CHECKPOINT = cli.define_checkpoint_flags()

_SPLIT = flags.DEFINE_string(
    'split', None, "The dataset split (default: the config's " 'test_split).'
)
_SOURCE_FILE = flags.DEFINE_string(
    'source_file',
    None,
    'Translate this file instead of a split (with --reference_file), one sentence a line.',
)
_REFERENCE_FILE = flags.DEFINE_string(
    'reference_file', None, 'References for --source_file, line by line.'
)
_TFDS_DATA_DIR = flags.DEFINE_string(
    'tfds_data_dir', None, "Where the TFDS data is (default: the run's)."
)
_MAX_SENTENCES = flags.DEFINE_integer(
    'max_sentences', 0, 'Only the first N sentences (0: all), for quick checks.'
)
_COMPARE_TO = flags.DEFINE_string(
    'compare_to',
    None,
    "Another system's output on the same sentences (one a line): adds a "
    'paired bootstrap test of this checkpoint against it.',
)
_BOOTSTRAP_SAMPLES = flags.DEFINE_integer(
    'bootstrap_samples', 1000, 'Resamples of the paired bootstrap test.'
)
_OUTPUT_DIR = flags.DEFINE_string(
    'output_dir', None, 'Where results go (default: WORKDIR/eval/<checkpoint>).'
)
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar.')


def main(argv: list[str]) -> None:
  del argv  # Unused.
  cli.check_checkpoint_flags(_CHECKPOINT)
  if _MAX_SENTENCES.value < 0 or _BOOTSTRAP_SAMPLES.value < 1:
    cli.fail('--max_sentences must be >= 0, --bootstrap_samples >= 1.')
  if bool(_SOURCE_FILE.value) != bool(_REFERENCE_FILE.value):
    cli.fail('--source_file and --reference_file go together.')
  if _SOURCE_FILE.value and (_SPLIT.value or _TFDS_DATA_DIR.value):
    cli.fail('--source_file replaces the dataset; drop --split and --tfds_data_dir.')
  workdirs = _CHECKPOINT.workdir.value
  workdir = workdirs[0]
  if _TFDS_DATA_DIR.value:
    paths.check_input_directory(_TFDS_DATA_DIR.value, '--tfds_data_dir', 'a TFDS data directory')
  inputs = {
      '--source_file': _SOURCE_FILE.value,
      '--reference_file': _REFERENCE_FILE.value,
      '--compare_to': _COMPARE_TO.value,
  }
  for flag, path in inputs.items():
    if path:
      paths.check_input_file(path, flag)
  # Where the results go, before the checkpoint loads (the default's name needs its step).
  if _OUTPUT_DIR.value:
    paths.check_output_directory(_OUTPUT_DIR.value, '--output_dir', create=False)
  else:
    paths.check_output_directory(
        RunLayout.of(workdir).evaluations, 'the results directory', create=False
    )

  # Imported here so that flag errors are reported without loading JAX and TFDS.
  import jax

  from transformer_jax.data import data_sources
  from transformer_jax.data import languages
  from transformer_jax.decoding import evaluation

  # A split is read untagged and scored direction by direction, each with its own tag.
  translator, checkpoint = cli.load_translator(_CHECKPOINT, untagged=not _SOURCE_FILE.value)
  config, steps = checkpoint.config, checkpoint.steps

  # A source file's whole name (newstest2014.en), so that its results never take the name
  # of a split's (test.en gives test.en.hyp.txt beside the test split's test.hyp.txt).
  split = _SPLIT.value or config.test_split
  name = os.path.basename(_SOURCE_FILE.value) if _SOURCE_FILE.value else split
  # A multilingual run's split is scored direction by direction (`--target_lang`: those into
  # it), each with its own results: <split>.<src>-<tgt>.hyp.txt and .metrics.json.
  found = [
      d for d in languages.directions(config) if _CHECKPOINT.target_lang.value in (None, d.target)
  ]
  per_direction = not _SOURCE_FILE.value and languages.is_multilingual(config)
  names = [f'{name}.{d.name}' for d in found] if per_direction else [name]
  if _COMPARE_TO.value and len(names) > 1:
    cli.fail(
        f'--compare_to gives one other output, but this model is scored in {len(names)} '
        'directions; pick one with --target_lang (or --source_file and --reference_file).'
    )
  tag = evaluation.result_tag(steps)
  if len(workdirs) > 1:  # Each ensemble (its members, weights, steps) its own directory.
    tag = evaluation.ensemble_tag([storage.resolve(w) for w in workdirs], translator.weights, tag)
  output_dir = _OUTPUT_DIR.value or os.path.join(RunLayout.of(workdir).evaluations, tag)
  if jax.process_index() == 0:  # The one writer; before any sentence is translated.
    paths.check_output_directory(
        output_dir, '--output_dir' if _OUTPUT_DIR.value else 'the results directory'
    )
    for result_name in names:
      for path in evaluation.result_paths(output_dir, result_name):
        paths.check_not_input(path, 'the output', inputs)
  if _TFDS_DATA_DIR.value:
    config.tfds_data_dir = _TFDS_DATA_DIR.value  # An existing field: allowed when locked.
  jobs = []  # (result name, direction or None, sources, references)
  if _SOURCE_FILE.value:
    sources = line_io.read_lines(_SOURCE_FILE.value, 'source_file')
    references = line_io.read_lines(_REFERENCE_FILE.value, 'reference_file')
    if len(sources) != len(references):
      cli.fail(
          f'{_SOURCE_FILE.value} has {len(sources)} lines but {_REFERENCE_FILE.value} has '
          f'{len(references)}.'
      )
    jobs.append((name, None, sources, references))
  else:
    for result_name, direction in zip(names, found if per_direction else [None]):
      try:
        pairs = data_sources.open_split(config, split, direction, tagged=False)
      except KeyError as e:  # TFDS: no such split.
        cli.fail(f'cannot read split {split!r} of {config.dataset}: {e}; pass --split.')
      jobs.append((result_name, direction, [p[0] for p in pairs], [p[1] for p in pairs]))
  results = []
  for result_name, direction, sources, references in jobs:
    if direction is not None:
      translator.source_prefix = languages.source_prefix(config, direction.target)
    results.append(
        _evaluate_one(translator, checkpoint, workdirs, result_name, direction, sources, references)
    )
  if jax.process_index() == 0:
    for (result_name, *_), result in zip(jobs, results):
      written = evaluation.write_results(output_dir, result_name, result.hypotheses, result.metrics)
      if len(jobs) > 1:
        print(f'{result_name}:')
      print(evaluation.summary(result.metrics))
      print(f'Wrote {written[0]} and {written[1]}')
    if len(jobs) > 1:
      print(evaluation.directions_table([j[0] for j in jobs], [r.metrics for r in results]))


def _evaluate_one(translator, checkpoint, workdirs, name, direction, sources, references):
  """Translates and scores one set of sentences (the --max_sentences first)."""
  from transformer_jax.decoding import evaluation

  config, steps = checkpoint.config, checkpoint.steps
  if _MAX_SENTENCES.value:
    sources, references = sources[: _MAX_SENTENCES.value], references[: _MAX_SENTENCES.value]
  baseline = None
  if _COMPARE_TO.value:
    baseline = line_io.read_lines(_COMPARE_TO.value, 'compare_to')[: len(references)]
    if len(baseline) != len(references):
      cli.fail(
          f'--compare_to={_COMPARE_TO.value} has {len(baseline)} lines for '
          f'{len(references)} sentences.'
      )
  info = {
      'workdir': storage.resolve(workdirs[0]),
      'ensemble': (
          [
              {'workdir': storage.resolve(w), 'weight': weight}
              for w, weight in zip(workdirs, translator.weights)
          ]
          if len(workdirs) > 1
          else None
      ),
      'step': checkpoint.step,
      'checkpoint_steps': steps,
      'split': name,
      'dataset': direction.dataset if direction else config.dataset,
      'source_lang': direction.source if direction else config.source_lang,
      'target_lang': direction.target if direction else config.target_lang,
      'language_tag': translator.source_prefix.strip() or None,
      'compared_to': storage.resolve(_COMPARE_TO.value) if _COMPARE_TO.value else None,
  }
  logging.info(
      'Evaluating %s (steps %s) on %d sentences of %s.', workdirs[0], steps, len(sources), name
  )
  return evaluation.evaluate(
      translator,
      sources,
      references,
      baseline=baseline,
      bootstrap_samples=_BOOTSTRAP_SAMPLES.value,
      show_progress=_PROGRESS.value,
      info=info,
  )


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

r"""Reranks n-best lists with further models' scores: one output line a source line.

  python translate.py --workdir=EN_ES --n_best=8 --beam_size=8 --input=test.en > test.nbest
  python rerank.py --source=test.en --n_best=test.nbest --reverse=ES_EN \
      --weights=score=1,reverse=0.5 > test.reranked.es
  python rerank.py --source=test.en --n_best=test.nbest --reverse=ES_EN \
      --tune_source=valid.en --tune_n_best=valid.nbest --tune_reference=valid.es

Features of each hypothesis: `score` and `log_prob` (the n-best list's own: the length-
penalized score and log P(Y | X) of the model that wrote it), `words` (its word count), and
one a further model, its score.py SCORE: `forward` for --forward=DIR (source -> hypothesis),
`reverse` for --reverse=DIR (hypothesis -> source: the channel model of noisy-channel
reranking); several of one kind are `forward1`, `forward2`, ... A model of several target
languages (a multilingual run) scores into --target_lang (forward) or --source_lang (reverse),
whose tag starts its sources. The best weighted sum wins
(ties: the earlier hypothesis). --weights=NAME=W,... sets weights (default: score=1 and each
model 1); the --tune_* files instead search them (--tune_trials random trials, --seed) for the
best corpus sacreBLEU on a validation set, print them, and use them. A source line with no
hypotheses gets an empty line and a warning. --print_scores writes the reranked lists in the
n-best format, each line's features in its third field and its total last.

Exit codes: 0 done; 1 an unexpected error; 2 a flag, file, work directory or checkpoint problem
(explained in one paragraph; the traceback only with --verbose).
"""

import contextlib
import sys

from absl import flags

from transformer_jax import errors
from transformer_jax.commands import cli
from transformer_jax.commands import line_io
from transformer_jax.decoding import reranking
from transformer_jax.storage import paths

_SOURCE = flags.DEFINE_string('source', None, 'The source lines the n-best list translates.')
_N_BEST = flags.DEFINE_string('n_best', None, 'Their n-best list (translate.py --n_best=K).')
_FORWARD = flags.DEFINE_multi_string(
    'forward', [], 'A work directory of another source -> target model (feature `forward`).'
)
_REVERSE = flags.DEFINE_multi_string(
    'reverse', [], 'A work directory of a target -> source model (feature `reverse`).'
)
_WEIGHTS = flags.DEFINE_list(
    'weights', None, 'NAME=WEIGHT,... of the features (default: score=1 and each model 1).'
)
_OUTPUT = flags.DEFINE_string('output', '-', "The best hypothesis a line ('-': stdout).")
_PRINT_SCORES = flags.DEFINE_bool(
    'print_scores', False, 'Write the reranked n-best lists with their features instead.'
)
_TUNE_SOURCE = flags.DEFINE_string('tune_source', None, 'Validation sources, to tune weights.')
_TUNE_N_BEST = flags.DEFINE_string('tune_n_best', None, 'Their n-best list.')
_TUNE_REFERENCE = flags.DEFINE_string('tune_reference', None, 'Their references.')
_TUNE_TRIALS = flags.DEFINE_integer('tune_trials', 200, 'Random weight trials when tuning.')
_SEED = flags.DEFINE_integer('seed', 0, "The tuning search's random seed.")
_BATCH_SIZE = flags.DEFINE_integer('batch_size', None, 'Pairs scored together.')
_SOURCE_LANG = flags.DEFINE_string(
    'source_lang',
    None,
    "The sources' language, for --reverse models of several target languages (they "
    'translate into it).',
)
_TARGET_LANG = flags.DEFINE_string(
    'target_lang',
    None,
    "The hypotheses' language, for --forward models of several target languages.",
)
_COMPILATION_CACHE_DIR = cli.define_compilation_cache_flag()


def _model_names() -> list[tuple[str, str, bool]]:
  """(feature name, work directory, is reverse) of each further model."""
  models = []
  for kind, workdirs in (('forward', _FORWARD.value), ('reverse', _REVERSE.value)):
    for i, workdir in enumerate(workdirs, 1):
      models.append((kind if len(workdirs) == 1 else f'{kind}{i}', workdir, kind == 'reverse'))
  return models


def _parse_weights(features: list[str]) -> dict[str, float] | None:
  if _WEIGHTS.value is None:
    return None
  weights = {}
  for item in _WEIGHTS.value:
    name, _, value = item.partition('=')
    try:
      weights[name.strip()] = float(value)
    except ValueError:
      cli.fail(f'--weights: {item!r} is not NAME=NUMBER (e.g. --weights=score=1,reverse=0.5).')
  reranking.check_weights(weights, features)  # A UserError: one paragraph, exit 2.
  return weights


def _check_flags() -> tuple[list[str], dict[str, float] | None]:
  tune = [_TUNE_SOURCE.value, _TUNE_N_BEST.value, _TUNE_REFERENCE.value]
  if any(tune) and not all(tune):
    cli.fail('--tune_source, --tune_n_best and --tune_reference go together.')
  if bool(_SOURCE.value) != bool(_N_BEST.value):
    cli.fail('--source and --n_best go together.')
  if not _SOURCE.value and not all(tune):
    cli.fail('give --source and --n_best to rerank (and/or the --tune_* files to tune).')
  if _TUNE_TRIALS.value < 1:
    cli.fail(f'--tune_trials={_TUNE_TRIALS.value} must be >= 1.')
  models = _model_names()
  if not models:
    cli.fail('give a model to rerank with: --reverse=DIR (target -> source) or --forward=DIR.')
  inputs = {'--source': _SOURCE.value, '--n_best': _N_BEST.value}
  inputs.update({'--tune_source': tune[0], '--tune_n_best': tune[1], '--tune_reference': tune[2]})
  for flag, path in inputs.items():
    if path:
      paths.check_input_file(path, flag)
  for name, workdir, _ in models:
    paths.check_input_directory(workdir, f'--{name.rstrip("0123456789")}', 'a work directory')
    inputs[f'--{name}'] = workdir
  if _OUTPUT.value != '-':
    paths.check_output_file(_OUTPUT.value, '--output', inputs)
  features = ['score', *[name for name, _, _ in models], 'log_prob', 'words']
  return features, _parse_weights(features)


def _read(source_path: str, n_best_path: str, flag: str) -> tuple[list[str], list]:
  sources = line_io.read_lines(source_path, flag)
  lines = line_io.read_lines(n_best_path, flag.replace('source', 'n_best'))
  return sources, reranking.parse_n_best(lines, len(sources), n_best_path)


def _add_model_features(sources, lists, scorers) -> None:
  """Scores every (source, hypothesis) pair with each further model into its features."""
  pairs = [(s, c) for s, candidates in zip(sources, lists) for c in candidates]
  for name, scorer, reverse in scorers:
    hypotheses = [c.text for _, c in pairs]
    texts = [s for s, _ in pairs]
    scores, _ = scorer.score(hypotheses, texts) if reverse else scorer.score(texts, hypotheses)
    failed = 0
    for (_, candidate), s in zip(pairs, scores):
      candidate.features[name] = s.score if not s.error else -1e9
      failed += bool(s.error)
    if failed:
      cli.warn(f'{failed} hypotheses could not be scored by {name} (given -1e9): {s.error}.')


def main(argv: list[str]) -> None:
  del argv  # Unused.
  features, weights = _check_flags()
  models = _model_names()
  sets = {}
  if _TUNE_SOURCE.value:
    sets['tune'] = _read(_TUNE_SOURCE.value, cli.given(_TUNE_N_BEST), 'tune_source')
    references = line_io.read_lines(cli.given(_TUNE_REFERENCE), 'tune_reference')
    if len(references) != len(sets['tune'][0]):
      cli.fail(f'--tune_reference has {len(references)} lines for {len(sets["tune"][0])} sources.')
  if _SOURCE.value:
    sets['test'] = _read(_SOURCE.value, cli.given(_N_BEST), 'source')

  from transformer_jax.decoding import scoring
  from transformer_jax.decoding import translator as translator_lib

  cli.use_compilation_cache(_COMPILATION_CACHE_DIR.value)
  scorers = []
  with cli.quiet_loading():
    for name, workdir, reverse in models:
      language, flag = (_SOURCE_LANG, 'source') if reverse else (_TARGET_LANG, 'target')
      try:
        translator, _ = translator_lib.load_translator(
            workdir, batch_size=_BATCH_SIZE.value, target_lang=language.value
        )
      except errors.ConfigError as e:  # A multilingual model: which language it scores into.
        cli.fail(
            f'--{"reverse" if reverse else "forward"}={workdir}: {e} Here that is '
            f'--{flag}_lang, the {"sources" if reverse else "hypotheses"}\' language.'
        )
      scorers.append((name, scoring.Scorer(translator), reverse))
  for sources, lists in sets.values():
    _add_model_features(sources, lists, scorers)

  if 'tune' in sets:
    tuned_features = ['score', *[name for name, _, _ in models], 'words']
    result = reranking.tune(
        sets['tune'][1], references, tuned_features, _TUNE_TRIALS.value, _SEED.value
    )
    weights = result.weights
    shown = ','.join(f'{k}={v:.4g}' for k, v in weights.items())
    print(
        f'{cli.program()}: tuned --weights={shown}: BLEU {result.bleu:.2f} on the '
        f'{len(references)} tuning sentences (score alone: {result.baseline_bleu:.2f}; '
        f'{result.trials} trials).',
        file=sys.stderr,
    )
  if weights is None:
    weights = {'score': 1.0, **{name: 1.0 for name, _, _ in models}}
  if 'test' not in sets:
    return
  _, lists = sets['test']
  picks = reranking.rerank(lists, weights)
  with contextlib.ExitStack() as stack:
    output = line_io.open_output(stack, _OUTPUT.value)
    for index, (candidates, pick) in enumerate(zip(lists, picks)):
      if pick < 0:
        cli.warn(f'line {index + 1}: no hypotheses in --n_best; writing an empty line.')
      if not _PRINT_SCORES.value:
        output.write((candidates[pick].text if pick >= 0 else '') + '\n')
        continue
      ranked = sorted(candidates, key=lambda c: -reranking.total(c, weights))
      for c in ranked:
        shown = ' '.join(f'{k}= {v:.6g}' for k, v in c.features.items())
        output.write(f'{index} ||| {c.text} ||| {shown} ||| {reranking.total(c, weights):.6g}\n')
    output.flush()


flags.adopt_module_key_flags(cli)


def run() -> None:
  """The console script's entry point."""
  cli.run(main)


if __name__ == '__main__':
  run()

"""Evaluation: translate a test split, score it, write hypotheses and metrics.

Three BLEU-family numbers, each for a purpose:

  * sacreBLEU on detokenized output (`tok:13a`, mixed case), with its signature: the number to
    report and compare across papers;
  * chrF (sacreBLEU's chrF2), with its signature;
  * tokenized BLEU with compound splitting, to compare with the paper's tables. tensor2tensor's
    `get_ende_bleu.sh` (the paper's scoring) runs the Moses tokenizer on both sides, splits
    hyphenated compounds (`rich-text` -> `rich ##AT##-##AT## text`) and scores with
    `multi-bleu.perl` on whitespace tokens. Here sacreBLEU's 13a tokenizer (mteval-v13a, the
    closest Moses-like tokenizer sacreBLEU has; `intl` would split the hyphens itself) stands in
    for Moses, the same compound regex follows, and sacreBLEU scores with `tokenize='none'`
    like multi-bleu.perl. Expect it to be close to, not identical with, the Moses pipeline.

Paired bootstrap resampling against a second system uses sacreBLEU's `PairedTest`.
Results go to `WORKDIR/eval/<tag>/` (tag: `step_<N>` or `avg<K>_step_<first>-<last>`), next to
the run's `checkpoints/`: `<split>.hyp.txt`, one hypothesis a line, and `<split>.metrics.json`.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
import re
import sys
from typing import Any

from absl import logging
import sacrebleu
from sacrebleu.metrics import BLEU
from sacrebleu.metrics import CHRF
from sacrebleu.significance import PairedTest
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
import tqdm

from transformer_jax.decoding.translator import DecodeOptions
from transformer_jax.decoding.translator import DecodeStats
from transformer_jax.decoding.translator import Translator
from transformer_jax.storage import storage

# tensor2tensor's get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'.
_COMPOUND = re.compile(r'(\S)-(\S)')
_TOKENIZE_13A = Tokenizer13a()
TOKENIZED_BLEU_METHOD = (
    '13a tokenization, hyphen compound splitting (##AT##-##AT##), BLEU '
    "on whitespace tokens (sacrebleu tokenize='none'), as "
    "tensor2tensor's get_ende_bleu.sh with 13a in place of Moses"
)


def split_compounds(text: str) -> str:
  """'rich-text format' -> 'rich ##AT##-##AT## text format' (non-overlapping, like perl)."""
  return _COMPOUND.sub(r'\1 ##AT##-##AT## \2', text)


def tokenize_for_bleu(text: str) -> str:
  """The tokenized-BLEU preprocessing of one sentence: 13a tokenization, then compounds."""
  return split_compounds(_TOKENIZE_13A(text.strip()))


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """BLEU in the paper's style (see the module docstring), on detokenized inputs."""
  # force: the input is tokenized on purpose; no "forgot to detokenize" warning.
  return (
      BLEU(tokenize='none', force=True)
      .corpus_score(
          [tokenize_for_bleu(h) for h in hypotheses], [[tokenize_for_bleu(r) for r in references]]
      )
      .score
  )


def _check_lengths(hypotheses: Sequence[str], references: Sequence[str]) -> None:
  if len(hypotheses) != len(references):
    raise ValueError(
        f'{len(hypotheses)} hypotheses but {len(references)} references; '
        'scoring needs one hypothesis per reference line.'
    )


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
  """sacreBLEU and chrF (with signatures) and tokenized, compound-split BLEU.

  Args:
    hypotheses: detokenized system output, one per reference.
    references: detokenized references.

  Returns:
    A JSON-ready dict: `bleu`, `bleu_signature`, `bleu_details` (sacreBLEU's line),
    `chrf`, `chrf_signature`, `tokenized_bleu`, `tokenized_bleu_method`.
  """
  _check_lengths(hypotheses, references)
  bleu, chrf = BLEU(), CHRF()
  bleu_result = bleu.corpus_score(list(hypotheses), [list(references)])
  chrf_result = chrf.corpus_score(list(hypotheses), [list(references)])
  return {
      'bleu': bleu_result.score,
      'bleu_signature': str(bleu.get_signature()),
      'bleu_details': bleu_result.format(),
      'chrf': chrf_result.score,
      'chrf_signature': str(chrf.get_signature()),
      'tokenized_bleu': tokenized_bleu(hypotheses, references),
      'tokenized_bleu_method': TOKENIZED_BLEU_METHOD,
  }


def paired_bootstrap(
    hypotheses: Sequence[str],
    baseline: Sequence[str],
    references: Sequence[str],
    num_samples: int = 1000,
) -> dict[str, Any]:
  """Paired bootstrap resampling (Koehn 2004) of this system against a baseline.

  Args:
    hypotheses: this system's output.
    baseline: the other system's output, on the same sentences.
    references: the references.
    num_samples: bootstrap resamples (sacreBLEU's default: 1000). The resampling seed is
      sacreBLEU's: 12345 unless the environment variable SACREBLEU_SEED says otherwise.

  Returns:
    {metric: {'baseline', 'system', 'system_mean', 'system_ci95', 'p_value'}} for BLEU and
    chrF, and 'signature' per metric; p is the chance that the difference is due to the
    sample (small: significant).
  """
  _check_lengths(hypotheses, references)
  _check_lengths(baseline, references)
  test = PairedTest(
      [('baseline', list(baseline)), ('system', list(hypotheses))],
      {'bleu': BLEU(), 'chrf': CHRF()},
      [list(references)],
      test_type='bs',
      n_samples=num_samples,
  )
  signatures, scores = test()
  out = {}
  for (metric, signature), results in zip(
      signatures.items(), (v for k, v in scores.items() if k != 'System')
  ):
    base, system = results
    out['bleu' if metric.startswith('BLEU') else 'chrf'] = {
        'baseline': float(base.score),
        'system': float(system.score),
        'system_mean': float(system.mean),
        'system_ci95': float(system.ci),
        'p_value': float(system.p_value),
        'signature': str(signature),
    }
  return out


def result_tag(steps: Sequence[int]) -> str:
  """'step_<N>' for one checkpoint, 'avg<K>_step_<first>-<last>' for an average."""
  if len(steps) == 1:
    return f'step_{steps[0]}'
  return f'avg{len(steps)}_step_{steps[0]}-{steps[-1]}'


def ensemble_tag(workdirs: Sequence[str], weights: Sequence[float], first_tag: str) -> str:
  """'ensemble<M>_<first_tag>_<8 hex digits>' for M models: the digits hash the members'
  work directories and weights, so that each ensemble has its own results directory."""
  members = json.dumps([list(workdirs), [round(w, 6) for w in weights]])
  digest = hashlib.sha256(members.encode()).hexdigest()[:8]
  return f'ensemble{len(workdirs)}_{first_tag}_{digest}'


def result_paths(directory: str, name: str) -> tuple[str, str]:
  """`<name>.hyp.txt` and `<name>.metrics.json` in `directory`."""
  return (
      os.path.join(directory, f'{name}.hyp.txt'),
      os.path.join(directory, f'{name}.metrics.json'),
  )


def write_results(
    directory: str, name: str, hypotheses: Sequence[str], metrics: dict[str, Any]
) -> tuple[str, str]:
  """Writes `<name>.hyp.txt` (one line each) and `<name>.metrics.json` together: both
  replace the old pair, or neither does (`storage.write_files`).

  Returns:
    The two paths.
  """
  if not storage.is_remote(directory):
    os.makedirs(directory, exist_ok=True)
  paths = result_paths(directory, name)
  storage.write_files(
      {
          paths[0]: ''.join(h + '\n' for h in hypotheses),
          paths[1]: json.dumps(metrics, indent=2, sort_keys=True) + '\n',
      }
  )
  return paths


@dataclasses.dataclass
class EvalResult:
  """What `evaluate` produced.

  Attributes:
    hypotheses: the translations, in test-set order.
    metrics: everything written to the metrics JSON.
    stats: decoding statistics.
  """

  hypotheses: list[str]
  metrics: dict[str, Any]
  stats: DecodeStats


def evaluate(
    translator: Translator,
    sources: Sequence[str],
    references: Sequence[str],
    *,
    baseline: Sequence[str] | None = None,
    bootstrap_samples: int = 1000,
    show_progress: bool = True,
    info: dict[str, Any] | None = None,
) -> EvalResult:
  """Translates `sources` with a progress bar and scores the output against `references`.

  Args:
    translator: the model to evaluate.
    sources: source sentences.
    references: one reference per source.
    baseline: another system's output on `sources`, for paired bootstrap resampling.
    bootstrap_samples: resamples for the paired test.
    show_progress: draw a tqdm bar on stderr when it is a terminal (no carriage returns in
      log files).
    info: extra entries for the metrics (checkpoint, split, ...).

  Returns:
    Hypotheses, metrics and decoding statistics.
  """
  _check_lengths(sources, references)
  if baseline is not None:
    _check_lengths(baseline, references)
  with tqdm.tqdm(
      total=len(sources),
      unit='sent',
      disable=not (show_progress and sys.stderr.isatty()),
      desc='Compiling',
      dynamic_ncols=True,
  ) as bar:
    tokens_done = 0

    def progress(sentences: int, tokens: int) -> None:
      nonlocal tokens_done
      if sentences == tokens == 0:  # Compilation is done: time the decoding alone.
        bar.set_description('Translating')
        bar.reset(total=len(sources))
      tokens_done += tokens
      elapsed = max(bar.format_dict['elapsed'], 1e-9)
      bar.set_postfix_str(f'{tokens_done / elapsed:.0f} tok/s', refresh=False)
      bar.update(sentences)

    hypotheses, stats = translator.translate(sources, progress)
  if stats.truncated:
    logging.warning(
        '%d source sentences were longer than max_len=%d tokens and were cut (lines %s).',
        len(stats.truncated),
        translator.max_source_length,
        ', '.join(str(i + 1) for i in stats.truncated[:20]),
    )
  if stats.capped:
    logging.warning(
        '%d sentences had their output limit cut to max_len=%d tokens, below '
        'their source length + %d (learned positions end there; lines %s).',
        len(stats.capped),
        translator.max_source_length,
        translator.options.max_decode_extra_length,
        ', '.join(str(i + 1) for i in stats.capped[:20]),
    )
  metrics = dict(info or {})
  metrics.update(score(hypotheses, references))
  options: DecodeOptions = translator.options
  metrics['decoding'] = {
      **dataclasses.asdict(options),
      'sentences': stats.sentences,
      'source_tokens': stats.source_tokens,
      'output_tokens': stats.output_tokens,
      'truncated_sources': len(stats.truncated),
      'capped_outputs': len(stats.capped),
      'compile_seconds': round(stats.compile_seconds, 3),
      'decode_seconds': round(stats.decode_seconds, 3),
      'sentences_per_second': round(stats.sentences_per_second, 3),
      'tokens_per_second': round(stats.tokens_per_second, 3),
  }
  if baseline is not None:
    metrics['paired_bootstrap'] = paired_bootstrap(
        hypotheses, baseline, references, bootstrap_samples
    )
  metrics['sacrebleu_version'] = sacrebleu.__version__
  return EvalResult(hypotheses, metrics, stats)


def summary(metrics: dict[str, Any]) -> str:
  """A few human-readable lines of the metrics."""
  d = metrics['decoding']
  lines = [
      f"sacreBLEU {metrics['bleu']:.2f}  ({metrics['bleu_signature']})",
      f"chrF      {metrics['chrf']:.2f}  ({metrics['chrf_signature']})",
      f"tokenized BLEU with compound splitting {metrics['tokenized_bleu']:.2f}  "
      '(compare with the paper)',
      f"{d['sentences']} sentences in {d['decode_seconds']:.1f}s "
      f"(+{d['compile_seconds']:.1f}s compiling): {d['sentences_per_second']:.1f} "
      f"sentences/s, {d['tokens_per_second']:.1f} output tokens/s",
  ]
  for metric, result in metrics.get('paired_bootstrap', {}).items():
    lines.append(
        f"paired bootstrap {metric}: baseline {result['baseline']:.2f}, this "
        f"{result['system']:.2f} ({result['system_mean']:.2f} +- "
        f"{result['system_ci95']:.2f}), p = {result['p_value']:.4f}"
    )
  return '\n'.join(lines)


def directions_table(names: Sequence[str], metrics: Sequence[dict[str, Any]]) -> str:
  """A multilingual evaluation's table: sacreBLEU and chrF of each direction (`names`: its
  results' names, '<split>.<src>-<tgt>'), then their unweighted average."""
  width = max(len('average'), *(len(n) for n in names))
  lines = [f'{"direction":<{width}}  sacreBLEU   chrF  sentences']
  for name, m in zip(names, metrics):
    lines.append(
        f"{name:<{width}}  {m['bleu']:9.2f}  {m['chrf']:5.2f}  {m['decoding']['sentences']:9d}"
    )
  bleu = sum(m['bleu'] for m in metrics) / len(metrics)
  chrf = sum(m['chrf'] for m in metrics) / len(metrics)
  total = sum(m['decoding']['sentences'] for m in metrics)
  lines.append(f'{"average":<{width}}  {bleu:9.2f}  {chrf:5.2f}  {total:9d}')
  return '\n'.join(lines)

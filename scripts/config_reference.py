"""Writes docs/config.md, the reference of every config field, from transformer_jax/config.py.

One source of truth: the defaults come from `base_config()`, each field's meaning from the
comment beside it (or the comment lines above it) there, its allowed values from the tuples of
choices the checks use, and whether a resumed run may change it from `RESUMABLE_FIELDS`.
tests/test_docs.py fails when the page is stale (or a field has no comment).

  python scripts/config_reference.py           # rewrites docs/config.md
  python scripts/config_reference.py --check   # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import inspect
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from transformer_jax import config as config_lib  # noqa: E402
from transformer_jax.training import optimizer  # noqa: E402

PAGE = os.path.join(REPO, 'docs', 'config.md')

CHOICES = {
    'positional_encoding': config_lib.POSITIONAL_ENCODINGS,
    'sinusoid_layout': config_lib.SINUSOID_LAYOUTS,
    'norm_position': config_lib.NORM_POSITIONS,
    'activation': config_lib.ACTIVATIONS,
    'output_vocabulary': config_lib.OUTPUT_VOCABULARIES,
    'decoder_start': tuple(config_lib.DECODER_STARTS),
    'dtype': config_lib.DTYPE_CHOICES,
    'remat_policy': config_lib.REMAT_POLICIES,
    'attention_implementation': config_lib.ATTENTION_IMPLEMENTATIONS,
    'nonfinite': config_lib.NONFINITE_MODES,
    'dropout_rng_impl': config_lib.DROPOUT_RNG_IMPLS,
    'length_penalty_form': config_lib.LENGTH_PENALTY_FORMS,
    'best_checkpoint_metric': tuple(config_lib.BEST_CHECKPOINT_METRICS),
    'vocab_model_type': config_lib.VOCAB_MODEL_TYPES,
    'lr_schedule': optimizer.SCHEDULES,
}

_SECTION = re.compile(r'^\s*# --- (?P<name>.+?)\.? ---\s*$')
_FIELD = re.compile(r'^  c\.(?P<name>\w+) = (?P<rest>.*)$')


def fields() -> list[tuple[str, str, str]]:
  """(section, field, description) for each field of `base_config`, in its order."""
  out, section, comments = [], '', []
  for line in inspect.getsource(config_lib.base_config).splitlines():
    if match := _SECTION.match(line):
      section, comments = match['name'], []
    elif match := _FIELD.match(line):
      rest = match['rest']
      beside = rest.split('  # ', 1)[1].strip() if '  # ' in rest else ''
      out.append((section, match['name'], ' '.join(comments + [beside]).strip()))
      comments = []
    elif line.strip().startswith('#'):
      comments.append(line.strip().lstrip('#').strip())
    elif not line.strip():
      comments = []
  return out


def _cell(text: str) -> str:
  return text.replace('|', '\\|')


def render() -> str:
  """The page's text."""
  defaults = config_lib.base_config()
  lines = [
      '# Config reference',
      '',
      'Every field of `base_config()` (`transformer_jax/config.py`), which every file in',
      '`configs/` starts from; set one on the command line with `--config.FIELD=VALUE`.',
      'Written by `python scripts/config_reference.py` from the code (defaults, the comments',
      "beside each field, the checks' choices); a test fails when this page is stale.",
      '"Resume" says whether a resumed run may change the field; any other difference from',
      "the checkpoint's config stops the resume.",
  ]
  section = None
  for field_section, name, description in fields():
    if field_section != section:
      section = field_section
      lines += [
          '',
          f'## {section}',
          '',
          '| Field | Default | Allowed | Resume | Meaning |',
          '|---|---|---|---|---|',
      ]
    value = defaults[name]
    default = repr(value.to_dict() if hasattr(value, 'to_dict') else value)
    allowed = ', '.join(f'`{c!r}`' for c in CHOICES[name]) if name in CHOICES else ''
    resume = 'yes' if name in config_lib.RESUMABLE_FIELDS else ''
    lines.append(
        f'| `{name}` | `{_cell(default)}` | {_cell(allowed)} | {resume} | '
        f'{_cell(description)} |'
    )
  return '\n'.join(lines) + '\n'


def main(argv: list[str]) -> int:
  text = render()
  if '--check' in argv:
    with open(PAGE, encoding='utf-8') as f:
      if f.read() != text:
        print(f'{PAGE} is stale: run python scripts/config_reference.py', file=sys.stderr)
        return 1
    return 0
  os.makedirs(os.path.dirname(PAGE), exist_ok=True)
  with open(PAGE, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'Wrote {PAGE}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))

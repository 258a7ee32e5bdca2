"""The Transformer of "Attention Is All You Need" in JAX/Flax.

The public API, importable from here:

    from transformer_jax import Transformer, TransformerConfig, base_config
    model = Transformer(TransformerConfig.from_config(base_config(), vocab_size=32000))

- `Transformer`, `TransformerConfig`: the model (a linen module) and its frozen config.
- `base_config`: the run config every file in `configs/` starts from.
- `train_and_evaluate`: a whole training run into a work directory (what train.py runs).
- `load`: a checkpoint (or the average of the last ones) ready for inference.
- `Translator`, `load_translator`: batched translation of text; `beam_search`,
  `greedy_search`, `sample`: the searches over a key/value cache, with their `SearchOptions`.

The package's folders, one concern each (a folder imports only the folders below it in this
list, never one above; `tests/test_layout.py` checks it):

- `errors.py`, `config.py` (the root): errors a user can fix, and every run config field.
- `storage/`: bytes and paths, local or gs://, the work directory's layout and lock.
- `runtime/`: the device mesh, the processes of a job, host memory.
- `data/`: parallel text to device batches.
- `model/`: the paper's model; `model/kernels/` the platform-specific kernels behind it.
- `checkpoints/`: saving, averaging and loading checkpoints.
- `decoding/`: search, translation and evaluation.
- `training/`: the optimizer, the steps and the loop.
- `aot/`, `interop/`: compiling for absent hardware; other toolkits' models.
- `commands/`: the command-line programs.

Names are imported on first use (PEP 562), so `import transformer_jax.config` does not import
the model, the data pipeline or Orbax.
"""

from __future__ import annotations

import importlib
from typing import Any

# {public name: the module that defines it}.
_PUBLIC = {
    'Transformer': 'transformer_jax.model.models',
    'TransformerConfig': 'transformer_jax.model.config',
    'base_config': 'transformer_jax.config',
    'train_and_evaluate': 'transformer_jax.training.train_loop',
    'load': 'transformer_jax.checkpoints.loading',
    'Translator': 'transformer_jax.decoding.translator',
    'load_translator': 'transformer_jax.decoding.translator',
    'beam_search': 'transformer_jax.decoding.decode',
    'greedy_search': 'transformer_jax.decoding.decode',
    'sample': 'transformer_jax.decoding.decode',
    'SearchOptions': 'transformer_jax.decoding.decode',
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
  if name not in _PUBLIC:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_PUBLIC))

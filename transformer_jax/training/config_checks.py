"""A whole run config, checked before anything is built or compiled.

`config.validate` checks the fields `config.py` owns; the model's, the optimizer's and
decoding's fields are checked by the dataclasses that own them (`TransformerConfig`,
`optimizer.OptimizerConfig`, `translator.DecodeOptions`), the directions by
`languages.directions` and the training sources' weights by `corpora.sources` (their files
are read where training opens them); all sit above `config.py`. `validate_run` runs all six,
so that a command refuses any bad field in one place, before its first slow step.
"""

from __future__ import annotations

import ml_collections

from transformer_jax import config as config_lib
from transformer_jax.data import corpora
from transformer_jax.data import languages
from transformer_jax.decoding import translator
from transformer_jax.model.config import TransformerConfig
from transformer_jax.training import optimizer


def validate_run(
    config: ml_collections.ConfigDict, *, vocab_size: int | None = None, training: bool = False
) -> None:
  """Checks every field of a run config (see `config.validate` for the arguments).

  Raises:
    ConfigError: the first field that cannot work, with what to set instead.
  """
  config_lib.validate(config, vocab_size=vocab_size, training=training)
  TransformerConfig.from_config(config, vocab_size=vocab_size or config.vocab_size_target)
  optimizer.OptimizerConfig.from_config(config, config.d_model)
  translator.DecodeOptions.from_config(config)
  languages.directions(config)
  corpora.sources(config, read=False)

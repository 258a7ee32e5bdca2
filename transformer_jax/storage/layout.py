"""The layout of a run's work directory: every path of a run, named in one place.

    workdir/
      checkpoints/      Orbax checkpoints, one folder a step (`checkpoints.checkpointing`)
      eval/             evaluate.py's results, one folder a checkpoint (`commands.evaluate`)
      metrics.jsonl     a JSON line a logged step (`training.metrics_writer`)
      tensorboard/      TensorBoard's event files (`training.metrics_writer`)
      profile/          jax.profiler traces (`training.train_loop`, `profile_steps`)
      train.lock        the one training job's lock (`storage.workdir_lock`)
      vocab/            the SentencePiece model, unless `vocab_path` names one (`data`)
      tokens/           token stores when the vocabulary's folder is not writable (`data`)

The vocabulary and token stores are read as local files (SentencePiece reads files, token
stores are memory-mapped), so for a gs:// work directory they live in its local cache
(`storage.local_cache`) and are published to the bucket from there. A module receives the path
it needs from a `RunLayout`, made once from the work directory; no other module spells these
names.
"""

from __future__ import annotations

import dataclasses
import os

from transformer_jax.storage import storage


@dataclasses.dataclass(frozen=True)
class RunLayout:
  """Every path of one run. Make it with `RunLayout.of(workdir)`.

  Attributes:
    root: the work directory: an absolute local path or a gs:// URL.
    local: where the run's locally read files live: the work directory as given, or the local
      cache of a gs:// one.
  """

  root: str
  local: str

  @classmethod
  def of(cls, workdir: str) -> RunLayout:
    local = storage.local_cache(workdir) if storage.is_remote(workdir) else workdir
    return cls(root=storage.resolve(workdir), local=local)

  def _under(self, name: str) -> str:
    return f'{self.root}/{name}'

  @property
  def checkpoints(self) -> str:
    return self._under('checkpoints')

  @property
  def evaluations(self) -> str:
    return self._under('eval')

  @property
  def metrics(self) -> str:
    return self._under('metrics.jsonl')

  @property
  def tensorboard(self) -> str:
    return self._under('tensorboard')

  @property
  def profile(self) -> str:
    return self._under('profile')

  @property
  def lock(self) -> str:
    return self._under('train.lock')

  @property
  def vocab(self) -> str:
    return os.path.join(self.local, 'vocab')

  @property
  def tokens(self) -> str:
    return os.path.join(self.local, 'tokens')

  @staticmethod
  def is_run(directory: str) -> bool:
    """Whether a local `directory` is some run's work directory (it has checkpoints)."""
    return os.path.isdir(RunLayout.of(directory).checkpoints)

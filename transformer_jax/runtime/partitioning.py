"""The device mesh and every sharding of the run, resolved in this one module.

The model names the axes of its parameters and activations logically (`batch, length, embed,
mlp, heads, kv, vocab`); the config maps those names onto the three mesh axes

  * `data`:   pure data parallelism: parameters replicated, the batch split;
  * `fsdp`:   data parallelism with parameters and optimizer state split as well (ZeRO-3);
  * `tensor`: tensor (model) parallelism over heads, the feed-forward width and the vocabulary.

Nothing outside this module names a mesh axis or builds a `PartitionSpec`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import math
from typing import Any

from absl import logging
import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import ml_collections
import numpy as np

from transformer_jax.config import ConfigError

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('batch', 'length')  # Logical axes of every batch array: [batch, length].

LogicalRules = tuple[tuple[str, Any], ...]


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """The mesh axis sizes, with one -1 filled in so that the product is `num_devices`.

  Args:
    mesh_config: {'data': int, 'fsdp': int, 'tensor': int}; at most one may be -1.
    num_devices: devices in the whole job (all hosts).

  Returns:
    Sizes in `MESH_AXES` order.

  Raises:
    ConfigError: unknown axes, several -1, or sizes whose product is not the device count.
  """
  unknown = sorted(set(mesh_config) - set(MESH_AXES))
  if unknown:
    raise ConfigError(f'config.mesh has unknown axes {unknown}; the axes are {MESH_AXES}.')
  sizes = [int(mesh_config.get(axis, 1)) for axis in MESH_AXES]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(
        f'config.mesh={dict(zip(MESH_AXES, sizes))} is invalid: sizes must be positive, '
        'with at most one -1 (meaning "all remaining devices").'
    )
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(
          f'config.mesh={dict(zip(MESH_AXES, sizes))}: the fixed axes ({known} devices) '
          f'do not divide the {num_devices} devices of this job; choose sizes whose '
          f'product divides {num_devices}, e.g. --config.mesh.fsdp=1 --config.mesh.tensor=1.'
      )
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ConfigError(
        f'config.mesh={dict(zip(MESH_AXES, sizes))} needs {known} devices but this job has '
        f'{num_devices}; set one axis to -1 (e.g. --config.mesh.data=-1) or make the '
        f'product {num_devices}.'
    )
  return tuple(sizes)


def normalize_rules(rules: Sequence[Sequence[Any]]) -> LogicalRules:
  """Logical-axis rules as hashable tuples (a JSON round trip turns them into lists).

  Raises:
    ConfigError: a rule is malformed or names a mesh axis that does not exist.
  """
  normalized = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ConfigError(
          f'logical_axis_rules entry {rule!r} must be (logical_name, '
          'mesh_axes), e.g. ("mlp", "tensor").'
      )
    name, target = rule
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
      raise ConfigError(
          f'logical_axis_rules maps {name!r} onto unknown mesh axes {bad}; '
          f'the mesh axes are {MESH_AXES}.'
      )
    if target is None or isinstance(target, str):
      normalized.append((name, target))
    else:
      normalized.append((name, tuple(target)))
  return tuple(normalized)


class Partitioner:
  """A device mesh plus the logical-axis rules, and the shardings they imply.

  Attributes:
    mesh: the `jax.sharding.Mesh` with axes `MESH_AXES`.
    rules: the logical-axis rules.
  """

  def __init__(self, mesh: Mesh, rules: LogicalRules):
    self.mesh = mesh
    self.rules = rules

  @classmethod
  def from_config(
      cls, config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None
  ) -> 'Partitioner':
    """Builds the mesh of `config.mesh` over all devices of the job (every host).

    Args:
      config: the run config (`mesh`, `logical_axis_rules`).
      devices: defaults to `jax.devices()`.

    Raises:
      ConfigError: the mesh does not fit the devices or the rules are malformed.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(config.mesh, len(devices))
    rules = normalize_rules(config.logical_axis_rules)
    try:
      # Topology-aware placement on TPU and GPU (neighbouring chips share the inner axes).
      device_array = mesh_utils.create_device_mesh(shape, devices)
    except (AssertionError, NotImplementedError, ValueError):
      device_array = np.asarray(devices).reshape(shape)
    return cls(Mesh(device_array, MESH_AXES), rules)

  @classmethod
  def for_inference(cls, config: ml_collections.ConfigDict) -> 'Partitioner':
    """The training mesh of `config`, or, when it does not fit these devices, pure data
    parallelism over all of them (decoding needs no particular layout)."""
    try:
      return cls.from_config(config)
    except ConfigError as e:
      logging.warning(
          'The training mesh does not fit here (%s); decoding with the batch '
          'split over all %d devices instead.',
          e,
          jax.device_count(),
      )
      data_parallel = ml_collections.ConfigDict(
          {
              'mesh': {'data': -1, 'fsdp': 1, 'tensor': 1},
              'logical_axis_rules': config.logical_axis_rules,
          }
      )
      return cls.from_config(data_parallel)

  # --- Shardings. ---

  def sharding(self, logical_axes: Sequence[str | None]) -> NamedSharding:
    """The sharding of an array whose axes have these logical names."""
    return nn.logical_to_mesh_sharding(PartitionSpec(*logical_axes), self.mesh, self.rules)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  @property
  def batch_sharding(self) -> NamedSharding:
    """[batch, length] arrays: rows split over the mesh axes the `batch` rule names."""
    return self.sharding(BATCH_AXES)

  def tree_shardings(self, boxed_tree: Any) -> Any:
    """Shardings for a pytree whose leaves may be `nn.Partitioned` (logically named) boxes.

    Unboxed leaves (step counters, optimizer counts) are replicated. The result has the
    structure of the *unboxed* tree.
    """
    specs = nn.get_partition_spec(boxed_tree)
    return nn.logical_to_mesh_sharding(specs, self.mesh, self.rules)

  @property
  def num_hosts(self) -> int:
    """The processes the mesh's devices belong to: the job's hosts (for a compile-only target,
    the target's hosts, not this process's job)."""
    return len({d.process_index for d in self.mesh.devices.flat})

  @property
  def device_kind(self) -> str:
    return self.mesh.devices.flat[0].device_kind

  @property
  def num_batch_shards(self) -> int:
    """How many distinct pieces the batch dimension is split into."""
    spec = self.batch_sharding.spec
    axes = spec[0] if len(spec) else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(self.mesh.shape[a] for a in axes)

  def rows_multiple(self, grad_accum_steps: int = 1) -> int:
    """What each host's batch row count must be a multiple of.

    Every device's share must hold whole microbatch rows, so a host's rows must divide
    evenly among its batch shards, `grad_accum_steps` times over.

    Raises:
      ConfigError: the batch shards cannot be spread evenly over the hosts.
    """
    shards, hosts = self.num_batch_shards, self.num_hosts
    if shards % hosts:
      raise ConfigError(
          f'The batch is split into {shards} pieces (the mesh axes that the "batch" rule '
          f'names), which {hosts} hosts cannot share evenly; make data*fsdp a multiple of '
          'the number of hosts.'
      )
    return shards // hosts * grad_accum_steps

  # --- Placement. ---

  def shard_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This host's rows of a batch -> global arrays split over the batch mesh axes.

    Each host passes its own rows; the global batch is their concatenation in host order.
    """
    sharding = self.batch_sharding
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
    }

  @contextlib.contextmanager
  def activate(self) -> Iterator[None]:
    """Tracing context in which the model's `with_logical_constraint`s take effect."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def describe(self) -> str:
    """One line for the log: the mesh shape and the device kind."""
    shape = ', '.join(f'{k}={v}' for k, v in self.mesh.shape.items())
    return (
        f'mesh ({shape}) over {self.mesh.size} {self.device_kind} devices '
        f'on {self.num_hosts} host(s)'
    )

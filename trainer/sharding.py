"""Device mesh and a sharding rule for every parameter, so the one jitted train step runs on a mesh.

Why this shape: the model is plain jit code (no shard_map), so placing the inputs is all it takes; XLA's
SPMD partitioner inserts the collectives. The rules are the usual ones for an MoE:

- the batch is split over every mesh axis ("data", and "fsdp"/"expert" too, which act as extra data
  parallelism outside the expert layers), so no device computes attention twice;
- routed-expert weights ``[E, ...]`` are split over "expert" along E (expert parallelism);
- with an "fsdp" axis, every matrix is also split along its largest dimension that divides evenly
  (ZeRO-3 style; weights are gathered on use);
- norms and anything that does not divide evenly are replicated. A rule never fails: it degrades to
  replication, so small test models run on any mesh.

``TrainConfig.param_sharding="zero3"`` is FSDP over the data-parallel axes (ZeRO-3) rather than over a
separate "fsdp" axis: every mesh axis carries data parallelism outside the expert layers, so a dense
matrix is split over all of them (as many as divide one of its dimensions: the largest group first,
leftover axes on another dimension), and a routed expert's ``[E, ...]`` over "expert" on E and over the
other axes on another dimension (Marin's hero: dense weights over (data, expert), experts over expert on
E and data elsewhere). The optimizer state follows its parameter (``param_shardings`` on its tree), and
the gradient of a split weight is reduced to its shard: a reduce-scatter where the backend forms one
(XLA:GPU/TPU turn the partitioner's all-reduce + dynamic-slice into it; XLA:CPU keeps the pair, see
tests/test_trainer_precision.py).

Axis order is data, fsdp, expert (expert innermost, so an expert group sits on neighbouring devices).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from trainer.config import ModelConfig
from trainer.layers_scan import layer_axis_repeats

MESH_AXES = ("data", "fsdp", "expert")


def make_mesh(axes: dict[str, int] | None = None, *, devices: list | None = None) -> Mesh:
    """A mesh over the first prod(axes) devices; None puts all devices on "data"."""
    devices = list(devices if devices is not None else jax.devices())
    axes = dict(axes or {"data": len(devices)})
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {MESH_AXES}.")
    names = tuple(a for a in MESH_AXES if a in axes)
    shape = tuple(int(axes[a]) for a in names)
    size = int(np.prod(shape))
    if size > len(devices):
        raise ValueError(f"mesh {dict(zip(names, shape))} needs {size} devices but only {len(devices)} are visible.")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices[:size])


def _axis_size(mesh: Mesh, name: str) -> int:
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


PARAM_SHARDING_RULES = ("default", "zero3")


def _zero3_spec(spec: list, shape: tuple[int, ...], mesh: Mesh) -> list:
    """Split ``shape`` further over every mesh axis ``spec`` does not use yet: the largest group of axes whose
    product divides a free dimension goes on the largest such dimension, then the same for what is left."""
    left = [a for a in MESH_AXES if _axis_size(mesh, a) > 1 and a not in spec]
    while left:
        best = None
        for size in range(len(left), 0, -1):
            for group in itertools.combinations(left, size):
                split = math.prod(_axis_size(mesh, a) for a in group)
                free = [i for i in range(len(shape)) if spec[i] is None and shape[i] % split == 0]
                if free and (best is None or split > best[0]):
                    best = (split, group, max(free, key=lambda i: shape[i]))
        if best is None:
            break
        _, group, dim = best
        spec[dim] = group[0] if len(group) == 1 else group
        left = [a for a in left if a not in group]
    return spec


def param_partition_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rule: str = "default") -> P:
    """Sharding rule of one parameter from its path and shape; ``rule`` is ``TrainConfig.param_sharding``
    (see module docstring)."""
    if rule not in PARAM_SHARDING_RULES:
        raise ValueError(f"unknown train.param_sharding {rule!r}; use one of {PARAM_SHARDING_RULES}.")
    if layer_axis_repeats(path) is not None:  # stacked layers (trainer/layers_scan.py): the layer axis stays whole
        layer_path = tuple(name for name in path if layer_axis_repeats((name,)) is None)
        return P(None, *param_partition_spec(layer_path, shape[1:], mesh, rule))
    spec: list = [None] * len(shape)
    if len(shape) < 2:
        return P(*spec)
    expert_size = _axis_size(mesh, "expert")
    if "experts" in path and expert_size > 1 and shape[0] % expert_size == 0:
        spec[0] = "expert"
    if rule == "zero3":
        return P(*_zero3_spec(spec, shape, mesh))
    fsdp_size = _axis_size(mesh, "fsdp")
    if fsdp_size > 1:
        free = [i for i in range(len(shape)) if spec[i] is None and shape[i] % fsdp_size == 0]
        if free:
            spec[max(free, key=lambda i: shape[i])] = "fsdp"
    return P(*spec)


def param_shardings(params: Any, cfg: ModelConfig, mesh: Mesh, rule: str = "default") -> Any:
    """A NamedSharding per leaf of `params`, or of any tree whose paths contain the parameter paths
    (e.g. an optax AdamW state: its mu/nu get their parameter's sharding, its step count is replicated).
    ``rule`` is ``TrainConfig.param_sharding``."""
    del cfg  # the rules read each leaf's path and shape; cfg stays in the signature for future rules

    def leaf_sharding(path, leaf):
        # DictKey.key, SequenceKey.idx, GetAttrKey.name (optax states): the rule works on optimizer state too
        names = tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
        return NamedSharding(mesh, param_partition_spec(names, tuple(np.shape(leaf)), mesh, rule))

    return jax.tree_util.tree_map_with_path(leaf_sharding, params)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in MESH_AXES if a in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over every mesh axis; the global batch must divide by the device count."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """For the router state, optimizer scalars and metrics."""
    return NamedSharding(mesh, P())

"""MuonH and AdamH: Marin's optimizer for its 535B hero, as optax transformations.

Why this module: Marin trained its ladder and hero with three optimizer groups (``experiments/grug/
moe_hero_ep/optimizer.py``): **MuonH** for every matrix and the GatedNorm gates, **AdamH** for the
lm_head, plain **Adam** for embeddings, router, per-head gates, 1-D gains and conv kernels. A forecast is
only as good as the recipe the ladder shares with the hero, so the trainer runs the same three groups.

What optax already has, and what is written here:

- momentum: ``optax.trace(decay=0.95, nesterov=True)`` is exactly Marin's ``buf = mu * buf + g``,
  ``update = mu * buf + g`` (torch-style: no dampening, no bias correction). ``optax.contrib.muon`` is
  *not* the same: its momentum is an EMA with bias correction, ``(1 - b) g + b m`` over
  ``1 - b^t``, which weighs the current gradient differently for the first ~50 steps; its
  Newton-Schulz orthogonaliser is private (``optax.contrib._muon``) and its state carries the NS
  coefficients. So the momentum is optax's and the orthogonalisation is here (a few lines), checked
  against optax's private one in tests/test_trainer_muon.py.
- Newton-Schulz (``newton_schulz``): Marin's "quintic" schedule (five (a, b, c) triples, one per step,
  the same as optax's ``"dion"`` preset), Frobenius pre-normalisation ``X / (||X||_F + eps)``, the wide
  orientation (transpose when rows > columns). Marin runs it in bfloat16 (``ns_dtype``); float32 is the
  default here because XLA:CPU emulates bf16 matmuls. Non-2-D leaves are a stack or a reshaped matrix,
  named by ``optax.contrib.MuonDimensionNumbers``: routed experts ``[E, din, F]`` are E matrices
  (batched NS over E, which stays sharded over the "expert" mesh axis: no gather of the experts), an
  attention ``wq [d, H, K]`` is one ``d x HK`` matrix, ``wo [H, K, d]`` one ``HK x d`` matrix, and any
  leading stack axis (layers) is a batch axis.
- the hyperball step (``hyperball``), which optax lacks: with ``r = ||W||_F`` per matrix,
  ``W' = W - lr * r * U / ||U||_F``, then ``W' <- r * W' / ||W'||_F``; the update is ``W' - W``. Every
  matrix keeps its Frobenius norm (its initial norm, for ever: no weight decay is needed or applied), and
  the step moves it by ``lr`` of its own norm, whatever the scale of ``U``. Marin's width scaling
  ``sqrt(max(1, fan_out / fan_in))`` is therefore a no-op and is left out.
- AdamH = ``optax.scale_by_adam`` (bias-corrected ``m / (sqrt(v) + eps)``) then the same hyperball step.
- Adam = ``optax.scale_by_adam`` then ``-adam_lr`` (decoupled weight decay only on Adam-group matrices,
  e.g. the router, when ``weight_decay > 0``; Marin's hero used none).

Learning rates: one injected hyperparameter ``learning_rate`` (the MuonH and AdamH groups, what
``optim/learning_rate`` logs); the Adam group runs at ``learning_rate * adam_learning_rate /
learning_rate`` of the same schedule, i.e. Marin's "MuonH at 13/3 of the Adam LR" by default. So
``trainer.optim.with_learning_rate`` / ``learning_rate_of`` work unchanged.

Groups come from ``trainer.model.param_groups`` labels (``GROUP_OPTIMIZER``); a group with no rule is
an error that names it, so a new parameter kind is never silently routed to the wrong optimizer.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

# Marin's "quintic" coefficients (levanter.optim.util NEWTON_SCHULZ_COEFFICIENTS["quintic"], from NVIDIA's
# Emerging-Optimizers; optax calls the same five triples "dion"): step i uses triple i.
QUINTIC_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Marin's LR heuristic: the MuonH/AdamH groups at 13/3 of the Adam group's LR.
MUONH_TO_ADAM_LR = 13 / 3

MUONH, ADAMH, ADAM = "muonh", "adamh", "adam"

# param_groups label -> optimizer group (Marin's create_mask, by role rather than by path substring).
GROUP_OPTIMIZER: dict[str, str] = {
    "attention": MUONH,
    "experts": MUONH,
    "shared_experts": MUONH,
    "latent_projection": MUONH,
    "dense_ffn": MUONH,
    "gated_norm": MUONH,  # GatedNorm low-rank gates: NS + hyperball, as Marin
    "lm_head": ADAMH,
    "embedding": ADAM,
    "router": ADAM,
    "norm": ADAM,  # 1-D RMSNorm gains
    "attention_gate": ADAM,  # per-head gate 2*sigmoid(x W_gate) (Marin's attn_gate)
    "conv": ADAM,  # short causal conv kernels (sconv)
}


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def matrix_dims(names: tuple[str, ...], ndim: int) -> MuonDimensionNumbers:
    """Which axes of a leaf form its matrix (input, output); every other axis is a stack of matrices.

    Attention projections keep heads as their own axes: ``wq/wk/wv [.., d, heads, K]`` are ``d x heads*K``
    and ``wo [.., H, K, d]`` is ``H*K x d``. Everything else is a matrix over its last two axes, with any
    leading axes (routed experts E, a stacked layer axis) as the stack.
    """
    if ndim < 2:
        raise ValueError(f"parameter {'/'.join(names)} has {ndim} axes; MuonH/AdamH need a matrix (>= 2 axes).")
    last = names[-1] if names else ""
    if "attention" in names and last in ("wq", "wk", "wv") and ndim >= 3:
        return MuonDimensionNumbers(reduction_axis=(ndim - 3,), output_axis=(ndim - 2, ndim - 1))
    if "attention" in names and last == "wo" and ndim >= 3:
        return MuonDimensionNumbers(reduction_axis=(ndim - 3, ndim - 2), output_axis=(ndim - 1,))
    return MuonDimensionNumbers(reduction_axis=(ndim - 2,), output_axis=(ndim - 1,))


def _axes(dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
    return as_tuple(dims.reduction_axis), as_tuple(dims.output_axis)


def optimizer_labels(params: Any, groups: Any) -> Any:
    """``params``-shaped tree of "muonh" / "adamh" / "adam" from the model's group labels (see module doc)."""

    def label(path, leaf, group):
        if group not in GROUP_OPTIMIZER:
            raise ValueError(
                f"parameter {'/'.join(_names(path))} has group {group!r}, which no MuonH/AdamH/Adam rule covers; "
                f"add it to trainer.muon.GROUP_OPTIMIZER (known groups: {sorted(GROUP_OPTIMIZER)})."
            )
        choice = GROUP_OPTIMIZER[group]
        if choice in (MUONH, ADAMH) and len(leaf.shape) < 2:
            return ADAM  # a vector in a matrix group (a bias): nothing to orthogonalise or keep on a sphere
        return choice

    return jax.tree_util.tree_map_with_path(label, params, groups)


# ------------------------------------------------------------------------------------------------
# Newton-Schulz


def newton_schulz(
    x: jax.Array,
    *,
    steps: int = 5,
    eps: float = 1e-8,
    coefficients: tuple[tuple[float, float, float], ...] = QUINTIC_COEFFICIENTS,
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Approximate polar factor ``U V^T`` of each matrix in ``x [..., m, n]`` (singular values near 1).

    Step i uses ``coefficients[i % len]``: ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on the wide
    orientation. Returns ``x``'s dtype.
    """
    out_dtype = x.dtype
    work = x.astype(dtype)
    tall = work.shape[-2] > work.shape[-1]
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(work.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
    work = work / (norm + eps).astype(dtype)
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        gram = work @ jnp.swapaxes(work, -1, -2)
        work = a * work + (b * gram + c * (gram @ gram)) @ work
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    return work.astype(out_dtype)


def orthogonalize(x: jax.Array, dims: MuonDimensionNumbers, **ns_kwargs) -> jax.Array:
    """Newton-Schulz of every matrix in ``x`` as ``dims`` names them (stack axes first, kept in place)."""
    reduction, output = _axes(dims)
    reduction = tuple(a % x.ndim for a in reduction)
    output = tuple(a % x.ndim for a in output)
    stack = tuple(a for a in range(x.ndim) if a not in reduction + output)
    order = stack + reduction + output
    moved = jnp.transpose(x, order) if order != tuple(range(x.ndim)) else x
    stack_shape = tuple(x.shape[a] for a in stack)
    m = math.prod(x.shape[a] for a in reduction)
    n = math.prod(x.shape[a] for a in output)
    flat = moved.reshape(stack_shape + (m, n))
    result = newton_schulz(flat, **ns_kwargs).reshape(moved.shape)
    if order != tuple(range(x.ndim)):
        result = jnp.transpose(result, tuple(order.index(a) for a in range(x.ndim)))
    return result


def _matrix_axes(dims: MuonDimensionNumbers, ndim: int) -> tuple[int, ...]:
    reduction, output = _axes(dims)
    return tuple(sorted(a % ndim for a in reduction + output))


def scale_by_newton_schulz(
    *, steps: int = 5, eps: float = 1e-8, dtype: Any = jnp.float32
) -> optax.GradientTransformation:
    """Stateless: each update leaf orthogonalised per matrix (``matrix_dims`` from its path)."""

    def update_fn(updates, state, params=None):
        del params

        def one(path, u):
            return orthogonalize(u, matrix_dims(_names(path), u.ndim), steps=steps, eps=eps, dtype=dtype)

        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


# ------------------------------------------------------------------------------------------------
# The hyperball step


def hyperball_update(param: jax.Array, direction: jax.Array, learning_rate: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``W' - W`` where ``W'`` moves ``W`` by ``learning_rate * ||W||`` along ``-direction`` and is put back
    on the sphere of radius ``||W||`` (norms over ``axes``: one per matrix)."""
    p = param.astype(jnp.float32)
    u = direction.astype(jnp.float32)
    radius = jnp.sqrt(jnp.sum(jnp.square(p), axis=axes, keepdims=True))
    u_norm = jnp.sqrt(jnp.sum(jnp.square(u), axis=axes, keepdims=True))
    moved = p - learning_rate * u * radius / jnp.maximum(u_norm, 1e-10)
    moved_norm = jnp.sqrt(jnp.sum(jnp.square(moved), axis=axes, keepdims=True))
    new = moved / jnp.maximum(moved_norm, 1e-10) * radius
    return (new - p).astype(param.dtype)


def hyperball(learning_rate: jax.Array) -> optax.GradientTransformation:
    """Stateless: turn each direction into the hyperball update of its parameter (needs ``params``)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("the hyperball step needs params: call optimizer.update(grads, state, params).")

        def one(path, u, p):
            axes = _matrix_axes(matrix_dims(_names(path), p.ndim), p.ndim)
            return hyperball_update(p, u, learning_rate, axes)

        return jax.tree_util.tree_map_with_path(one, updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


# ------------------------------------------------------------------------------------------------
# The three groups


class MuonHSettings(NamedTuple):
    """What ``muonh_optimizer`` reads (``trainer.optim`` fills it from ``OptimizerConfig``)."""

    adam_lr_ratio: float  # Adam-group LR / MuonH LR (3/13 for Marin's heuristic)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_epsilon: float = 1e-8
    ns_dtype: Any = jnp.float32
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None


def muonh_optimizer(
    settings: MuonHSettings, labels: Any, adam_decay_mask: Any, *, learning_rate: float = 1.0
) -> optax.GradientTransformation:
    """MuonH / AdamH / Adam by ``labels`` with ``learning_rate`` injectable (``opt_state.hyperparams``)."""

    def make(learning_rate):
        adam_lr = learning_rate * settings.adam_lr_ratio
        adam_parts = [optax.scale_by_adam(settings.beta1, settings.beta2, settings.epsilon)]
        if settings.weight_decay > 0:
            adam_parts.append(optax.add_decayed_weights(settings.weight_decay, adam_decay_mask))
        adam_parts.append(optax.scale_by_learning_rate(adam_lr))
        groups = optax.multi_transform(
            {
                MUONH: optax.chain(
                    optax.trace(decay=settings.momentum, nesterov=settings.nesterov),
                    scale_by_newton_schulz(steps=settings.ns_steps, eps=settings.ns_epsilon, dtype=settings.ns_dtype),
                    hyperball(learning_rate),
                ),
                ADAMH: optax.chain(
                    optax.scale_by_adam(settings.beta1, settings.beta2, settings.epsilon), hyperball(learning_rate)
                ),
                ADAM: optax.chain(*adam_parts),
            },
            labels,
        )
        if settings.max_grad_norm is not None:
            return optax.chain(optax.clip_by_global_norm(settings.max_grad_norm), groups)
        return groups

    return optax.inject_hyperparams(make)(learning_rate=learning_rate)


def frobenius_norms(params: Any, labels: Any) -> Any:
    """Per-matrix Frobenius norms of the MuonH/AdamH leaves (None elsewhere): what the hyperball keeps."""

    def one(path, p, label):
        if label == ADAM:
            return None
        axes = _matrix_axes(matrix_dims(_names(path), p.ndim), p.ndim)
        return jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32)), axis=axes))

    return jax.tree_util.tree_map_with_path(one, params, labels)

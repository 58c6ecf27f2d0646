"""Which layers run under one ``jax.lax.scan``, and the stacked parameter layout that lets them.

Why: an unrolled Python loop traces and compiles every block again, so compile time grows with depth
(measured in bench/bench_trainer_compile.py: see bench/RESULTS_trainer_compile.md). Blocks that are the
same function of the same shapes can instead be stacked along a leading axis and run by one
``lax.scan``, whose body XLA compiles once whatever the number of repeats.

The plan. Layers are not all alike: sliding-window and global layers differ in window (and may differ in
KV heads), and the first ``moe.num_dense_layers`` are dense. A layer's *signature* (``trainer.model``
builds it) is everything that makes its block a different program: dense or MoE, attention window, and
the tree of its parameter shapes (which carries the KV heads and whatever else a block holds). The
repeating pattern of signatures, e.g. (local, local, local, global), forms a *unit*; consecutive repeats
of a unit become one scanned segment whose body runs the unit's layers unrolled; layers that repeat
nothing (leading dense layers, a trailing global layer) stay unrolled. ``plan_segments`` chooses the
segmentation that traces the fewest block bodies (a scanned segment costs its unit length, an unrolled
layer costs one), preferring fewer segments on a tie. It is a small dynamic programme over positions,
so any pattern is handled, not only the ones ``ModelConfig`` can express today. With few repeats it may
scan runs of equal layers rather than the whole unit (``dlllglllgg``: d, lll, g, lll, gg = 5 bodies,
against 6 for d, (lllg) x 2, g). The plan decides the stored layout, so a change to it changes the
checkpoint layout of every ``scan_layers`` run: treat it as part of the format.

The layout. With ``ModelConfig.scan_layers`` the parameters are *stored* stacked, not stacked inside the
step: stacking in the jitted step would copy every block weight (and its gradient back) on every step,
and at hero scale that is a second copy of the model. ``params["blocks"]`` then holds, in layer order,
``"007"`` for an unrolled layer 7 (as today) and ``"scan002_2x4"`` for a segment that starts at layer 2 and
repeats a 4-layer unit twice; inside it, ``"u0" .. "u3"`` are the unit's positions, each the block tree of
that position with a leading axis of length 2 (repeat r of position j is layer ``2 + 4r + j``). The
leading layer axis is never sharded (``trainer.sharding`` reads ``layer_axis_repeats``) and param groups
ignore it (they read path names, which keep "attention", "experts", "norm", ...).

``stack_blocks``/``unstack_blocks`` convert between the two layouts exactly (tests compare the scanned
model against the unrolled one with the same weights; ``init_params`` draws the unrolled layout and
stacks it, so a scanned run starts from the very weights of its unrolled twin).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import jax

_STACKED_KEY = re.compile(r"^scan(\d{3,})_(\d+)x(\d+)$")


@dataclass(frozen=True)
class Segment:
    """Layers ``start .. stop - 1``: ``repeats`` copies of a unit of ``unit`` consecutive layers."""

    start: int
    unit: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.unit * self.repeats

    @property
    def scanned(self) -> bool:
        return self.repeats > 1

    @property
    def key(self) -> str:
        """The segment's key in ``params["blocks"]``."""
        return f"scan{self.start:03d}_{self.repeats}x{self.unit}" if self.scanned else f"{self.start:03d}"

    def layers(self, position: int) -> list[int]:
        """The layers at unit position ``position``, one per repeat, in order."""
        return [self.start + r * self.unit + position for r in range(self.repeats)]


def position_key(position: int) -> str:
    return f"u{position}"


def plan_segments(signatures: Sequence[Hashable]) -> tuple[Segment, ...]:
    """The segmentation of layers with these signatures that traces the fewest block bodies (module docstring)."""
    n = len(signatures)
    # best[s] = (bodies traced, segments) for layers s..n-1, and the first segment of that plan
    best: list[tuple[tuple[int, int], Segment | None]] = [((0, 0), None)] * (n + 1)
    for s in range(n - 1, -1, -1):
        (cost, count), _ = best[s + 1]
        choice = ((cost + 1, count + 1), Segment(s, 1, 1))
        for unit in range(1, (n - s) // 2 + 1):
            pattern = tuple(signatures[s : s + unit])
            repeats = 1
            while s + (repeats + 1) * unit <= n and tuple(signatures[s + repeats * unit : s + (repeats + 1) * unit]) == pattern:
                repeats += 1
                (rest_cost, rest_count), _ = best[s + repeats * unit]
                candidate = ((rest_cost + unit, rest_count + 1), Segment(s, unit, repeats))
                if candidate[0] < choice[0]:
                    choice = candidate
        best[s] = choice
    segments, s = [], 0
    while s < n:
        segment = best[s][1]
        assert segment is not None
        segments.append(segment)
        s = segment.stop
    return tuple(segments)


def stack_blocks(
    blocks: dict[str, Any],
    segments: Sequence[Segment],
    stack: Callable[[list], Any],
    *,
    is_leaf: Callable[[Any], bool] | None = None,
) -> dict[str, Any]:
    """Unrolled ``{"000": block, ...}`` -> the stacked layout; ``stack`` joins one leaf's per-layer values
    (``jnp.stack`` for arrays, a shape function for shape trees)."""
    out: dict[str, Any] = {}
    for segment in segments:
        if not segment.scanned:
            out[segment.key] = blocks[segment.key]
            continue
        out[segment.key] = {
            position_key(j): jax.tree.map(
                lambda *leaves: stack(list(leaves)), *[blocks[f"{i:03d}"] for i in segment.layers(j)], is_leaf=is_leaf
            )
            for j in range(segment.unit)
        }
    return out


def unstack_blocks(blocks: dict[str, Any], segments: Sequence[Segment]) -> dict[str, Any]:
    """The stacked layout -> unrolled ``{"000": block, ...}`` (arrays; the exact inverse of ``stack_blocks``)."""
    out: dict[str, Any] = {}
    for segment in segments:
        if not segment.scanned:
            out[segment.key] = blocks[segment.key]
            continue
        for j in range(segment.unit):
            stacked = blocks[segment.key][position_key(j)]
            for r, layer in enumerate(segment.layers(j)):
                out[f"{layer:03d}"] = jax.tree.map(lambda a, r=r: a[r], stacked)
    return {key: out[key] for key in sorted(out)}


def layer_axis_repeats(path: Sequence[str]) -> int | None:
    """Length of the leading layer axis of a parameter (or of optimizer state mirroring it) at ``path``,
    or None when it has none: the leaf sits under a ``"scanNNN_RxP"`` segment key."""
    for name in path:
        match = _STACKED_KEY.match(str(name))
        if match:
            return int(match.group(2))
    return None

"""What a forecast's target changes that its rungs held fixed.

A scaling law fitted to rungs knows what the rungs varied (width, depth, tokens, a learning rate scaled with
width) and nothing about what they kept the same. When the target departs from a setting every rung shares
(another head count, a different schedule, batch or data mixture), the law extrapolates along the ladder as if
nothing else changed, and neither the fit nor its backtest can show the difference. Measured on the local
ladder (experiments/local_ladder.py), whose rungs all have two attention heads: the same hero with three heads
ended 1.4% lower than with two, from the same rungs and so the same forecast (2.2%, outside the forecast's 95%
band, on the earlier eval that favoured larger models). So `ladder plan` warns before anything runs, and the fit
step's stored forecast carries the same warning.

Compared: the model (except how it is laid out or dispatched, which does not change the function it computes),
the optimizer and its schedule, the data and its mixture, and the training settings that change what is learned
or what is measured (batch size, precision, eval dispatch, which held-out windows an eval reads), plus the per-head
width the head count implies.
A setting the rungs themselves vary is the ladder's own axis and is not reported, even when the target lies
beyond the rungs' range: that is the extrapolation the forecast's band is about.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ladder.dag import DAG, TrainStep
from ladder.fitting import ladder_runs_for

# fields that change how a step runs, not the function it learns or the metric it logs
EXECUTION_ONLY = frozenset({"model.scan_layers", "model.kv_heads_layout", "model.moe.dispatch"})
TRAIN_FIELDS = ("batch_size", "precision", "eval_dispatch", "eval_windows")
MAX_LISTED = 8


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}", out)
    else:
        out[prefix] = value


def recipe_settings(spec) -> dict[str, Any]:
    """The settings of an ExperimentSpec a ladder is expected to hold fixed or vary on purpose, flattened."""
    out: dict[str, Any] = {}
    doc = spec.model_dump(mode="json")
    for section in ("model", "optimizer", "data"):
        _flatten(doc[section], section, out)
    for field in TRAIN_FIELDS:
        out[f"train.{field}"] = doc["train"][field]
    model = spec.model
    out["model.head_dim"] = model.head_dim or model.hidden_dim // model.num_heads
    out["model.moe"] = "dense" if model.moe is None else "MoE"
    return {key: value for key, value in out.items() if key not in EXECUTION_ONLY}


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 60 else text[:57] + "..."


def recipe_departures(rungs: Mapping[str, Any], target_name: str, target) -> str | None:
    """One warning naming every setting all `rungs` (name -> ExperimentSpec) share and `target` changes, or None."""
    if len(rungs) < 2:
        return None
    rung_settings = [recipe_settings(spec) for spec in rungs.values()]
    target_settings = recipe_settings(target)
    keys = list(dict.fromkeys([*target_settings, *(key for s in rung_settings for key in s)]))
    changed: dict[str, str] = {}
    for key in keys:
        values = [s.get(key, "unset") for s in rung_settings]
        value = target_settings.get(key, "unset")
        if all(v == values[0] for v in values) and value != values[0]:
            changed[key] = f"{key} {_show(value)} (every rung: {_show(values[0])})"
    # a changed section (a dense target of MoE rungs) is named once, not with every field inside it
    changed = {k: text for k, text in changed.items() if not any(k.startswith(parent + ".") for parent in changed)}
    if not changed:
        return None
    texts = list(changed.values())
    listed = "; ".join(texts[:MAX_LISTED]) + (f"; and {len(texts) - MAX_LISTED} more" if len(texts) > MAX_LISTED else "")
    return (f"{target_name} changes what its {len(rungs)} rungs hold fixed: {listed}. The law fitted to the rungs has never "
            "seen these changes; neither the forecast nor its band accounts for what they do to the loss")


def departures_for(dag: DAG, target: str) -> str | None:
    """`recipe_departures` of `target` against the training steps a forecast of it reads (`ladder_runs_for`)."""
    step = dag[target]
    if not isinstance(step, TrainStep):
        return None
    rungs = {name: dag[name].spec for name in ladder_runs_for(dag, target) if isinstance(dag[name], TrainStep)}
    return recipe_departures(rungs, target, step.spec)

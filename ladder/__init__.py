"""ladder: declare a scaling ladder as typed specs, run it as a DAG on Ray, forecast the hero.

The names most experiments need are re-exported here; see README.md for a whole experiment.
"""

from ladder.dag import DAG, FitConfig, FitStep, FunctionStep, Step, TrainStep, build_ladder
from ladder.spec import DerivedNumbers, ExperimentSpec, ResourceSpec

__all__ = [
    "DAG",
    "DerivedNumbers",
    "ExperimentSpec",
    "FitConfig",
    "FitStep",
    "FunctionStep",
    "ResourceSpec",
    "Step",
    "TrainStep",
    "build_ladder",
]

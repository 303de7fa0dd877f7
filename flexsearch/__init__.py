"""flexsearch: find the fastest way to train a PyTorch model on many devices.

Public API (DESIGN section 1): :func:`load_model`, :func:`trace`, :class:`Cluster`,
:func:`plan`, :func:`simulate`, :func:`parallelize`, :class:`Plan`, and the error types.
"""

from flexsearch.api import plan, simulate
from flexsearch.cost.hardware import Cluster
from flexsearch.emit import make_optimizer, parallelize
from flexsearch.errors import (
    CalibrationWarning,
    ClusterSpecError,
    FlexsearchError,
    InfeasiblePlanError,
    ModelLoadError,
    PlanFileError,
    PlanKindError,
    ProfileError,
    TraceError,
    UnsupportedOpError,
)
from flexsearch.graph import OpGraph, OpNode, trace
from flexsearch.model_files import load_model
from flexsearch.plan import Plan
from flexsearch.sim.result import Simulation

__version__ = "0.1.0"

__all__ = [
    "CalibrationWarning",
    "Cluster",
    "ClusterSpecError",
    "FlexsearchError",
    "InfeasiblePlanError",
    "ModelLoadError",
    "OpGraph",
    "OpNode",
    "Plan",
    "PlanFileError",
    "PlanKindError",
    "ProfileError",
    "Simulation",
    "make_optimizer",
    "TraceError",
    "UnsupportedOpError",
    "load_model",
    "parallelize",
    "plan",
    "simulate",
    "trace",
]

"""flexsearch: find the fastest way to train a PyTorch model on many devices.

Public API (DESIGN section 1): :func:`load_model`, :func:`trace`, :class:`Cluster`,
:func:`plan`, :func:`simulate`, :func:`parallelize`, :class:`Plan`, and the error types.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

_HOMES = {
    "plan": "flexsearch.api", "simulate": "flexsearch.api", "Cluster": "flexsearch.cost.hardware",
    "make_optimizer": "flexsearch.emit", "parallelize": "flexsearch.emit", "OpGraph": "flexsearch.graph",
    "OpNode": "flexsearch.graph", "trace": "flexsearch.graph", "load_model": "flexsearch.model_files",
    "Plan": "flexsearch.plan", "Simulation": "flexsearch.sim.result",
    **dict.fromkeys(("CalibrationWarning", "ClusterSpecError", "FlexsearchError", "InfeasiblePlanError",
                     "ModelLoadError", "PlanFileError", "PlanKindError", "ProfileError", "TraceError",
                     "UnsupportedOpError"), "flexsearch.errors"),
}
"""Where each public name lives. The package imports them on first use (PEP 562), so
that ``import flexsearch`` (and the ``flexsearch`` command's entry,
:mod:`flexsearch.console`) loads no torch until a name is used: a Ctrl-C during the
command's first seconds of imports is then caught like any other."""


class _Package(types.ModuleType):
    """The package's module type: importing the submodule :mod:`flexsearch.plan` binds
    nothing over the public :func:`plan` (the import system sets a package's attribute
    to each submodule it loads; the eager ``__init__`` bound the function after it)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flexsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


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

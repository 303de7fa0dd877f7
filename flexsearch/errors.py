"""The exception types of flexsearch.

Every error a user can cause is a :class:`FlexsearchError` whose message is one line
naming the problem and the fix. The CLI prints that line and exits with code 2; an
exception of any other type is an internal error (exit code 1).
"""

from __future__ import annotations


class FlexsearchError(Exception):
    """Base of every user-facing error: the message is one line, problem and fix."""


class ModelLoadError(FlexsearchError):
    """A model file (``path.py[:NAME]``) could not be loaded."""


class TraceError(FlexsearchError):
    """The model could not be lifted into an operator graph."""


class UnsupportedOpError(TraceError):
    """The graph holds an op that a requested stage cannot handle."""


class ClusterSpecError(FlexsearchError):
    """A hardware or cluster spec is unknown or malformed."""


class PlanFileError(FlexsearchError):
    """A plan file is damaged, of a newer version, or made for another model."""


class InfeasiblePlanError(FlexsearchError):
    """No plan fits the devices' memory."""


class PlanKindError(InfeasiblePlanError):
    """No plan of the kinds asked for exists here (``plan --kind``): the message says why."""


class CalibrationError(FlexsearchError):
    """A calibration could not be measured or its file is unusable."""


class ProfileError(FlexsearchError):
    """A profile file is damaged or a measurement could not be made."""


class EmitError(FlexsearchError):
    """A plan cannot be emitted here: another model or world size, or a kind the
    emitter does not run."""


class TopologyError(FlexsearchError):
    """A decentralized-training topology is malformed or cannot be built for this many ranks."""


class CalibrationWarning(UserWarning):
    """Predictions for this host's devices use no calibration, or one measured on
    another host (``flexsearch calibrate`` measures this one)."""

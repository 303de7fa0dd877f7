"""Achievable fractions of peak, per op kind: ``costmodels/efficiency.json``.

The roofline (:mod:`flexsearch.cost.compute`) divides an op's FLOPs by
``peak[dtype] * flops`` and its bytes by ``memory_bandwidth * bandwidth``, where
``flops`` and ``bandwidth`` are the factors read here for the op's ``NodeKind``.
``default`` must give both factors for every ``NodeKind``; ``devices`` may override
some kinds for one device, keyed by the device spec's ``name``. Every factor carries a
source or the reasoning behind it, like every hardware number.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import get_args

from pydantic import ValidationError, model_validator

from flexsearch.cost.hardware import (
    COSTMODELS_DIR,
    Fraction,
    Frozen,
    read_json,
    validation_message,
)
from flexsearch.errors import ClusterSpecError
from flexsearch.graph.opgraph import NodeKind

EFFICIENCY_FILE = COSTMODELS_DIR / "efficiency.json"


class KindEfficiency(Frozen):
    """Fractions of peak FLOP/s and of peak memory bandwidth one op kind reaches."""

    flops: Fraction
    bandwidth: Fraction


class EfficiencyTable(Frozen):
    """Per-kind efficiency factors, with optional per-device overrides."""

    description: str = ""
    default: dict[NodeKind, KindEfficiency]
    devices: dict[str, dict[NodeKind, KindEfficiency]] = {}

    @model_validator(mode="after")
    def _covers_every_kind(self) -> EfficiencyTable:
        missing = [k for k in get_args(NodeKind) if k not in self.default]
        if missing:
            raise ValueError(f"default lacks the op kind(s) {', '.join(missing)}")
        return self

    def factors(self, kind: str, device_name: str | None = None) -> tuple[float, float]:
        """``(flops_factor, bandwidth_factor)`` for an op kind on a device."""
        entry = self.devices.get(device_name or "", {}).get(kind) or self.default.get(kind)  # type: ignore[call-overload]
        if entry is None:
            entry = self.default["opaque"]
        return entry.flops.value, entry.bandwidth.value


@lru_cache(maxsize=16)
def _load_cached(path: str, _stamp: tuple[int, int]) -> EfficiencyTable:
    raw = read_json(Path(path), "efficiency file")
    try:
        return EfficiencyTable.model_validate(raw)
    except ValidationError as e:
        raise ClusterSpecError(validation_message(f"efficiency file {path}", e)) from None


def load_efficiency(path: str | os.PathLike[str] | None = None) -> EfficiencyTable:
    """Read and validate an efficiency file (default: the built-in one); cached until
    the file's modification time or size changes."""
    p = Path(path if path is not None else EFFICIENCY_FILE).resolve()
    try:
        st = p.stat()
    except OSError:
        read_json(p, "efficiency file")  # raises the one-line error
        raise
    return _load_cached(str(p), (st.st_mtime_ns, st.st_size))


def efficiency_from_dict(data: dict) -> EfficiencyTable:
    """Validate an in-memory table (tests, generated tables)."""
    try:
        return EfficiencyTable.model_validate(data)
    except ValidationError as e:
        raise ClusterSpecError(validation_message("efficiency table", e)) from None


__all__ = ["EFFICIENCY_FILE", "EfficiencyTable", "KindEfficiency", "efficiency_from_dict", "load_efficiency"]

"""Fits from the calibration's measurements to its terms: pure functions over numbers.

- :func:`fit_collective`: ``t = a + b M`` by relative least squares (each size weighs
  alike: the fit minimises ``sum ((a + b M) / t - 1)^2``);
- :func:`fit_updates`: per optimizer ``t = per_tensor x tensors + per_byte x bytes`` by
  least squares, each parameter set's time the slowest rank's (all ranks update at once,
  sharing the memory system);
- :func:`residual_line`: slope and intercept, both clamped at 0, of the simulator's
  residuals (measured minus predicted seconds) of two probes that differ in one counted
  thing (ops, tensors, collectives, actions): the slope is that thing's cost, the
  intercept a per-step cost;
- :func:`overlap_fraction`: how much of the shorter of compute and an all-reduce hides
  when both run at once;
- :func:`robust` and :func:`combine`: one value per term from the calibration's repeats
  (outliers rejected, the median kept, half the kept range as its spread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def lstsq2(rows: Sequence[tuple[float, float]], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``y = a x0 + b x1``, both clamped at 0."""
    sol, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys, dtype=float), rcond=None)
    return max(0.0, float(sol[0])), max(0.0, float(sol[1]))


def fit_collective(rows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b M`` over ``(M, t)`` rows (module docstring)."""
    return lstsq2([(1.0 / t, m / t) for m, t in rows], [1.0] * len(rows))


def slowest(per_rank: Sequence[dict], key: str) -> list[tuple[float, float]]:
    """``(size, seconds)`` rows of collective ``key`` with each size's slowest rank."""
    rows = per_rank[0][key]
    return [(rows[i][0], max(r[key][i][1] for r in per_rank)) for i in range(len(rows))]


def fit_updates(per_rank: Sequence[dict[str, list]]) -> dict[str, tuple[float, float]]:
    """``(per_tensor_s, per_byte_s)`` per optimizer (module docstring)."""
    out = {}
    for name, rows in per_rank[0].items():
        times = [max(r[name][i][2] for r in per_rank) for i in range(len(rows))]
        out[name] = lstsq2([(n, b) for n, b, _ in rows], times)
    return out


def residual_line(r_a: float, r_b: float, x_a: float, x_b: float) -> tuple[float, float]:
    """``(slope, intercept)``, both clamped at 0, of the line through residuals ``r_a``,
    ``r_b`` of two probes with ``x_a < x_b`` of the counted thing."""
    slope = max(0.0, (r_b - r_a) / (x_b - x_a))
    return slope, max(0.0, r_a - slope * x_a)


def overlap_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The fraction of the shorter of the two that running both at once hides."""
    return (compute_s + comm_s - both_s) / min(compute_s, comm_s)


OUTLIER_MADS = 3.0
"""A repeat is an outlier when it lies more than this many median absolute deviations
from the median (and more than :data:`OUTLIER_FLOOR` of it: identical repeats have no
deviation to measure against)."""
OUTLIER_FLOOR = 0.05


def robust(values: Sequence[float]) -> tuple[float, float, int]:
    """``(median, spread, rejected)`` of one term's repeats: those further than
    ``OUTLIER_MADS`` median absolute deviations (at least ``OUTLIER_FLOOR`` of the
    median) from the median are rejected; of the rest, the median and half the range."""
    v = np.asarray(values, dtype=float)
    med = float(np.median(v))
    dev = np.abs(v - med)
    limit = max(OUTLIER_MADS * float(np.median(dev)), OUTLIER_FLOOR * abs(med))
    kept = v[dev <= limit]
    return float(np.median(kept)), float(kept.max() - kept.min()) / 2, int(len(v) - len(kept))


def _is_term(node: Any) -> bool:
    return isinstance(node, dict) and "value" in node and "source" in node


def combine(trees: Sequence[dict]) -> dict:
    """One calibration (as a dict) from the same calibration fitted on each repeat:
    every numeric term is :func:`robust`'s median, with its ``spread`` and a source
    that says so (the repeat nearest the median gives the rest of the source text); a
    yes/no term is the majority's; everything else is the first repeat's."""
    first = trees[0]
    if _is_term(first):
        values = [t["value"] for t in trees]
        if len(trees) == 1:
            return first
        if isinstance(first["value"], bool):
            yes = sum(bool(v) for v in values)
            pick = next(t for t in trees if bool(t["value"]) == (2 * yes > len(trees)))
            return {**pick, "source": f"{pick['source']}; {yes} of {len(trees)} repeats said yes"}
        med, spread, rejected = robust(values)
        near = min(trees, key=lambda t: abs(t["value"] - med))
        dropped = f", {rejected} rejected as outliers" if rejected else ""
        return {**near, "value": med, "spread": spread,
                "source": f"{near['source']}; median of {len(trees)} repeats{dropped}, spread +-{spread:.3g}"}
    if isinstance(first, dict):
        return {k: combine([t[k] for t in trees]) for k in first}
    return first

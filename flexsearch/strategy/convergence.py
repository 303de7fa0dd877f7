"""How many iterations D-PSGD needs relative to synchronous SGD, measured: the
convergence file, the fit of the bound's constants to it, and the constants the planner
uses for a model family.

**What is measured** (:mod:`flexsearch.calibrate.convergence` trains the model for real):
per rank count ``n`` and data split (``iid``: every rank's slice of the global batch
drawn from the shuffled data set; ``non-iid``: each rank draws only from its own few
classes), one training-loss curve per algorithm (synchronous all-reduce and D-PSGD on
each topology), ``L_a(e)`` at evaluations ``e = 0 .. E`` (before training, then a few per
epoch), with the same seed, data order and global batch for every algorithm.

**Measured factor** (:func:`measured_factors`): the target ``L*`` is all-reduce's loss at
the first evaluation where it is at most :data:`TARGET_FRACTION` of its initial loss
(still in the fast-learning phase, far above the noise floor a small data set is
overfitted to; if it never gets there, its lowest loss in the first half of the run);
``e_a`` is the first (fractional) evaluation at which ``L_a`` reaches ``L*``,
interpolated linearly in ``log L`` between evaluations; the factor of topology ``a``
is ``e_a / e_ar``. A curve that never reaches ``L*`` gives a *censored* factor: at least
``E / e_ar`` for a run of ``E`` evaluations.

**Fit** (:func:`fit`): the factor the planner uses is
:func:`~flexsearch.strategy.topology.iterations_factor`, i.e. Koloskova et al.'s bound
``B(p, tau, n; s, z) / B(1, 1, n; s, z)`` with ``s = sigma^2/eps`` (``noise_ratio``) and
``z = zeta^2/eps`` (``heterogeneity_ratio``). The fit is least squares in log space::

    i.i.d.:      s* = argmin_s  sum_k r_k(s, 0)^2
    non-i.i.d.:  z* = argmin_z  sum_k r_k(s*, z)^2
    r_k(s, z) = log F(p_k, tau_k, n_k; s, z) - log max(1, f_k)

over the measured factors ``f_k`` of the split (a censored ``f_k`` contributes only when
the model predicts less than it: ``r_k = min(r_k, 0)``; topologies that mix exactly,
``p = 1, tau = 1``, e.g. every topology on 2 ranks, are left out: the bound gives them
factor 1 whatever the constants), by a grid over ``log10 s`` in
``[-2, 6]`` and ``log10 z`` in ``{-inf} u [-4, 10]`` (200 points per decade, far finer than
the measurements resolve); ``s`` comes from the i.i.d. runs only (``z = 0`` there by
construction), ``z`` from the non-i.i.d. runs with ``s`` fixed. When every i.i.d. factor is
1 the residual keeps falling as ``s`` grows to the grid's edge: the fit then keeps the
smallest ``s`` whose every factor is within :data:`RESOLUTION` of the measured one (the
most conservative ``s`` the measurements cannot tell apart from no slowdown) and says so
(``at_bound``).

**Use** (:func:`constants_for`): the planner trains on i.i.d. shuffled data (every rank
takes a slice of the same shuffled global batch), so it uses the i.i.d. fit ``(s*, 0)``
of the model's family (the traced model's class name) from the first convergence file
found: ``$FLEXSEARCH_HOME/convergence/<family>.json`` (what ``flexsearch calibrate
--convergence`` writes; ``flexsearch plan`` and :func:`flexsearch.plan` look there), then
the built-in ``costmodels/convergence/<family>.json`` (all that ``plan_graph`` and
``flexsearch bench`` read, so their results do not depend on this machine's files).
Without one it uses :data:`DEFAULT_CONSTANTS` (``s = 100``, ``z = 0``: conservative, the
factor of a 32-rank ring is 7.4) and its notes say so.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from flexsearch.errors import FlexsearchError
from flexsearch.strategy.topology import (
    bound_factor as model_factor,  # the fit's model: the planner's factor
)
from flexsearch.strategy.topology import build, mixing_parameters

SPLITS = ("iid", "non-iid")
TARGET_FRACTION = 0.25
"""The target loss: all-reduce's first loss at most this fraction of its initial one."""
RESOLUTION = 0.05
"""Factors that differ by less than 5% are not told apart (one epoch in 20)."""
S_GRID = tuple(10 ** (-2 + k / 200) for k in range(8 * 200 + 1))
Z_GRID = (0.0, *(10 ** (-4 + k / 200) for k in range(14 * 200 + 1)))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Curve(_Frozen):
    """One training run: the loss over the whole training set at the end of each epoch
    (``losses[0]``: before training), of the ranks' average model."""

    algorithm: str
    """``all-reduce`` or a topology name."""
    ranks: int
    split: Literal["iid", "non-iid"]
    losses: tuple[float, ...]
    """One per evaluation: before training, then ``evals_per_epoch`` per epoch."""
    wall_s: float | None = None
    """Measured seconds of the run on this machine (not a prediction)."""


class Factor(_Frozen):
    """A topology's measured iterations factor against all-reduce (module docstring)."""

    topology: str
    ranks: int
    split: Literal["iid", "non-iid"]
    factor: float
    target_loss: float
    censored: bool = False
    """The curve never reached the target: ``factor`` is a lower bound."""
    p: float
    tau: int


class Fit(_Frozen):
    split: Literal["iid", "non-iid"]
    noise_ratio: float
    heterogeneity_ratio: float
    rms_log_error: float
    """Root mean square of the residuals ``r_k`` at the fit."""
    at_bound: bool = False
    """The best fit lies on the grid's edge: for ``iid``, no slowdown measured (``s``
    is then the most conservative value that fits, module docstring); for ``non-iid``,
    a slowdown larger than the bound fits at any ``z`` on the grid."""


class ConvergenceFile(_Frozen):
    """What ``flexsearch calibrate --convergence`` writes (module docstring)."""

    version: Literal[1] = 1
    family: str
    """The model's class name: the planner uses this file for graphs of that model."""
    model: str
    """The model spec trained."""
    dataset: str
    source: str
    """The command that wrote the file."""
    date: str
    host: dict[str, str | int]
    seed: int
    epochs: int
    evals_per_epoch: int
    target_fraction: float
    batch_per_rank: int
    optimizer: str
    lr: float
    curves: tuple[Curve, ...]
    factors: tuple[Factor, ...]
    fits: tuple[Fit, ...]

    def fit_for(self, split: str) -> Fit | None:
        return next((f for f in self.fits if f.split == split), None)


@dataclass(frozen=True)
class Constants:
    """The bound's constants the planner uses and where they come from."""

    noise_ratio: float
    heterogeneity_ratio: float
    source: str
    """``default`` or ``measured``."""
    origin: str
    """One phrase for the notes: the file and its date, or why the default is used."""


DEFAULT_CONSTANTS = Constants(100.0, 0.0, "default", "conservative default (sigma^2/eps = 100, zeta = 0)")


# --- measured factors -------------------------------------------------------------------

def index_to_reach(losses: Sequence[float], target: float) -> float | None:
    """The first fractional index at which ``losses`` is ``<= target``, interpolated
    linearly in ``log`` loss; None when it never is."""
    if not losses:
        return None
    if losses[0] <= target:
        return 0.0
    for e in range(1, len(losses)):
        if losses[e] <= target:
            hi, lo = math.log(max(losses[e - 1], 1e-300)), math.log(max(losses[e], 1e-300))
            t = math.log(max(target, 1e-300))
            return e - 1 + ((hi - t) / (hi - lo) if hi > lo else 1.0)
    return None


def target_loss(losses: Sequence[float], fraction: float = TARGET_FRACTION) -> float:
    """All-reduce's target loss (module docstring)."""
    goal = fraction * losses[0]
    for x in losses[1:]:
        if x <= goal:
            return x
    return min(losses[1: max(2, (len(losses) + 1) // 2)])


def measured_factors(curves: Iterable[Curve], fraction: float = TARGET_FRACTION) -> tuple[Factor, ...]:
    """Every topology curve's factor against the all-reduce curve of its rank count and
    split (module docstring). Raises ValueError when a group has no all-reduce curve of
    at least two evaluations."""
    groups: dict[tuple[int, str], list[Curve]] = {}
    for c in curves:
        groups.setdefault((c.ranks, c.split), []).append(c)
    out = []
    for (n, split), cs in sorted(groups.items()):
        ar = next((c for c in cs if c.algorithm == "all-reduce"), None)
        if ar is None or len(ar.losses) < 2:
            raise ValueError(f"{split} curves on {n} ranks need an all-reduce curve of at least two evaluations")
        target = target_loss(ar.losses, fraction)
        base = max(index_to_reach(ar.losses, target) or 1.0, 1e-9)
        for c in cs:
            if c.algorithm == "all-reduce":
                continue
            p, tau = mixing_parameters(build(c.algorithm, n))
            e = index_to_reach(c.losses, target)
            censored = e is None
            f = (len(c.losses) - 1 if censored else e) / base
            out.append(Factor(topology=c.algorithm, ranks=n, split=split, factor=f, target_loss=target,
                              censored=censored, p=p, tau=tau))
    return tuple(out)


# --- the fit ------------------------------------------------------------------------------

def _residuals(factors: Sequence[Factor], s: float, z: float) -> list[float]:
    out = []
    for f in factors:
        r = math.log(model_factor(f.p, f.tau, f.ranks, s, z)) - math.log(max(1.0, f.factor))
        out.append(min(r, 0.0) if f.censored else r)
    return out


def _sq(r: Sequence[float]) -> float:
    return sum(x * x for x in r)


def fit(factors: Iterable[Factor]) -> tuple[Fit, ...]:
    """The i.i.d. fit of ``s`` and, when there are non-i.i.d. factors, the fit of ``z``
    with that ``s`` (module docstring). Raises ValueError without i.i.d. factors."""
    factors = tuple(f for f in factors if f.p < 1.0 or f.tau > 1)  # the exact average: no information
    iid = [f for f in factors if f.split == "iid"]
    if not iid:
        raise ValueError("no i.i.d. factor of a topology that is not the exact average (2 ranks mix exactly) "
                         "to fit sigma^2/eps from; measure on 4 or more ranks")
    res = [_residuals(iid, s, 0.0) for s in S_GRID]
    k = min(range(len(S_GRID)), key=lambda i: _sq(res[i]))
    at_bound = k == len(S_GRID) - 1
    if at_bound:  # no slowdown measured: the smallest s that fits every factor to RESOLUTION
        k = next(i for i, r in enumerate(res) if max(map(abs, r)) <= RESOLUTION or i == k)
    s = S_GRID[k]
    out = [Fit(split="iid", noise_ratio=s, heterogeneity_ratio=0.0,
               rms_log_error=math.sqrt(_sq(res[k]) / len(iid)), at_bound=at_bound)]
    non = [f for f in factors if f.split == "non-iid"]
    if non:
        zres = [_sq(_residuals(non, s, z)) for z in Z_GRID]
        j = min(range(len(Z_GRID)), key=zres.__getitem__)
        out.append(Fit(split="non-iid", noise_ratio=s, heterogeneity_ratio=Z_GRID[j],
                       rms_log_error=math.sqrt(zres[j] / len(non)), at_bound=j == len(Z_GRID) - 1))
    return tuple(out)


# --- files ----------------------------------------------------------------------------------

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "costmodels" / "convergence"
"""The measurements shipped with the package (``costmodels/convergence/``)."""


def load(path: str | os.PathLike[str]) -> ConvergenceFile:
    """Read and validate a convergence file; a FlexsearchError names a bad one."""
    try:
        return ConvergenceFile.model_validate_json(Path(path).read_text())
    except OSError as e:
        raise FlexsearchError(f"cannot read convergence file {path}: {e.strerror or e}") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise FlexsearchError(f"{path} is not a convergence file: {where}: {first['msg']}; rewrite it with "
                              "flexsearch calibrate --convergence") from None


def find(family: str, dirs: Sequence[Path] = (BUILTIN_DIR,)) -> Path | None:
    """The convergence file of ``family`` in the first of ``dirs`` that has one."""
    for d in dirs:
        p = Path(d) / f"{family}.json"
        if p.is_file():
            return p
    return None


def constants_of(data: ConvergenceFile, path: str | os.PathLike[str] | None = None) -> Constants:
    f = data.fit_for("iid")
    if f is None:
        return DEFAULT_CONSTANTS
    where = Path(path).name if path is not None else f"{data.family}.json"
    return Constants(f.noise_ratio, 0.0, "measured",
                     f"measured for {data.family} ({where}, {data.date[:10]}: sigma^2/eps = {f.noise_ratio:.3g})")


def constants_for(family: str, dirs: Sequence[Path] = (BUILTIN_DIR,)) -> Constants:
    """The constants for graphs of ``family`` from the first file in ``dirs`` (module
    docstring; :func:`flexsearch.api.resolve_convergence` puts the user's directory
    first), else the default with a note saying so."""
    path = find(family, dirs)
    if path is None:
        return Constants(DEFAULT_CONSTANTS.noise_ratio, DEFAULT_CONSTANTS.heterogeneity_ratio, "default",
                         f"{DEFAULT_CONSTANTS.origin}: no convergence measured for {family} (flexsearch "
                         f"calibrate --convergence MODEL measures it)")
    return constants_of(load(path), path)

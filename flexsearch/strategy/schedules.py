"""Pipeline schedules as sequences of small immutable compute actions.

A schedule is given per pipeline rank as the ordered tuple of compute actions the rank runs in
one training iteration (one minibatch split into ``microbatches`` microbatches). Everything here
is a pure function of integers: no process groups, no torch.distributed runtime.

The orders for ``gpipe``, ``1f1b`` and ``interleaved`` are the ones torch's ``ScheduleGPipe``,
``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` execute (torch.distributed.pipelining.schedules);
``tests/test_schedules.py`` checks them against torch itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "pipedream")

_ACTION_RE = re.compile(r"(\d+)([FB])(\d+)")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action: forward ("F") or full backward ("B") of ``microbatch`` on ``stage``."""

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"action kind must be 'F' or 'B', got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0, got {self.text}")

    @property
    def text(self) -> str:
        """``<stage><kind><microbatch>``, e.g. ``"1F3"``: the string form of torch's ``_Action``."""
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __str__(self) -> str:
        return self.text


def parse_action(text: str) -> Action:
    """Inverse of :attr:`Action.text`: ``parse_action("1F3") == Action(1, "F", 3)``."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bad action text {text!r}: expected <stage><F|B><microbatch>, e.g. '1F3'")
    return Action(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=64)
def rank_actions(
    schedule: str, ranks: int, microbatches: int, *, chunks: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, the ordered compute actions it runs in one iteration.

    ``ranks`` is the pipeline depth p, ``microbatches`` is m and ``chunks`` is the number v of model
    chunks per rank (only ``"interleaved"`` takes v > 1). Stage s lives on rank ``s % ranks``, so
    with ``chunks=1`` rank r owns stage r. Every schedule is "warm-up forwards, then alternate one
    backward (oldest microbatch first) and one forward until all forwards are issued, then the
    remaining backwards"; they differ in the warm-up count w of rank r:

    - ``"gpipe"``: fill-drain, w = m: all forwards 0..m-1, then all backwards 0..m-1 in ascending
      order (``ScheduleGPipe``).
    - ``"1f1b"``: 1F1B with a flush (PipeDream-Flush), w = min(m, p - r) (``Schedule1F1B``; torch
      itself also requires m >= p, this function does not).
    - ``"interleaved"``: interleaved 1F1B (``ScheduleInterleaved1F1B``), v chunks per rank, stage
      ``r + c * p`` for chunk c. Microbatches are issued in rounds of q = m // max(1, m // p):
      the k-th forward of a rank runs chunk ``(k // q) % v`` and the k-th backward runs chunk
      ``v - 1 - (k // q) % v``, each on microbatch ``(k // (q * v)) * q + k % q``.
      w = min((v - 1) * q + 2 * (p - 1 - r) + 1, m * v) (torch's warm-up count, plus the first
      forward of its F-then-B steady phase). Like torch, m must be a multiple of max(1, m // p).
      v = 1 is not the ``"1f1b"`` order: it has 2 * (p - 1 - r) + 1 warm-up forwards, not p - r.
    - ``"pipedream"``: PipeDream's asynchronous 1F1B (no flush, weight stashing) for one window of
      m minibatches: w = min(m, p - r). Within a window this is the ``"1f1b"`` order; the
      difference is that the real system starts the next window without draining.

    Memoised (a pure function of integers, its value immutable): a search simulates one
    layout under several shardings, and a 1T model's 64 x 512 actions take a tenth of a
    second to build.
    """
    for name, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if schedule != "interleaved" and chunks != 1:
        raise ValueError(f"chunks={chunks} needs 'interleaved'; use chunks=1 for {schedule!r}")
    if schedule == "interleaved":
        return tuple(_interleaved(ranks, microbatches, chunks, r) for r in range(ranks))
    out = []
    for r in range(ranks):
        warmup = microbatches if schedule == "gpipe" else min(microbatches, ranks - r)
        forwards = [Action(r, "F", j) for j in range(microbatches)]
        backwards = [Action(r, "B", j) for j in range(microbatches)]
        out.append(warmup_then_alternate(forwards, backwards, warmup))
    return tuple(out)


def _interleaved(p: int, m: int, v: int, r: int) -> tuple[Action, ...]:
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"interleaved needs microbatches to be a multiple of max(1, microbatches // ranks)"
            f" = {rounds} (like torch's ScheduleInterleaved1F1B), got {m}: use a multiple of {p}"
        )
    q = m // rounds  # microbatches per round

    def nth(k: int, kind: Kind) -> Action:
        chunk = (k // q) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + r, kind, (k // (q * v)) * q + k % q)

    warmup = min((v - 1) * q + 2 * (p - 1 - r) + 1, m * v)
    forwards = [nth(k, "F") for k in range(m * v)]
    backwards = [nth(k, "B") for k in range(m * v)]
    return warmup_then_alternate(forwards, backwards, warmup)


def warmup_then_alternate(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> tuple[Action, ...]:
    """``forwards[:warmup]``, then B, F, B, F, ... until the forwards run out, then the other B."""
    order = forwards[:warmup]
    for i, forward in enumerate(forwards[warmup:]):
        order += [backwards[i], forward]
    return tuple(order + backwards[len(forwards) - warmup :])


def in_flight(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage, the peak number of microbatches whose F has run and whose B has not yet
    (microbatches whose activations are kept).

    For one rank's actions: ``"gpipe"`` gives m, ``"1f1b"`` and ``"pipedream"`` give min(p - r, m).
    """
    live: dict[int, set[int]] = {}
    peak: dict[int, int] = {}
    for a in actions:
        mbs = live.setdefault(a.stage, set())
        if a.kind == "F":
            mbs.add(a.microbatch)
            peak[a.stage] = max(peak.get(a.stage, 0), len(mbs))
        elif a.microbatch in mbs:
            mbs.remove(a.microbatch)
        else:
            raise ValueError(f"{a.text} runs before its forward {a.stage}F{a.microbatch}")
    return peak


def validate(
    per_rank: Sequence[Sequence[Action]], ranks: int, microbatches: int, chunks: int = 1
) -> None:
    """Raise ValueError unless every (stage, microbatch) has exactly one F and one B, both on
    the rank that owns the stage (``stage % ranks``), F first; stages are 0 .. ranks*chunks-1."""
    if len(per_rank) != ranks:
        raise ValueError(f"expected actions for {ranks} ranks, got {len(per_rank)}")
    seen: set[Action] = set()
    for r, actions in enumerate(per_rank):
        for a in actions:
            if a.stage >= ranks * chunks or a.microbatch >= microbatches:
                raise ValueError(
                    f"{a.text} on rank {r} is out of range: there are {ranks * chunks} stages"
                    f" and {microbatches} microbatches"
                )
            if a.stage % ranks != r:
                owner = a.stage % ranks
                raise ValueError(f"{a.text} is on rank {r}, but stage {a.stage} is on rank {owner}")
            if a in seen:
                raise ValueError(f"{a.text} appears twice")
            if a.kind == "B" and Action(a.stage, "F", a.microbatch) not in seen:
                raise ValueError(f"{a.text} runs before its forward on rank {r}")
            seen.add(a)
    missing = 2 * ranks * chunks * microbatches - len(seen)
    if missing:
        raise ValueError(f"{missing} actions missing: each stage needs F and B of every microbatch")


def unit_grid(
    per_rank: Sequence[Sequence[Action]], *, forward: int = 1, backward: int = 1
) -> tuple[tuple[Action | None, ...], ...]:
    """List-schedule the per-rank sequences in unit time steps; return the rank x step grid.

    Each rank runs its actions in the given order; an action starts at the first step at which its
    rank is free and its dependencies have finished (communication is free): F(s, j) needs
    F(s-1, j); B(s, j) needs F(s, j) and B(s+1, j), or only F(s, j) on the last stage. An action
    lasting d steps fills d consecutive cells; idle cells are None. Every row has the makespan's
    length. Raises ValueError if the order deadlocks (or depends on an action no rank runs).
    """
    if forward < 1 or backward < 1:
        raise ValueError(f"durations must be >= 1 step, got forward={forward}, backward={backward}")
    last = max((a.stage for actions in per_rank for a in actions), default=0)
    finish: dict[Action, int] = {}
    free = [0] * len(per_rank)
    pos = [0] * len(per_rank)
    starts: list[list[tuple[int, Action]]] = [[] for _ in per_rank]
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(per_rank):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                deps = _dependencies(a, last)
                if any(d not in finish for d in deps):
                    break
                if a in finish:
                    raise ValueError(f"{a.text} appears twice")
                start = max([free[r], *(finish[d] for d in deps)])
                free[r] = finish[a] = start + (forward if a.kind == "F" else backward)
                starts[r].append((start, a))
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} at {a[pos[r]].text}" for r, a in enumerate(per_rank) if pos[r] < len(a)]
    if stuck:
        raise ValueError(f"schedule deadlocks: {', '.join(stuck)} can never start")
    grid = [[None] * max(free, default=0) for _ in per_rank]
    for row, placed in zip(grid, starts, strict=True):
        for start, a in placed:
            row[start : finish[a]] = [a] * (finish[a] - start)
    return tuple(tuple(row) for row in grid)


def _dependencies(a: Action, last: int) -> list[Action]:
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    deps = [Action(a.stage, "F", a.microbatch)]
    if a.stage < last:
        deps.append(Action(a.stage + 1, "B", a.microbatch))
    return deps


def makespan_units(
    per_rank: Sequence[Sequence[Action]], *, forward: int = 1, backward: int = 1
) -> int:
    """Steps :func:`unit_grid` needs: 2 * (m + p - 1) for gpipe and 1f1b with unit costs."""
    grid = unit_grid(per_rank, forward=forward, backward=backward)
    return len(grid[0]) if grid else 0


def format_grid(grid: Sequence[Sequence[Action | None]]) -> str:
    """A printable table: a header of step numbers, then one row per rank; idle cells are ``.``."""
    steps = max((len(row) for row in grid), default=0)
    cells = [[str(t) for t in range(steps)]]
    cells += [[a.text if a else "." for a in row] + ["."] * (steps - len(row)) for row in grid]
    width = max((len(c) for row in cells for c in row), default=1)
    labels = ["step", *(f"r{r}" for r in range(len(grid)))]
    label_width = max(len(label) for label in labels)
    return "\n".join(
        " ".join([label.ljust(label_width), *(c.rjust(width) for c in row)]).rstrip()
        for label, row in zip(labels, cells, strict=True)
    )

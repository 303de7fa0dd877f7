"""Search budgets as deadlines: a ``time.perf_counter()`` time every phase checks
between its candidates (None: no budget). A forked worker reads the same monotonic
clock, so one deadline serves the planner and its worker."""

from __future__ import annotations

import time


def past(deadline: float | None) -> bool:
    """Has the clock passed ``deadline`` (None: never)?"""
    return deadline is not None and time.perf_counter() >= deadline

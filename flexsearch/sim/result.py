"""A simulation's result: the predicted iteration, per-device memory and the timeline.

Every simulator (op-level, pipeline, gossip) returns a :class:`Simulation`, so plans of
every kind compare on one scale; :meth:`Simulation.to_chrome_trace` writes its timeline
for Perfetto.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from flexsearch.sim.accounting import DeviceMemory
from flexsearch.sim.tasks import Scheduled


@dataclass(frozen=True)
class Simulation:
    """Predicted iteration: time, per-device memory and busy time, the timeline."""

    iteration_time_s: float
    memory_bytes: tuple[float, ...]
    capacity_bytes: float
    compute_s: tuple[float, ...]
    timeline: tuple[Scheduled, ...]
    link_names: tuple[str, ...]
    critical_path_s: float
    """Longest chain of dependent tasks (durations only, no waiting for resources)."""
    serial_s: float
    """Sum of all task durations."""
    memory_terms: tuple[DeviceMemory, ...] = ()
    """Per device, the terms its peak is made of (:mod:`flexsearch.sim.accounting`):
    what the memory model is checked against torch's memory trackers by."""

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_bytes, default=0.0)

    @property
    def feasible(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    def to_chrome_trace(self, path: str | os.PathLike[str] | None = None) -> dict:
        """The timeline as Chrome trace JSON (Perfetto, chrome://tracing): returned, and
        written to ``path`` when given.

        One track per device (process "devices") and per link (process "links"); times
        in microseconds. A slice per task and resource, its category the task's kind:
        compute (``fwd``, ``bwd``, ``update``) on the device tracks, communication
        (``xfer``, ``coll``) on the tracks of every link it loads (a slice per piece of a
        transfer that paused over others: :class:`~flexsearch.sim.tasks.Scheduled`); and
        ``bubble`` slices: each idle gap on a device between the start of its first task
        and the end of its last one (pipeline bubbles, waits for communication).
        ``otherData`` holds the iteration's summary."""
        devices = len(self.memory_bytes)
        group = {"fwd": "compute", "bwd": "compute", "update": "compute",
                 "xfer": "communication", "coll": "communication"}
        colour = {"compute": "thread_state_running", "communication": "thread_state_iowait",
                  "bubble": "grey"}
        events: list[dict] = []
        for pid, name in enumerate(("devices", "links")):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        tracks = [(0, d, f"device {d}") for d in range(devices)]
        tracks += [(1, i, f"link {name}") for i, name in enumerate(self.link_names)]
        for pid, tid, name in tracks:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        slices: dict[tuple[int, int], list[tuple[float, float, dict]]] = {}
        for s in self.timeline:
            t = s.task
            kind = group.get(t.kind, "compute")
            for r in t.resources:
                pid, tid = (0, r) if r < devices else (1, r - devices)
                # a transfer that paused over others holds its links for its pieces only
                for a, b in s.pieces if s.pieces and r >= devices else ((s.start, s.end),):
                    start, end = a * 1e6, b * 1e6
                    slices.setdefault((pid, tid), []).append((start, end, {
                        "name": f"{t.kind} {t.name}", "cat": t.kind, "ph": "X", "pid": pid, "tid": tid,
                        "ts": start, "dur": end - start, "cname": colour[kind],
                        "args": {"kind": kind, "detail": t.detail, "bytes": t.nbytes},
                    }))
        for (pid, tid), track in sorted(slices.items()):
            track.sort(key=lambda x: (x[0], x[1]))
            busy_until = None
            for start, end, e in track:
                if pid == 0 and busy_until is not None and start > busy_until:
                    events.append({"name": "bubble", "cat": "bubble", "ph": "X", "pid": 0, "tid": tid,
                                   "ts": busy_until, "dur": start - busy_until, "cname": colour["bubble"],
                                   "args": {"kind": "idle"}})
                events.append(e)
                busy_until = end if busy_until is None else max(busy_until, end)
        trace = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "iteration_time_s": self.iteration_time_s,
                "memory_bytes": list(self.memory_bytes),
                "capacity_bytes": self.capacity_bytes,
            },
        }
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

"""flexsearch.measure: the allocator's peak read from torch.profiler's memory events."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from flexsearch.measure import STEPS, allocator_peak, stderr_off


def test_allocator_peak_counts_the_steps_above_what_was_held_when_they_began():
    kept = torch.ones(1 << 20)  # 4 MB before the profiler: never counted
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with stderr_off():
        prof.start()
    try:
        before = torch.ones(1 << 19)  # 2 MB allocated before the steps and held through them
        with record_function(STEPS):
            big = torch.ones(1 << 21)  # 8 MB, then freed
            del big
            small = torch.ones(1 << 18)  # 1 MB
    finally:
        with stderr_off():
            prof.stop()
    assert allocator_peak(prof) == 8 * 2**20
    assert kept.numel() + before.numel() + small.numel() > 0

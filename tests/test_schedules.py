"""Pipeline schedules: orders equal to what torch's pipelining schedules run, in-flight counts,
unit-time makespans, validation and the action text form."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from flexsearch.strategy.schedules import (
    SCHEDULES,
    Action,
    format_grid,
    in_flight,
    makespan_units,
    parse_action,
    rank_actions,
    unit_grid,
    validate,
)

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

ranks_st = st.integers(1, 6)
mbs_st = st.integers(1, 12)
chunks_st = st.integers(1, 4)


def texts(per_rank) -> list[list[str]]:
    return [[a.text for a in actions] for actions in per_rank]


def interleaved_ok(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


class _RecordingStage:
    """Stands in for a PipelineStage: no communication, records the compute calls it gets."""

    def __init__(self, num_stages: int, stage_index: int):
        self.num_stages, self.stage_index = num_stages, stage_index
        self.is_last = stage_index == num_stages - 1
        self.log: list[str] = []

    def __getattr__(self, name):  # get_*_ops -> no p2p ops; everything else is a no-op
        return (lambda *a, **k: []) if name.startswith("get_") else (lambda *a, **k: None)

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, **kwargs):
        self.log.append(f"{self.stage_index}B{mb}")


def torch_runs(cls, p: int, m: int) -> list[list[str]]:
    """The compute order each rank of torch's single-stage schedule `cls` executes in one step."""
    out = []
    for r in range(p):
        stage = _RecordingStage(p, r)
        schedule = cls(stage, m)
        schedule._initialize_stage = lambda *a, **k: None
        schedule._step_microbatches()
        out.append(stage.log)
    return out


def torch_interleaved(p: int, m: int, v: int) -> list[list[str]]:
    """pipeline_order of torch's ScheduleInterleaved1F1B, built per rank from fake stages."""
    out = []
    for r in range(p):
        stages = [SimpleNamespace(group_size=p, group_rank=r, num_stages=p * v) for _ in range(v)]
        order = torch_schedules.ScheduleInterleaved1F1B(stages, m).pipeline_order[r]
        out.append([str(a) for a in order if a is not None])
    return out


# -- equality with torch ---------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(1, 1), (1, 3), (2, 1), (2, 2), (3, 5), (4, 4), (4, 8), (5, 3)])
def test_gpipe_matches_torch(p, m):
    ours = texts(rank_actions("gpipe", p, m))
    assert ours == torch_runs(torch_schedules.ScheduleGPipe, p, m)
    # torch's schedule IR for GPipe lists the same compute order.
    stage = SimpleNamespace(num_stages=p)
    ir = torch_schedules.ScheduleGPipe(stage, m).pipeline_order
    assert ours == [[str(a) for a in ir[r] if a.computation_type.value in "FB"] for r in range(p)]


@pytest.mark.parametrize(
    "p,m", [(1, 1), (1, 4), (2, 2), (2, 5), (3, 3), (3, 5), (4, 4), (4, 8), (5, 7)]
)
def test_1f1b_matches_torch(p, m):
    assert texts(rank_actions("1f1b", p, m)) == torch_runs(torch_schedules.Schedule1F1B, p, m)


def test_1f1b_known_order():
    assert texts(rank_actions("1f1b", 3, 5)) == [
        ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0F4", "0B2", "0B3", "0B4"],
        ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1F4", "1B3", "1B4"],
        ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3", "2F4", "2B4"],
    ]


@pytest.mark.parametrize(
    "p,m,v",
    [(1, 1, 1), (1, 3, 2), (2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 2, 2), (3, 6, 2), (3, 9, 3),
     (4, 3, 2), (4, 4, 1), (4, 6, 2), (4, 8, 2), (4, 10, 2), (4, 12, 3)],
)  # fmt: skip
def test_interleaved_matches_torch(p, m, v):
    assert texts(rank_actions("interleaved", p, m, chunks=v)) == torch_interleaved(p, m, v)


def test_interleaved_divisibility_matches_torch():
    for p in range(1, 5):
        for m in range(1, 13):
            try:
                torch_interleaved(p, m, 2)
                torch_accepts = True
            except ValueError:
                torch_accepts = False
            assert torch_accepts == interleaved_ok(p, m), (p, m)
            if not torch_accepts:
                with pytest.raises(ValueError, match="multiple"):
                    rank_actions("interleaved", p, m, chunks=2)


def test_action_text_matches_torch():
    a = Action(12, "B", 7)
    parsed = torch_schedules._Action.from_str(a.text)
    assert (parsed.stage_index, parsed.microbatch_index) == (12, 7)
    assert parsed.computation_type.value == "B"
    assert str(torch_schedules._Action(3, torch_schedules.F, 0)) == Action(3, "F", 0).text


# -- properties --------------------------------------------------------------------------------


@given(st.sampled_from(SCHEDULES), ranks_st, mbs_st, chunks_st)
def test_every_schedule_is_valid_and_runs(schedule, p, m, v):
    v = v if schedule == "interleaved" else 1
    assume(schedule != "interleaved" or interleaved_ok(p, m))
    per_rank = rank_actions(schedule, p, m, chunks=v)
    validate(per_rank, p, m, v)
    grid = unit_grid(per_rank, backward=2)  # raises if the order deadlocks
    busy = sum(cell is not None for row in grid for cell in row)
    assert busy == 3 * p * v * m


@given(ranks_st, mbs_st)
def test_in_flight(p, m):
    for r, actions in enumerate(rank_actions("gpipe", p, m)):
        assert in_flight(actions) == {r: m}
    for schedule in ("1f1b", "pipedream"):
        for r, actions in enumerate(rank_actions(schedule, p, m)):
            assert in_flight(actions) == {r: min(p - r, m)}


@given(st.sampled_from(["gpipe", "1f1b", "pipedream"]), ranks_st, mbs_st, st.integers(1, 3))
def test_makespan_is_fill_drain(schedule, p, m, backward):
    per_rank = rank_actions(schedule, p, m)
    assert makespan_units(per_rank) == 2 * (m + p - 1)
    assert makespan_units(per_rank, backward=backward) == (1 + backward) * (m + p - 1)


@given(ranks_st, st.integers(1, 4), chunks_st)
def test_interleaved_bubble_shrinks_with_chunks(p, rounds, v):
    m = p * rounds  # Megatron's setting: bubble of (p - 1) steps per F and B over m * v each
    assert makespan_units(rank_actions("interleaved", p, m, chunks=v)) == 2 * (m * v + p - 1)


def test_interleaved_one_chunk_warms_up_more_than_1f1b():
    # torch uses 2 * (p - 1 - r) + 1 forwards before the first backward, not p - r.
    peaks = [in_flight(a)[r] for r, a in enumerate(rank_actions("interleaved", 4, 8))]
    assert peaks == [7, 5, 3, 1]


@given(st.builds(Action, st.integers(0, 10**6), st.sampled_from(["F", "B"]), st.integers(0, 10**6)))
def test_parse_action_round_trip(a):
    assert parse_action(a.text) == a
    assert str(a) == a.text


# -- unit grid --------------------------------------------------------------------------------


def test_grid_and_format():
    grid = unit_grid(rank_actions("gpipe", 2, 1), backward=2)
    a = parse_action
    assert grid == (
        (a("0F0"), None, None, None, a("0B0"), a("0B0")),
        (None, a("1F0"), a("1B0"), a("1B0"), None, None),
    )
    assert format_grid(grid) == (
        "step   0   1   2   3   4   5\n"
        "r0   0F0   .   .   . 0B0 0B0\n"
        "r1     . 1F0 1B0 1B0   .   ."
    )


def test_1f1b_grid_steady_state():
    rows = format_grid(unit_grid(rank_actions("1f1b", 2, 3))).splitlines()
    assert rows[1].split()[1:] == ["0F0", "0F1", ".", "0B0", "0F2", "0B1", ".", "0B2"]
    assert rows[2].split()[1:] == [".", "1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "."]


def test_grid_detects_deadlock():
    a = parse_action
    per_rank = [[a("0F0"), a("0B0"), a("0F1"), a("0B1")], [a("1F1"), a("1B1"), a("1F0"), a("1B0")]]
    validate(per_rank, 2, 2)  # consistent per stage, but rank 0 waits for 1B0 behind 1F1
    with pytest.raises(ValueError, match="deadlock"):
        unit_grid(per_rank)


# -- bad inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "F1", "1F", "1X2", "-1F2", "1f2", "1F2x", "1B2 3", "1W0"])
def test_parse_action_rejects(text):
    with pytest.raises(ValueError, match="bad action text"):
        parse_action(text)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("zb", 2, 2), {}, "unknown schedule"),
        (("gpipe", 0, 2), {}, "ranks"),
        (("1f1b", 2, 0), {}, "microbatches"),
        (("interleaved", 2, 2), {"chunks": 0}, "chunks"),
        (("1f1b", 2, 2), {"chunks": 2}, "interleaved"),
        (("gpipe", 2.0, 2), {}, "ranks"),
        (("gpipe", True, 2), {}, "ranks"),
        (("interleaved", 2, 5), {"chunks": 2}, "multiple"),
    ],
)
def test_rank_actions_rejects(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rank_actions(*args, **kwargs)


def test_action_rejects():
    with pytest.raises(ValueError):
        Action(0, "W", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Action(-1, "F", 0)


def _swap_first_f_and_b(actions):
    actions = list(actions)
    i = next(k for k, x in enumerate(actions) if x.kind == "B")
    j = next(k for k, x in enumerate(actions) if x == Action(x.stage, "F", actions[i].microbatch))
    actions[i], actions[j] = actions[j], actions[i]
    return actions


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda pr: [_swap_first_f_and_b(pr[0]), *pr[1:]], "before its forward"),
        (lambda pr: [pr[0][:-1], *pr[1:]], "missing"),
        (lambda pr: [pr[0] + pr[0][-1:], *pr[1:]], "twice"),
        (lambda pr: [pr[1], pr[0], *pr[2:]], "but stage 1 is on rank 1"),
        (lambda pr: [[Action(0, "F", 9), *pr[0]], *pr[1:]], "out of range"),
        (lambda pr: pr[:-1], "3 ranks"),
    ],
)
def test_validate_rejects(mutate, match):
    per_rank = [list(a) for a in rank_actions("1f1b", 3, 4)]
    validate(per_rank, 3, 4)
    with pytest.raises(ValueError, match=match):
        validate(mutate(per_rank), 3, 4)


def test_in_flight_rejects_backward_first():
    with pytest.raises(ValueError, match="before its forward"):
        in_flight([Action(0, "B", 0), Action(0, "F", 0)])

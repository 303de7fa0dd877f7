"""``flexsearch calibrate``: the fits, the fitting order on a simulated machine whose terms
are known, and the command's resuming and writing (with the measurements stubbed: the
real probes run in ``benchmarks/fidelity.py --calibrate`` and take minutes)."""

from __future__ import annotations

import json

import pytest

from flexsearch.calibrate import Settings, calibrate, fit, probes, run
from flexsearch.cost.calibration import DeviceCalibration, load_calibration, load_calibration_file
from flexsearch.cost.hardware import Cluster
from flexsearch.errors import CalibrationError

DEVICE = Cluster.resolve("cpu", 2).device.name


def test_collective_and_update_fits_are_exact_on_exact_data():
    rows = [(m, 3e-4 + 2e-9 * m) for m in probes.COLLECTIVE_SIZES]
    a, b = fit.fit_collective(rows)
    assert a == pytest.approx(3e-4, rel=1e-6) and b == pytest.approx(2e-9, rel=1e-6)
    per_rank = [{"adam": [(n, n * e * 4, 5e-6 * n + 1e-9 * n * e * 4) for n, e in probes.UPDATE_SETS]},
                {"adam": [(n, n * e * 4, 4e-6 * n + 1e-9 * n * e * 4) for n, e in probes.UPDATE_SETS]}]
    pt, pb = fit.fit_updates(per_rank)["adam"]  # the slower rank's
    assert pt == pytest.approx(5e-6, rel=1e-6) and pb == pytest.approx(1e-9, rel=1e-6)
    assert fit.residual_line(1.0, 4.0, 2, 8) == (0.5, 0.0)
    assert fit.residual_line(5.0, 3.0, 2, 8) == (0.0, 5.0)  # clamped: no negative costs
    assert fit.overlap_fraction(1.0, 1.0, 1.5) == pytest.approx(0.5)


def _truth() -> DeviceCalibration:
    """A machine with known terms (the built-in calibration's, made distinctive)."""
    base = load_calibration_file().devices[DEVICE]
    raw = base.model_dump(mode="json")
    raw["host"] = None
    raw["step_spread"], raw["repeats"] = None, 1  # one round's fit has no spread
    raw["op_overhead"]["plain"] = {"forward_s": {"value": 2e-6, "source": "test"},
                                   "backward_s": {"value": 5e-6, "source": "test"}}
    raw["profiled_call"] = {"forward_s": {"value": 0.0, "source": "test"},
                            "backward_s": {"value": 0.0, "source": "test"}}
    raw["op_overhead"]["sharded"] = {"forward_s": {"value": 4e-5, "source": "test"},
                                     "backward_s": {"value": 9e-5, "source": "test"}}
    raw["ddp_per_tensor_s"] = {"value": 7e-6, "source": "test"}
    raw["fsdp_collective_s"] = {"value": 3e-4, "source": "test"}
    raw["zero1_per_tensor_s"] = {"value": 6e-5, "source": "test"}
    raw["pipeline_action_s"] = {"value": 2e-4, "source": "test"}
    raw["move_s"] = {"value": 8e-4, "source": "test"}
    for k, v in {"ddp": 1e-3, "zero1": 6e-3, "fsdp": 2e-3, "sharded": 3e-3, "pipeline": 4e-3,
                 "decentralized": 5e-3}.items():
        raw["step_s"][k] = {"value": v, "source": "test"}
        if k != "zero1":  # ZeRO-1 runs DDP's runtime
            raw["runtime_bytes"][k] = {"value": v * 1e9, "source": "test"}
    return DeviceCalibration.model_validate(raw)


def simulated_measurements(truth: DeviceCalibration, profile_path) -> dict:
    """What the calibration's stages would measure on a machine the simulator describes
    exactly with the terms ``truth``."""
    s = Settings()
    predict = run.Predictor(s.ranks, profile_path)
    colls = {op: [(m, f.time_s(2, m)) for m in probes.COLLECTIVE_SIZES] for op, f in truth.collectives.items()}
    conc = truth.concurrency
    upd = {k: [(n, n * e * 4, u.per_tensor_s.value * n + u.per_byte_s.value * n * e * 4)
               for n, e in probes.UPDATE_SETS] for k, u in truth.optimizer.items()}
    dt = truth.sharded_update_per_tensor_s.value

    def probe(name: str, mode: str, **kw) -> dict:
        p = predict(name, mode, truth, **kw)
        return {"step": p["step"], "bytes": p["bytes"], "worst_rank": 0, "forward": p["forward"], "foreign": 0.0}

    out = {
        "profile": str(profile_path),
        "collectives": [colls, colls],
        "concurrency": {"alone": [1.0, 2.0], "together": [{"forward": conc["forward"].value,
                                                           "backward": 2.0 * conc["backward"].value}]},
        "updates": [upd],
        "working": truth.optimizer_working_tensors.value,
        "overlap": {"compute": 0.01, "comm": 0.01, "both": 0.019},
        "sharded_update": [{"plain": 0.01, "dtensor": 0.01 + 256 * dt}],
        "plain": {n: {k: predict(n, "plain", truth, one=True)[k] for k in ("step", "forward")} for n in probes.PROBES},
        "pipeline": {f"m{m}": probe("deep32", "pipeline", microbatches=m) for m in (2, 8)},
    }
    for mode in ("ddp", "zero1", "fsdp", "sharded", "decentralized", "moves"):
        out[mode] = {n: probe(n, mode) for n in probes.PROBES}
    return json.loads(json.dumps(out))  # as the progress file stores it


def _flat(cal: DeviceCalibration) -> dict[str, float]:
    out: dict[str, float] = {}

    def walk(v, path):
        if isinstance(v, dict):
            if "value" in v and "source" in v:
                out[path] = float(v["value"])
                return
            for k, w in v.items():
                walk(w, f"{path}.{k}" if path else k)

    walk(cal.model_dump(mode="json"), "")
    return out


@pytest.fixture(scope="module")
def empty_profile(tmp_path_factory):
    return tmp_path_factory.mktemp("profile") / "probes.json"  # no entries: roofline op costs


def test_assemble_recovers_a_simulated_machines_terms(empty_profile):
    """Every term is fitted in order against the simulator with the terms before it;
    on measurements the simulator makes exactly, each comes back."""
    truth = _truth()
    raw = simulated_measurements(truth, empty_profile)
    got = run.assemble(raw, Settings(), "test", empty_profile)
    want, have = _flat(truth), _flat(got)
    assert got.communication_blocks_compute.value is True
    misses = {k: (want[k], have[k]) for k in want if have[k] != pytest.approx(want[k], rel=0.05, abs=1e-9)}
    assert not misses, misses


class Interrupted(Exception):
    pass


def test_calibrate_resumes_and_writes_atomically(tmp_path, monkeypatch, empty_profile):
    truth = _truth()
    raw = simulated_measurements(truth, empty_profile)
    calls: list[str] = []
    stopped: list[bool] = []

    def measure(stage, settings, profile_path):
        calls.append(stage)
        if stage == "plain" and not stopped:
            stopped.append(True)
            raise Interrupted  # the run stops in the middle (Ctrl-C, a killed process)
        return raw[stage]

    monkeypatch.setattr(run, "measure_stage", measure)
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps({"devices": {"another-device": load_calibration_file().devices[DEVICE]
                                           .model_dump(mode="json")}}))
    with pytest.raises(Interrupted):
        calibrate(out=out, profile_path=empty_profile)
    partial = tmp_path / "calibration.json.partial.json"
    assert partial.exists() and "plain" not in json.loads(partial.read_text())["stages"]
    assert "another-device" in json.loads(out.read_text())["devices"]  # nothing written yet
    done = calls.index("plain")
    calls.clear()
    res = calibrate(out=out, profile_path=empty_profile)
    rest = [*run.STAGES[done:], *run.STAGES[1:], *run.STAGES[1:]]  # this round's rest, then two more rounds
    assert calls == rest  # resumed at the interrupted stage
    assert res.measured == tuple(rest) and res.resumed
    assert not partial.exists() and res.log_path.exists()
    written = load_calibration_file(out)
    assert set(written.devices) == {"another-device", DEVICE}  # other entries kept
    cal = load_calibration(DEVICE, out)
    assert cal.host is not None and cal.host.cores >= 1
    assert "flexsearch calibrate" in cal.ddp_per_tensor_s.source
    # three identical repeats: every term as fitted, no spread, no step noise
    assert cal.repeats == 3 and cal.ddp_per_tensor_s.spread == 0.0 and cal.step_spread.value == 0.0
    assert "median of 3 repeats" in cal.ddp_per_tensor_s.source


def test_repeats_reject_an_outlier_and_record_the_spread(tmp_path, monkeypatch, empty_profile):
    """One round disturbed (every measured time 3x): its terms are rejected, the spread
    of the two others is recorded, and the step noise says how far the rounds' steps
    differ."""
    truth = _truth()
    raw = simulated_measurements(truth, empty_profile)
    rounds = {"n": 0}

    def scaled(x, f):
        if isinstance(x, dict):
            return {k: (v if k in ("worst_rank", "bytes", "foreign") else scaled(v, f)) for k, v in x.items()}
        if isinstance(x, list):
            return [scaled(v, f) for v in x]
        return x * f if isinstance(x, float) else x

    def measure(stage, settings, profile_path):
        if stage == "collectives":
            rounds["n"] += 1
        if stage in ("profile", "working", "overlap", "plain", "sharded_update"):
            return raw[stage]
        factor = {1: 1.0, 2: 1.02, 3: 3.0}[rounds["n"]]
        if stage == "collectives":  # (size, seconds) rows: only the seconds scale
            return [{op: [(m, t * factor) for m, t in rows] for op, rows in r.items()} for r in raw[stage]]
        return scaled(raw[stage], factor)

    monkeypatch.setattr(run, "measure_stage", measure)
    res = calibrate(out=tmp_path / "c.json", profile_path=empty_profile)
    cal = res.calibration
    a, b = truth.collectives["all_reduce"].latency_s.value, cal.collectives["all_reduce"].latency_s
    assert b.value == pytest.approx(1.01 * a, rel=1e-6) and b.spread == pytest.approx(0.01 * a, rel=1e-6)
    assert "1 rejected as outliers" in b.source
    # the probes' steps: 1, 1.02 and 3 x the truth: half the range (1) over the median (1.02)
    assert cal.step_spread.value == pytest.approx(1.0 / 1.02, rel=1e-6)


def test_fit_robust_and_combine():
    assert fit.robust([1.0, 1.02, 5.0]) == (pytest.approx(1.01), pytest.approx(0.01), 1)
    assert fit.robust([2.0, 2.0, 2.0]) == (2.0, 0.0, 0)
    assert fit.robust([1.0, 1.04, 1.08]) == (pytest.approx(1.04), pytest.approx(0.04), 0)  # within 5%: all kept
    trees = [{"a": {"value": v, "source": f"run {i}"}, "flag": {"value": f, "source": "x"}, "ranks": 2}
             for i, (v, f) in enumerate(((1.0, True), (3.0, False), (2.0, True)))]
    out = fit.combine(trees)
    assert out["a"]["value"] == 2.0 and out["a"]["spread"] == 1.0 and out["a"]["source"].startswith("run 2")
    assert out["flag"]["value"] is True and "2 of 3 repeats said yes" in out["flag"]["source"]
    assert out["ranks"] == 2


def test_calibrate_does_not_overwrite_a_file_that_is_not_a_calibration(tmp_path):
    out = tmp_path / "notes.json"
    out.write_text("my notes")
    with pytest.raises(CalibrationError, match="not a calibration file"):
        calibrate(out=out)
    assert out.read_text() == "my notes"

"""`flexsearch plan`, `simulate` and `show`: summary, --json, files, bad input."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from test_cli import invoke, run

from flexsearch.plan import PLAN_VERSION, REFERENCE_BASELINES

TINY = str(ROOT / "benchmarks/models/alexnet.py:alexnet_tiny")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    out, tl = d / "plan.json", d / "timeline.json"
    r = run("plan", TINY, "--devices", "4", "--cluster", "flexflow-k80", "--max-iters", "60", "--no-decentralized",
            "--out", str(out), "--trace", str(tl), "--json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("{") and r.stdout.count("\n") == 1  # --json: one object, nothing else
    return d, out, tl, json.loads(r.stdout)


def test_plan_json_summary_and_files(planned):
    _, out, tl, summary = planned
    for key in ("kind", "devices", "iteration_time_s", "peak_memory_bytes", "lower_bound_s",
                "baselines", "search_time_s"):
        assert key in summary
    assert summary["devices"] == 4 and "data" in summary["baselines"]
    sync = [t for k, t in summary["baselines"].items() if k not in REFERENCE_BASELINES]
    assert summary["iteration_time_s"] <= min(sync) * (1 + 1e-9)
    assert summary["lower_bound_s"] <= summary["iteration_time_s"]
    plan = json.loads(out.read_text())
    assert plan["version"] == PLAN_VERSION and plan["kind"] == summary["kind"]
    events = json.loads(tl.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)


def test_plan_is_reproducible(planned, tmp_path):
    _, out, _, _ = planned
    again = tmp_path / "again.json"
    r = run("plan", TINY, "--devices", "4", "--cluster", "flexflow-k80", "--max-iters", "60", "--no-decentralized",
            "--out", str(again))
    assert r.returncode == 0, r.stderr
    assert "predicted iteration" in r.stdout and "speedup over data parallel" in r.stdout
    assert again.read_bytes() == out.read_bytes()


def test_simulate_and_show(planned, capsys):
    _, out, _, summary = planned
    r = invoke(capsys, "simulate", str(out), "--json")
    assert r.returncode == 0, r.stderr
    sim = json.loads(r.stdout)
    assert sim["iteration_time_s"] == pytest.approx(summary["iteration_time_s"], rel=1e-12)
    r = invoke(capsys, "show", str(out))
    assert r.returncode == 0, r.stderr
    assert "features_0" in r.stdout


def test_plan_refuses_to_overwrite(planned, capsys):
    _, out, _, _ = planned
    before = out.read_bytes()
    r = invoke(capsys, "plan", TINY, "--devices", "4", "--max-iters", "5", "--out", str(out))
    assert r.returncode == 2 and "--force" in r.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", TINY, "--cluster", "no-such-cluster"], "no-such-cluster"),
        (["plan", TINY, "--devices", "0"], "--devices"),
        (["plan", TINY, "--objective", "speed"], "--objective"),
        (["simulate", "absent.json"], "does not exist"),
        (["show", "absent.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    r = invoke(capsys, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_damaged_plan_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run("simulate", str(bad))
    assert r.returncode == 2 and "damaged" in r.stderr


# -- in-process runs (no interpreter start per case) -------------------------------------
MLP = str(ROOT / "benchmarks/models/mlp.py:mlp_tiny")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    from flexsearch.cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_default_cluster_is_named(capsys):
    rc, out, err = cli(capsys, "plan", MLP, "--devices", "2", "--max-iters", "5")
    assert rc == 0, err
    assert "dgx-h100" in out and "default" in out and "--cluster" in out
    rc, out, err = cli(capsys, "plan", MLP, "--devices", "2", "--max-iters", "5", "--cluster", "dgx-a100")
    assert rc == 0 and "dgx-a100" in out and "default" not in out


def test_json_prints_nothing_else(capsys, tmp_path):
    rc, out, err = cli(capsys, "plan", MLP, "--devices", "2", "--max-iters", "5", "--json",
                       "--out", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.json"))
    assert rc == 0, err
    assert out.count("\n") == 1 and json.loads(out)["devices"] == 2
    rc, out, err = cli(capsys, "simulate", str(tmp_path / "p.json"), "--json", "--trace", str(tmp_path / "t2.json"))
    assert rc == 0 and out.count("\n") == 1 and json.loads(out)["feasible"]


def test_every_file_flag_refuses_to_overwrite(capsys, tmp_path):
    plan_file, tl = tmp_path / "p.json", tmp_path / "t.json"
    assert cli(capsys, "plan", MLP, "--devices", "2", "--max-iters", "5", "--out", str(plan_file))[0] == 0
    tl.write_text("keep")
    for args in (["plan", MLP, "--devices", "2", "--max-iters", "5", "--trace", str(tl)],
                 ["plan", MLP, "--devices", "2", "--max-iters", "5", "--out", str(plan_file)],
                 ["simulate", str(plan_file), "--trace", str(tl)],
                 ["report", str(plan_file), "--out", str(tl)]):
        before = plan_file.read_bytes()
        rc, out, err = cli(capsys, *args)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (args, err)
        assert "--force" in err and "exists" in err
        assert tl.read_text() == "keep" and plan_file.read_bytes() == before
    rc, _, err = cli(capsys, "simulate", str(plan_file), "--trace", str(tl), "--force")
    assert rc == 0, err
    assert "traceEvents" in json.loads(tl.read_text())


# -- Ctrl-C during the search ------------------------------------------------------------
def test_interrupted_search_returns_best_plan_through_the_api():
    import flexsearch
    from flexsearch.graph import trace

    model, inputs = flexsearch.load_model(MLP)
    seen = []

    def ctrl_c_after_five(it: int, best: float) -> None:
        seen.append(best)
        if it == 5:
            raise KeyboardInterrupt

    p = flexsearch.plan(model, inputs, devices=4, max_iters=500, progress=ctrl_c_after_five)
    assert p.interrupted and p.search.iterations == 5
    assert "pipedream" in p.baselines  # the pipelines are searched before the MCMC
    assert "ps" not in p.baselines  # the decentralized step is skipped too
    # the best so far: the search's, or DDP's one-bucket data parallel when faster
    assert p.predicted.iteration_time_s <= seen[-1] * (1 + 1e-12)
    sim = flexsearch.simulate(trace(model, inputs, precision=p.precision), p)  # a complete, valid plan
    assert sim.feasible and sim.iteration_time_s == pytest.approx(p.predicted.iteration_time_s)
    full = flexsearch.plan(model, inputs, devices=4, max_iters=5)
    assert not full.interrupted


def test_interrupted_search_through_the_cli(ctrl_c_in_search, tmp_path):
    """A Ctrl-C that lands inside the search loop (here: in the cost function)."""
    from typer.testing import CliRunner

    from flexsearch.cli import app

    out = tmp_path / "plan.json"
    r = CliRunner().invoke(app, ["plan", MLP, "--devices", "4", "--max-iters", "500", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["interrupted"] and summary["iteration_time_s"] > 0
    assert "interrupted: returning the best plan found so far" in r.stderr
    assert out.exists() and json.loads(out.read_text())["search"]["iterations"] < 500
    r = CliRunner().invoke(app, ["plan", MLP, "--devices", "4", "--max-iters", "500", "--force", "--out", str(out)])
    assert r.exit_code == 0 and "interrupted" in r.stdout  # the table says so too


# -- bad input: one line on stderr, exit 2, no traceback ---------------------------------
@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "syntax.py").write_text("def broken(:\n    pass\n")
    (d / "empty.py").write_text("x = 1\n")
    (d / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (d / "damaged.json").write_text('{"version": 1, "model": "m.py", "kind"')
    (d / "foreign.json").write_text('{"name": "not a plan", "items": [1, 2]}')
    (d / "list.json").write_text("[1, 2, 3]")
    (d / "cluster.json").write_text('{"name": "half"}')
    (d / "huge.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build_model():\n"
        "    with torch.device('meta'):\n"
        "        m = nn.Sequential(nn.Linear(262144, 262144), nn.ReLU(), nn.Linear(262144, 16))\n"
        "    return m, (torch.empty(8, 262144, device='meta'),)\n"
    )
    from flexsearch.cli import main

    assert main(["plan", MLP, "--devices", "2", "--max-iters", "5", "--out", str(d / "mlp.json")]) == 0
    plan = json.loads((d / "mlp.json").read_text())
    (d / "newer.json").write_text(json.dumps({**plan, "version": 99}))
    gpt = str(ROOT / "benchmarks/models/gpt.py:gpt_tiny")
    (d / "other_model.json").write_text(json.dumps({**plan, "model": gpt}))
    (d / "bad_config.json").write_text(json.dumps({**plan, "configs": {**plan["configs"], "fc1": "s9q"}}))
    assert main(["plan", MLP, "--devices", "2", "--kind", "data", "--max-iters", "5", "--out", str(d / "data.json")]) == 0
    data = json.loads((d / "data.json").read_text())
    (d / "fewer_devices.json").write_text(json.dumps({**data, "devices": 1}))
    some = next(iter(data["configs"].values()))
    (d / "extra_op.json").write_text(json.dumps({**data, "configs": {**data["configs"], "ghost": some},
                                                 "decisions": {**data["decisions"], "ghost": some}}))
    (d / "moved_model.json").write_text(json.dumps({**plan, "model": "nowhere/m.py:build"}))
    (d / "extra_input.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build():\n"
        "    return nn.Linear(8, 8), (torch.randn(16, 8), 3)\n"
    )
    return d


BAD = [
    # unknown or out-of-range flag values
    (["plan", MLP, "--objective", "foo"], "--objective"),
    (["plan", MLP, "--cluster", "nosuch"], "unknown cluster preset 'nosuch'"),
    (["plan", MLP, "--devices", "0"], "--devices"),
    (["plan", MLP, "--devices", "-4"], "--devices"),
    (["plan", MLP, "--devices", "many"], "--devices"),
    (["plan", MLP, "--cluster", "flexflow-p100", "--devices", "17"], "at most 16 devices"),
    (["plan", MLP, "--cluster", "cpu", "--devices", "9"], "at most 8 devices"),
    (["plan", MLP, "--budget", "0"], "--budget"),
    (["plan", MLP, "--max-iters", "-1"], "--max-iters"),
    (["plan", MLP, "--frobnicate"], "No such option"),
    (["plan", MLP, "--kind", "fast"], "unknown plan kind 'fast'"),
    (["plan", MLP, "--devices", "100000"], "100000 devices"),
    # a kind the model has no plan of: why, in one line
    (["plan", MLP, "--devices", "2", "--cluster", "cpu", "--kind", "hybrid"], "no hybrid plan"),
    (["plan", MLP, "--devices", "1", "--kind", "decentralized"], "no decentralized plan on one device"),
    (["plan", MLP, "--cluster", "{d}/cluster.json"], "cluster.json"),
    (["plan", MLP, "--cluster", "{d}/absent.json"], "absent.json"),
    # model file problems
    (["plan", "{d}/absent.py"], "does not exist"),
    (["plan", "{d}/syntax.py"], "SyntaxError"),
    (["plan", "{d}/empty.py"], "no model found"),
    (["plan", "{d}/exits.py"], "exits (sys.exit(3)) when imported"),
    (["plan", MLP.replace("mlp_tiny", "no_such")], "has no 'no_such'"),
    # nothing fits even on every device the cluster has
    (["plan", "{d}/huge.py", "--cluster", "flexflow-p100", "--devices", "16", "--max-iters", "5"], "needs"),
    # plan files: missing, damaged, foreign, newer, another model's, edited
    (["show", "{d}/absent.json"], "does not exist"),
    (["show", "{d}/damaged.json"], "damaged"),
    (["simulate", "{d}/damaged.json"], "damaged"),
    (["report", "{d}/damaged.json", "--out", "{d}/r.html"], "damaged"),
    (["show", "{d}/foreign.json"], "not a flexsearch plan"),
    (["simulate", "{d}/list.json"], "not a flexsearch plan"),
    (["report", "{d}/foreign.json", "--out", "{d}/r.html"], "not a flexsearch plan"),
    (["simulate", "{d}/newer.json"], "upgrade flexsearch"),
    (["simulate", "{d}/other_model.json"], "not the plan's"),
    (["show", "{d}/bad_config.json"], "damaged"),
    (["show", "{d}/fewer_devices.json"], "is damaged or edited: "),  # a configuration on more devices than the plan
    (["verify", MLP, "--plan", "{d}/fewer_devices.json"], "is damaged or edited: "),
    (["simulate", "{d}/extra_op.json"], "ghost, which is not an op of the model"),
    (["verify", MLP, "--plan", "{d}/extra_op.json"], "ghost, which is not an op of the model"),
    (["simulate", "{d}/moved_model.json"], "is neither here nor next to"),
    (["show", "{d}/syntax.py"], "not a plan file"),
    (["profile", MLP, "--out", "{d}/mlp.json"], "is not a profile file"),
    (["plan", MLP.rsplit(":", 1)[0] + ":"], "no NAME after ':'"),
    (["plan", "{d}/extra_input.py:build"], "do not fit Linear.forward"),  # an input forward does not take (the tracer)
    (["report", "{d}/mlp.json"], "--out"),
    # output paths refused before any work: the same file twice, a directory (even with --force)
    (["plan", MLP, "--out", "{d}/same.json", "--trace", "{d}/same.json"], "--out and --trace are the same file"),
    (["plan", MLP, "--out", "{d}/same.json", "--trace", "{d}/../{d_name}/same.json"], "are the same file"),
    (["plan", "{d}/syntax.py", "--out", "{d}/syntax.py", "--force"], "the model file and --out are the same file"),
    (["plan", MLP, "--out", "{d}", "--force"], "--out {d} is a directory"),
    (["plan", MLP, "--out", "{d}/mlp.json/plan.json"], "mlp.json is a file, not a directory"),
    (["plan", MLP, "--out", "/proc/flexsearch-plan.json"], "cannot write --out"),  # before the search
    (["plan", MLP, "--max-iters", "5", "--out", "/dev/full", "--force"], "cannot write --out /dev/full"),  # a full disk
    (["report", "{d}/mlp.json", "--out", "/proc/flexsearch-report.html"], "cannot write --out"),
    (["plan", MLP, "--trace", "{d}", "--force"], "--trace {d} is a directory"),
    (["report", "{d}/mlp.json", "--out", "{d}", "--force"], "--out {d} is a directory"),
    (["simulate", "{d}/mlp.json", "--trace", "{d}", "--force"], "--trace {d} is a directory"),
    (["profile", MLP, "--out", "{d}"], "--out {d} is a directory"),
    (["report", "{d}/mlp.json", "--out", "{d}/mlp.json", "--force"], "PLAN.json and --out are the same file"),
    (["simulate", "{d}/mlp.json", "--trace", "{d}/mlp.json", "--force"], "PLAN.json and --trace are the same file"),
    # options that contradict each other
    (["plan", MLP, "--kind", "decentralized", "--no-decentralized"], "--no-decentralized rules them out"),
    (["plan", MLP, "--kind", "data,decentralized", "--no-decentralized"], "drop one of the two"),
    (["plan", MLP, "--cluster", "cpu", "--batch-norm", "sync"], "SyncBatchNorm runs on GPUs only"),
]


@pytest.mark.parametrize(("args", "needle"), BAD, ids=[" ".join(a[:1] + [a[-1]]) + f"-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_in_process(capsys, bad_files, args, needle):
    args = [a.replace("{d}", str(bad_files)).replace("{d_name}", bad_files.name) for a in args]
    needle = needle.replace("{d}", str(bad_files))
    plan_before = (bad_files / "mlp.json").read_bytes()
    rc, out, err = cli(capsys, *args)
    assert (bad_files / "mlp.json").read_bytes() == plan_before and not (bad_files / "same.json").exists()
    assert rc == 2, (out, err)
    # a calibration warning (the cpu preset on a host the calibration on disk is not from) is its own line
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0] and "Traceback" not in err


def test_infeasible_model_says_what_it_needs(capsys, bad_files):
    rc, _, err = cli(capsys, "plan", str(bad_files / "huge.py"), "--cluster", "flexflow-p100", "--devices", "16",
                     "--max-iters", "5")
    assert rc == 2
    assert "no plan fits in 14.9 GiB per device on 16 x" in err and "needs" in err and "GiB" in err
    assert "iB in all, " in err and ("devices' worth" in err or "spread evenly" in err)  # 20 TiB
    assert "more devices" in err and "cluster with more memory" in err


REAL_CTRL_C = """
import os, signal, sys
import flexsearch.search.mcmc as mcmc
from flexsearch.cli import main

real, calls = mcmc.cost_of, []

def cost(sim):  # a real SIGINT, sent while the MCMC runs (after the CP-SAT ILP seed)
    calls.append(1)
    if len(calls) == 20:
        os.kill(os.getpid(), signal.SIGINT)
    return real(sim)

mcmc.cost_of = cost
sys.exit(main(["plan", sys.argv[1], "--devices", "4", "--max-iters", "500", "--json"]))
"""


def test_real_ctrl_c_after_the_ilp_returns_the_best_plan():
    """CP-SAT takes SIGINT over during a solve; the planner must put Python's handler
    back, or a later Ctrl-C kills the process and loses the plan."""
    import signal
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", REAL_CTRL_C, MLP], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 0, (r.returncode, r.stderr)
    summary = json.loads(r.stdout)
    assert summary["interrupted"]
    assert r.stderr.strip() == summary_line(r.stderr)


def summary_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: returning the best plan found so far"), stderr
    return lines[0]


def test_ctrl_c_outside_a_search_exits_130(capsys, monkeypatch):
    import flexsearch.model_files as model_files

    def ctrl_c(spec):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_files, "load_model", ctrl_c)
    rc, out, err = cli(capsys, "plan", MLP, "--devices", "2")
    assert rc == 130 and out == "" and err.strip() == "interrupted"


@pytest.mark.parametrize("after_s", [0.3, 0.8, 1.5])
def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(after_s):
    """A real SIGINT in the command's first second, while it imports torch and its own
    modules (``import flexsearch`` imports none of them: :mod:`flexsearch.console`)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "flexsearch", "plan", MLP, "--devices", "2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted" and out == ""


def test_importing_the_package_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, flexsearch, flexsearch.console; assert 'torch' not in sys.modules; "
            "from flexsearch import precision, Plan; assert 'torch' in sys.modules; "
            "print(flexsearch.trace.__module__, sorted(set(flexsearch.__all__) - set(dir(flexsearch))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["flexsearch.graph.tracer", "[]"]


# -- the Python API: bad arguments are FlexsearchErrors, before the model is traced --------
@pytest.fixture
def no_tracing(monkeypatch):
    """``flexsearch.plan`` fails the test if it gets as far as tracing the model."""
    import flexsearch.api

    def traced(*a, **k):
        raise AssertionError("the model was traced before the arguments were checked")

    monkeypatch.setattr(flexsearch.api, "trace", traced)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"optimizer": "lamb"}, "unknown optimizer 'lamb'; use one of adam, momentum, sgd"),
    ({"optimizer": None}, "unknown optimizer None"),
    ({"max_iters": 2.5}, "max_iters must be a whole number >= 0 (got 2.5)"),
    ({"max_iters": True}, "max_iters must be a whole number"),
    ({"max_iters": -1}, "max_iters must be a whole number >= 0"),
    ({"max_iters": "5"}, "max_iters must be a whole number"),
    ({"budget_s": "5"}, "budget_s must be a number of seconds"),
    ({"kinds": "dat"}, "unknown plan kind 'dat'"),
    ({"kinds": "decentralized", "decentralized": False}, "decentralized=False rules them out"),
    ({"kinds": ["data", "decentralized"], "decentralized": False}, "drop one of the two"),
    ({"batch_norm": "sync", "cluster": "cpu"}, "SyncBatchNorm runs on GPUs only"),
])
def test_api_refuses_bad_arguments_before_tracing(no_tracing, kw, needle):
    import flexsearch
    from flexsearch.errors import FlexsearchError

    model, inputs = flexsearch.load_model(MLP)
    with pytest.raises(FlexsearchError) as e:
        flexsearch.plan(model, inputs, devices=2, **{"max_iters": 0, **kw})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_api_kinds_may_be_one_string():
    """``kinds="data"`` is the kind data (not the kinds d, a, t, a); commas separate
    several, as the CLI's --kind."""
    import flexsearch

    model, inputs = flexsearch.load_model(MLP)
    assert flexsearch.plan(model, inputs, devices=2, kinds="data", max_iters=0, workers=1).kind == "data"
    assert flexsearch.plan(model, inputs, devices=2, kinds=" fsdp, data", max_iters=0, workers=1).kind in ("data",
                                                                                                           "fsdp")


# -- what the table and notes say ----------------------------------------------------------
def test_precision_note_names_what_the_device_has(monkeypatch):
    """bf16-mixed on the cpu preset is for its CPU's bf16 instructions, not tensor cores."""
    import flexsearch.precision
    from flexsearch.api import resolve_cluster, resolve_precision

    monkeypatch.setattr(flexsearch.precision, "host_runs_bf16", lambda: True)
    prec, why = resolve_precision("auto", resolve_cluster("cpu", 2))
    assert prec.name == "bf16-mixed" and "tensor cores" not in why and "AVX512-BF16 or AMX" in why, why
    prec, why = resolve_precision("auto", resolve_cluster("dgx-h100", 2))
    assert prec.name == "bf16-mixed" and "(bf16 tensor cores)" in why and "AVX512" not in why, why


def _table_text(p) -> str:
    from rich.console import Console

    from flexsearch.tables import plan_table

    console = Console(record=True, width=240)
    console.print(plan_table(p, None))
    return console.export_text()


def test_plan_table_says_a_one_stage_pipeline_does_not_pipeline():
    """A pipeline plan of one stage (its chunks all on every device) runs no pipeline;
    the table says so, with "1 microbatch" in the singular."""
    import flexsearch
    from flexsearch.plan import Stage

    model, inputs = flexsearch.load_model(MLP)
    two = flexsearch.plan(model, inputs, devices=2, cluster="cpu", kinds="pipeline", max_iters=0, workers=1,
                          precision="fp32")
    assert len(two.stages) == 2 and (two.chunks or 1) == 1
    text = _table_text(two)
    assert f"{two.schedule}, {two.microbatches} microbatch" in text and "no pipelining" not in text
    everywhere = tuple(Stage(**{**st.model_dump(), "devices": (0, 1), "replicas": 2}) for st in two.stages)
    one = two.model_copy(update={"stages": everywhere, "chunks": 2, "microbatches": 1, "schedule": "interleaved"})
    text = _table_text(one)
    assert "no pipelining (one stage in 2 chunks run in turn), 1 microbatch" in text, text
    assert "interleaved" not in text and "1 microbatches" not in text and "chunks per rank" not in text
    assert "chunk 0" in text and "chunk 1" in text and "1 x 2 x" in text
    text = _table_text(one.model_copy(update={"stages": everywhere[:1], "chunks": 1, "microbatches": 4}))
    assert "no pipelining (one stage), 4 microbatches accumulated" in text and "stage 0" in text, text


def test_a_budget_counts_from_the_process_start():
    """``--budget`` bounds the whole command: the process's age (its start-up and imports,
    before any clock of ours) is taken off it, as tracing is."""
    import time

    from flexsearch.cli import _process_age_s

    assert _process_age_s() >= time.thread_time() - 0.05  # this thread ran that long on the CPU, at least
    r = run("plan", TINY, "--devices", "2", "--cluster", "cpu", "--budget", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    assert any("budget 0.5 s" in n for n in json.loads(r.stdout)["notes"])  # spent by start-up, tracing


def test_main_called_in_a_program_counts_its_budget_from_the_call(capsys, monkeypatch):
    """``flexsearch.cli.main`` in a long-running program (here one alive for 1,000 s)
    counts the budget from the call, not from the program's start (it found the budget
    spent)."""
    from test_cli import invoke

    import flexsearch.cli

    monkeypatch.setattr(flexsearch.cli, "_process_age_s", lambda: 1000.0)
    r = invoke(capsys, "plan", TINY, "--devices", "2", "--cluster", "cpu", "--budget", "60", "--json")
    assert r.returncode == 0, r.stderr
    assert not [n for n in json.loads(r.stdout)["notes"] if n.startswith("budget")]

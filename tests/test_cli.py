"""The command line: output, --json, and bad input as one line on stderr with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

import flexsearch

TINY = str(ROOT / "benchmarks/models/gpt.py:gpt_tiny")


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexsearch", *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=300)


def invoke(capsys, *args: str) -> SimpleNamespace:
    """:func:`run` in this process (``flexsearch.cli.main``: the exit code, one-line errors
    and output as the command prints them), without a new interpreter's two seconds."""
    from flexsearch.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_trace_prints_summary_and_table(capsys):
    r = invoke(capsys, "trace", TINY)
    assert r.returncode == 0, r.stderr
    assert "traced via fx" in r.stdout and "parameters" in r.stdout
    assert "repeated block: 2 x Block" in r.stdout
    assert "heaviest" in r.stdout and "linear" in r.stdout


def test_trace_json_is_one_object(capsys):
    r = invoke(capsys, "trace", TINY, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["nodes"] == len(data["graph"]["nodes"])
    assert data["num_params"] > 0 and data["flops"] > 0 and data["fingerprint"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["trace", "nope/absent.py"], "does not exist"),
        (["trace", "benchmarks/models/gpt.py:no_such"], "has no 'no_such'"),
        (["trace", TINY, "--bogus"], "No such option"),
        (["trace", TINY, "--top", "0"], "--top"),
        (["trace"], "Missing argument"),
        (["profile"], "MODEL"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    r = invoke(capsys, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr


def test_model_file_errors_through_cli(model_file, capsys):
    broken = model_file("import torch\nraise ImportError('needs foo')\n", name="broken.py")
    r = invoke(capsys, "trace", str(broken))
    assert r.returncode == 2
    assert "ImportError: needs foo" in r.stderr and f"{broken}:2" in r.stderr
    control = model_file(
        """
        import torch
        from torch import nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                if x.mean() > 0:
                    return self.fc(x)
                return x

        def build_model():
            return M(), (torch.randn(2, 4),)
        """,
        name="control.py",
    )
    r = invoke(capsys, "trace", str(control))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "control.py:11" in r.stderr and "if x.mean() > 0:" in r.stderr


def test_profile_writes_cache(tmp_path, capsys):
    """The first command in a new process, the others in this one (:func:`invoke`)."""
    out = tmp_path / "prof.json"
    spec = str(ROOT / "benchmarks/models/mlp.py:mlp_tiny")
    r = run("profile", spec, "--out", str(out), "--repeats", "1", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    assert out.exists() and "measured" in r.stdout
    again = invoke(capsys, "profile", spec, "--out", str(out), "--repeats", "1", "--warmup", "0")
    assert " 0 measured" in " ".join(again.stdout.split())  # rich wraps long paths

    # plan and simulate price the ops from it (--profile), and say how many
    plan_file = tmp_path / "plan.json"
    common = ("--devices", "2", "--cluster", "cpu", "--max-iters", "20", "--no-decentralized")
    r = invoke(capsys, "plan", spec, *common, "--precision", "fp32", "--profile", str(out), "--out", str(plan_file), "--json")
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert f"op costs: 7 of 7 ops measured (profile {out})" in notes
    sim = invoke(capsys, "simulate", str(plan_file), "--json")
    assert "pass --profile to re-predict it as planned" in " ".join(sim.stderr.split())
    again = json.loads(invoke(capsys, "simulate", str(plan_file), "--profile", str(out), "--json").stdout)
    assert again["iteration_time_s"] == again["planned_iteration_time_s"]
    assert json.loads(sim.stdout)["iteration_time_s"] != again["iteration_time_s"]  # the roofline's times differ
    # a profile that prices none of the ops, or none at all: one line, exit 2
    for args, needle in (((str(out), "--precision", "bf16-mixed"), "flexsearch profile MODEL --precision bf16-mixed"),
                         ((str(tmp_path / "nope.json"),), "does not exist")):
        bad = invoke(capsys, "plan", spec, *common, "--profile", *args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and needle in bad.stderr, bad.stderr
    # profiled at that precision, it does
    assert invoke(capsys, "profile", spec, "--out", str(out), "--repeats", "1", "--warmup", "0",
               "--precision", "bf16-mixed").returncode == 0
    r = invoke(capsys, "plan", spec, *common, "--precision", "bf16-mixed", "--profile", str(out), "--json")
    assert f"op costs: 7 of 7 ops measured (profile {out})" in json.loads(r.stdout)["notes"], r.stderr


def test_cluster_lists_and_shows_presets(capsys):
    r = invoke(capsys, "cluster")
    assert r.returncode == 0 and "dgx-h100" in r.stdout and "flexflow-k80" in r.stdout
    r = invoke(capsys, "cluster", "pipedream-a", "--devices", "8")
    assert r.returncode == 0 and "8 devices on 2 node(s)" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["cluster", "nope"], "use one of: commodity"),
        (["cluster", "flexflow-k80", "--devices", "100"], "at most 64 devices"),
        (["cluster", "dgx-h100", "--devices", "0"], "--devices"),
    ],
)
def test_cluster_bad_input(args, needle, capsys):
    r = invoke(capsys, *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert needle in r.stderr


# Every command's arguments and options with their defaults. A change to the command
# line must update this listing on purpose (users' scripts and DESIGN section 2 use it).
GOLDEN_FLAGS = """
bench --check default=False
bench --update default=False
bench --baseline default=None
calibrate --out default=None
calibrate --ranks default=None min=2
calibrate --threads default=1 min=1
calibrate --steps default=40 min=3
calibrate --warmup default=3 min=2
calibrate --retries default=3 min=1
calibrate --max-wait default=60.0 min=0
calibrate --restart default=False
calibrate --repeats default=3 min=1
calibrate --convergence default=None
calibrate --epochs default=20 min=2
cluster NAME default=None
cluster --devices default=None min=1
plan MODEL default=None required
plan --devices default=8 min=1
plan --cluster default=None
plan --budget default=None min=0.001
plan --max-iters default=None min=0
plan --seed default=0
plan --objective default='time_to_accuracy'
plan --decentralized default=True
plan --precision default='auto'
plan --batch-norm default='local'
plan --kind default=None
plan --out default=None
plan --trace default=None
plan --force default=False
plan --workers default=None min=1
plan --profile default=None
plan --json default=False
profile MODEL default=None
profile --out default=None
profile --threads default=1 min=1
profile --repeats default=5 min=1
profile --warmup default=2 min=0
profile --comm default=False
profile --ranks default=2 min=2
profile --precision default='fp32'
report PLAN_FILE default=None required
report --out default=None required
report --force default=False
show PLAN_FILE default=None required
simulate PLAN_FILE default=None required
simulate --trace default=None
simulate --force default=False
simulate --profile default=None
simulate --json default=False
trace MODEL default=None required
trace --json default=False
trace --top default=10 min=1
verify MODEL default=None required
verify --plan default=None required
verify --ranks default=None min=1
verify --steps default=3 min=1
verify --timeout default=600 min=1
verify --json default=False
"""


def cli_flags() -> str:
    import typer

    from flexsearch.cli import app

    group = typer.main.get_command(app)
    lines = []
    for name in sorted(group.commands):
        for p in group.commands[name].params:
            opt = " ".join(p.opts) if p.param_type_name == "option" else p.name.upper()
            bounds = "".join(f" {k}={getattr(p, k)}" for k in ("min", "max") if getattr(p, k, None) is not None)
            lines.append(f"{name} {opt} default={p.default!r}" + (" required" if p.required else "") + bounds)
    return "\n".join(lines)


def test_cli_flags_are_frozen():
    assert cli_flags() == GOLDEN_FLAGS.strip(), "the CLI changed: update GOLDEN_FLAGS (and DESIGN/README) on purpose"


def test_design_commands_exist():
    """DESIGN section 2: every command and flag it names."""
    listing = cli_flags()
    for cmd, flags in {
        "plan": ["--devices", "--cluster", "--budget", "--max-iters", "--seed", "--objective", "--out", "--trace", "--json"],
        "trace": ["--json"], "profile": ["--out"], "simulate": ["--trace", "--json"], "show": [],
        "report": ["--out"], "bench": ["--check", "--update"],
    }.items():
        assert f"\n{cmd} " in "\n" + listing
        for flag in flags:
            assert f"\n{cmd} {flag} " in "\n" + listing, (cmd, flag)


# -- verify: how a failed run reads --------------------------------------------------------
MLP = str(ROOT / "benchmarks/models/mlp.py:mlp_tiny")


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    from flexsearch.cli import main

    path = tmp_path_factory.mktemp("verify") / "plan.json"
    assert main(["plan", MLP, "--devices", "2", "--cluster", "cpu", "--kind", "data", "--max-iters", "0",
                 "--precision", "fp32", "--out", str(path)]) == 0
    return path


def _verify_with(monkeypatch, capsys, plan, failure, *extra: str):
    """``flexsearch verify`` whose ranks fail with ``failure`` (a RanksFailed)."""
    import flexsearch.emit.launch
    from flexsearch.cli import main

    def fails(*a, **k):
        raise failure

    monkeypatch.setattr(flexsearch.emit.launch, "run_ranks", fails)
    capsys.readouterr()
    rc = main(["verify", MLP, "--plan", str(plan), *extra])
    return rc, *capsys.readouterr()


def test_verify_prints_the_root_cause_of_a_failed_rank(monkeypatch, capsys, mlp_plan):
    """The failing rank's own error and the original one it came from, not the last line
    of its traceback (a note) nor a peer's lost connection."""
    from flexsearch.emit.launch import RanksFailed

    failure = RanksFailed(
        "rank 0:\nTraceback ...\nRuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1\n"
        "rank 1:\nTraceback ...\nRuntimeError: the op failed\nflexsearch: while running op linear_2 as s1.x2 on rank 1",
        causes={0: "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1",
                1: "RuntimeError: the op failed (flexsearch: while running op linear_2 as s1.x2 on rank 1)\n"
                   "caused by ValueError: mat1 and mat2 shapes cannot be multiplied (4x16 and 32x8)"})
    rc, out, err = _verify_with(monkeypatch, capsys, mlp_plan, failure)
    assert rc == 1 and out == ""
    assert err.splitlines() == [
        "the emitted plan failed: rank 1: RuntimeError: the op failed (flexsearch: while running op linear_2 as "
        "s1.x2 on rank 1)", "caused by ValueError: mat1 and mat2 shapes cannot be multiplied (4x16 and 32x8)"], err


def test_verify_reports_a_mismatch_over_a_peers_crash(monkeypatch, capsys, mlp_plan):
    """A rank that found a mismatch and finished is the answer: "differs", exit 1, even
    when another rank then failed (its peer gone)."""
    from flexsearch.emit.launch import RanksFailed

    lost = "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1"
    failure = RanksFailed(f"rank 1:\nTraceback ...\n{lost}", causes={1: lost},
                          results={0: {"ok": False, "error": "gradient of fc1.weight differs: ..."}})
    rc, out, err = _verify_with(monkeypatch, capsys, mlp_plan, failure)
    assert rc == 1 and out == "" and err.strip() == "differs: gradient of fc1.weight differs: ...", err
    rc, out, err = _verify_with(monkeypatch, capsys, mlp_plan, failure, "--json")
    got = json.loads(out)
    assert rc == 1 and not got["ok"] and got["ranks"][0]["error"].startswith("gradient of fc1.weight")
    assert not got["ranks"][1]["ok"] and "Connection closed by peer" in got["ranks"][1]["error"]


def test_verify_refuses_another_models_plan_before_starting_ranks(monkeypatch, capsys, mlp_plan):
    """A plan made for another model: exit 2 with both models named, and no rank started
    (the ranks found it, exit 1, with the plan's model named twice)."""
    other = str(ROOT / "benchmarks/models/mlp.py:mlp_digits")
    monkeypatch.setattr("flexsearch.emit.launch.run_ranks", lambda *a, **k: pytest.fail("a rank started"))
    r = invoke(capsys, "verify", other, "--plan", str(mlp_plan))
    assert r.returncode == 2 and "made for model" in r.stderr and "mlp_digits" in r.stderr, r.stderr


UNSEEDED = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x, mask=None):
        h = self.l(x)
        if mask is not None:
            h = h * mask
        return h


def build_model():
    return M(), (torch.randn(8, 16),)
'''


def test_an_unseeded_model_called_without_its_optional_argument_plans_and_verifies(tmp_path, capsys):
    """``forward(x, mask=None)`` called without ``mask``: symbolic tracing would take the
    ``mask is not None`` branch, so the model is traced with ``torch.export`` as called;
    and a model file that seeds nothing builds the same weights on every rank of
    ``verify`` (each rank built its own: DDP's copy of rank 0's differed from rank 1's
    reference, and a correct plan was reported as differing)."""
    model = tmp_path / "unseeded.py"
    model.write_text(UNSEEDED)
    plan = tmp_path / "plan.json"
    r = invoke(capsys, "plan", str(model), "--devices", "2", "--cluster", "cpu", "--kind", "data", "--max-iters", "0",
               "--precision", "fp32", "--out", str(plan))
    assert r.returncode == 0, r.stderr
    assert flexsearch.trace(*flexsearch.load_model(str(model))).via == "export"
    v = run("verify", str(model), "--plan", str(plan))
    assert v.returncode == 0 and "matches on 2 ranks" in v.stdout, v.stdout + v.stderr

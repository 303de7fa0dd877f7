"""Fidelity: the simulator's predicted iteration time and peak memory against real runs
of the emitted plans on this machine's gloo processes.

    python benchmarks/fidelity.py                      # the table (about 3 minutes)
    python benchmarks/fidelity.py --quick              # one case, two plans (under a minute)
    python benchmarks/fidelity.py --reprofile          # the op profile measured afresh first
    python benchmarks/fidelity.py --calibrate          # `flexsearch calibrate` first, whatever is on disk
    python benchmarks/fidelity.py --repeat 3           # the table three times; the last line the worst run
    python benchmarks/fidelity.py [--ranks 2] [--threads 1] [--steps 10] [--warmup 3]
        [--cases mlp,gpt:data+soap] [--retries 3] [--max-wait 60] [--json out.json]

For each case (a zoo family at a size whose step takes 20-200 ms here: ``mlp`` 4 x 1024
Linear, ``gpt`` 2 layers d=256, ``cnn`` the tiny AlexNet at batch 512, ``rnn`` a 2 x
LSTM(256) language model) and each plan kind the emitter runs (``data`` = DDP, ``fsdp``
= FSDP2, ``soap`` = the planner's best SOAP plan other than data parallelism on
DTensor, pipelines ``gpipe`` / ``1f1b`` / ``interleaved`` (the pipeline search's best of
that schedule), ``hybrid`` = pipeline x tensor parallel, which needs 4 ranks; ``dpsgd`` =
D-PSGD on the best gossip topology for the rank count), every plan made by
``plan_graph(kinds=...)``; and the data-parallel plan changed in one field
(:func:`variant_of`): ``zero1`` (ZeroRedundancyOptimizer), ``zero2`` / ``zero3``
(FSDP2 without / with resharding after the forward), ``recompute`` (DDP with every
block checkpointed), ``accum`` and ``zero2-accum`` (DDP and ZeRO-2 with 2 accumulated
microbatches); and ``bf16``: the data-parallel plan of the model traced, profiled
(ops under ``torch.autocast``) and planned in ``bf16-mixed`` precision, run under
autocast (where this CPU runs bf16 natively, AVX512-BF16 or AMX; elsewhere the row
says so):

1. **profile**: every distinct op measured alone by the profiler
   (:func:`flexsearch.cost.profiler.profile_model`, ``--threads`` threads) at the whole
   batch and at splits 2..32, cached in ``--profile`` (default: this machine's,
   ``~/.flexsearch/profiles/fidelity-cpu-1t.json``; a rerun measures only what is new,
   a profile measured on another host is measured afresh). The measurements answer
   for the ``cpu`` preset's device;
2. **plan**: a plan of that kind on the ``cpu`` preset, searched with the measured costs
   and the calibration;
3. **predict**: :func:`flexsearch.simulate` with the same costs and calibration;
4. **measure**: :func:`flexsearch.measure.measure_plan` (its docstring: time, memory,
   noise).

**Calibration.** The predictions use this machine's calibration
(:func:`flexsearch.cost.calibration.load_calibration`). When the one on disk was
measured on another kind of machine (CPU model, cores, torch) or there is none, the
benchmark runs ``flexsearch calibrate`` first; with ``--no-calibrate`` it says plainly
that its predictions are uncalibrated for this host and goes on.

**Ranking.** Per case, Kendall's tau-b between the predicted and the measured order of
its plans; the headline is the mean over cases weighted by their number of plan pairs.
Two plans whose predictions differ by less than the calibration's step spread (the
run-to-run noise ``flexsearch calibrate`` measured) are within noise: the model does
not claim to order them. ``kendall_tau`` counts the pairs it separates,
``kendall_tau_all`` every pair; ``separated`` is the fraction of pairs the first counts.

**4 ranks.** Hybrid plans (pipeline x tensor parallel) need 4 devices: their rows run
on 4 ranks after the table and are kept out of its figures (on a machine with fewer
than 4 cores the ranks share cores; the table says so).

Last line: ``median_error=... max_error=... memory_median_error=... kendall_tau=...
kendall_tau_all=... separated=...`` (|relative error| of the iteration time over all
runs; of the peak memory; ranking); with ``--repeat N``, each run's line and then the
worst of the N (the largest errors, the smallest taus).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from zoo import get, load_module  # noqa: E402

import flexsearch  # noqa: E402
from flexsearch.calibrate.probes import build_probe  # noqa: E402
from flexsearch.cost.calibration import DeviceCalibration, load_calibration, within_noise  # noqa: E402
from flexsearch.cost.hardware import Cluster, user_dir  # noqa: E402
from flexsearch.cost.profiler import ProfileDB, host_info, local_device, profile_model  # noqa: E402
from flexsearch.emit.precision import check_runs_here  # noqa: E402
from flexsearch.errors import EmitError, PlanKindError  # noqa: E402
from flexsearch.graph.opgraph import OpGraph  # noqa: E402
from flexsearch.graph.tracer import trace  # noqa: E402
from flexsearch.measure import load_average, measure_plan  # noqa: E402
from flexsearch.plan import Plan  # noqa: E402
from flexsearch.precision import precision as precision_of  # noqa: E402
from flexsearch.search.planner import plan_graph  # noqa: E402
from flexsearch.search.results import plan_from  # noqa: E402
from flexsearch.sim.context import CostContext  # noqa: E402
from flexsearch.sim.predict import predict  # noqa: E402
from flexsearch.strategy.fsdp import fsdp_units  # noqa: E402
from flexsearch.strategy.kinds import FSDP_SHARDINGS  # noqa: E402

KINDS = ("data", "fsdp", "soap", "gpipe", "1f1b", "interleaved", "hybrid", "dpsgd", "zero1", "zero2", "zero3",
         "recompute", "accum", "zero2-accum", "bf16")
PRECISIONS = {"bf16": ("bf16-mixed", "data")}
"""Kinds in another precision than fp32: (precision, the plan kind)."""
VARIANTS = {"zero1": {"shard": "zero1"}, "zero2": {"shard": "zero2"}, "zero3": {"shard": "zero3"},
            "recompute": {"recompute": "full"}, "accum": {"microbatches": 2},
            "zero2-accum": {"shard": "zero2", "microbatches": 2}}
"""Kinds made from the data-parallel plan by changing a field or two: a ZeRO stage, full
activation checkpointing of every block (DDP), or 2 accumulated microbatches (DDP, and
ZeRO-2)."""
CLUSTER = "cpu"
PROFILE = user_dir() / "profiles" / "fidelity-cpu-1t.json"
"""The op profile's cache: this machine's (op times do not travel between machines)."""
DEGREES = (2, 4, 8, 16, 32)  # profiled splits: SOAP degrees and pipeline microbatches
QUICK = "mlp:data+1f1b"
FOUR_RANKS = [("gpt", "hybrid"), ("mlp", "hybrid")]
"""Rows on 4 ranks: pipeline x tensor parallel needs 4 devices (on a 2-core machine the
ranks share cores, so these are kept out of the headline figures)."""


# ----------------------------------------------------------------------------- cases


def _mlp(batch: int = 256):
    """4 Linear layers 1024 wide (4.2M parameters), batch 256."""
    m = load_module(get("mlp_tiny"))
    return m.MLP(1024, 1024, 1024, 4), (torch.randn(batch, 1024),)


def _gpt(batch: int = 16):
    """GPT: 2 layers, d=256, 4 heads, vocab 2048, seq 64 (2.1M parameters), batch 16."""
    m = load_module(get("gpt_tiny"))
    cfg = m.GPTConfig(vocab_size=2048, block_size=64, n_layer=2, n_head=4, n_embd=256, dropout=0.0)
    return m.GPT(cfg), (torch.randint(0, cfg.vocab_size, (batch, 64)),)


def _cnn(batch: int = 512):
    """The tiny AlexNet (5 convs, 3 Linear; 3x32x32 inputs), batch 512."""
    m = load_module(get("alexnet_tiny"))
    return m.TinyAlexNet(), (torch.randn(batch, 3, 32, 32),)


def _rnn(batch: int = 32):
    """RNN language model: vocab 2000, embed 256, 2 x LSTM(256), seq 32 (2.1M parameters), batch 32."""
    m = load_module(get("rnnlm_tiny"))
    return m.RNNLanguageModel(2000, 256, 256, 2), (torch.randint(0, 2000, (batch, 32)),)


CASES = {"mlp": _mlp, "gpt": _gpt, "cnn": _cnn, "rnn": _rnn}


def build(family: str, batch: int | None = None):
    """``(model, inputs, target)`` of a case (or a calibration probe, ``deep8``/``deep32``),
    the same in every process (seeded)."""
    if family not in CASES:
        return build_probe(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, x = CASES[family]() if batch is None else CASES[family](batch)
        with torch.no_grad():
            y = torch.randn(model(*x).shape)
    return model, x, y


# ----------------------------------------------------------------------------- plans


def plan_for(graph: OpGraph, cl: Cluster, kind: str, measured=None, calibration: DeviceCalibration | None = None,
             seed: int = 0) -> Plan | None:
    """The planner's best plan of ``kind`` for ``graph`` on ``cl`` (None where the model
    has none), costed with ``measured`` op times and ``calibration``."""
    if kind in VARIANTS:
        return variant_of(graph, cl, VARIANTS[kind], measured, calibration, seed)
    kinds = {"dpsgd": "decentralized", "hybrid": "hybrid", "data": "data", "fsdp": "fsdp", "soap": "soap"}
    want = kinds.get(kind, "pipeline")
    schedules = {"hybrid": ("1f1b",)}.get(kind, (kind,)) if want in ("pipeline", "hybrid") else ("1f1b",)
    try:
        return plan_graph(graph, cl, kinds=(want,), measured=measured, calibration=calibration, seed=seed,
                          max_iters=200 if want == "soap" else 0, schedules=schedules)
    except PlanKindError:
        return None


def variant_of(graph: OpGraph, cl: Cluster, change: dict, measured, calibration: DeviceCalibration | None,
               seed: int) -> Plan:
    """The data-parallel plan with ``change`` applied to its strategy (FSDP units as the
    planner decides them for a sharding that gathers parameters), predicted with the
    same costs."""
    base = plan_graph(graph, cl, kinds=("data",), measured=measured, calibration=calibration, seed=seed,
                      max_iters=0).strategy(graph)
    if change.get("shard") in FSDP_SHARDINGS:
        change = {**change, "fsdp_units": fsdp_units(graph.modules)}
    strategy = dataclasses.replace(base, **change)
    ctx = CostContext(cl, measured, calibration=calibration)
    return plan_from(graph, cl, strategy, predict(graph, strategy, ctx), baselines={}, lower_bound_s=0.0)


def profile(model, inputs, threads: int, path: Path = PROFILE, precision: str = "fp32"):
    """Measure the model's ops (full batch and the splits of :data:`DEGREES`) in
    ``precision`` into ``path`` (kept: a rerun measures only what is new), as the ``cpu``
    preset's device: the preset's devices are this machine's processes of ``threads``
    threads."""
    db, _ = profile_model(model, inputs, out=path, threads=threads, degrees=DEGREES, precision=precision)
    return db.aliased(Cluster.resolve(CLUSTER, 1).device.name)


# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    case: str
    kind: str
    plan: str
    predicted_s: float = math.nan
    measured_s: float = math.nan
    predicted_bytes: float = math.nan
    measured_bytes: float = math.nan
    error: str = ""
    foreign: float = math.nan
    """CPUs' worth of other processes' work during the timed steps (0: a quiet machine)."""
    per_rank_s: list[float] = field(default_factory=list)
    per_rank_bytes: list[float] = field(default_factory=list)

    @property
    def time_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def describe(plan: Plan) -> str:
    if plan.kind in ("pipeline", "hybrid"):
        return (f"{plan.schedule} p{len(plan.stages) // (plan.chunks or 1)}x{plan.stages[0].replicas}"
                f"x{plan.tensor_degree} m{plan.microbatches}")
    if plan.kind == "data":
        name = {"none": "ddp", "zero3": "fsdp"}.get(plan.shard, plan.shard)
        return name + (f" rc={plan.recompute}" if plan.recompute != "none" else "") + \
            (f" m{plan.microbatches}" if (plan.microbatches or 1) > 1 else "") + \
            (f" {plan.precision}" if plan.precision != "fp32" else "")
    if plan.kind == "decentralized":
        return f"dpsgd {plan.topology}"
    kinds: dict[str, int] = {}
    for c in plan.decisions.values():
        kinds[c] = kinds.get(c, 0) + 1
    return "soap " + ",".join(f"{k}x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:3])


def run_case(family: str, kind: str, *, ranks: int, threads: int, steps: int, warmup: int,
             batch: int | None = None, profile_path: Path = PROFILE, timeout_s: float = 600,
             retries: int = 3, max_wait_s: float = 60.0, calibration: DeviceCalibration | None = None) -> Row:
    """Plan, predict, emit and measure one (case, kind)."""
    from flexsearch.emit.launch import RanksFailed

    model, x, _ = build(family, batch)
    precision, plan_kind = PRECISIONS.get(kind, ("fp32", kind))
    try:
        check_runs_here(model, precision_of(precision), "cpu")
    except EmitError as e:
        return Row(family, kind, "-", error=str(e)[:120])
    graph = trace(model, x, name=f"fidelity:{family}", precision=precision)
    cl = Cluster.resolve(CLUSTER, ranks)
    db = profile(model, x, threads, profile_path, precision)
    plan = plan_for(graph, cl, plan_kind, measured=db, calibration=calibration)
    if plan is None:
        return Row(family, kind, "-", error="no such plan")
    row = Row(family, kind, describe(plan))
    sim = flexsearch.simulate(graph, plan, cl, measured=db, calibration=calibration)
    row.predicted_s = sim.iteration_time_s
    try:
        m = measure_plan(build, (family, batch), plan, ranks=ranks, threads=threads, steps=steps, warmup=warmup,
                         timeout_s=timeout_s, retries=retries, max_wait_s=max_wait_s)
    except RanksFailed as e:
        row.error = str(e).strip().splitlines()[-1][:200]
        return row
    row.foreign = m.foreign
    row.per_rank_s, row.per_rank_bytes = list(m.step_s), list(m.peak_bytes)
    row.measured_s = m.time_s
    row.measured_bytes = m.peak_bytes[m.worst_rank]
    row.predicted_bytes = sim.memory_bytes[m.worst_rank]
    return row


# ----------------------------------------------------------------------------- statistics


def kendall_tau(x: list[float], y: list[float], pairs=None) -> float:
    """Kendall's tau-b of two equally long sequences (nan for fewer than 2 items), over
    the index pairs ``(i, j)``, ``i < j``, that ``pairs(i, j)`` accepts (default all)."""
    n = len(x)
    conc = disc = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            if pairs is not None and not pairs(i, j):
                continue
            a = (x[i] > x[j]) - (x[i] < x[j])
            b = (y[i] > y[j]) - (y[i] < y[j])
            if a == 0 and b == 0:
                continue
            if a == 0:
                tx += 1
            elif b == 0:
                ty += 1
            elif a == b:
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else math.nan


def summary(rows: list[Row], noise: float = 0.0) -> dict[str, float]:
    """Headline figures: median and max |time error|, median |memory error|, and per
    case Kendall's tau between predicted and measured order, weighted by the case's
    plan pairs: ``kendall_tau`` over the pairs the model separates (predictions not
    :func:`~flexsearch.cost.calibration.within_noise` at ``noise``), ``kendall_tau_all``
    over all; ``separated`` the fraction of pairs the first counts."""
    ok = [r for r in rows if not r.error]
    errs = [abs(r.time_error) for r in ok]
    mems = [abs(r.memory_error) for r in ok]
    taus: dict[str, list[tuple[float, int]]] = {"sep": [], "all": []}
    n_sep = n_all = 0
    for case in dict.fromkeys(r.case for r in ok):
        rs = [r for r in ok if r.case == case]
        pred, meas = [r.predicted_s for r in rs], [r.measured_s for r in rs]
        apart = {(i, j) for i in range(len(rs)) for j in range(i + 1, len(rs))
                 if not within_noise(pred[i], pred[j], noise)}
        pairs = len(rs) * (len(rs) - 1) // 2
        n_sep, n_all = n_sep + len(apart), n_all + pairs
        for key, tau, weight in (("sep", kendall_tau(pred, meas, lambda i, j, a=apart: (i, j) in a), len(apart)),
                                 ("all", kendall_tau(pred, meas), pairs)):
            if not math.isnan(tau):
                taus[key].append((tau, weight))

    def mean(key: str) -> float:
        w = sum(x for _, x in taus[key])
        return sum(t * x for t, x in taus[key]) / w if w else math.nan

    return {
        "median_error": statistics.median(errs) if errs else math.nan,
        "max_error": max(errs) if errs else math.nan,
        "memory_median_error": statistics.median(mems) if mems else math.nan,
        "kendall_tau": mean("sep"),
        "kendall_tau_all": mean("all"),
        "separated": n_sep / n_all if n_all else math.nan,
    }


def worst(runs: list[dict[str, float]]) -> dict[str, float]:
    """The worst of several runs' summaries: the largest errors, the smallest taus."""
    lo = {"kendall_tau", "kendall_tau_all", "separated"}
    return {k: (min if k in lo else max)(r[k] for r in runs) for k in runs[0]}


def parse_cases(text: str | None) -> list[tuple[str, str]]:
    """``mlp,gpt:data+soap`` -> [(mlp, every kind), (gpt, data), (gpt, soap)]."""
    if not text:
        return [(f, k) for f in CASES for k in KINDS]
    out = []
    for item in text.split(","):
        fam, _, kinds = item.partition(":")
        if fam not in CASES:
            raise SystemExit(f"unknown case {fam!r}; choose from {', '.join(CASES)}")
        for k in (kinds.split("+") if kinds else KINDS):
            if k not in KINDS:
                raise SystemExit(f"unknown plan kind {k!r}; choose from {', '.join(KINDS)}")
            out.append((fam, k))
    return out


def this_hosts_calibration(ranks: int, threads: int, *, calibrate: bool, allowed: bool, retries: int,
                           max_wait_s: float) -> DeviceCalibration | None:
    """The calibration to predict with (module docstring): this machine's from disk,
    measured first when there is none for this host (or when asked), else None."""
    from flexsearch.calibrate import Settings
    from flexsearch.calibrate import calibrate as run_calibration

    device = Cluster.resolve(CLUSTER, ranks).device.name
    cal = load_calibration(device)
    host = host_info()
    mine = cal is not None and cal.host is not None and cal.host.same_machine(host)
    if mine and not calibrate:
        return cal
    if not allowed:
        where = "none on disk" if cal is None else f"the one on disk is from {cal.host.cpu if cal.host else 'an unrecorded host'}"
        print(f"# predictions UNCALIBRATED for this host ({host['cpu']}, {host['cores']} cores): {where}; "
              "run `flexsearch calibrate`", flush=True)
        return None
    print(f"# calibrating this host first ({host['cpu']}, {host['cores']} cores): `flexsearch calibrate`", flush=True)
    res = run_calibration(settings=Settings(ranks=ranks, threads=threads, retries=retries, max_wait_s=max_wait_s),
                          progress=lambda i, n, stage: print(f"#   calibrate {i}/{n}: {stage}", flush=True))
    print(f"# wrote {res.path}", flush=True)
    return res.calibration


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default=None, help="e.g. mlp,gpt:data+soap (default: every case and kind)")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}, 3 steps, no waiting for a quiet machine")
    ap.add_argument("--profile", type=Path, default=PROFILE, help="op profile cache")
    ap.add_argument("--reprofile", action="store_true",
                    help="measure the op profile afresh (this host's speed drifts: profile and runs alike)")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--retries", type=int, default=3,
                    help="rerun a measurement disturbed by other processes (> 0.25 CPUs busy) up to this often")
    ap.add_argument("--max-wait", type=float, default=60.0,
                    help="seconds to wait for a quiet machine before each measurement")
    ap.add_argument("--calibrate", action="store_true", help="run `flexsearch calibrate` first, whatever is on disk")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole table this often; the last line is the worst of the runs")
    ap.add_argument("--no-four-ranks", dest="four_ranks", action="store_false",
                    help="leave out the 4-rank hybrid rows (kept apart from the headline figures)")
    ap.add_argument("--no-calibrate", dest="allow_calibrate", action="store_false",
                    help="never calibrate: predict uncalibrated when the calibration on disk is not this host's")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.quick:
        args.cases, args.steps, args.warmup, args.max_wait, args.retries = args.cases or QUICK, 3, 2, 0.0, 1
        if args.profile == PROFILE:  # measure afresh, and leave the repository's profile alone
            import tempfile

            args.profile = Path(tempfile.mkdtemp(prefix="fidelity-quick-")) / "profile.json"
    torch.set_num_threads(args.threads)
    if args.profile.exists() and not args.reprofile:
        measured_on = ProfileDB.load(args.profile).data.host
        if measured_on != host_info():
            where = measured_on["cpu"] if measured_on else "an unrecorded host"
            print(f"# the op profile {args.profile} was measured on {where}, not this host: measuring it afresh",
                  flush=True)
            args.reprofile = True
    if args.reprofile and args.profile.exists():
        args.profile.unlink()
    cal = this_hosts_calibration(args.ranks, args.threads, calibrate=args.calibrate,
                                 allowed=args.allow_calibrate and not args.quick, retries=args.retries,
                                 max_wait_s=args.max_wait)
    noise = cal.step_spread.value if cal is not None and cal.step_spread is not None else 0.0
    print(f"# {load_average()}; {args.ranks} ranks x {args.threads} threads, device {local_device(args.threads)}, "
          f"torch {torch.__version__}, {'calibrated' if cal is not None else 'uncalibrated'}; plans whose "
          f"predictions differ by less than {noise:.1%} (the calibration's step spread) are within noise", flush=True)
    runs, four = [], []
    for k in range(args.repeat):
        if args.repeat > 1:
            print(f"# run {k + 1} of {args.repeat}", flush=True)
        rows = table(parse_cases(args.cases), args, cal, args.ranks)
        runs.append(summary(rows, noise))
        if args.repeat > 1:
            print(f"# run {k + 1}: " + line(runs[-1]), flush=True)
        if args.four_ranks and not args.quick:
            cores = os.cpu_count() or 1
            print(f"# 4 ranks on {cores} cores{' (oversubscribed: ranks share cores)' if cores < 4 else ''}: "
                  "hybrid plans, kept out of the figures above", flush=True)
            rows4 = table(FOUR_RANKS, args, cal, 4)
            four.append(summary(rows4, noise))
            print("# 4 ranks: " + line(four[-1]), flush=True)
            rows += rows4
        if args.json is not None:
            args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "runs": runs, "four_ranks": four,
                                             "noise": noise, "load": load_average(),
                                             "calibrated": cal is not None}, indent=1))
    print(f"# {load_average()}")
    out = worst(runs)
    print(line(out) + (f" runs={len(runs)} (the worst of them)" if len(runs) > 1 else ""))


def line(s: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in s.items())


def table(cases: list[tuple[str, str]], args, cal: DeviceCalibration | None, ranks: int) -> list[Row]:
    """Run and print the rows of ``cases`` on ``ranks`` ranks."""
    print(f"{'case':5} {'kind':11} {'plan':26} {'pred ms':>9} {'meas ms':>9} {'err':>7} "
          f"{'pred MB':>9} {'meas MB':>9} {'err':>7} {'other':>5}", flush=True)
    rows = []
    for fam, kind in cases:
        t0 = time.perf_counter()
        row = run_case(fam, kind, ranks=ranks, threads=args.threads, steps=args.steps, warmup=args.warmup,
                       profile_path=args.profile, retries=args.retries, max_wait_s=args.max_wait, calibration=cal)
        rows.append(row)
        if row.error:
            print(f"{fam:5} {kind:11} {row.plan:26} {row.error}", flush=True)
            continue
        print(f"{fam:5} {kind:11} {row.plan:26} {row.predicted_s * 1e3:9.2f} {row.measured_s * 1e3:9.2f} "
              f"{row.time_error:+7.1%} {row.predicted_bytes / 1e6:9.1f} {row.measured_bytes / 1e6:9.1f} "
              f"{row.memory_error:+7.1%} {row.foreign:5.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows

if __name__ == "__main__":
    main()

"""Plan quality: the planner's plans against the baselines and the lower bound.

For every non-tiny zoo model (at its zoo batch) on the paper clusters (FlexFlow's P100
cluster x 16 and K80 cluster x 16 and 64, PipeDream's clusters A and B x 16, DGX H100
x 8 and 64), runs ``plan_graph`` (baselines, ILP seed, MCMC with ``--max-iters`` steps
and optionally a ``--budget-s`` budget) and prints one row per case: the found plan's
predicted iteration time, its speedup over data parallel and over the expert plan
(CNNs) or the best Megatron plan (transformers) when those fit ("OOM": the baseline
does not fit in memory, "-": not applicable), its ratio to the lower bound
(single-device time / N), the plan kind (data or soap), the MCMC iterations and the
search time. Each model is traced once and planned on every cluster.

A case where nothing fits raises ``InfeasiblePlanError`` and is reported as
"infeasible". Invariant checked: the found plan is never slower than a baseline that
fits; for an infeasible case, no baseline may fit (the baselines are simulated again
to check). Violations are counted (must be 0). Other exceptions are reported as
"error" rows and counted.

    python benchmarks/plan_quality.py                       # every model and cluster
    python benchmarks/plan_quality.py --quick               # 4 models x 2 clusters, 100 iterations
    python benchmarks/plan_quality.py --models alexnet gpt2_small --max-iters 1000
    python benchmarks/plan_quality.py --skip gpt3_175b:dgx-h100:64 dlrm

Last line: ``cases=... infeasible=... errors=... violations=... median_speedup_over_data=...
max_speedup_over_data=... median_ratio_to_lower_bound=...`` (speedups over the cases
where data parallel fits, ratios over the feasible cases).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import build, entries  # noqa: E402

import flexsearch  # noqa: E402
from flexsearch.cost.hardware import Cluster  # noqa: E402
from flexsearch.errors import InfeasiblePlanError  # noqa: E402
from flexsearch.plan import REFERENCE_BASELINES  # noqa: E402
from flexsearch.search.baselines import run_baselines  # noqa: E402
from flexsearch.search.planner import plan_graph  # noqa: E402
from flexsearch.sim.context import CostContext  # noqa: E402
from flexsearch.sim.simulator import Simulator  # noqa: E402
from flexsearch.strategy.space import Space  # noqa: E402

CLUSTERS = (
    ("flexflow-p100", 16),
    ("flexflow-k80", 16),
    ("flexflow-k80", 64),
    ("pipedream-a", 16),
    ("pipedream-b", 16),
    ("dgx-h100", 8),
    ("dgx-h100", 64),
)
QUICK_MODELS = ("alexnet", "mlp")
QUICK_CLUSTERS = (("flexflow-p100", 16), ("dgx-h100", 8))
HEADER = (
    f"{'model':<13} {'cluster':<14} {'N':>3} {'time ms':>10} {'vs data':>8} {'vs megatron':>11} "
    f"{'vs expert':>9} {'/ bound':>8} {'kind':<5} {'iters':>5} {'search s':>8}  note"
)


def _vs(plan, name: str, t: float) -> str:
    if name in plan.baselines:
        return f"{plan.baselines[name] / t:.2f}"
    return "OOM" if name in plan.infeasible_baselines else "-"


def run_case(graph, preset: str, devices: int, args) -> dict:
    """Plan one case; return its row's fields (status: ok, infeasible or error)."""
    try:
        cluster = Cluster.preset(preset, devices)
        plan = plan_graph(
            graph,
            cluster,
            max_iters=args.max_iters,
            budget_s=args.budget_s,
            seed=args.seed,
            ilp_time_limit_s=args.ilp_limit_s,
        )
    except InfeasiblePlanError:
        base = run_baselines(Space(graph, cluster.devices), Simulator(graph, CostContext(cluster)),
                             cluster.devices_per_node)
        fits = [k for k, b in base.items() if b.simulation.feasible]
        return {
            "status": "infeasible",
            "violations": len(fits),
            "note": f"VIOLATION: baselines {fits} fit" if fits else "nothing fits",
        }
    except Exception as e:  # reported, not fatal: one case must not end the sweep
        return {"status": "error", "violations": 0, "note": f"{type(e).__name__}: {e}"[:120]}
    t = plan.predicted.iteration_time_s
    slower = [k for k, v in plan.baselines.items() if t > v * (1 + 1e-9) and k not in REFERENCE_BASELINES]
    return {
        "status": "ok",
        "plan": plan,
        "time": t,
        "violations": len(slower),
        "speedup": plan.speedup_over_data,
        "ratio": t / plan.lower_bound_s,
        "note": f"VIOLATION: slower than {slower}" if slower else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", help="zoo builders (default: every non-tiny one)")
    ap.add_argument("--clusters", nargs="+", help="PRESET:DEVICES (default: the paper clusters)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"models {' '.join(QUICK_MODELS)} on 2 clusters, 50 iterations",
    )
    ap.add_argument("--max-iters", type=int, help="MCMC steps per case (default 300, quick 50)")
    ap.add_argument("--budget-s", type=float, help="search budget per case, seconds (default none)")
    ap.add_argument(
        "--ilp-limit-s", type=float, help="ILP time limit per case (default 10, quick 5)"
    )
    ap.add_argument(
        "--skip", nargs="+", default=[], help="MODEL or MODEL:PRESET:DEVICES to leave out"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    models = args.models or (
        QUICK_MODELS if args.quick else [e.name for e in entries() if e.size != "tiny"]
    )
    if args.clusters:
        clusters = [(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1])) for c in args.clusters]
    else:
        clusters = QUICK_CLUSTERS if args.quick else CLUSTERS
    if args.max_iters is None:
        args.max_iters = 50 if args.quick else 300
    if args.ilp_limit_s is None:
        args.ilp_limit_s = 5.0 if args.quick else 10.0

    t_all = time.perf_counter()
    rows: list[dict] = []
    print(HEADER, flush=True)
    for model in models:
        todo = [
            (c, n)
            for c, n in clusters
            if model not in args.skip and f"{model}:{c}:{n}" not in args.skip
        ]
        if not todo:
            continue
        t = time.perf_counter()
        try:
            graph = flexsearch.trace(*build(model))
        except Exception as e:
            for c, n in todo:
                rows.append({"status": "error", "violations": 0})
                print(
                    f"{model:<13} {c:<14} {n:>3} {'error':>10}  trace failed: {type(e).__name__}: {e}"[
                        :200
                    ]
                )
            continue
        print(
            f"# {model}: {len(graph.nodes)} nodes, {graph.num_params:,} parameters, traced in "
            f"{time.perf_counter() - t:.1f} s",
            flush=True,
        )
        for c, n in todo:
            r = run_case(graph, c, n, args)
            rows.append(r)
            if r["status"] != "ok":
                print(f"{model:<13} {c:<14} {n:>3} {r['status']:>10}  {r['note']}", flush=True)
                continue
            p, tm = r["plan"], r["time"]
            sp = (
                f"{r['speedup']:.2f}"
                if r["speedup"]
                else ("OOM" if "data" in p.infeasible_baselines else "-")
            )
            print(
                f"{model:<13} {c:<14} {n:>3} {tm * 1e3:>10.2f} {sp:>8} {_vs(p, 'megatron', tm):>11} "
                f"{_vs(p, 'expert', tm):>9} {r['ratio']:>8.2f} {p.kind:<5} {p.search.iterations:>5} "
                f"{p.search_time_s:>8.1f}  {r['note']}",
                flush=True,
            )

    ok = [r for r in rows if r["status"] == "ok"]
    speedups = [r["speedup"] for r in ok if r["speedup"]]
    ratios = [r["ratio"] for r in ok]

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f}" if xs else "nan"

    print(
        f"{len(rows)} cases in {time.perf_counter() - t_all:.0f} s: {len(ok)} planned, "
        f"{sum(r['status'] == 'infeasible' for r in rows)} infeasible, "
        f"{sum(r['status'] == 'error' for r in rows)} errors; data parallel fits in {len(speedups)}"
    )
    print(
        f"cases={len(rows)} infeasible={sum(r['status'] == 'infeasible' for r in rows)} "
        f"errors={sum(r['status'] == 'error' for r in rows)} violations={sum(r['violations'] for r in rows)} "
        f"median_speedup_over_data={med(speedups)} max_speedup_over_data={max(speedups, default=float('nan')):.3f} "
        f"median_ratio_to_lower_bound={med(ratios)}"
    )


if __name__ == "__main__":
    main()

"""Time to a plan, tracing included, on the cases of [v2 4/6]'s table.

Each case loads or builds the model, traces it at the precision ``auto`` picks for the
cluster (bf16-mixed on these GPUs) and runs the planner with its defaults (and the
row's budget), in this process: what ``flexsearch plan`` does after Python has started
and imported flexsearch (about 1.3 s more here).

============  ====================================================  ========  ======
key           case                                                  budget    target
============  ====================================================  ========  ======
``xl8``       ``benchmarks/models/gpt.py:gpt2_xl`` on 8 dgx-h100    none      10 s
``m1_7b``     Megatron's GPT 1.7B (its Table 1) on 32 dgx-a100      60 s      15 s
``m18_4b``    Megatron's GPT 18.4B on 256 dgx-a100                  60 s      20 s
``g175b``     ``benchmarks/models/gpt.py:gpt3_175b`` on 1,024       none      15 s
``m1t``       Megatron's GPT 1T on 3,072 dgx-a100                   60 s      30 s
============  ====================================================  ========  ======

The Megatron models are ``megatron_table.build``'s (the zoo's GPT at the row's size,
on meta). Per case the last line gives ``<key>_s`` (seconds, tracing included),
``<key>_trace_s``, ``<key>_over`` (seconds past the budget over the budget, 0 when
within it) and ``<key>_ok`` (1 when a plan came back, 0 when the planner found none).

    python benchmarks/plan_time.py                   # every case (about 3 minutes)
    python benchmarks/plan_time.py --cases xl8 m1_7b --workers 1
    python benchmarks/plan_time.py --quick           # GPT-2 small on 8 dgx-h100 only
    python benchmarks/plan_time.py --cases m1t m18_4b --budgets 8 15 20

``--budgets``: each case under each of these budgets instead of its own (keys
``<key>_b<budget>_...``), and ``max_over=``, the largest overrun of them: budgets are
promises ([v2 4/6]: never past one by more than 10%), tight ones included, where tracing
takes a third or more of the budget and what is left is a few of the search's longest
steps (a pipeline simulation of GPT 1T, the ILP's costs of GPT 1.7B).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import megatron_table  # noqa: E402

import flexsearch  # noqa: E402
from flexsearch.api import resolve_precision  # noqa: E402
from flexsearch.cost.hardware import Cluster  # noqa: E402
from flexsearch.errors import FlexsearchError  # noqa: E402
from flexsearch.graph.tracer import trace  # noqa: E402
from flexsearch.search.planner import plan_graph  # noqa: E402

CASES = {  # key: (model, cluster, devices, budget_s)
    "xl8": ("benchmarks/models/gpt.py:gpt2_xl", "dgx-h100", 8, None),
    "m1_7b": ("1.7B", "dgx-a100", 32, 60.0),
    "m18_4b": ("18.4B", "dgx-a100", 256, 60.0),
    "g175b": ("benchmarks/models/gpt.py:gpt3_175b", "dgx-h100", 1024, None),
    "m1t": ("1T", "dgx-a100", 3072, 60.0),
}
QUICK = {"small8": ("benchmarks/models/gpt.py:gpt2_small", "dgx-h100", 8, None)}


def load(model: str):
    """The model and its inputs: a Megatron row's GPT, or a model file."""
    rows = {r.name: r for r in megatron_table.ROWS}
    if model in rows:
        return megatron_table.build(rows[model])
    return flexsearch.load_model(str(ROOT / model))


def run(key: str, model: str, cluster_name: str, devices: int, budget_s: float | None,
        workers: int | None) -> dict[str, float]:
    t0 = time.perf_counter()
    module, inputs = load(model)
    cluster = Cluster.preset(cluster_name, devices)
    prec, _ = resolve_precision("auto", cluster)
    graph = trace(module, inputs, precision=prec)
    traced = time.perf_counter() - t0
    left = None if budget_s is None else max(1e-3, budget_s - traced)
    try:
        plan = plan_graph(graph, cluster, budget_s=left, workers=workers)
        what = f"{megatron_table.describe(plan)} {plan.predicted.iteration_time_s:.3f} s/iter"
        ok = 1
    except FlexsearchError as e:
        what, ok = f"no plan: {str(e)[:90]}", 0
    took = time.perf_counter() - t0
    over = 0.0 if budget_s is None else max(0.0, took / budget_s - 1)
    print(f"{key:<7} {model:<40} {devices:>5} x {cluster_name:<9} {took:>7.1f} s (trace {traced:.1f} s)  {what}",
          flush=True)
    return {f"{key}_s": took, f"{key}_trace_s": traced, f"{key}_over": over, f"{key}_ok": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), help="cases to run (default: all)")
    ap.add_argument("--workers", type=int, default=None, help="the planner's processes (default: the CPUs)")
    ap.add_argument("--quick", action="store_true", help="GPT-2 small on 8 dgx-h100 only")
    ap.add_argument("--budgets", nargs="+", type=float, help="run each case under each of these budgets (seconds)")
    args = ap.parse_args(argv)
    cases = QUICK if args.quick else {k: CASES[k] for k in (args.cases or CASES)}
    figures: dict[str, float] = {}
    for key, (model, cluster, devices, budget_s) in cases.items():
        for b in args.budgets or [budget_s]:
            name = key if not args.budgets else f"{key}_b{b:g}".replace(".", "p")
            figures.update(run(name, model, cluster, devices, b, workers=args.workers))
    overs = [v for k, v in figures.items() if k.endswith("_over")]
    print(" ".join(f"{k}={v:.3g}" for k, v in figures.items()) + f" max_over={max(overs, default=0.0):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

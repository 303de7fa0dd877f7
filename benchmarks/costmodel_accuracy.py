"""Roofline-predicted vs measured op times on this device (issue [2/8]).

For a set of zoo models (at batch sizes that fit and run in seconds here), every
distinct op is measured alone by the profiler (full shape, forward and backward,
median of repeats) and predicted by the cost model's roofline on the ``cpu`` preset's
device spec (peak FLOP/s and bandwidth measured by ``flexsearch profile --comm``,
efficiency factors from ``costmodels/efficiency.json``). Prints per op class the median
and 90th-percentile |relative error| = |predicted - measured| / measured, forward and
backward, and the worst ops.

    python benchmarks/costmodel_accuracy.py [--threads 1] [--repeats 3] [--cluster cpu]
    python benchmarks/costmodel_accuracy.py --quick  # the MLP and ResNet-20 only, one repeat
    python benchmarks/costmodel_accuracy.py --fit    # calibrate, then evaluate held out

``--fit`` calibrates the device's per-class efficiency factors on half of the distinct
ops (every other op of each class, ordered by size; the binding factor *= median
(predicted / measured) of the class's forward times, at most 1), writes them to
``costmodels/efficiency.json`` with this command as their source, and computes the
error table on the other, held-out half only.

Last line: ``matmul_class_median_error=... matmul_class_p90_error=... all_median_error=...``
(matmul class = linear, matmul, conv; the target is a median within 0.25).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import build, get  # noqa: E402

from flexsearch.cost.compute import WHOLE, op_cost  # noqa: E402
from flexsearch.cost.efficiency import EFFICIENCY_FILE  # noqa: E402
from flexsearch.cost.hardware import Cluster  # noqa: E402
from flexsearch.cost.profiler import ProfileDB, local_device, profile_graph  # noqa: E402
from flexsearch.graph.tracer import trace_calls  # noqa: E402

# (zoo builder, keyword arguments): paper configurations at batches a 2-core CPU runs.
CASES = (
    ("mlp", {"batch_size": 64}),
    ("gpt2_small", {"batch_size": 1}),
    ("bert_large", {"batch_size": 1}),
    ("resnet20", {"batch_size": 64}),
    ("alexnet", {"batch_size": 8}),
    ("vgg16", {"batch_size": 2}),
    ("rnnlm", {"batch_size": 8}),
)
MATMUL_CLASS = ("linear", "matmul", "conv")
COMPUTE_BOUND = ("linear", "matmul", "conv", "attention", "rnn")
EFFICIENCY = EFFICIENCY_FILE


def fit(rows: list[tuple], device_name: str, measured_on: str) -> None:
    """Scale each class's binding factor (FLOP/s for matmul-like classes, bandwidth for
    the rest) by median(predicted / measured) of its forward times, at most 1.0."""
    data = json.loads(EFFICIENCY.read_text())
    table = data.setdefault("devices", {}).setdefault(device_name, {})
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r[2], []).append(r[3] / r[4])
    today = datetime.date.today().isoformat()
    for kind, ratios in sorted(by_kind.items()):
        factor = statistics.median(ratios)
        what = "flops" if kind in COMPUTE_BOUND else "bandwidth"
        entry = table.setdefault(kind, dict(data["default"][kind]))
        old = entry[what]["value"]
        entry[what] = {
            "value": round(min(1.0, old * factor), 4),
            "source": f"fitted by `python benchmarks/costmodel_accuracy.py --fit` on {today} "
            f"({measured_on}, median over {len(ratios)} distinct {kind} ops of the zoo models in CASES)",
        }
        print(f"fit {kind:<12} {what:<9} {old:.3f} -> {entry[what]['value']:.3f}")
    EFFICIENCY.write_text(json.dumps(data, indent=2) + "\n")


def _row(builder: str, node, measured: tuple[float, float], device) -> tuple:
    predicted = op_cost(node, device, WHOLE)
    return (builder, node.name, node.kind, predicted.forward_s, measured[0], predicted.backward_s, measured[1], node.flops)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--models", nargs="*", default=[c[0] for c in CASES])
    ap.add_argument("--fit", action="store_true", help="calibrate efficiency factors, evaluate held out")
    ap.add_argument("--quick", action="store_true", help="the MLP and ResNet-20 only, one repeat (no --fit)")
    args = ap.parse_args()
    if args.quick:
        args.models, args.repeats, args.fit = ["mlp", "resnet20"], 1, False

    torch.set_num_threads(args.threads)
    device = Cluster.resolve(args.cluster, devices=1).device
    name = local_device(args.threads)
    rows = []  # (model, op, kind, pred_f, meas_f, pred_b, meas_b, flops)
    with tempfile.TemporaryDirectory() as tmp:
        db = ProfileDB.load(Path(tmp) / "p.json", device=name)
        for builder, kwargs in CASES:
            if builder not in args.models:
                continue
            model, inputs = build(get(builder), **kwargs)
            graph, calls = trace_calls(model, inputs)
            profile_graph(graph, calls, db, device_name=name, degrees=(), warmup=1, repeats=args.repeats)
            seen = set()
            for node in graph.nodes:
                if node.signature in seen or node.kind in ("input", "output", "view") or node.flops + node.bytes_read == 0:
                    continue
                seen.add(node.signature)
                measured = db.lookup(node, WHOLE, name, "float32")
                if measured is None:
                    continue
                rows.append((builder, node, measured))

    if args.fit:  # alternate distinct ops of each class, by size: half fit, half held out
        ordered = sorted(rows, key=lambda r: (r[1].kind, r[1].flops, r[1].bytes_read))
        calib, rows = ordered[0::2], ordered[1::2]
        fit([_row(b, n, m, device) for b, n, m in calib], device.name, name)
    rows = [_row(b, n, m, device) for b, n, m in rows]

    def err(p: float, m: float) -> float:
        return abs(p - m) / m

    held = " (held out)" if args.fit else ""
    print(f"device spec {device.name!r} (cluster {args.cluster}); measured on {name}, {len(rows)} distinct ops{held}")
    print(f"{'class':<12} {'ops':>4} {'fwd median':>11} {'fwd p90':>8} {'bwd median':>11} {'bwd p90':>8}")
    by_kind: dict[str, list[tuple]] = {}
    for r in rows:
        by_kind.setdefault(r[2], []).append(r)
    for kind, rs in sorted(by_kind.items()):
        f = [err(r[3], r[4]) for r in rs]
        b = [err(r[5], r[6]) for r in rs if r[6] > 0]
        bm = f"{statistics.median(b):>11.2f} {pct(b, 0.9):>8.2f}" if b else f"{'-':>11} {'-':>8}"
        print(f"{kind:<12} {len(rs):>4} {statistics.median(f):>11.2f} {pct(f, 0.9):>8.2f} {bm}")
    worst = sorted(rows, key=lambda r: -err(r[3], r[4]))[:8]
    print("worst forward predictions (model, op, kind, predicted ms, measured ms):")
    for r in worst:
        print(f"  {r[0]:<11} {r[1]:<28} {r[2]:<11} {r[3] * 1e3:>9.3f} {r[4] * 1e3:>9.3f}")
    mm = [err(r[3], r[4]) for r in rows if r[2] in MATMUL_CLASS] + [err(r[5], r[6]) for r in rows if r[2] in MATMUL_CLASS and r[6] > 0]
    everything = [err(r[3], r[4]) for r in rows] + [err(r[5], r[6]) for r in rows if r[6] > 0]
    print(
        f"matmul_class_median_error={statistics.median(mm):.3f} matmul_class_p90_error={pct(mm, 0.9):.3f} "
        f"all_median_error={statistics.median(everything):.3f} ops={len(rows)}"
    )


if __name__ == "__main__":
    main()

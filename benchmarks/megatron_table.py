"""Megatron-LM's weak-scaling table as a test of the cost model and the search.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21), Table 1: GPT models (vocabulary V = 51,200, sequence s = 2,048)
trained on DGX A100 80 GB nodes (Selene: 8 GPUs on NVSwitch, 8 x 200 Gb/s HDR
InfiniBand per node) with mixed precision and activation recomputation, and the
teraFLOP/s per GPU each run achieved. The table's time per iteration follows from the
paper's FLOP count (its equation 3, which counts the recomputed forward):

    F = 96 B s l h^2 (1 + s / 6h + V / 16 l h),   t = F / (X * N)

with batch B, l layers, hidden size h, X the achieved FLOP/s per GPU and N GPUs.

For each row this script:

1. builds the model (the zoo's GPT, ``benchmarks/models/gpt.py``, at the row's size,
   on the meta device) and traces it under ``bf16-mixed``, what ``auto`` picks on
   ``dgx-a100``;
2. **predicts Megatron's own layout** through the public strategy values: a pipeline
   of ``p`` stages of ``l / p`` layers each (the embedding in the first, the head in
   the last), ``t``-way Megatron tensor parallelism in a stage, ``d = N / (t p)``
   replicas, the 1F1B schedule (Megatron's default, non-interleaved) and full
   activation recomputation. The table does not give the microbatch size: the fastest
   of 1, 2, 4 and 8 that fits is taken (the paper tunes it per model, its section 5.6);
3. runs the planner (``plan_graph``, default search; ``--no-search`` skips it) and
   reports its layout, its prediction and the speedup it predicts over Megatron's
   layout, and the search time.

The cost model's constants are not fitted to this table: the A100's peaks, links and
capacity come from NVIDIA's datasheets (``costmodels/clusters/dgx-a100.json``) and the
fraction of peak each op kind reaches from ``costmodels/efficiency.json`` (cuBLAS and
STREAM-like figures, each with its source). A ratio far from 1 is a miss to explain,
not a constant to move.

``--unfused-attention`` builds the attention as SC21 ran it (2021, before fused
attention kernels: the ``batch x heads x s x s`` scores written by ``q k^T``, masked,
softmaxed, dropped out and read by ``@ v``) instead of ``scaled_dot_product_attention``
(costed as one fused kernel); a diagnostic of how much the table's small rows depend
on it (the score traffic grows with ``s / h``), not the table.

Rows: the six rows quoted in the issue ([v2 3/6]) are marked ``*``; the other four were
read from the paper's Table 1 from memory and are marked ``(recalled)``; check them
against the paper before relying on them.

    python benchmarks/megatron_table.py                 # every row, with the search
    python benchmarks/megatron_table.py --no-search     # Megatron's layouts only
    python benchmarks/megatron_table.py --rows 1.7B 18.4B
    python benchmarks/megatron_table.py --quick         # 1.7B and 18.4B, layouts only
    python benchmarks/megatron_table.py --no-search --unfused-attention

Last line: ``rows=... median_ratio=... min_ratio=... max_ratio=... fits=...
search_not_worse=...`` (ratio = predicted / measured time per iteration, over the rows
run; ``fits``: rows whose Megatron layout fits in 80 GB as predicted;
``search_not_worse``: rows where the planner's plan is predicted at least as fast as
Megatron's layout, of those searched).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import flexsearch  # noqa: F401  (the package, before its submodules)
from flexsearch.cost.hardware import Cluster
from flexsearch.errors import FlexsearchError
from flexsearch.graph.tracer import trace
from flexsearch.precision import precision
from flexsearch.search.pipeline import block_bounds
from flexsearch.search.planner import plan_graph
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.strategy.kinds import Pipelined
from flexsearch.strategy.recompute import recompute_units

ROOT = Path(__file__).resolve().parent.parent
V, S = 51200, 2048
MICROBATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Row:
    name: str
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float
    """Achieved teraFLOP/s per GPU (the paper's Table 1)."""
    quoted: bool
    """Quoted in the issue (checked); else recalled from the paper."""

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)

    def flops(self) -> float:
        """The paper's equation 3: FLOPs per iteration, the recomputed forward included."""
        b, layers, h = self.batch, self.layers, self.hidden
        return 96 * b * S * layers * h * h * (1 + S / (6 * h) + V / (16 * layers * h))

    def measured_s(self) -> float:
        return self.flops() / (self.tflops * 1e12 * self.gpus)


ROWS = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, True),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, False),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, False),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, True),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, True),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, False),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, True),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, True),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, False),
    Row("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, True),
)
QUICK = ("1.7B", "18.4B")


def _gpt_module():
    spec = importlib.util.spec_from_file_location("flexsearch_bench_gpt", ROOT / "benchmarks/models/gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(row: Row, fused_attention: bool = True):
    """The zoo's GPT at the row's size (learned positions, tied head, biases: GPT-2's
    layout, as Megatron's GPT; q, k and v projections apart, so that a column split is
    head-aligned as Megatron's fused per-head QKV is), on meta, with the row's global
    batch; ``fused_attention=False``: the attention unfused (``--unfused-attention``)."""
    gpt = _gpt_module()
    cfg = gpt.GPTConfig(vocab_size=V, block_size=S, n_layer=row.layers, n_head=row.heads, n_embd=row.hidden,
                        fused_qkv=False, fused_attention=fused_attention)
    return gpt._build(cfg, row.batch, S, meta=True)


def layer_bounds(graph, layers: int, p: int) -> tuple[tuple[int, int], ...]:
    """``p`` stages of ``layers / p`` transformer layers (node positions); the embedding
    joins the first stage, the final norm and the head the last."""
    units = recompute_units(graph)
    if len(units) != layers:
        raise ValueError(f"expected {layers} layers, found {len(units)} repeated blocks")
    bounds = block_bounds(graph, p)
    if bounds is None:
        raise ValueError(f"{layers} layers do not split into {p} stages")
    return bounds


def megatron_layout(graph, row: Row, ctx: CostContext):
    """Megatron's layout (module docstring) at its fastest fitting microbatch size:
    ``(microbatch size, strategy, simulation)``, or the fastest non-fitting one."""
    bounds = layer_bounds(graph, row.layers, row.p)
    per_replica = row.batch // row.d
    best = None
    for mbs in MICROBATCH_SIZES:
        if per_replica % mbs:
            continue
        strategy = Pipelined(bounds, tensor=row.t, replicas=row.d, schedule="1f1b",
                             microbatches=per_replica // mbs, recompute="full")
        sim = predict(graph, strategy, ctx, timeline=False)
        key = (not sim.feasible, sim.iteration_time_s)
        if best is None or key < best[0]:
            best = (key, mbs, strategy, sim)
    return best[1:]


def describe(plan) -> str:
    """A plan's layout in Megatron's terms."""
    shard = f" {plan.shard}" if plan.shard != "none" else ""
    if plan.stages:
        p = len(plan.stages) // (plan.chunks or 1)
        return (f"{plan.kind} p={p} t={plan.tensor_degree} d={plan.stages[0].replicas} "
                f"m={plan.microbatches} {plan.schedule} rc={plan.recompute}{shard}")
    extra = f" m={plan.microbatches}" if (plan.microbatches or 1) > 1 else ""
    return f"{plan.kind}{shard}{extra} rc={plan.recompute}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS], help="rows to run (default: all)")
    ap.add_argument("--no-search", action="store_true", help="Megatron's layouts only, no planner run")
    ap.add_argument("--budget-s", type=float, default=None, help="the planner's time budget per row")
    ap.add_argument("--max-iters", type=int, default=None, help="the planner's MCMC steps (default: its own)")
    ap.add_argument("--quick", action="store_true", help=f"rows {', '.join(QUICK)}, layouts only")
    ap.add_argument("--unfused-attention", action="store_true",
                    help="attention as SC21 ran it (scores materialised; a diagnostic, not the table)")
    args = ap.parse_args(argv)
    names = QUICK if args.quick else (args.rows or [r.name for r in ROWS])
    search = not (args.no_search or args.quick)
    rows = [r for r in ROWS if r.name in names]

    head = (f"{'row':<8} {'N':>5} {'layout t/p/d':>12} {'mbs':>3} {'measured s':>10} {'predicted s':>11} "
            f"{'ratio':>6} {'mem GB':>7}")
    if search:
        head += f"  {'planner layout':<48} {'pred s':>8} {'speedup':>7} {'search s':>8}"
    print("Megatron-LM (SC21) Table 1 on dgx-a100, bf16-mixed; measured s/iter from the paper's FLOP/s"
          + ("; attention unfused" if args.unfused_attention else ""))
    print(head)
    ratios, fits, better, searched = [], 0, 0, 0
    for row in rows:
        t0 = time.perf_counter()
        model, inputs = build(row, fused_attention=not args.unfused_attention)
        graph = trace(model, inputs, precision="bf16-mixed")
        cluster = Cluster.preset("dgx-a100", row.gpus)
        ctx = CostContext(cluster, precision=precision("bf16-mixed"))
        mbs, _, sim = megatron_layout(graph, row, ctx)
        measured = row.measured_s()
        ratio = sim.iteration_time_s / measured
        ratios.append(ratio)
        fits += sim.feasible
        star = "*" if row.quoted else " "
        line = (f"{row.name + star:<8} {row.gpus:>5} {f'{row.t}/{row.p}/{row.d}':>12} {mbs:>3} {measured:>10.2f} "
                f"{sim.iteration_time_s:>11.2f} {ratio:>6.2f} {sim.peak_memory_bytes / 1e9:>7.1f}"
                f"{'' if sim.feasible else ' OOM'}")
        if search:
            kw = {k: v for k, v in (("budget_s", args.budget_s), ("max_iters", args.max_iters)) if v is not None}
            t1 = time.perf_counter()
            try:
                plan = plan_graph(graph, cluster, **kw)
                took = time.perf_counter() - t1
                speedup = sim.iteration_time_s / plan.predicted.iteration_time_s
                searched += 1
                better += speedup >= 1 - 1e-9
                line += (f"  {describe(plan):<48} {plan.predicted.iteration_time_s:>8.2f} {speedup:>6.2f}x "
                         f"{took:>8.1f}")
            except FlexsearchError as e:
                line += f"  no plan: {str(e)[:80]}"
        print(line + f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("* quoted in the issue; other rows recalled from the paper (check them). ratio = predicted / measured.")
    print(f"rows={len(rows)} median_ratio={statistics.median(ratios):.3f} min_ratio={min(ratios):.3f} "
          f"max_ratio={max(ratios):.3f} fits={fits} search_not_worse={better}/{searched}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

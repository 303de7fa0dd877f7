"""Decentralized vs centralized data parallelism: predicted time per iteration.

For n = 8, 16, 32, 64, 112 workers on ``commodity`` (one P100 per machine, 1 Gb/s
Ethernet, 5 ms latency: the D-PSGD paper's slow network) and on ``dgx-h100``: D-PSGD on
a ring, on the static exponential graph and on the one-peer exponential graph (n a power
of two only: n/a at 112), a parameter server (one server; sharded over every worker)
and all-reduce (the planner's ``"data"`` baseline), all on the same simulator
(:mod:`flexsearch.sim.decentralized`) and the same per-worker compute.

Workloads (weak scaling: a fixed batch per worker, the global batch grows with n):

- ResNet-20 / CIFAR-10 (the zoo's ``resnet20``, 0.27M parameters, the D-PSGD paper's
  model): 128 images per worker (approx.: whether the paper's 128 is per worker or in
  total was not checked), SGD with momentum.
- GPT-2 small (the zoo's ``gpt2_small``, 124M parameters, loaded with
  ``flexsearch.load_model``): 8 sequences of 1024 tokens per worker (the GPT-2 paper's
  batch of 512 at n = 64; a choice), Adam.

The per-worker compute (forward, backward, activation memory) does not depend on n, so it
is costed once per (model, cluster) and reused for every n. Times are in ms per
iteration; ``!`` marks a plan that does not fit in device memory (D-PSGD keeps a receive
buffer per in-neighbour). ``xiter`` is the ring's iterations factor (iterations to the
same accuracy relative to synchronous SGD, :func:`flexsearch.strategy.topology.iterations_factor`).
The last line: ``key=value`` headline figures (speedups of D-PSGD over all-reduce and
over the parameter server at n = 112).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from flexsearch.cost.hardware import Cluster
from flexsearch.errors import TopologyError
from flexsearch.graph.tracer import trace
from flexsearch.model_files import load_model
from flexsearch.search.decentralized import centralized_baselines
from flexsearch.sim.context import CostContext
from flexsearch.sim.decentralized import simulate_gossip
from flexsearch.sim.stages import replica_cost
from flexsearch.strategy.topology import build, iterations_factor

ROOT = Path(__file__).resolve().parent
NS = (8, 16, 32, 64, 112)
CLUSTERS = ("commodity", "dgx-h100")
# name, model spec, replicas the spec's batch splits into (per-worker batch), optimizer
MODELS = (
    ("resnet20", "models/resnet.py:resnet20", 1, "momentum"),
    ("gpt2", "models/gpt.py:gpt2_small", 64, "adam"),
)
GOSSIP = ("ring", "exponential", "one_peer_exponential")


def cell(sim) -> str:
    if sim is None:
        return "n/a"
    return f"{sim.iteration_time_s * 1e3:.1f}" + ("" if sim.feasible else "!")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=list(NS))
    ap.add_argument("--quick", action="store_true", help="n = 8 and 16 only")
    args = ap.parse_args()
    if args.quick:
        args.ns = [8, 16]
    t0 = time.perf_counter()
    graphs = {}
    for name, spec, replicas, _ in MODELS:
        model, inputs = load_model(str(ROOT / spec))
        graphs[name] = (trace(model, inputs), replicas)
    head = (f"{'cluster':<10} {'model':<8} {'n':>4} {'ring':>9} {'expo':>9} {'1peer':>9} {'ps':>10} "
            f"{'ps-shard':>9} {'allreduce':>9} {'AR/ring':>8} {'PS/ring':>8} {'xiter':>7}")
    print(head)
    print("-" * len(head))
    headline: dict[str, float] = {}
    notes: set[str] = set()
    for cname in CLUSTERS:
        for name, _, _, optimizer in MODELS:
            graph, replicas = graphs[name]
            cost = replica_cost(graph, CostContext(Cluster.preset(cname, 1)), replicas=replicas)  # per (model, cluster)
            for n in args.ns:
                cluster = Cluster.preset(cname, n)
                ctx = CostContext(cluster)
                gossip = {}
                for top in GOSSIP:
                    try:
                        topology = build(top, n)
                    except TopologyError as e:
                        gossip[top] = None
                        notes.add(f"{top} at n = {n}: {e}")
                        continue
                    gossip[top] = (simulate_gossip(ctx, cost, topology, optimizer=optimizer, timeline=False),
                                   iterations_factor(topology))
                base = centralized_baselines(graph, ctx, optimizer=optimizer, cost=cost, all_reduce=True)
                ring, factor = gossip["ring"]
                ar, ps = base["all-reduce"].iteration_time_s, base["ps"].iteration_time_s
                r = ring.iteration_time_s
                print(f"{cname:<10} {name:<8} {n:>4} {cell(ring):>9} "
                      f"{cell(gossip['exponential'] and gossip['exponential'][0]):>9} "
                      f"{cell(gossip['one_peer_exponential'] and gossip['one_peer_exponential'][0]):>9} "
                      f"{cell(base['ps']):>10} {cell(base['ps-sharded']):>9} {cell(base['all-reduce']):>9} "
                      f"{ar / r:>7.2f}x {ps / r:>7.2f}x {factor:>7.2f}")
                if n == max(args.ns):
                    short = "dgx" if cname == "dgx-h100" else cname
                    key = f"{name}_{short}_n{n}"
                    headline[f"ring_over_allreduce_{key}"] = ar / r
                    headline[f"ring_over_ps_{key}"] = ps / r
                    headline[f"ring_over_ps_sharded_{key}"] = base["ps-sharded"].iteration_time_s / r
                    if gossip["exponential"] is not None:
                        headline[f"expo_over_allreduce_{key}"] = ar / gossip["exponential"][0].iteration_time_s
    for note in sorted(notes):
        print(f"n/a: {note}")
    headline["seconds"] = time.perf_counter() - t0
    print(" ".join(f"{k}={v:.3g}" for k, v in headline.items()))


if __name__ == "__main__":
    main()

"""Pipeline partitioner speed (PipeDream's hierarchical DP, :mod:`flexsearch.search.partition`).

1. A 1,000-layer chain over 64 devices in two levels (8 devices per node over NVLink,
   8 nodes over InfiniBand, ``dgx-h100``'s links), per-stage replication allowed,
   memory-aware (80 GB, Adam, activations of ``ceil(64 / r)`` minibatches in flight).
   The layers are random (seeded): compute 1-10 ms, 0-50 MB of weights, 1-20 MB of
   activations, so no repetition helps. Target: <= 2 s.
2. A ResNet-101-sized DAG (the zoo's ``resnet101``, traced: every op a layer, cut points
   the prefixes of its topological order) over 8 x 2 devices (two ``dgx-h100`` nodes of
   8), the chain's costs from the cost model at ``B / 16`` samples per minibatch.
   Target: <= 5 s. Chain building (cost model, reported apart) is not the partitioner.

Each figure is the median of ``--rounds`` runs. The last line: ``key=value`` pairs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.microbatch import microbatch_graph
from flexsearch.graph.tracer import trace
from flexsearch.model_files import load_model
from flexsearch.search.partition import Chain, Memory, partition
from flexsearch.search.pipeline import cluster_levels, pipedream_chain
from flexsearch.sim.context import CostContext
from flexsearch.sim.stages import cut_bytes, stage_node_costs

ROOT = Path(__file__).resolve().parent


def random_chain(layers: int, seed: int = 0) -> Chain:
    rng = random.Random(seed)
    return Chain(
        compute=tuple(rng.uniform(1e-3, 10e-3) for _ in range(layers)),
        params=tuple(rng.uniform(0, 50e6) for _ in range(layers)),
        cut_bytes=(0.0,) + tuple(rng.uniform(1e6, 20e6) for _ in range(layers - 1)) + (0.0,),
        stash=tuple(rng.uniform(1e6, 20e6) for _ in range(layers)),
    )


def timed(fn, rounds: int):
    times, out = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1

    cluster = Cluster.preset("dgx-h100", 64)
    levels = cluster_levels(cluster)
    assert [lv.workers for lv in levels] == [8, 8]
    n = cluster.devices
    memory = Memory(cluster.device.memory_capacity.value, 4.0, in_flight=lambda r: -(-n // r),
                    weight_stashing=True)
    chain = random_chain(args.layers)
    chain_s, part = timed(lambda: partition(chain, levels, memory=memory), args.rounds)
    assert part is not None
    print(f"chain {args.layers} layers x 64 devices (8 x 8): {chain_s:.3f} s, "
          f"configuration {part.text()}, bottleneck {part.bottleneck_s * 1e3:.2f} ms")

    t0 = time.perf_counter()
    model, inputs = load_model(str(ROOT / "models/resnet.py:resnet101"))
    graph = trace(model, inputs)
    c16 = Cluster.preset("dgx-h100", 16)
    mg = microbatch_graph(graph, 16)
    costs = stage_node_costs(mg, CostContext(c16), 1)
    dag = pipedream_chain(costs, cut_bytes(mg))
    build_s = time.perf_counter() - t0
    mem16 = Memory(c16.device.memory_capacity.value, 4.0, in_flight=lambda r: -(-16 // r), weight_stashing=True)
    dag_s, dpart = timed(lambda: partition(dag, cluster_levels(c16), memory=mem16), args.rounds)
    assert dpart is not None
    print(f"resnet101 DAG {dag.layers} ops x 16 devices (8 x 2): {dag_s:.3f} s "
          f"(chain built in {build_s:.1f} s incl. tracing), configuration {dpart.text()}")
    print(f"chain_s={chain_s:.3f} chain_target_s=2 resnet101_s={dag_s:.3f} resnet101_target_s=5 "
          f"resnet101_layers={dag.layers}")


if __name__ == "__main__":
    main()

"""Time and peak memory to trace the largest zoo models (issue [1/8]), and a Hugging Face
Llama-3-8B-shaped model ([v2 2/6]: ``llama3_8b_hf``, built on meta from a config).

Each model is loaded and traced in a fresh subprocess, so its peak RSS is its own;
the time covers building the model (on the meta device) and tracing it.

    python benchmarks/trace_speed.py [--models gpt2_xl gpt3_175b] [--repeats 3]

Targets on a 2-core machine: gpt3_175b <= 30 s and <= 2 GB peak RSS; gpt2_xl <= 5 s;
llama3_8b_hf <= 30 s and <= 2 GB (hidden 4096, 32 layers, 32 heads with 8 key/value
heads, MLP 14336, vocabulary 128256: the published Llama 3 8B shape; batch 8 x 2048).
Last line: key=value pairs (seconds and MB per model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {bench!r})
from zoo import get
t0 = time.perf_counter()
import flexsearch
t1 = time.perf_counter()
if {name!r} == "llama3_8b_hf":
    import torch, transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0)
    with torch.device("meta"):
        model, inputs = transformers.LlamaForCausalLM(cfg), (torch.randint(0, 128256, (8, 2048)),)
else:
    model, inputs = flexsearch.load_model(get({name!r}).abs_spec)
t2 = time.perf_counter()
graph = flexsearch.trace(model, inputs)
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "build_s": t2 - t1, "trace_s": t3 - t2,
    "nodes": len(graph.nodes), "params": graph.num_params,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def measure(name: str) -> dict:
    code = CHILD.format(bench=str(HERE), name=name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2_xl", "gpt3_175b", "llama3_8b_hf"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="GPT-2 XL once")
    args = ap.parse_args()
    if args.quick:
        args.models, args.repeats = ["gpt2_xl"], 1
    figures = []
    print(f"{'model':<12} {'params':>16} {'nodes':>6} {'build s':>8} {'trace s':>8} {'total s':>8} {'peak RSS MB':>12}")
    for name in args.models:
        runs = [measure(name) for _ in range(args.repeats)]
        build = statistics.median(r["build_s"] for r in runs)
        tr = statistics.median(r["trace_s"] for r in runs)
        total = statistics.median(r["build_s"] + r["trace_s"] for r in runs)
        rss = max(r["peak_rss_mb"] for r in runs)
        r0 = runs[0]
        print(f"{name:<12} {r0['params']:>16,} {r0['nodes']:>6} {build:>8.2f} {tr:>8.2f} {total:>8.2f} {rss:>12.0f}")
        figures += [f"{name}_trace_s={total:.2f}", f"{name}_peak_rss_mb={rss:.0f}"]
    print(" ".join(figures))


if __name__ == "__main__":
    main()

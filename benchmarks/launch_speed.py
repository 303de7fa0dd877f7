"""Start-up of multi-process jobs: what the fork server of ``run_ranks`` preloads.

``flexsearch verify``, the fidelity benchmark and the tests run every emitted plan on
local gloo ranks with :func:`flexsearch.emit.launch.run_ranks`, which forks them from a
fork server that imported :data:`flexsearch.emit.launch.PRELOAD` once. A module the
server did not import, each rank imports again in every job. This compares, job by
job, the preload as shipped with the one before it (:data:`MINIMAL`: torch,
torch.distributed, flexsearch.emit; the emitter's runtimes, the verifier and the
tracer were then imported lazily by each rank).

Each round starts two fresh interpreters (children of this script), one per preload,
in alternating order; each makes the tiny GPT's plans of up to four kinds (``data``,
``fsdp``, ``soap``, ``pipeline``: those its jobs use; 2 devices, no search), then
verifies them one job after another on 2 ranks
(:func:`flexsearch.emit.verify.verify_job`, one step), cycling through the kinds for
``--jobs`` jobs. Figures, medians over the rounds:

- ``first_s`` / ``first_minimal_s``: the first job, fork server start included (what a
  user's one ``flexsearch verify`` waits for after Python has started);
- ``job_s`` / ``job_minimal_s``: the median of the later jobs (what a test session or
  the fidelity benchmark pays per job);
- ``first_ratio``, ``job_ratio``: shipped over minimal (below 1: the shipped preload is
  faster).

    python benchmarks/launch_speed.py            # 3 rounds of 9 jobs
    python benchmarks/launch_speed.py --quick    # 1 round of 2 jobs (a smoke run)

Last line: ``first_s=... first_minimal_s=... first_ratio=... job_s=... job_minimal_s=...
job_ratio=... rounds=...``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = str(ROOT / "benchmarks/models/gpt.py:gpt_tiny")
KINDS = ("data", "fsdp", "soap", "pipeline")
MINIMAL = ("torch", "torch.distributed", "flexsearch.emit")
"""The fork server's preload before the emitter's runtimes, the verifier and the tracer
were added to it."""


def child(preload: str, jobs: int) -> None:
    """In a fresh interpreter: the plans, then ``jobs`` verify jobs; prints their seconds
    as JSON."""
    import flexsearch
    from flexsearch.emit import launch
    from flexsearch.emit.verify import verify_job

    if preload == "minimal":
        launch.PRELOAD = MINIMAL
    model, inputs = flexsearch.load_model(SPEC)
    plans = [flexsearch.plan(model, inputs, devices=2, cluster="cpu", kinds=[k], max_iters=0, seed=0)
             for k in KINDS[:jobs]]
    times = []
    for j in range(jobs):
        plan = plans[j % len(plans)]
        t0 = time.perf_counter()
        res = launch.run_ranks(verify_job, 2, SPEC, plan.model_dump_json(), 1, timeout_s=300)
        times.append(time.perf_counter() - t0)
        if not all(r["ok"] for r in res):
            raise SystemExit(f"{plan.kind} plan did not verify: {res[0]}")
    print(json.dumps(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="rounds of the two interpreters (default 3, quick 1)")
    ap.add_argument("--jobs", type=int, help="jobs per interpreter, at least 2 (default 9, quick 2)")
    ap.add_argument("--quick", action="store_true", help="1 round of 2 jobs")
    ap.add_argument("--child", choices=("shipped", "minimal"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    jobs = args.jobs or (2 if args.quick else 9)
    if jobs < 2:
        ap.error("--jobs must be at least 2: the first job starts the fork server, the later ones are compared")
    if args.child:
        child(args.child, jobs)
        return
    rounds = args.rounds or (1 if args.quick else 3)
    got: dict[str, list[list[float]]] = {"shipped": [], "minimal": []}
    for r in range(rounds):
        for preload in (("shipped", "minimal") if r % 2 == 0 else ("minimal", "shipped")):
            out = subprocess.run([sys.executable, __file__, "--child", preload, "--jobs", str(jobs)],
                                 capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"{preload} preload failed:\n{out.stderr[-3000:]}")
            times = json.loads(out.stdout.strip().splitlines()[-1])
            got[preload].append(times)
            print(f"round {r + 1}, {preload:>7} preload: first job {times[0]:.2f} s, later jobs "
                  + " ".join(f"{t:.2f}" for t in times[1:]), flush=True)
    first = {k: statistics.median(t[0] for t in v) for k, v in got.items()}
    later = {k: statistics.median(statistics.median(t[1:]) for t in v) for k, v in got.items()}
    print(f"first job (fork server start included): {first['shipped']:.2f} s shipped, {first['minimal']:.2f} s "
          f"minimal; later jobs: {later['shipped']:.2f} s and {later['minimal']:.2f} s")
    print(f"first_s={first['shipped']:.3f} first_minimal_s={first['minimal']:.3f} "
          f"first_ratio={first['shipped'] / first['minimal']:.3f} job_s={later['shipped']:.3f} "
          f"job_minimal_s={later['minimal']:.3f} job_ratio={later['shipped'] / later['minimal']:.3f} rounds={rounds}")


if __name__ == "__main__":
    main()

"""Train a model-file model with a saved flexsearch plan, one process per device.

    flexsearch plan benchmarks/models/mlp.py:mlp_tiny --devices 2 --cluster cpu --out plan.json
    torchrun --nproc-per-node 2 examples/train.py --plan plan.json \\
        --model benchmarks/models/mlp.py:mlp_tiny --steps 20 [--lr 0.01] [--checkpoint DIR]

Every rank loads the model and the plan, ``flexsearch.emit.parallelize`` gives the module
this rank runs, and each step feeds the same global batch on every rank (the model's
example inputs and a synthetic regression target, seeded alike on all ranks) with an
MSE loss and Adam. Rank 0 prints the loss of every step and the median step time after
warmup; ``--checkpoint DIR`` saves the trained model at the end (a
torch.distributed.checkpoint directory under the original model's keys, loadable with
``flexsearch.emit.checkpoint.load_original`` into the plain model). NCCL on GPUs when
CUDA is available, else gloo on CPU. A user error (bad plan, model or world size) prints
one line to stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import flexsearch
from flexsearch.emit import checkpoint as ckpt
from flexsearch.emit import graph_of, parallelize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan JSON written by `flexsearch plan --out`")
    ap.add_argument("--model", required=True, help="model file: path/to/file.py[:NAME]")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic target (default 0)")
    ap.add_argument("--checkpoint", help="save the trained model to this directory")
    return ap.parse_args(argv)


def materialize(model: nn.Module, inputs: tuple, device: torch.device, seed: int) -> tuple[nn.Module, tuple]:
    """``model`` and ``inputs`` on ``device``; a model built on the meta device (the zoo's
    full-size models) gets real storage, initialized by its layers' ``reset_parameters``
    under ``seed`` (the same on every rank), and meta inputs become random ones."""
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model = model.to_empty(device=device)
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    model = model.to(device)
    gen = torch.Generator().manual_seed(seed + 1)

    def real(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta:
            x = (torch.randn(x.shape, generator=gen).to(x.dtype) if x.dtype.is_floating_point
                 else torch.zeros(x.shape, dtype=x.dtype))
        return x.to(device)

    return model, tree_map(real, inputs)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target)


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model, inputs = flexsearch.load_model(args.model)
    plan = flexsearch.Plan.load(args.plan)
    graph_of(model, plan)  # the plan's model? (before allocating anything)
    model, inputs = materialize(model, tuple(inputs), device, args.seed)
    with torch.no_grad():
        out = model(*inputs)
    if not isinstance(out, torch.Tensor):
        raise flexsearch.FlexsearchError(f"{args.model} returns {type(out).__name__}, not a tensor; this "
                                         "example trains models whose output is one tensor")
    gen = torch.Generator().manual_seed(args.seed)  # the same target on every rank
    target = torch.randn(out.shape, generator=gen).to(device)
    module = parallelize(model, plan)
    opt = flexsearch.make_optimizer(module, torch.optim.Adam, lr=args.lr)  # ZeRO-1 plans shard it
    if rank == 0:
        print(f"{plan.kind} plan on {dist.get_world_size()} ranks ({dist.get_backend()}), "
              f"{args.steps} steps", flush=True)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = module.train_step(inputs, target, loss_fn)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f} time {times[-1] * 1e3:.1f} ms", flush=True)
    timed = times[args.warmup:] or times
    if rank == 0 and timed:
        print(f"median step time {statistics.median(timed) * 1e3:.2f} ms "
              f"(over {len(timed)} steps after {len(times) - len(timed)} warmup)", flush=True)
    if args.checkpoint:
        ckpt.save(module, args.checkpoint)
        if rank == 0:
            print(f"checkpoint saved to {args.checkpoint}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps < 0 or args.warmup < 0:
        print("error: --steps and --warmup must be >= 0", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("error: start this script with torchrun (e.g. torchrun --nproc-per-node 2 "
              "examples/train.py ...)", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend)
    try:
        train(args)
    except flexsearch.FlexsearchError as e:
        print(f"error (rank {dist.get_rank()}): {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One GPU, one training step: the roofline cost model's prediction against a real run.

The cost model prices a GPU op from the preset's datasheet peaks and the efficiency
factors of ``flexsearch/costmodels/efficiency.json`` (vendor and published figures,
cited there; none fitted to a run of this benchmark). This benchmark checks them where
a user would: one training step of a zoo GPT in eager PyTorch on one GPU.

Four parts, so that measuring on the GPU machine needs nothing but torch (profiling
there needs flexsearch too):

- ``predict`` (here): per case, ``flexsearch.plan`` on one device of each GPU preset
  (``dgx-h100``, ``h200``) at the case's precision: the predicted iteration time and
  peak memory of the one-device (data) plan;
- ``measure`` (on the GPU; imports only torch and the zoo's model files): the same model
  and batch, initialised on the GPU, trained with ``torch.optim.Adam`` (the planner's
  optimizer) under the precision (``bf16-mixed``: ``torch.autocast`` in bf16 over fp32
  weights; ``tf32``: TF32 matmuls in fp32), a cross-entropy loss over the logits; after
  ``--warmup`` steps, the median of ``--steps`` step times (CUDA events: forward,
  loss, backward, optimizer step, ``zero_grad``) and the peak of
  ``torch.cuda.max_memory_allocated`` over them. The loss is timed alone too
  (``loss_ms``): the planner does not cost the loss, so it is part of the error. On a
  GPU, one step more with the allocator's peak in each phase (``phase_bytes``). Then
  three steps under ``torch.profiler``: the GPU's kernel time per step by category
  (GEMM, attention, optimizer, other) and in all (``busy``: the rest of the step the
  GPU waits for the CPU to launch work);
- ``profile`` (on the GPU; needs flexsearch and its dependencies there):
  ``flexsearch``'s own op profiler over each case's model on the GPU (whole ops), so
  that ``predict --profile FILE`` also predicts each plan from measured op times
  (``profiled``), as a user who runs ``flexsearch profile`` on their GPU would;
- ``compare``: the predictions of the preset that matches the measured device, per
  case: ``error`` = predicted / measured - 1 for time and memory; then per case the
  predicted and measured time by category (predicted: the cost model's forward and
  backward of every node of each kind at the plan's precision, and its optimizer
  update; they need not add up to the iteration time, which the simulator schedules);
  and, where ``measure`` recorded them (``phase_bytes``: one step more, the allocator's
  peak in its forward, loss, backward and optimizer step), the memory model's branches
  against the peak of the phase each describes (:func:`phase_terms`).

    python benchmarks/gpu_step.py predict --out pred.json      # here
    python benchmarks/gpu_step.py measure --out meas.json      # on the GPU machine
    python benchmarks/gpu_step.py profile --out prof.json      # on the GPU machine
    python benchmarks/gpu_step.py predict --profile prof.json --out pred.json
    python benchmarks/gpu_step.py compare pred.json meas.json
    python benchmarks/gpu_step.py --quick                      # all three on gpt_tiny, on this machine

Cases (:data:`CASES`): zoo GPTs, GPT-2 small with its vocabulary padded (``:v50304``),
and Hugging Face's GPT-2 and a Llama built from configs (:data:`HF`), trained on their
own loss; ``--cases TEXT`` keeps the cases whose key contains it.

``--quick`` predicts for ``dgx-h100`` and measures on whatever device is here (a CPU
in CI): a test of the plumbing, its errors mean nothing. Measured runs are kept in
``costmodels/measurements/gpu-step-*.json``. The last line: ``key=value`` pairs
(``median_time_error``, ``max_time_error``, ``median_memory_error``, ``rows``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo import build  # noqa: E402  (stdlib only: safe on the GPU machine)

PRESETS = ("dgx-h100", "h200")
DEVICE_PRESET = {"H100": "dgx-h100", "H200": "h200"}
class Case(NamedTuple):
    """One measured step: a zoo builder, its batch, the precision, and a vocabulary
    size in place of the builder's (None: its own)."""

    name: str
    batch: int
    precision: str
    vocab: int | None = None

    @property
    def key(self) -> str:
        vocab = f":v{self.vocab}" if self.vocab else ""
        return f"{self.name}:b{self.batch}:{self.precision}{vocab}"

    @property
    def hf(self) -> bool:
        """A Hugging Face model (:data:`HF`), trained on its own loss (``labels``)."""
        return self.name in HF

    def build(self):
        """``(model, inputs)`` on the meta device (a zoo builder's, or :data:`HF`'s)."""
        if self.hf:
            return hf_model(self.name, self.batch, self.vocab)
        kwargs = {"vocab_size": self.vocab} if self.vocab else {}
        return build(self.name, batch_size=self.batch, **kwargs)


HF = {  # transformers config class, model class, config: models as users build them
    "hf_gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),  # GPT-2 small: its defaults
    "hf_llama": ("LlamaConfig", "LlamaForCausalLM", {  # TinyLlama-1.1B's shape (GQA, 4 KV heads)
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}),
}
HF_SEQ = 1024


def hf_model(name: str, batch: int, vocab: int | None):
    """A Hugging Face causal LM built from its config on the meta device (nothing is
    downloaded), with ``batch`` sequences of :data:`HF_SEQ` tokens as its input ids and
    labels."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg_cls, model_cls, kwargs = HF[name]
    cfg = getattr(transformers, cfg_cls)(**kwargs, **({"vocab_size": vocab} if vocab else {}))
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, HF_SEQ))
    return model, (ids, {"labels": ids})


CASES = [Case(*c) for c in (
    ("gpt2_small", 8, "bf16-mixed"),
    ("gpt2_small", 16, "bf16-mixed"),
    ("gpt2_small", 32, "bf16-mixed"),  # the main job's batch per device (512 over 16 GPUs)
    ("gpt2_medium", 8, "bf16-mixed"),
    ("gpt2_xl", 4, "bf16-mixed"),
    ("gpt2_xl", 1, "bf16-mixed"),  # peak at the update: the parameters' state outweighs the activations
    ("gpt2_small", 8, "tf32"),
    ("gpt2_small", 8, "bf16-mixed", 50304),  # nanoGPT's padded vocabulary: the LM head's GEMMs aligned
    ("gpt2_small", 8, "tf32", 50304),
    ("hf_gpt2", 8, "bf16-mixed"),  # Hugging Face's GPT-2 small: its eager GELU, its own fp32 loss
    ("hf_llama", 4, "bf16-mixed"),
)]
QUICK = [Case("gpt_tiny", 4, "bf16-mixed")]


# ----------------------------------------------------------------------------- predict

PARTS = ("gemm", "attention", "optimizer", "other")


def category(node_kind: str) -> str:
    """A graph node's kind as one of :data:`PARTS`."""
    if node_kind in ("linear", "matmul", "conv"):
        return "gemm"
    return "attention" if node_kind == "attention" else "other"


def kernel_category(name: str) -> str:
    """A CUDA kernel's name as one of :data:`PARTS` (cuBLAS/CUTLASS GEMMs, flash or
    memory-efficient attention, the optimizer's multi-tensor kernels, the rest)."""
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n:
        return "gemm"
    if "multi_tensor" in n or "adam" in n:
        return "optimizer"
    return "other"


def predict(cases, presets=PRESETS, profile: Path | None = None) -> dict:
    """Per preset and case: the one-device plan's predicted time (s) and peak bytes;
    with ``profile`` (what ``profile`` measured on the GPU) also ``profiled_s``, the
    same plan's prediction with the measured op times in place of the roofline."""
    import torch

    import flexsearch
    from flexsearch.cost.compute import WHOLE, op_cost
    from flexsearch.cost.hardware import Cluster
    from flexsearch.cost.profiler import ProfileDB
    from flexsearch.precision import precision as precision_of
    from flexsearch.sim.accounting import roofline_update_s
    from flexsearch.sim.context import CostContext

    db = ProfileDB.load(profile) if profile is not None else None
    if db is not None:  # measured by the GPU machine's torch: answer for this one's
        db.data.entries = {k.rsplit("|torch-", 1)[0] + f"|torch-{torch.__version__}": e
                           for k, e in db.data.entries.items()}
    out: dict = {"presets": {preset: {} for preset in presets}}
    for case in cases:
        precision = case.precision
        model, inputs = case.build()
        graph = flexsearch.trace(model, inputs, precision=precision)
        for preset in presets:
            t0 = time.perf_counter()
            plan = flexsearch.plan(model, inputs, devices=1, cluster=preset, precision=precision,
                                   decentralized=False, max_iters=50)
            plan_s = time.perf_counter() - t0
            cl = Cluster.resolve(preset, 1)
            profiled = math.nan
            if db is not None:
                profiled = flexsearch.simulate(graph, plan, measured=db.aliased(cl.device.name),
                                               timeline=False).iteration_time_s
            terms = flexsearch.simulate(graph, plan, timeline=False).memory_terms[0]
            ctx = CostContext(cl, precision=precision_of(plan.precision))
            parts: dict[str, float] = {"optimizer": roofline_update_s(ctx, plan.optimizer, graph.param_bytes)}
            for node in graph.nodes:  # each op's forward and backward at the plan's precision
                c = op_cost(node, cl.device, WHOLE, dtype=ctx.compute_dtype(node), efficiency=ctx.efficiency)
                parts[category(node.kind)] = parts.get(category(node.kind), 0.0) + c.forward_s + c.backward_s
            out["presets"][preset][case.key] = {
                "parts_s": parts,
                "profiled_s": profiled,
                "iteration_s": plan.predicted.iteration_time_s,
                "peak_bytes": plan.predicted.peak_memory_bytes,
                "phase_bytes": phase_terms(terms),
                "kind": plan.kind,
                "precision": plan.precision,
                "model_flops": plan.model_flops,
                "plan_s": plan_s,
            }
    return out


def phase_terms(m) -> dict[str, float]:
    """The memory model's branches (:mod:`flexsearch.sim.accounting`, uncalibrated) as
    the allocator's peak in each phase of a step measures them: ``loss``, once the loss
    holds its tensors over the output (``P + O + A + Y``); ``backward`` (``P + O + A + Y
    + max(T, W)``, the model's peak of the backward's start); ``update`` (``P + O + G +
    U``; the step measured still references the logits then, which the model leaves
    out): :func:`flexsearch.sim.accounting.peak_branches` with the state beside them."""
    from flexsearch.sim.accounting import peak_branches

    state = m.params + m.optimizer + m.buffers
    branches = peak_branches(m, None)
    return {"loss": state + m.activations + m.loss_grad, "backward": state + branches["backward"],
            "update": state + branches["update"]}


# ----------------------------------------------------------------------------- measure


def measure(cases, steps: int = 20, warmup: int = 5, profile: bool = True, out: Path | None = None) -> dict:
    """Per case (:func:`measure_case`), on the local GPU (else the CPU); written to
    ``out`` after every case (a run cut short keeps the cases it finished)."""
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "steps": steps, "warmup": warmup, "rows": {}}
    for case in cases:
        data["rows"][case.key] = row = measure_case(case, dev, steps, warmup, profile)
        print(f"{case.key}: {row}", flush=True)
        if out is not None:
            out.write_text(json.dumps(data, indent=1))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return data


def gpu_model(case: Case, dev):
    """The zoo model on ``dev``, its parameters drawn afresh (tied ones kept tied), and a
    batch of tokens."""
    import torch

    model, inputs = case.build()
    idx = inputs[0]
    shared: dict[int, list] = {}  # to_empty unties shared (tied) parameters: tie them again
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            shared.setdefault(id(p), []).append((mod, pname))
    model = model.to_empty(device=dev)
    for (mod, pname), *others in shared.values():
        for other, oname in others:
            setattr(other, oname, getattr(mod, pname))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.train(), torch.randint(0, model.config.vocab_size, idx.shape, device=dev)


def measure_case(case: Case, dev, steps: int, warmup: int, profile: bool) -> dict:
    """Median step seconds, peak allocated bytes, the loss's own time and, on a GPU with
    ``profile``, the kernels' time per step by category (module docstring)."""
    import torch
    import torch.nn.functional as F

    cuda = dev.type == "cuda"
    precision = case.precision
    model, idx = gpu_model(case, dev)
    target = torch.randint_like(idx, 0, model.config.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    mixed = precision == "bf16-mixed"

    def loss_of(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mixed):
            # a Hugging Face model's own loss, which the planner traces and prices
            out = model(input_ids=idx, labels=target).loss if case.hf else model(idx)
        (out if case.hf else loss_of(out)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [timed(step) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if cuda else math.nan
    phases = phase_peaks(case, model, idx, target, opt, loss_of) if cuda else {}
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mixed), torch.no_grad():
        shape = model(input_ids=idx).logits if case.hf else model(idx)
    logits = torch.randn(shape.shape, dtype=shape.dtype, device=dev, requires_grad=True)
    del shape
    loss_times = [timed(lambda: loss_of(logits).backward()) for _ in range(5)]
    parts: dict[str, float] = {}
    busy = math.nan
    if cuda and profile:  # where the GPU's time goes: kernels by category, per step
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        busy = 0.0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us = getattr(e, "device_time", None)
                us = e.cuda_time if us is None else us
                k = kernel_category(e.name)
                parts[k] = parts.get(k, 0.0) + us / 1e6 / 3
                busy += us / 1e6 / 3
    return {
        "parts_s": parts,
        "gpu_busy_s": busy,
        "step_s": statistics.median(times),
        "step_spread": (max(times) - min(times)) / 2 / statistics.median(times),
        "peak_bytes": peak,
        "phase_bytes": phases,
        "loss_s": statistics.median(loss_times),
        "params": sum(p.numel() for p in model.parameters()),
    }


def phase_peaks(case: Case, model, idx, target, opt, loss_of) -> dict[str, float]:
    """One training step more on the GPU: ``torch.cuda.max_memory_allocated`` over each of
    its phases (forward, loss, backward, optimizer step; a Hugging Face model's loss is
    in its forward) and ``memory_allocated`` when the step starts and each phase ends
    (``<phase>_end``), bytes."""
    import torch

    out: dict[str, float] = {"start": torch.cuda.memory_allocated()}

    def phase(name: str, fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        out[name], out[f"{name}_end"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        return result

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed"):
        y = phase("forward", lambda: model(input_ids=idx, labels=target).loss if case.hf else model(idx))
    loss = y if case.hf else phase("loss", lambda: loss_of(y))
    phase("backward", loss.backward)
    phase("update", opt.step)
    opt.zero_grad(set_to_none=True)
    return out


def profile_ops(cases, out: Path) -> None:
    """On the GPU: ``flexsearch``'s op profiler (:func:`flexsearch.cost.profiler.profile_model`,
    whole ops: a one-device plan splits none) over every case's model, into ``out``."""
    import torch

    from flexsearch.cost.profiler import profile_model

    dev = torch.device("cuda")
    for case in cases:
        model, idx = gpu_model(case, dev)
        t0 = time.perf_counter()
        inputs = (idx, {"labels": idx}) if case.hf else (idx,)
        _, counts = profile_model(model, inputs, out=out, degrees=(), precision=case.precision)
        print(f"{case.key}: profiled {counts} in {time.perf_counter() - t0:.1f} s", flush=True)
        del model
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- compare


def preset_for(device: str) -> str:
    for tag, preset in DEVICE_PRESET.items():
        if tag in device:
            return preset
    return PRESETS[0]


def compare(pred: dict, meas: dict) -> dict:
    """Print the table; return the headline figures."""
    preset = preset_for(meas["device"])
    rows = pred["presets"][preset]
    print(f"# measured on {meas['device']} (torch {meas['torch']}, {meas['date']}), predicted for the "
          f"{preset} preset")
    print(f"{'case':32} {'pred ms':>9} {'meas ms':>9} {'err':>7} {'profiled':>9} {'err':>7} {'loss ms':>8} "
          f"{'pred GB':>8} {'meas GB':>8} {'err':>7} {'MFU':>6}")
    terr, merr, perr = [], [], []
    for key, m in meas["rows"].items():
        p = rows.get(key)
        if p is None:
            print(f"{key:32} not predicted")
            continue
        te = p["iteration_s"] / m["step_s"] - 1
        me = p["peak_bytes"] / m["peak_bytes"] - 1 if m["peak_bytes"] == m["peak_bytes"] else math.nan
        terr.append(abs(te))
        if me == me:
            merr.append(abs(me))
        pe = p.get("profiled_s", math.nan) / m["step_s"] - 1
        if pe == pe:
            perr.append(abs(pe))
        peak = PEAK.get(p["precision"], math.nan)
        mfu = p["model_flops"] / m["step_s"] / peak if p.get("model_flops") else math.nan
        print(f"{key:32} {p['iteration_s'] * 1e3:9.2f} {m['step_s'] * 1e3:9.2f} {te:+7.1%} "
              f"{p.get('profiled_s', math.nan) * 1e3:9.2f} {pe:+7.1%} {m['loss_s'] * 1e3:8.2f} "
              f"{p['peak_bytes'] / 1e9:8.2f} {m['peak_bytes'] / 1e9:8.2f} {me:+7.1%} {mfu:6.1%}")
    print("# time by category, ms per step (predicted / GPU kernels measured); busy: the GPU's kernel time in all")
    for key, m in meas["rows"].items():
        p = rows.get(key)
        if p is None or not m.get("parts_s"):
            continue
        cells = "  ".join(f"{k} {p['parts_s'].get(k, 0.0) * 1e3:.1f}/{m['parts_s'].get(k, 0.0) * 1e3:.1f}"
                          for k in PARTS)
        print(f"{key:32} {cells}  busy {m['gpu_busy_s'] * 1e3:.1f} of {m['step_s'] * 1e3:.1f}")
    phased = [(key, m["phase_bytes"], rows[key]["phase_bytes"]) for key, m in meas["rows"].items()
              if m.get("phase_bytes") and rows.get(key, {}).get("phase_bytes")]
    if phased:
        print("# memory by phase, GB: the model's branch / the allocator's peak in that phase of one step "
              "(backward: the model's A + Y + max(T, W) at the backward's start)")
        for key, got, want in phased:
            cells = "  ".join(f"{k} {want[k] / 1e9:.2f}/{got[k] / 1e9:.2f} ({want[k] / got[k] - 1:+.1%})"
                              for k in ("loss", "backward", "update") if k in got)
            print(f"{key:32} forward {got['forward'] / 1e9:.2f}  {cells}")
    return {
        "median_time_error": statistics.median(terr) if terr else math.nan,
        "max_time_error": max(terr) if terr else math.nan,
        "median_memory_error": statistics.median(merr) if merr else math.nan,
        "median_profiled_error": statistics.median(perr) if perr else math.nan,
        "rows": len(terr),
    }


PEAK = {"bf16-mixed": 989.4e12, "tf32": 494.7e12}
"""Dense tensor-core peak of the H100 and H200 SXM per precision (both presets' own figures)."""


def line(s: dict) -> str:
    return " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", nargs="?", choices=("predict", "measure", "profile", "compare"))
    ap.add_argument("files", nargs="*", help="compare: the predict and measure JSON files")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", type=Path, help="predict: also with this op profile (what `profile` wrote)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="gpt_tiny, dgx-h100, measured on this machine")
    ap.add_argument("--cases", default="", help="only the cases whose key contains this text (e.g. hf_)")
    args = ap.parse_args()
    cases = [c for c in (QUICK if args.quick else CASES) if args.cases in c.key]
    if args.part == "profile":
        if args.out is None:
            ap.error("profile writes the op profile to --out FILE")
        profile_ops(cases, args.out)
        return
    if args.part == "predict":
        data = predict(cases, profile=args.profile)
    elif args.part == "measure":
        data = measure(cases, args.steps, args.warmup, out=args.out)
    elif args.part == "compare":
        if len(args.files) != 2:
            ap.error("compare takes two files: the predictions and the measurements")
        print(line(compare(*(json.loads(Path(f).read_text()) for f in args.files))))
        return
    else:
        if not args.quick:
            ap.error("name a part (predict, measure, profile, compare), or --quick for all but profile on gpt_tiny")
        pred = predict(cases, PRESETS[:1])
        meas = measure(cases, steps=3, warmup=1)
        print(line(compare(pred, meas)))
        return
    text = json.dumps(data, indent=1)
    if args.out is not None:
        args.out.write_text(text)
        print(f"written to {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()

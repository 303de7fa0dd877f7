"""Hugging Face's GPT-2 against the zoo's hand-written one ([v2 2/6]): the same
architecture (12 layers, 768 wide, 12 heads, vocabulary 50,257, 1,024 positions, tied
embeddings) built by ``transformers`` from its default config and trained on its own
loss (``labels``), and the zoo's ``gpt2_small``, planned for the same cluster, batch and
precision (``auto``: bf16 mixed on H100s).

The code differs, not the shape. Hugging Face's GPT-2 runs its GELU as eight
elementwise ops (eager ``gelu_new``), computes its loss on logits upcast to fp32 (the
zoo model returns logits and is costed without a loss), and flattens the batch into
rows before each ``Conv1D`` (an ``addmm``). Both models are
traced, costed by the same roofline on the same preset, and searched the same way.
Nothing is fitted. A plan that costs the Hugging Face model far more than its extra
work explains points at a tracer or cost-model gap. Before this benchmark existed,
views were charged as copies, ``addmm`` was opaque and flattened rows were not split by
data parallelism: the Hugging Face model was predicted at 487.7 ms, 3.2x the figure below.

    python benchmarks/hf_models.py [--devices 16] [--cluster dgx-h100] [--max-iters 0]
    python benchmarks/hf_models.py --quick      # 2 layers, 128 wide, batch 8 x 64, 2 `cpu` devices

And Hugging Face's Llama (16 layers, 2,048 wide, vocabulary 32,000, batch 32 x 1,024;
``--quick``: 2 layers, 128 wide), which only ``torch.export`` traces, planned on 8
devices as data parallelism (DDP) and sharded (``kinds=["fsdp"]``): its RMSNorms begin
with a cast the export leaves as ``aten.to.dtype``. While that was opaque, every sharded
plan ran the norms on the whole batch on every device.

Last line: ``hf_ms=`` and ``zoo_ms=`` (predicted per iteration), ``ratio=`` (HF over
zoo), both plans' kinds and model FLOP/s utilisations, ``extra_flops=`` (HF's FLOPs
per iteration over the zoo model's: its loss, negligible next to the matmuls), and the
Llama's ``llama_ddp_ms=``, ``llama_fsdp_ms=`` with its sharding, their ratio
``llama_fsdp_over_ddp=`` and its FSDP units (``llama_fsdp_units=``); and the Llama
fine-tuned, its embedding and first three quarters of its layers frozen, as DDP:
``llama_tune_ms=``, ``llama_tune_over_ddp=`` (over training all of it) and
``llama_tune_gib=`` (its predicted peak per device). Measured
on this host: ``hf_ms=152.828 zoo_ms=67.126 ratio=2.277`` (the Hugging Face model's
elementwise GELU about 56 ms and its fp32 loss about 30 ms of its 140 ms of op time per
device).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def hf_gpt2(layers: int, width: int, heads: int, vocab: int, positions: int, batch: int, seq: int):
    """Hugging Face's GPT-2 on the meta device, given its labels (the model's own loss)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                  n_positions=positions)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (ids, {"labels": ids})


def zoo_gpt2(layers: int, width: int, heads: int, vocab: int, positions: int, batch: int, seq: int):
    from benchmarks.models.gpt import GPTConfig, _build

    cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, block_size=positions,
                    dropout=0.0)
    return _build(cfg, batch, seq, meta=True)


def hf_llama(layers: int, width: int, heads: int, vocab: int, batch: int, seq: int):
    """Hugging Face's Llama on the meta device (grouped keys: a quarter of the heads),
    given its labels. ``torch.export`` traces it (``fx`` cannot follow its code)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 4), max_position_embeddings=seq)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (ids, {"labels": ids})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--max-iters", type=int, default=0, help="MCMC steps per search (default 0: the exact "
                    "and closed-form candidates only, which is where both plans land)")
    ap.add_argument("--quick", action="store_true", help="a 2-layer 128-wide GPT-2 at batch 8 x 64 on 2 cpu devices")
    args = ap.parse_args(argv)

    import flexsearch

    if args.quick:
        shape, devices, cluster = (2, 128, 4, 1024, 64, 8, 64), 2, "cpu"
    else:
        shape, devices, cluster = (12, 768, 12, 50257, 1024, 512, 1024), args.devices, args.cluster
    rows = {}
    for name, build in (("hf", hf_gpt2), ("zoo", zoo_gpt2)):
        t0 = time.perf_counter()
        model, inputs = build(*shape)
        plan = flexsearch.plan(model, inputs, devices=devices, cluster=cluster, max_iters=args.max_iters,
                               calibration=None)
        rows[name] = plan
        print(f"{name:<4} {plan.kind:<14} {plan.predicted.iteration_time_s * 1e3:10.3f} ms  MFU {plan.mfu:6.1%}  "
              f"{plan.model_flops / 1e12:8.2f} TFLOP/iter  precision {plan.precision}  "
              f"({time.perf_counter() - t0:.1f} s)")
    hf, zoo = rows["hf"], rows["zoo"]
    # Hugging Face's Llama (exported), data parallel as DDP runs it and sharded (--kind fsdp)
    llama_shape = (2, 128, 4, 1024, 8, 64) if args.quick else (16, 2048, 16, 32000, 32, 1024)
    llama_devices, llama_cluster = (2, "cpu") if args.quick else (8, args.cluster)
    model, inputs = hf_llama(*llama_shape)
    llama = {k: flexsearch.plan(model, inputs, devices=llama_devices, cluster=llama_cluster, kinds=[k],
                                max_iters=args.max_iters, calibration=None) for k in ("data", "fsdp")}
    # fine-tuning: the embedding and the first three quarters of the layers frozen
    keep = llama_shape[0] - llama_shape[0] // 4
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens.") or any(name.startswith(f"model.layers.{i}.") for i in range(keep)):
            p.requires_grad_(False)
    llama["tune"] = flexsearch.plan(model, inputs, devices=llama_devices, cluster=llama_cluster, kinds=["data"],
                                    max_iters=args.max_iters, calibration=None)
    for k, plan in llama.items():
        print(f"llama {k:<5} {plan.kind}/{plan.shard:<6} {plan.predicted.iteration_time_s * 1e3:10.3f} ms  "
              f"peak {plan.predicted.peak_memory_bytes / 2**30:6.2f} GiB  units {len(plan.fsdp_units)}")
    ddp_s, fsdp_s, tune_s = (llama[k].predicted.iteration_time_s for k in ("data", "fsdp", "tune"))
    print(f"hf_ms={hf.predicted.iteration_time_s * 1e3:.3f} zoo_ms={zoo.predicted.iteration_time_s * 1e3:.3f} "
          f"ratio={hf.predicted.iteration_time_s / zoo.predicted.iteration_time_s:.3f} hf_kind={hf.kind} zoo_kind={zoo.kind} "
          f"hf_mfu={hf.mfu:.3f} zoo_mfu={zoo.mfu:.3f} extra_flops={hf.model_flops / zoo.model_flops:.3f} "
          f"llama_ddp_ms={ddp_s * 1e3:.3f} llama_fsdp_ms={fsdp_s * 1e3:.3f} llama_fsdp_shard={llama['fsdp'].shard} "
          f"llama_fsdp_over_ddp={fsdp_s / ddp_s:.3f} llama_fsdp_units={len(llama['fsdp'].fsdp_units)} "
          f"llama_tune_ms={tune_s * 1e3:.3f} llama_tune_over_ddp={tune_s / ddp_s:.3f} "
          f"llama_tune_gib={llama['tune'].predicted.peak_memory_bytes / 2**30:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

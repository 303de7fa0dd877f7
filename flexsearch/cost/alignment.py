"""GEMM dimensions off tensor cores' 16-byte alignment, which the roofline prices as aligned.

Tensor-core GEMMs load their operands in 16-byte vectors. A row length (the reduced
dimension ``K`` or the output width ``N``; the rows' count ``M`` is free) that is not a
multiple of 16 bytes, 8 elements at bf16/fp16 and 4 at TF32, keeps cuBLAS off its fastest
kernels (NVIDIA, "Matrix Multiplication Background User's Guide", section "Tensor Core
Requirements"; the cuBLAS documentation, "Tensor Core Usage").

The roofline (:mod:`flexsearch.cost.compute`) has one efficiency per op kind and no
alignment term: no cited figure prices the slower kernels. What it costs was measured on
an H100 (``benchmarks/gpu_step.py``; ``benchmarks/README.md``, "One GPU"): GPT-2's LM
head, its vocabulary of 50,257 tokens as ``N``, ran 5.7x slower than the roofline at
bf16 and 2.7x at TF32, and within 10% of it with the vocabulary padded to 50,304, a
step 24% faster (bf16) at batch 8. So the planner names such GEMMs in the plan's notes
(:func:`misaligned_note`) with the padding that fixes them, rather than pricing them.
"""

from __future__ import annotations

from flexsearch.cost.hardware import Cluster
from flexsearch.graph.opgraph import OpGraph, OpNode
from flexsearch.precision import Precision, bf16_tensor_cores

ALIGN_BYTES = 16
"""Tensor cores' operand vector width (the user's guide cited above)."""
PAD_TO = 64
"""The multiple the note proposes: 128 bytes at bf16, the A100-and-later recommendation
of the same guide, and nanoGPT's vocabulary padding (50,257 to 50,304)."""
_BYTES = {"bfloat16": 2, "float16": 2, "tf32": 4}
"""Element bytes of the dtypes tensor cores run GEMMs in."""


def has_tensor_cores(cluster: Cluster) -> bool:
    """GPUs (devices not sharing a host's memory) with bf16 matrix units, by the test
    ``--precision auto`` uses (:func:`flexsearch.precision.bf16_tensor_cores`). A CPU's
    matrix units (AMX) pass that test but are not what was measured."""
    return cluster.spec.intra_node.kind != "shared-memory" and bf16_tensor_cores(cluster.device)


def gemm_rows(graph: OpGraph, node: OpNode) -> tuple[int, int] | None:
    """``(K, N)`` of a Linear or a matrix product: the input's last dim and the
    output's; None for other ops or shapes it cannot read."""
    if node.kind not in ("linear", "matmul") or not node.outputs or not node.inputs:
        return None
    source = graph.by_name.get(node.inputs[0])
    if source is None or not source.outputs:
        return None
    inp, out = source.outputs[0].shape, node.outputs[0].shape
    if not inp or not out:
        return None
    return inp[-1], out[-1]


def misaligned(graph: OpGraph, precision: Precision, cluster: Cluster) -> list[tuple[OpNode, int]]:
    """``(node, dim)`` per GEMM the cluster's devices run on tensor cores at ``precision``
    with a row length ``dim`` (K or N) off :data:`ALIGN_BYTES`; empty without them."""
    if not has_tensor_cores(cluster):
        return []
    out = []
    for node in graph.nodes:
        rows = gemm_rows(graph, node)
        if rows is None:
            continue
        dtype = precision.priced_dtype(node.kind, node.outputs[0].dtype)
        size = _BYTES.get(dtype)
        if size is None:  # fp32 off TF32: CUDA cores, no tensor-core alignment
            continue
        bad = [d for d in rows if (d * size) % ALIGN_BYTES]
        if bad:
            out.append((node, bad[0]))
    return out


def misaligned_note(graph: OpGraph, precision: Precision, cluster: Cluster) -> str | None:
    """One line naming the misaligned GEMMs (up to three) and the padding that aligns
    them; None when there are none."""
    found = misaligned(graph, precision, cluster)
    if not found:
        return None
    shown = ", ".join(f"{node.name} ({dim})" for node, dim in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    dim = found[0][1]
    padded = -(-dim // PAD_TO) * PAD_TO
    return (f"GEMM dimensions off tensor cores' 16-byte alignment, priced as if aligned: {shown}{more}; on an "
            f"H100 such a layer ran 2.7-5.7x slower than priced: pad them to a multiple of {PAD_TO} "
            f"(e.g. {dim} -> {padded})")

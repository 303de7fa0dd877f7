"""Training precision: what dtypes a plan computes, stores and communicates in.

| name | parameters (master) | compute | gradients, optimizer state | gradient reductions |
|---|---|---|---|---|
| ``fp32`` | fp32 | fp32 | fp32 | fp32 |
| ``tf32`` | fp32 | matmuls in TF32 (tensor cores), the rest fp32 | fp32 | fp32 |
| ``bf16-mixed`` | fp32 | ``torch.autocast(bfloat16)``: matmul-class ops in bf16, norms, softmax and losses in fp32 (autocast's op lists) | fp32 | fp32 |
| ``fp16-mixed`` | fp32 | ``torch.autocast(float16)``, loss scaling | fp32 | fp32 |
| ``bf16`` | bf16 (the model cast) | bf16 | bf16 | bf16 |

Mixed precision is torch's (Micikevicius et al. 2018 as ``torch.autocast``): the model
stays fp32 and is its own master copy; autocast casts the weights a lowered op uses to
the low dtype once per forward and autograd keeps that copy for the backward. FSDP2
plans gather their units in the low dtype (``MixedPrecisionPolicy(param_dtype=...)``)
and reduce-scatter gradients in fp32 (``reduce_dtype``); with bf16 parameters the ops
autocast leaves alone compute in bf16 too (an embedding's output, the residual stream
after it), so the tracer measures the graph a second time so
(:attr:`flexsearch.graph.opgraph.OpGraph.low_param_graph`) and FSDP2 plans are
predicted on that (:func:`flexsearch.sim.predict.runtime_graph`).

The tracer runs the model under the precision (:func:`flexsearch.graph.tracer.trace`),
so every node's dtype, FLOPs and bytes are what that precision really computes; the cost
model prices a node at its dtype's peak, and ``tf32`` (which has no dtype of its own)
at the TF32 peak for the matmul-class ops (:data:`MATMUL_KINDS`).

:func:`resolve` picks ``auto``: ``bf16-mixed`` on a device whose bf16 peak is at least
twice its fp32 peak (a GPU's tensor cores, a CPU's bf16 matrix instructions), else ``fp32``.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMES = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16")
MATMUL_KINDS = frozenset({"linear", "matmul", "conv", "attention", "rnn"})
"""Op kinds tensor cores run (autocast's lower-precision list, and TF32's reach)."""
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Precision:
    """One training precision (module docstring)."""

    name: str
    autocast: str | None = None
    """``torch.autocast`` dtype (mixed precision), else None."""
    cast: str | None = None
    """The dtype the model's floating-point parameters are cast to (``bf16``), else None."""
    tf32: bool = False
    """Matmul-class ops on TF32 tensor cores."""

    @property
    def low(self) -> str:
        """The compute dtype of matmul-class ops."""
        return self.autocast or self.cast or "float32"

    @property
    def mixed(self) -> bool:
        return self.autocast is not None

    @property
    def gather_dtype(self) -> str:
        """The dtype FSDP all-gathers parameters in (``param_dtype``)."""
        return self.low

    def priced_dtype(self, kind: str, dtype: str) -> str:
        """The dtype an op of ``kind`` computing in ``dtype`` is priced and profiled at:
        ``tf32`` for an fp32 matmul-class op under TF32, else ``dtype``."""
        return "tf32" if self.tf32 and kind in MATMUL_KINDS and dtype == "float32" else dtype

    def gather_factor(self, param_dtype: str = "float32") -> float:
        """Bytes gathered per stored parameter byte (FSDP2 ``param_dtype``)."""
        return _BYTES.get(self.gather_dtype, 4) / _BYTES.get(param_dtype, 4)


_PRECISIONS = {
    "fp32": Precision("fp32"),
    "tf32": Precision("tf32", tf32=True),
    "bf16-mixed": Precision("bf16-mixed", autocast="bfloat16"),
    "fp16-mixed": Precision("fp16-mixed", autocast="float16"),
    "bf16": Precision("bf16", cast="bfloat16"),
}
FP32 = _PRECISIONS["fp32"]
TF32 = _PRECISIONS["tf32"]


def precision(name: str) -> Precision:
    """The precision named ``name`` (ValueError naming the choices otherwise)."""
    try:
        return _PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; use auto or one of {', '.join(NAMES)}") from None


def bf16_tensor_cores(device) -> bool:
    """Does ``device`` (a :class:`~flexsearch.cost.hardware.DeviceSpec`) run bf16 on
    matrix units: a bf16 peak at least twice its fp32 peak?"""
    return device.peak("bfloat16") >= 2 * device.peak("float32")


CPU_BF16_UNITS = "AVX512-BF16 or AMX matrix instructions"
"""What runs a CPU's bf16 matmuls fast (oneDNN's bf16 support), as the notes name it."""


def resolve(name: str, device, *, cpu: bool = False) -> tuple[Precision, str]:
    """``(precision, why)`` for ``name`` on ``device`` (a
    :class:`~flexsearch.cost.hardware.DeviceSpec`): ``auto`` is ``bf16-mixed`` on a device
    with fast bf16 matrix units (bf16 peak >= 2x fp32 peak), else ``fp32``. ``why`` names
    the units a GPU's tensor cores, or with ``cpu`` (the device is a CPU process) the
    CPU's bf16 matrix instructions (:data:`CPU_BF16_UNITS`)."""
    if name != "auto":
        return precision(name), "chosen"
    bf16, fp32 = device.peak("bfloat16"), device.peak("float32")
    ratio = bf16 / fp32
    units = CPU_BF16_UNITS if cpu else "bf16 tensor cores"
    tflops = f"{bf16 / 1e12:.0f}" if bf16 >= 10e12 else f"{bf16 / 1e12:.2g}"
    if bf16_tensor_cores(device):
        return _PRECISIONS["bf16-mixed"], (f"auto: {device.name} runs bf16 at {tflops} TFLOP/s, "
                                           f"{ratio:.0f}x its fp32 peak ({units})")
    return FP32, (f"auto: {device.name} has no {units} (bf16 peak {ratio:.1f}x its fp32 peak); "
                  "pass --precision bf16-mixed to plan for it anyway")


def host_runs_bf16() -> bool:
    """Does this machine's CPU run bf16 natively (oneDNN's check: AVX512-BF16 or AMX)?
    Without it, CPU autocast has no low-precision LSTM and bf16 matmuls are emulated."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False

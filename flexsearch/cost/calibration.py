"""Calibration of the simulator against real runs: the file format and where it is read.

The roofline, the op profiles and the alpha-beta links price the work an iteration
does; running emitted plans shows what they leave out. ``flexsearch calibrate``
(:mod:`flexsearch.calibrate`) measures it on this machine into
:func:`user_calibration_path`; the built-in ``costmodels/calibration.json`` holds the
project's CI host's. Per device (keyed by the device spec's ``name``), each term below
is a number with the command that measured it, like every hardware number. A device
without an entry is simulated uncalibrated, and so is every prediction whose caller
did not load a calibration (:func:`load_calibration`).

- ``communication_blocks_compute``: communication runs on the devices' own cores
  (gloo on a CPU with one core per rank: copies and reductions compete with the compute
  thread), so a transfer or collective also occupies the devices it joins instead of
  overlapping with their compute.
- ``optimizer``: the update of one device per optimizer, ``per_tensor_s x parameter
  tensors + per_byte_s x parameter bytes`` (a single-tensor loop of several kernels per
  parameter: more traffic than the ideal roofline's and a fixed cost per tensor);
  ``sharded_update_per_tensor_s`` more per tensor when the parameters are DTensors.
- ``op_overhead``: added to every op task on top of its profiled (or roofline) time:
  ``plain`` for modules run by autograd on local tensors (DDP, pipeline stages),
  ``sharded`` for ops run on DTensors (SOAP plans, tensor-parallel stages): sharding
  propagation, redistribution and the interpreter per op.
- ``collectives``: measured cost of each collective on this backend, fitted at ``n0``
  ranks as ``t = a + b M``; on ``n`` ranks ``(n - 1) / (n0 - 1) a + (n - 1) n0 /
  (n (n0 - 1)) b M`` (the ring's latency steps and per-rank bytes). gloo's collectives
  on a CPU copy and reduce on the cores: all-gather and reduce-scatter cost several
  times what the point-to-point link's alpha-beta predicts, all-reduce about that.
- ``concurrency``: factors on every op's compute time (forward, backward): the
  profiler measures ops in one process, but every device of this host computes at
  once in training, sharing the cores' clocks, caches and memory bandwidth.
- ``profiled_call``: subtracted from every *measured* op time (never below 0): the
  profiler times each op alone through ``functional_call`` and ``autograd.grad``, a
  fixed cost per call that the same op inside a model does not pay.
- ``pipeline_action_s``: per forward or backward action of a pipeline schedule (the
  schedule's bookkeeping, microbatch split, send/receive posting).
- ``step_s``: fixed cost of one iteration per execution mode (``ddp``, ``zero1``, ``fsdp``,
  ``sharded``, ``pipeline``, ``decentralized``): the loss all-reduce, zero_grad, hooks,
  posting and waiting for the gossip messages. A mode without an entry costs nothing.
- ``runtime_bytes``: memory one iteration allocates per device whatever the model, per
  execution mode (communication buffers, the autograd engine, caches); none for a mode
  without an entry.
- ``fsdp_collective_s``: per all-gather or reduce-scatter of an FSDP unit (its hooks,
  the flat buffer's bookkeeping).
- ``zero1_per_tensor_s``: per parameter tensor of a ZeRO-1 step
  (``ZeroRedundancyOptimizer``: its bookkeeping and a broadcast per tensor), with
  ``step_s["zero1"]`` its fixed cost per step beyond DDP's.
- ``ddp_bucket_bytes`` / ``ddp_first_bucket_bytes``: DDP all-reduces gradients in
  buckets of this size (in the order they become ready; the first bucket smaller) and
  keeps a flat copy of the gradients (its buckets) for the whole run: each gradient is
  copied into its bucket and back (4 bytes moved per gradient byte, at the device's
  memory bandwidth), and its autograd hook costs ``ddp_per_tensor_s``.
- ``optimizer_working_tensors``: the update's temporaries, in multiples of the device's
  largest parameter tensor (alive together with the gradients).

Each measured term is the median of the calibration's ``repeats`` with its ``spread``
(:class:`Term`); ``step_spread`` is how far a measured step wanders from run to run, so
predictions closer than that are :func:`within_noise`. ``host`` records the machine:
:func:`host_warning` says in one line when predictions for this host's devices use no
calibration or another host's.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import NonNegativeFloat, ValidationError

from flexsearch.cost.hardware import (
    COSTMODELS_DIR,
    Frozen,
    NonNegative,
    Positive,
    Source,
    read_json,
    user_dir,
    validation_message,
)
from flexsearch.errors import ClusterSpecError

CALIBRATION_FILE = COSTMODELS_DIR / "calibration.json"

Mode = Literal["plain", "ddp", "zero1", "fsdp", "sharded", "pipeline", "decentralized"]
"""How the emitter runs a plan; ``plain``: one process running the model as it is (no
per-step or runtime terms)."""


class Flag(Frozen):
    value: bool
    source: Source


class Term(NonNegative):
    """A measured term >= 0: the median of the calibration's repeats that were kept."""

    spread: NonNegativeFloat | None = None
    """Half the range of the kept repeats, in the term's unit (None: measured once)."""


class PositiveTerm(Positive):
    """A measured term > 0 (:class:`Term`)."""

    spread: NonNegativeFloat | None = None


class UpdateCost(Frozen):
    """One device's optimizer update: ``per_tensor_s x tensors + per_byte_s x bytes``."""

    per_tensor_s: Term
    per_byte_s: Term


class CollectiveFit(Frozen):
    """``t = latency_s + per_byte_s x M`` on ``ranks`` ranks (module docstring)."""

    ranks: int
    latency_s: Term
    per_byte_s: Term

    def time_s(self, n: int, nbytes: float) -> float:
        if n < 2 or nbytes <= 0:
            return 0.0
        n0 = self.ranks
        return (n - 1) / (n0 - 1) * self.latency_s.value + (n - 1) * n0 / (n * (n0 - 1)) * self.per_byte_s.value * nbytes


class OpOverhead(Frozen):
    forward_s: Term
    backward_s: Term


class HostRecord(Frozen):
    """The machine a calibration was measured on."""

    cpu: str
    cores: int
    torch: str
    date: str

    def same_machine(self, host: dict) -> bool:
        """Is ``host`` (:func:`flexsearch.cost.profiler.host_info`) this kind of machine:
        the same CPU model, core count and torch?"""
        return (self.cpu, self.cores, self.torch) == (host.get("cpu"), host.get("cores"), host.get("torch"))


class DeviceCalibration(Frozen):
    """The calibration terms of one device (module docstring)."""

    host: HostRecord | None = None
    """Where it was measured (None: not recorded)."""
    communication_blocks_compute: Flag
    optimizer: dict[Literal["adam", "momentum", "sgd"], UpdateCost]
    sharded_update_per_tensor_s: Term
    op_overhead: dict[Literal["plain", "sharded"], OpOverhead]
    profiled_call: OpOverhead
    concurrency: dict[Literal["forward", "backward"], PositiveTerm]
    collectives: dict[str, CollectiveFit] = {}
    pipeline_action_s: Term
    step_s: dict[Mode, Term]
    ddp_bucket_bytes: PositiveTerm
    ddp_first_bucket_bytes: PositiveTerm
    ddp_per_tensor_s: Term
    optimizer_working_tensors: Term
    runtime_bytes: dict[Mode, Term]
    fsdp_collective_s: Term
    zero1_per_tensor_s: Term | None = None
    """ZeRO-1 (``ZeroRedundancyOptimizer``): per parameter tensor, the Python step's
    bookkeeping and one broadcast posted and waited for; with ``step_s["zero1"]`` per
    step, on top of DDP's (None: not measured, costs nothing)."""
    move_s: Term | None = None
    """A cross-block move of the SOAP emitter (``_Move`` of :mod:`flexsearch.emit.sharded`:
    a tensor from one device block to another), each way (the forward's, and its
    gradient's in the backward): the Python, DTensor and allocation work beyond its
    collectives (None: not measured, costs nothing)."""
    repeats: int = 1
    """How many times each term was measured (its value: the median of the repeats kept)."""
    step_spread: Term | None = None
    """Run-to-run noise of a measured step, a fraction: over the probes' runs in every
    execution mode, the half ranges of their step times across the repeats summed over
    their medians summed (:func:`flexsearch.calibrate.run.step_spread`). Two
    predictions closer than this cannot be told apart by measuring them (None:
    measured once)."""

    def update_s(self, optimizer: str, tensors: float, nbytes: float, sharded: bool = False) -> float:
        """Seconds of one device's optimizer update over ``tensors`` parameter tensors of
        ``nbytes`` bytes in all."""
        u = self.optimizer[optimizer]  # type: ignore[index]
        per_tensor = u.per_tensor_s.value + (self.sharded_update_per_tensor_s.value if sharded else 0.0)
        return per_tensor * tensors + u.per_byte_s.value * nbytes

    def step(self, mode: Mode) -> float:
        """Seconds of ``mode``'s fixed cost per iteration (0 when not measured)."""
        v = self.step_s.get(mode)
        return v.value if v is not None else 0.0

    def runtime(self, mode: Mode) -> float:
        """Bytes ``mode``'s runtime allocates per device (0 when not measured)."""
        v = self.runtime_bytes.get(mode)
        return v.value if v is not None else 0.0

    def move(self) -> float:
        """Seconds of :attr:`move_s` (0 when not measured)."""
        return self.move_s.value if self.move_s is not None else 0.0

    def op_s(self, mode: Literal["plain", "sharded"]) -> tuple[float, float]:
        o = self.op_overhead[mode]
        return o.forward_s.value, o.backward_s.value


def within_noise(a_s: float, b_s: float, spread: float | None) -> bool:
    """Do predictions ``a_s`` and ``b_s`` differ by less than ``spread`` (a fraction:
    a calibration's :attr:`DeviceCalibration.step_spread`) of the faster one? False
    without a spread."""
    return bool(spread) and abs(a_s - b_s) < spread * min(a_s, b_s)


def host_warning(device_name: str, cal: DeviceCalibration | None, host: dict) -> str | None:
    """One line saying why predictions for ``device_name`` (a device of this machine,
    what ``flexsearch calibrate`` measures) are not calibrated for ``host``
    (:func:`flexsearch.cost.profiler.host_info`): no calibration, an unrecorded host,
    or another kind of machine. None when the calibration is this host's."""
    here = f"{host.get('cpu')}, {host.get('cores')} cores, torch {host.get('torch')}"
    fix = "run `flexsearch calibrate` (a few minutes) to measure this one"
    if cal is None:
        return (f"no calibration of {device_name} on disk: predictions for this host ({here}) leave out its run-time "
                f"overheads; {fix}")
    if cal.host is None:
        return f"the calibration of {device_name} on disk does not say which host it was measured on; {fix}"
    if not cal.host.same_machine(host):
        h = cal.host
        return (f"the calibration of {device_name} on disk was measured on another host ({h.cpu}, {h.cores} cores, "
                f"torch {h.torch}, {h.date}), not this one ({here}); predictions may be off by tens of percent; "
                f"{fix}")
    return None


class CalibrationFile(Frozen):
    description: str = ""
    command: str = ""
    devices: dict[str, DeviceCalibration] = {}


@lru_cache(maxsize=8)
def _load_cached(path: str, _stamp: tuple[int, int]) -> CalibrationFile:
    raw = read_json(Path(path), "calibration file")
    try:
        return CalibrationFile.model_validate(raw)
    except ValidationError as e:
        raise ClusterSpecError(validation_message(f"calibration file {path}", e)) from None


def user_calibration_path() -> Path:
    """This machine's calibration file, what ``flexsearch calibrate`` writes by default
    (:func:`~flexsearch.cost.hardware.user_dir`)."""
    return user_dir() / "calibration.json"


def load_calibration_file(path: str | os.PathLike[str] | None = None) -> CalibrationFile:
    """Read and validate a calibration file (default: the built-in one); cached until
    the file changes. A missing default file is an empty calibration."""
    p = Path(path if path is not None else CALIBRATION_FILE).resolve()
    try:
        st = p.stat()
    except OSError:
        if path is None:
            return CalibrationFile()
        read_json(p, "calibration file")
        raise
    return _load_cached(str(p), (st.st_mtime_ns, st.st_size))


def load_calibration(device_name: str, path: str | os.PathLike[str] | None = None) -> DeviceCalibration | None:
    """The calibration of the device named ``device_name``, read from ``path``, else
    from this machine's file (:func:`user_calibration_path`) when it has the device,
    else from the built-in file; None when none has it. Nothing else in flexsearch
    reads a calibration: a caller that wants one asks for it here."""
    if path is not None:
        return load_calibration_file(path).devices.get(device_name)
    mine = user_calibration_path()
    if mine.is_file():
        hit = load_calibration_file(mine).devices.get(device_name)
        if hit is not None:
            return hit
    return load_calibration_file().devices.get(device_name)


__all__ = ["CALIBRATION_FILE", "CalibrationFile", "DeviceCalibration", "PositiveTerm", "Term", "host_warning",
           "load_calibration", "load_calibration_file", "user_calibration_path", "within_noise"]

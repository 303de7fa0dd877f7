"""Measure this machine for the ``cpu`` preset (``flexsearch profile --comm``).

The ``cpu`` preset models torch.distributed **gloo** processes on one host, one device
per process. This module measures what such processes achieve
(:mod:`flexsearch.cost.cpu_preset` writes it into this machine's ``cpu`` preset,
:func:`flexsearch.cost.hardware.user_dir` ``/clusters/cpu.json``, which shadows the
built-in one):

- :func:`measure_gloo`: spawns ``world_size`` gloo processes on 127.0.0.1 and times, per
  message size, a point-to-point ping-pong between ranks 0 and 1 (one-way time = round
  trip / 2) and a float32 ``all_reduce`` over all ranks (median of repeats, the slowest
  rank per repeat, a barrier before each timed repeat);
- :func:`fit_alpha_beta`: a least-squares fit of ``t = alpha + n / B`` to (size, time);
  the p2p fit gives the intra-node link's latency ``alpha`` and bandwidth ``B``;
- :func:`measure_compute`: the achieved FLOP/s of a large square matmul (float32, and
  bfloat16 where it runs) and the achieved memory bandwidth of a large ``copy_`` in one
  process with a given number of threads;
- :class:`MeasurementFile`: the raw measurements, kept next to the preset written.

The "peak" numbers written are *achieved* rates (a large GEMM, a large copy), the best
a process of this kind reaches, not the vector units' theoretical peak.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flexsearch.cost.hardware import (
    PRESETS_DIR,
    user_dir,
)
from flexsearch.errors import ProfileError

BUILTIN_CPU_PRESET = PRESETS_DIR / "cpu.json"
"""The built-in ``cpu`` preset (measured on the project's CI kind of host)."""


def cpu_preset_path() -> Path:
    """This machine's ``cpu`` preset, what ``profile --comm`` writes by default."""
    return user_dir() / "clusters" / "cpu.json"


def default_measurements_path() -> Path:
    """Where ``profile --comm`` keeps its raw measurements by default."""
    return user_dir() / "measurements" / "cpu-gloo.json"

COMMAND = "flexsearch profile --comm"

DEFAULT_SIZES: tuple[int, ...] = tuple(4**k for k in range(1, 14))
"""Message sizes in bytes: 4 B, 16 B, ..., 16 MiB, 64 MiB (powers of 4)."""

_MIN_LATENCY_S = 1e-9
"""The floor :func:`fit_alpha_beta` clamps a non-positive intercept to (1 ns)."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


# --------------------------------------------------------------------------- host


class HostInfo(_Model):
    """What the measurement ran on."""

    cpu_model: str
    logical_cores: Annotated[int, Field(ge=1)]
    platform: str
    torch_version: str


def cpu_model() -> str:
    """The CPU's ``model name`` from /proc/cpuinfo (else :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_info() -> HostInfo:
    import torch

    return HostInfo(
        cpu_model=cpu_model(),
        logical_cores=os.cpu_count() or 1,
        platform=platform.platform(),
        torch_version=torch.__version__,
    )


def _today() -> str:
    return _dt.date.today().isoformat()


# --------------------------------------------------------------------------- models


class GlooMeasurement(_Model):
    """Raw gloo timings on one host: per message size (bytes, float32 tensors of
    ``size / 4`` elements) the p2p one-way time (ping-pong round trip / 2 between ranks 0
    and 1) and the all-reduce time (slowest rank), each the median of ``repeats[i]``
    timed repeats, in seconds."""

    date: str
    host: HostInfo
    backend: Literal["gloo"] = "gloo"
    world_size: Annotated[int, Field(ge=2)]
    threads_per_rank: Annotated[int, Field(ge=1)]
    sizes: tuple[Annotated[int, Field(ge=4)], ...]
    repeats: tuple[Annotated[int, Field(ge=1)], ...]
    p2p_one_way_s: tuple[PositiveFloat, ...]
    all_reduce_s: tuple[PositiveFloat, ...]

    @model_validator(mode="after")
    def _same_lengths(self) -> GlooMeasurement:
        n = len(self.sizes)
        if n == 0:
            raise ValueError("a gloo measurement needs at least one message size")
        if not (len(self.repeats) == len(self.p2p_one_way_s) == len(self.all_reduce_s) == n):
            raise ValueError(
                "sizes, repeats, p2p_one_way_s and all_reduce_s must have the same length"
            )
        return self

    def fit_p2p(self) -> tuple[float, float]:
        """``(latency_s, bandwidth_Bps)`` of ``t = alpha + n / B`` fitted to the p2p times."""
        return fit_alpha_beta(self.sizes, self.p2p_one_way_s)


class ComputeMeasurement(_Model):
    """Achieved rates of one process with ``threads`` threads: FLOP/s of an ``n x n``
    matmul (``2 n^3`` FLOP, median of ``repeats``), bfloat16 where it ran, and the
    memory bandwidth of a ``copy_`` of ``copy_bytes`` (bytes read + written / time)."""

    date: str
    host: HostInfo
    threads: Annotated[int, Field(ge=1)]
    repeats: Annotated[int, Field(ge=1)]
    matmul_n: Annotated[int, Field(ge=1)]
    matmul_float32_flops: PositiveFloat
    matmul_bfloat16_n: Annotated[int, Field(ge=1)] | None = None
    matmul_bfloat16_flops: PositiveFloat | None = None
    copy_bytes: Annotated[int, Field(ge=1)]
    memory_bandwidth_Bps: PositiveFloat


class AlphaBetaFit(_Model):
    """``t = latency_s + n / bandwidth_Bps`` fitted to the p2p one-way times."""

    formula: Literal["t = alpha + n / B"] = "t = alpha + n / B"
    latency_s: PositiveFloat
    bandwidth_Bps: PositiveFloat
    sizes_used: Annotated[int, Field(ge=2)]


class MeasurementFile(_Model):
    """``measurements/cpu-gloo.json``: what ``profile --comm`` measured."""

    version: Literal[1] = 1
    command: str = COMMAND
    preset: str
    gloo: GlooMeasurement
    p2p_fit: AlphaBetaFit
    compute: ComputeMeasurement | None = None


def load_measurements(path: str | os.PathLike[str] | None = None) -> MeasurementFile:
    """Read a measurement file (default :func:`default_measurements_path`); a missing
    or damaged file is a one-line ProfileError."""
    p = Path(path) if path is not None else default_measurements_path()
    try:
        return MeasurementFile.model_validate_json(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"measurement file {p} not found; run `{COMMAND}` first") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ProfileError(
            f"measurement file {p} is damaged ({where}: {first['msg']}); run `{COMMAND}` again"
        ) from None


# --------------------------------------------------------------------------- fit


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = alpha + n / B`` (n bytes, t seconds) by least squares; return
    ``(alpha, B)`` = (latency in s, bandwidth in bytes/s).

    The residuals are relative, ``(alpha + beta * n - t) / t`` with ``beta = 1 / B``
    (``numpy.linalg.lstsq`` on the rows divided by ``t``): sizes spanning bytes to
    megabytes then weigh alike, so the small messages fix ``alpha`` and the large ones
    ``B``. Data on an exact line are recovered exactly under any weighting.

    Clamping: a negative intercept is refitted with ``alpha = 0`` (``t = beta * n``)
    and reported as 1 ns, so both results are positive. A slope ``beta <= 0`` (times not
    growing with size) leaves no bandwidth to fit and raises ValueError."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if n.ndim != 1 or n.shape != t.shape:
        raise ValueError("sizes and times must be 1-D sequences of the same length")
    if len(n) < 2 or len(np.unique(n)) < 2:
        raise ValueError("fitting t = alpha + n / B needs at least two distinct sizes")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n >= 0)):
        raise ValueError("sizes must be finite and >= 0, times finite and > 0")
    w = 1.0 / t
    a = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    b = t * w
    (alpha, beta), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha <= 0:
        (beta,), *_ = np.linalg.lstsq((n * w)[:, None], b, rcond=None)
        alpha = _MIN_LATENCY_S
    if not beta > 0:
        raise ValueError(
            "message times do not grow with size, so no bandwidth can be fitted; measure larger messages"
        )
    return float(max(alpha, _MIN_LATENCY_S)), float(1.0 / beta)


# --------------------------------------------------------------------------- gloo


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _repeats_for(nbytes: int, repeats: int) -> int:
    """Fewer repeats for big messages (``repeats`` up to 1 MiB, then proportionally
    fewer, never under ``min(repeats, 7)``), to bound the run time."""
    scaled = int(repeats * (1 << 20) / max(nbytes, 1))
    return max(min(repeats, 7), min(repeats, scaled))


def _gloo_worker(
    rank: int,
    world_size: int,
    port: int,
    sizes: tuple[int, ...],
    repeats: tuple[int, ...],
    warmup: int,
    threads: int,
    timeout_s: float,
    out_path: str,
) -> None:
    """One rank of :func:`measure_gloo` (run in a spawned process)."""
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_dt.timedelta(seconds=timeout_s),
    )
    try:
        bufs = [torch.ones(nbytes // 4, dtype=torch.float32) for nbytes in sizes]
        p2p: list[list[float]] = [[] for _ in sizes]
        mine: list[list[float]] = [[] for _ in sizes]
        # Rounds over all sizes (a warm-up round first), not all repeats of one size in
        # a row: a burst of load from elsewhere then spoils one sample of many sizes
        # instead of every sample of one size.
        for r in range(-warmup, max(repeats)):
            for k, buf in enumerate(bufs):
                if r >= repeats[k]:
                    continue
                # point-to-point ping-pong between ranks 0 and 1 (others join barriers)
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, dst=1)
                    dist.recv(buf, src=1)
                elif rank == 1:
                    dist.recv(buf, src=0)
                    dist.send(buf, dst=0)
                dt = time.perf_counter() - t0
                if r >= 0:
                    p2p[k].append(dt / 2)
                # all-reduce over every rank
                buf.fill_(1.0)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                dt = time.perf_counter() - t0
                if r >= 0:
                    mine[k].append(dt)
                if abs(float(buf[0]) - world_size) > 1e-3:
                    raise RuntimeError(f"all_reduce gave {float(buf[0])}, expected {world_size}")
        allreduce = []
        for times in mine:  # per repeat, the slowest rank's time
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            allreduce.append(statistics.median(slowest.tolist()))
        dist.barrier()
        if rank == 0:
            result = {"p2p": [statistics.median(t) for t in p2p], "all_reduce": allreduce}
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_gloo(
    world_size: int = 2,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 30,
    threads_per_rank: int = 1,
    timeout_s: float = 120.0,
    warmup: int = 1,
) -> GlooMeasurement:
    """Time gloo p2p and all-reduce on this host; see :class:`GlooMeasurement`.

    Spawns ``world_size`` processes (``torch.multiprocessing``, start method "spawn")
    that join a gloo process group on 127.0.0.1 (a free port found by binding port 0),
    each with ``torch.set_num_threads(threads_per_rank)``. ``sizes`` are bytes,
    multiples of 4 (float32 elements). The sizes are timed in rounds (one p2p and one
    all-reduce of every size per round), ``warmup`` untimed rounds then up to
    ``repeats`` timed ones (sizes above 1 MiB take part in fewer rounds, at least
    ``min(repeats, 7)``); each time is the median over its rounds.

    ``timeout_s`` bounds both the process group's collective timeout and the whole run:
    a rank that fails or hangs ends the run with a ProfileError instead of a hang.
    The default run takes ~5-10 s on a 2-core machine."""
    import torch.multiprocessing as mp

    sizes_t = tuple(int(s) for s in sizes)
    if world_size < 2:
        raise ValueError("measure_gloo needs world_size >= 2 (p2p runs between ranks 0 and 1)")
    if not sizes_t or any(s < 4 or s % 4 for s in sizes_t):
        raise ValueError(
            f"sizes must be a non-empty list of byte counts >= 4 and multiples of 4 (got {sizes_t})"
        )
    if repeats < 1 or threads_per_rank < 1 or warmup < 0 or timeout_s <= 0:
        raise ValueError("repeats and threads_per_rank must be >= 1, warmup >= 0, timeout_s > 0")
    reps = tuple(_repeats_for(s, repeats) for s in sizes_t)
    info = host_info()

    last_error = ""
    for _attempt in range(3):  # the free port can be taken between finding and binding it
        with tempfile.TemporaryDirectory(prefix="flexsearch-gloo-") as tmp:
            out = Path(tmp) / "result.json"
            args = (
                world_size,
                _free_port(),
                sizes_t,
                reps,
                warmup,
                threads_per_rank,
                float(timeout_s),
                str(out),
            )
            ctx = mp.start_processes(
                _gloo_worker, args=args, nprocs=world_size, join=False, start_method="spawn"
            )
            deadline = time.monotonic() + timeout_s + 30.0  # + process start-up
            try:
                while not ctx.join(timeout=0.5):
                    if time.monotonic() > deadline:
                        raise ProfileError(
                            f"gloo measurement did not finish within {timeout_s:g} s; "
                            "check that the machine is idle or raise timeout_s"
                        )
            except mp.ProcessRaisedException as e:
                last_error = " ".join(str(e).split())[-400:]
                if "address already in use" in last_error.lower():
                    continue
                raise ProfileError(f"gloo measurement failed: {last_error}") from None
            except mp.ProcessExitedException as e:
                raise ProfileError(f"a gloo rank exited unexpectedly ({e}); run again") from None
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(timeout=5)
            raw = json.loads(out.read_text())
            return GlooMeasurement(
                date=_today(),
                host=info,
                world_size=world_size,
                threads_per_rank=threads_per_rank,
                sizes=sizes_t,
                repeats=reps,
                p2p_one_way_s=tuple(raw["p2p"]),
                all_reduce_s=tuple(raw["all_reduce"]),
            )
    raise ProfileError(f"gloo measurement failed: {last_error}")


# --------------------------------------------------------------------------- compute


def _median_time(
    fn: Callable[..., Any], args: tuple[Any, ...], repeats: int, warmup: int = 1
) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_compute(
    threads: int = 1,
    matmul_n: int = 2048,
    copy_bytes: int = 256 << 20,
    repeats: int = 5,
    bfloat16: bool = True,
) -> ComputeMeasurement:
    """Achieved float32 (and bfloat16) matmul FLOP/s and ``copy_`` bandwidth of this
    process with ``torch.set_num_threads(threads)`` (restored afterwards).

    Matmul: ``n x n @ n x n``, ``2 n^3`` FLOP, median of ``repeats`` after a warm-up.
    Copy: ``dst.copy_(src)`` of ``copy_bytes`` float32 bytes, ``2 * copy_bytes`` moved
    (read + write) per copy. bfloat16 is skipped (None) if it fails; if one bfloat16
    matmul takes over 2 s it is re-measured at ``n / 2``."""
    import torch

    if threads < 1 or matmul_n < 1 or copy_bytes < 4 or repeats < 1:
        raise ValueError("threads, matmul_n and repeats must be >= 1 and copy_bytes >= 4")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            g = torch.Generator().manual_seed(0)
            a = torch.randn(matmul_n, matmul_n, generator=g)
            b = torch.randn(matmul_n, matmul_n, generator=g)
            t32 = _median_time(torch.mm, (a, b), repeats)
            f32 = 2.0 * matmul_n**3 / t32

            bf_n: int | None = None
            fbf: float | None = None
            if bfloat16:
                try:
                    bf_n = matmul_n
                    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
                    t0 = time.perf_counter()
                    torch.mm(ab, bb)
                    if time.perf_counter() - t0 > 2.0:
                        bf_n = max(1, matmul_n // 2)
                        ab, bb = ab[:bf_n, :bf_n].contiguous(), bb[:bf_n, :bf_n].contiguous()
                    tbf = _median_time(torch.mm, (ab, bb), repeats)
                    fbf = 2.0 * bf_n**3 / tbf
                except (RuntimeError, NotImplementedError):
                    bf_n, fbf = None, None
            del a, b

            numel = copy_bytes // 4
            src = torch.ones(numel, dtype=torch.float32)
            dst = torch.empty_like(src)
            tcopy = _median_time(dst.copy_, (src,), repeats)
            bw = 2.0 * numel * 4 / tcopy
            del src, dst
    finally:
        torch.set_num_threads(before)
    return ComputeMeasurement(
        date=_today(),
        host=host_info(),
        threads=threads,
        repeats=repeats,
        matmul_n=matmul_n,
        matmul_float32_flops=f32,
        matmul_bfloat16_n=bf_n,
        matmul_bfloat16_flops=fbf,
        copy_bytes=numel * 4,
        memory_bandwidth_Bps=bw,
    )


__all__ = [
    "AlphaBetaFit",
    "ComputeMeasurement",
    "GlooMeasurement",
    "HostInfo",
    "MeasurementFile",
    "fit_alpha_beta",
    "load_measurements",
    "measure_compute",
    "measure_gloo",
]

"""Write what :mod:`flexsearch.cost.machine` measured into a ``cpu`` preset
(``flexsearch profile --comm``).

:func:`write_cpu_preset` replaces the preset's intra-node bandwidth and latency and the
device's float32 (bfloat16) peak and memory bandwidth by the measured values, each with
a source saying how and when it was measured, and stores the raw measurements next to
it; :func:`profile_machine` measures and writes, returning a small summary for the CLI.
By default the preset written is this machine's (:func:`cpu_preset_path`, which shadows
the built-in one); the built-in one is its starting point.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexsearch.cost.hardware import ClusterSpec, load_cluster_spec, save_cluster_spec
from flexsearch.cost.machine import (
    BUILTIN_CPU_PRESET,
    COMMAND,
    DEFAULT_SIZES,
    AlphaBetaFit,
    ComputeMeasurement,
    GlooMeasurement,
    HostInfo,
    MeasurementFile,
    cpu_preset_path,
    default_measurements_path,
    measure_compute,
    measure_gloo,
)


def _host_words(host: HostInfo) -> str:
    return f"{host.cpu_model}, {host.logical_cores} cores"


def write_cpu_preset(
    gloo: GlooMeasurement,
    compute: ComputeMeasurement | None,
    path: str | os.PathLike[str] | None = None,
    measurements_path: str | os.PathLike[str] | None = None,
) -> tuple[Path, Path]:
    """Rewrite a ``cpu``-style preset with measured numbers; return (preset, measurements).

    Replaced: ``intra_node.bandwidth`` and ``intra_node.latency`` (the p2p fit of
    :func:`fit_alpha_beta`) and, when ``compute`` is given, ``device.peak_flops.float32``
    (``bfloat16`` if measured) and ``device.memory_bandwidth``, each with a source saying
    when, on what and how it was measured. Every other field is kept as it was.

    ``path`` defaults to this machine's preset (:func:`cpu_preset_path`; the built-in
    one is the starting point when it does not exist yet). The raw measurements (a
    :class:`MeasurementFile`) go to ``measurements_path``, by default
    :func:`default_measurements_path` for the default preset and
    ``<stem>-gloo.measurements.json`` next to any other ``path``."""
    preset = Path(path) if path is not None else cpu_preset_path()
    if measurements_path is not None:
        mpath = Path(measurements_path)
    elif path is None:
        mpath = default_measurements_path()
    else:
        mpath = preset.with_name(f"{preset.stem}-gloo.measurements.json")
    spec: ClusterSpec = load_cluster_spec(preset if preset.exists() or path is not None else BUILTIN_CPU_PRESET)

    alpha, bandwidth = gloo.fit_p2p()
    how = (
        f"measured by `{COMMAND}` on {gloo.date}, {_host_words(gloo.host)}, "
        f"gloo {gloo.world_size} ranks x {gloo.threads_per_rank} threads, torch {gloo.host.torch_version}"
    )
    fit = (
        f"; fit t = alpha + n/B over {len(gloo.sizes)} sizes "
        f"({gloo.sizes[0]} B..{gloo.sizes[-1]} B) of p2p one-way times (ping-pong / 2); raw data in "
        f"measurements/{mpath.name}"
    )
    bw_type = type(spec.intra_node.bandwidth)
    lat_type = type(spec.intra_node.latency)
    intra = spec.intra_node.model_copy(
        update={
            "bandwidth": bw_type(value=bandwidth, source=how + fit + "; one transfer at a time"),
            "latency": lat_type(value=alpha, source=how + fit),
        }
    )
    update: dict[str, Any] = {"intra_node": intra}

    if compute is not None:
        chow = (
            f"measured by `{COMMAND}` on {compute.date}, {_host_words(compute.host)}, "
            f"1 process x {compute.threads} threads, torch {compute.host.torch_version}"
        )
        peak_type = type(spec.device.peak_flops.float32)
        flops_update = {
            "float32": peak_type(
                value=compute.matmul_float32_flops,
                source=f"{chow}; achieved, median of {compute.repeats} float32 "
                f"{compute.matmul_n}x{compute.matmul_n} matmuls (2 n^3 FLOP each)",
            )
        }
        if compute.matmul_bfloat16_flops is not None:
            flops_update["bfloat16"] = peak_type(
                value=compute.matmul_bfloat16_flops,
                source=f"{chow}; achieved, median of {compute.repeats} bfloat16 "
                f"{compute.matmul_bfloat16_n}x{compute.matmul_bfloat16_n} matmuls (2 n^3 FLOP each)",
            )
        mem_type = type(spec.device.memory_bandwidth)
        device = spec.device.model_copy(
            update={
                "peak_flops": spec.device.peak_flops.model_copy(update=flops_update),
                "memory_bandwidth": mem_type(
                    value=compute.memory_bandwidth_Bps,
                    source=f"{chow}; achieved, median of {compute.repeats} copy_ of "
                    f"{compute.copy_bytes} float32 bytes (bytes read + written / time)",
                ),
            }
        )
        update["device"] = device

    new = spec.model_copy(update=update)
    # validate the whole result again (model_copy does not) before anything is written
    new = ClusterSpec.model_validate(new.model_dump())
    record = MeasurementFile(
        preset=spec.name,
        gloo=gloo,
        p2p_fit=AlphaBetaFit(latency_s=alpha, bandwidth_Bps=bandwidth, sizes_used=len(gloo.sizes)),
        compute=compute,
    )
    mpath.parent.mkdir(parents=True, exist_ok=True)
    mpath.write_text(record.model_dump_json(indent=2) + "\n")
    preset.parent.mkdir(parents=True, exist_ok=True)
    save_cluster_spec(new, preset)
    return preset, mpath


def profile_machine(
    world_size: int = 2,
    threads_per_rank: int = 1,
    write: bool = True,
    progress: Callable[[str], None] | None = None,
    path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Measure gloo p2p/all-reduce and one process's compute, fit the link, and (with
    ``write``) rewrite the ``cpu`` preset (``path``, default this machine's:
    :func:`cpu_preset_path`).

    Returns ``{"latency_s", "bandwidth_Bps", "float32_flops", "bfloat16_flops",
    "memory_bandwidth_Bps", "sizes", "p2p_one_way_s", "all_reduce_s", "preset_path",
    "measurements_path", "seconds"}`` (paths None without ``write``)."""
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    say(
        f"measuring gloo p2p and all_reduce: {world_size} ranks x {threads_per_rank} threads, "
        f"{len(DEFAULT_SIZES)} sizes {DEFAULT_SIZES[0]} B..{DEFAULT_SIZES[-1] >> 20} MiB"
    )
    gloo = measure_gloo(world_size=world_size, threads_per_rank=threads_per_rank)
    alpha, bandwidth = gloo.fit_p2p()
    say(f"link fit t = alpha + n/B: alpha = {alpha * 1e6:.1f} us, B = {bandwidth / 1e9:.2f} GB/s")
    say(f"measuring compute: one process x {threads_per_rank} threads (matmul, copy)")
    compute = measure_compute(threads=threads_per_rank)
    say(
        f"float32 matmul {compute.matmul_float32_flops / 1e9:.1f} GFLOP/s, "
        + (
            f"bfloat16 {compute.matmul_bfloat16_flops / 1e9:.1f} GFLOP/s, "
            if compute.matmul_bfloat16_flops
            else "bfloat16 not measured, "
        )
        + f"copy {compute.memory_bandwidth_Bps / 1e9:.2f} GB/s"
    )
    preset_path = measurements_path = None
    if write:
        preset_path, measurements_path = write_cpu_preset(gloo, compute, path=path)
        say(f"wrote {preset_path} and {measurements_path}")
    return {
        "latency_s": alpha,
        "bandwidth_Bps": bandwidth,
        "float32_flops": compute.matmul_float32_flops,
        "bfloat16_flops": compute.matmul_bfloat16_flops,
        "memory_bandwidth_Bps": compute.memory_bandwidth_Bps,
        "sizes": list(gloo.sizes),
        "p2p_one_way_s": list(gloo.p2p_one_way_s),
        "all_reduce_s": list(gloo.all_reduce_s),
        "preset_path": str(preset_path) if preset_path else None,
        "measurements_path": str(measurements_path) if measurements_path else None,
        "seconds": time.perf_counter() - start,
    }


__all__ = ["profile_machine", "write_cpu_preset"]

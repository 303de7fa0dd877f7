"""Plan-cost regression check (``flexsearch bench``).

A fixed matrix of zoo models x clusters x device counts (:data:`MATRIX`) is planned with
a fixed seed and MCMC budget (:data:`SEED`, :data:`MAX_ITERS`; no seconds budget), so
every run on every machine gives the same plans. Each plan's predicted iteration time
is compared with the recorded baseline (``benchmarks/baseline.json``, a
:class:`Baseline`):

- **regressed** (fails ``--check``): more than :data:`TOLERANCE` (1 %) slower than the
  baseline, or infeasible (nothing fits) where the baseline had a plan;
- **improved**: faster, or a plan where the baseline had none (printed, so that an
  improvement is recorded on purpose with ``--update``);
- **new** (fails ``--check``): a case the baseline does not have; a baseline made with
  another seed or budget is **stale** (fails ``--check``). Both ask for ``--update``.

The matrix covers every synchronous plan kind the planner returns (data, SOAP,
pipeline, hybrid) on the paper and DGX presets, and takes well under a minute on two
CPU cores (the models are built on the meta device; each is traced once per precision:
``auto``, bf16-mixed on the GPU presets).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flexsearch.errors import FlexsearchError, InfeasiblePlanError

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE_PATH = REPO_ROOT / "benchmarks" / "baseline.json"
SEED = 0
MAX_ITERS = 200
TOLERANCE = 0.01
BASELINE_VERSION = 1


@dataclass(frozen=True)
class Case:
    """One planning problem: a model spec (relative to the repository root), a cluster
    preset and a device count."""

    model: str
    cluster: str
    devices: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.model, self.cluster, self.devices)

    @property
    def name(self) -> str:
        """The builder's name, e.g. ``gpt2_small``."""
        return self.model.rsplit(":", 1)[-1]


def _m(file_name: str) -> str:
    return f"benchmarks/models/{file_name}"


MATRIX: tuple[Case, ...] = (
    Case(_m("mlp.py:mlp"), "dgx-h100", 8),  # soap
    Case(_m("mlp.py:mlp"), "commodity", 4),  # soap, slow network
    Case(_m("alexnet.py:alexnet"), "flexflow-p100", 16),  # soap (FlexFlow's setting)
    Case(_m("alexnet.py:alexnet"), "flexflow-k80", 16),
    Case(_m("vgg.py:vgg16"), "pipedream-a", 16),  # PipeDream's setting
    Case(_m("resnet.py:resnet50"), "dgx-a100", 8),  # data
    Case(_m("dlrm.py:dlrm"), "dgx-h100", 8),  # soap: embedding tables
    Case(_m("gpt.py:gpt2_small"), "dgx-h100", 8),  # pipeline
    Case(_m("gpt.py:gpt2_small"), "pipedream-b", 16),  # hybrid
    Case(_m("rnn.py:rnnlm"), "pipedream-a", 8),  # pipeline
    Case(_m("nmt.py:nmt"), "flexflow-k80", 16),  # pipeline
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BenchEntry(_Frozen):
    """One case's result: the plan kind and predicted iteration time, or ``None`` for
    both when nothing fits."""

    model: str
    cluster: str
    devices: int = Field(ge=1)
    kind: str | None
    iteration_time_s: float | None = Field(gt=0)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.model, self.cluster, self.devices)


class Baseline(_Frozen):
    """``benchmarks/baseline.json``: the recorded results and the settings they need."""

    version: Literal[1] = BASELINE_VERSION
    seed: int
    max_iters: int = Field(ge=0)
    entries: tuple[BenchEntry, ...]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def load_baseline(path: str | Path = BASELINE_PATH) -> Baseline | None:
    """The baseline at ``path``; ``None`` when the file does not exist."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        return Baseline.model_validate_json(p.read_text())
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise FlexsearchError(f"{p} is not a bench baseline ({where}: {err['msg']}); "
                              "rewrite it with `flexsearch bench --update`") from None
    except OSError as e:
        raise FlexsearchError(f"cannot read {p}: {e}") from None


def run_matrix(
    cases: Sequence[Case] = MATRIX,
    *,
    seed: int = SEED,
    max_iters: int = MAX_ITERS,
    root: Path = REPO_ROOT,
    progress: Callable[[int, int, Case], None] | None = None,
) -> tuple[BenchEntry, ...]:
    """Plan every case (each model traced once) and return the results in order.
    ``progress(done, total, case)`` is called before each case."""
    from flexsearch.api import resolve_cluster, resolve_precision
    from flexsearch.graph import trace
    from flexsearch.model_files import load_model
    from flexsearch.search.planner import plan_graph

    files = sorted({c.model.rsplit(":", 1)[0] for c in cases})
    missing = [f for f in files if not (root / f).exists()]
    if missing:
        raise FlexsearchError(f"the bench needs the model files under {root} ({missing[0]} is missing); "
                              "run it from a clone of the repository")
    models: dict = {}
    graphs: dict = {}
    out = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case)
        cluster = resolve_cluster(case.cluster, case.devices)
        precision, _ = resolve_precision("auto", cluster)
        graph = graphs.get((case.model, precision.name))
        if graph is None:
            if case.model not in models:
                models[case.model] = load_model(str(root / case.model))
            module, inputs = models[case.model]
            graph = graphs[case.model, precision.name] = trace(module, inputs, name=case.model,
                                                               precision=precision)
        try:
            p = plan_graph(graph, cluster, max_iters=max_iters, seed=seed)
            if p.interrupted:  # Ctrl-C: a cut search is no result to record
                raise KeyboardInterrupt
            out.append(BenchEntry(model=case.model, cluster=case.cluster, devices=case.devices,
                                  kind=p.kind, iteration_time_s=p.predicted.iteration_time_s))
        except InfeasiblePlanError:
            out.append(BenchEntry(model=case.model, cluster=case.cluster, devices=case.devices,
                                  kind=None, iteration_time_s=None))
    return tuple(out)


Status = Literal["same", "slower <1%", "improved", "regressed", "new"]
FAILING: tuple[Status, ...] = ("regressed", "new")


@dataclass(frozen=True)
class Row:
    """One case compared with its baseline entry (``before`` None: not recorded)."""

    now: BenchEntry
    before: BenchEntry | None
    status: Status

    @property
    def label(self) -> str:
        """E.g. ``gpt2_small on 8 x dgx-h100``."""
        return f"{self.now.model.rsplit(':', 1)[-1]} on {self.now.devices} x {self.now.cluster}"

    @property
    def change(self) -> float | None:
        """Relative change of the iteration time (+0.02: 2 % slower), when both fit."""
        a = self.before.iteration_time_s if self.before else None
        b = self.now.iteration_time_s
        return b / a - 1 if a and b else None


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    stale: str | None
    """Why the baseline cannot be compared (another seed or budget), else None."""

    @property
    def failed(self) -> bool:
        return self.stale is not None or any(r.status in FAILING for r in self.rows)

    def count(self, status: Status) -> int:
        return sum(r.status == status for r in self.rows)


def classify(now: BenchEntry, before: BenchEntry | None, tolerance: float = TOLERANCE) -> Status:
    """The status of one case (module docstring)."""
    if before is None:
        return "new"
    a, b = before.iteration_time_s, now.iteration_time_s
    if a is None or b is None:
        if a is None and b is None:
            return "same"
        return "improved" if a is None else "regressed"
    if b > a * (1 + tolerance):
        return "regressed"
    if b < a * (1 - 1e-9):
        return "improved"
    if b > a * (1 + 1e-9):
        return "slower <1%"
    return "same"


def compare(results: Sequence[BenchEntry], baseline: Baseline | None, *, seed: int = SEED,
            max_iters: int = MAX_ITERS, tolerance: float = TOLERANCE) -> Comparison:
    """Each result against its baseline entry."""
    stale = None
    if baseline is not None and (baseline.seed, baseline.max_iters) != (seed, max_iters):
        stale = (f"the baseline was recorded with seed {baseline.seed} and max_iters "
                 f"{baseline.max_iters}, the bench runs seed {seed} and max_iters {max_iters}")
    before = {e.key: e for e in baseline.entries} if baseline is not None else {}
    rows = tuple(Row(r, before.get(r.key), classify(r, before.get(r.key), tolerance)) for r in results)
    return Comparison(rows, stale)


def make_baseline(results: Sequence[BenchEntry], *, seed: int = SEED, max_iters: int = MAX_ITERS) -> Baseline:
    return Baseline(seed=seed, max_iters=max_iters, entries=tuple(results))


def write_baseline(baseline: Baseline, path: str | Path = BASELINE_PATH) -> None:
    Path(path).write_text(baseline.to_json())


@dataclass(frozen=True)
class BenchRun:
    """What ``flexsearch bench`` computed: the results, their comparison and its time."""

    results: tuple[BenchEntry, ...]
    comparison: Comparison
    seconds: float
    seed: int
    max_iters: int

    def baseline(self) -> Baseline:
        """These results as a baseline (what ``--update`` writes)."""
        return make_baseline(self.results, seed=self.seed, max_iters=self.max_iters)


def bench(
    cases: Sequence[Case] | None = None,
    *,
    baseline_path: str | Path | None = None,
    seed: int | None = None,
    max_iters: int | None = None,
    tolerance: float = TOLERANCE,
    root: Path = REPO_ROOT,
    progress: Callable[[int, int, Case], None] | None = None,
) -> BenchRun:
    """Run the matrix (default :data:`MATRIX`, :data:`SEED`, :data:`MAX_ITERS`) and
    compare it with the baseline file (default :data:`BASELINE_PATH`; a missing file
    compares every case as new)."""
    t0 = time.perf_counter()
    seed = SEED if seed is None else seed
    max_iters = MAX_ITERS if max_iters is None else max_iters
    baseline = load_baseline(BASELINE_PATH if baseline_path is None else baseline_path)
    results = run_matrix(MATRIX if cases is None else cases, seed=seed, max_iters=max_iters,
                         root=root, progress=progress)
    comparison = compare(results, baseline, seed=seed, max_iters=max_iters, tolerance=tolerance)
    return BenchRun(results, comparison, time.perf_counter() - t0, seed, max_iters)

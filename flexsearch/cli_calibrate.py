"""``flexsearch calibrate``'s command line, and the one-line calibration warning that
``plan`` and ``simulate`` print. :mod:`flexsearch.cli` registers the command and imports
this module, so the functions import its consoles when they run."""

from __future__ import annotations

from typing import Annotated

import typer

from flexsearch.tables import convergence_table


def calibrate(
    out: Annotated[str | None, typer.Option(help="Calibration file to write \\[default: ~/.flexsearch/calibration.json "
                                                 "or $FLEXSEARCH_HOME/calibration.json].", show_default=False)] = None,
    ranks: Annotated[int | None, typer.Option(
        help="gloo processes (the cpu preset's devices) to measure on \\[default: 2; with --convergence: 8, the "
             "largest of the rank counts 2, 4, ... trained].", min=2, show_default=False)] = None,
    threads: Annotated[int, typer.Option(help="CPU threads per process.", min=1)] = 1,
    steps: Annotated[int, typer.Option(help="Timed steps per probe run (the median is kept).", min=3)] = 40,
    warmup: Annotated[int, typer.Option(help="Untimed steps before timing.", min=2)] = 3,
    retries: Annotated[int, typer.Option(help="Rerun a measurement disturbed by other processes up to this often.",
                                         min=1)] = 3,
    max_wait: Annotated[float, typer.Option(help="Seconds to wait for a quiet machine before each measurement.",
                                            min=0)] = 60.0,
    restart: Annotated[bool, typer.Option("--restart", help="Ignore the progress of an interrupted run.")] = False,
    repeats: Annotated[int, typer.Option(help="Measure every stage this often (outliers rejected, the median "
                                               "kept, the spread recorded).", min=1)] = 3,
    convergence: Annotated[str | None, typer.Option(
        help="Measure D-PSGD's convergence for this model (MODEL spec) instead: train it on scikit-learn's digits "
             "under all-reduce and each gossip topology on 2, 4, ... up to --ranks gloo processes, and write the "
             "fitted iterations factors where the planner reads them for the model's family [default --out: "
             "~/.flexsearch/convergence/<class name>.json].", show_default=False)] = None,
    epochs: Annotated[int, typer.Option(help="Epochs per convergence run (--convergence).", min=2)] = 20,
) -> None:
    """Measure this machine's calibration of the simulator (the cpu preset's gloo processes).

    Probe models are trained for real under every execution mode; the simulator's
    residuals become per-op, per-tensor and per-step costs, each with this command and
    the host as its source. Resumable: an interrupted run continues where it stopped.
    With --convergence MODEL it measures D-PSGD's iterations to accuracy instead
    (flexsearch.calibrate.convergence)."""
    from flexsearch.cli import err, stdout

    if convergence is not None:
        _calibrate_convergence(convergence, out, 8 if ranks is None else ranks, epochs)
        return
    ranks = 2 if ranks is None else ranks
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flexsearch.calibrate import Settings
    from flexsearch.calibrate import calibrate as run

    settings = Settings(ranks=ranks, threads=threads, steps=steps, warmup=warmup, retries=retries,
                        max_wait_s=max_wait, repeats=repeats)
    with Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, stage: str) -> None:
            bar.update(task, completed=done, total=total, description=stage)

        res = run(out=out, settings=settings, restart=restart, progress=progress)
    spread = res.calibration.step_spread
    noise = f"; run-to-run noise of a step {spread.value:.1%}" if spread is not None else ""
    stdout.print(f"calibration of {res.device} written to {res.path} ({'resumed; ' if res.resumed else ''}"
                 f"{repeats} repeats{noise}; raw measurements in {res.log_path})", markup=False, soft_wrap=True)


def _calibrate_convergence(spec: str, out: str | None, ranks: int, epochs: int) -> None:
    from flexsearch.calibrate.convergence import Settings, measure, rank_counts, write
    from flexsearch.cli import err, stdout

    settings = Settings(ranks=rank_counts(ranks), epochs=epochs)
    with err.status(f"training {spec} on {', '.join(map(str, settings.ranks))} ranks", spinner="dots") as status:
        data = measure(spec, settings, progress=lambda s: status.update(f"training {spec}: {s}"))
    path = write(data, out)
    for x in convergence_table(data):
        stdout.print(x, markup=False)
    stdout.print(f"written to {path}; the planner uses it for {data.family} models", markup=False, soft_wrap=True)


def warn_calibration(cl) -> None:
    """Say in one line when predictions for this host's devices are not calibrated for it."""
    from flexsearch.api import calibration_warning
    from flexsearch.cli import err

    msg = calibration_warning("auto", cl)
    if msg is not None:
        err.print(f"warning: {msg}", markup=False, soft_wrap=True)



"""The report's figures: one PNG per figure, every run overlaid, one line per run.

matplotlib is imported by the functions that draw (``streamrec --help`` must stay
fast), and only ``Figure`` with the Agg canvas is used: no pyplot, no backend
switch, no global state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from monitoring.run_series import (
    has_missed_pushes,
    metric_series,
    staleness_series,
    summarize,
    throughput,
)
from monitoring.runs import NAN, Point, RunData

# matplotlib's "tab10": a run keeps its colour in every figure and in the table.
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


# --- figures -----------------------------------------------------------------------------


def color(index: int) -> str:
    """The colour of the ``index``-th run, the same in every figure and the table."""
    return COLORS[index % len(COLORS)]


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(visible=True, alpha=0.3)
    return fig, ax


def _png(fig: Figure, ax: Axes) -> bytes:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")
    FigureCanvasAgg(fig)  # attaches itself to the figure: PNG through Agg, no pyplot
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _mark_checkpoints(ax: Axes, xs: Sequence[float], index: int) -> None:
    """Small triangles on the x axis where run ``index`` took a checkpoint.

    Each run's row sits a little higher: runs checkpointing at the same sample
    counts would hide each other's marks otherwise.
    """
    if xs:
        ax.plot(
            list(xs),
            [0.025 * index] * len(xs),
            linestyle="none",
            marker="^",
            markersize=7,
            color=color(index),
            transform=ax.get_xaxis_transform(),  # y in axes units: on the axis line
            clip_on=False,
        )


def _samples_axis(ax: Axes) -> None:
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter())


def _plot_metric(
    runs: Sequence[RunData],
    metric: Callable[[Point], float | None],
    title: str,
    ylabel: str,
    *,
    best: bool = False,
) -> bytes:
    fig, ax = _figure(title, "samples learned", ylabel)
    _samples_axis(ax)
    for i, run in enumerate(runs):
        s = metric_series(run, metric)
        ax.plot(s.x, s.y, color=color(i), label=run.name, marker="." if len(s.x) < 60 else None)
        _mark_checkpoints(ax, [c.samples for c in run.checkpoints], i)
    if best:
        bests = [summarize(run).best_auc for run in runs]
        shared = len({b for b in bests if b is not None}) == 1
        for i, (run, b) in enumerate(zip(runs, bests, strict=True)):
            if b is None:
                continue
            ax.axhline(
                b,
                linestyle="--",
                linewidth=1,
                color="0.4" if shared else color(i),
                label=f"best achievable {b:.4f}" if shared else f"{run.name}: best {b:.4f}",
            )
            if shared:
                break
    return _png(fig, ax)


def plot_loss(runs: Sequence[RunData]) -> bytes:
    """PNG: rank 0's loss (mean of its recent batches) against samples learned."""
    return _plot_metric(runs, lambda p: p.loss, "Training loss (rank 0)", "loss")


def plot_auc(runs: Sequence[RunData]) -> bytes:
    """PNG: rank 0's progressive AUC against samples learned, and the best achievable."""
    return _plot_metric(
        runs, lambda p: p.auc, "Progressive AUC (rank 0)", "AUC over the window", best=True
    )


def plot_throughput(runs: Sequence[RunData]) -> bytes:
    """PNG: samples/s of all ranks together between reports, against seconds since start.

    >>> from monitoring.runs import run_from_lines
    >>> import json
    >>> line = lambda t, n: json.dumps({"time": t, "samples": n, "samples_total": n,
    ...                                 "elapsed_s": t - 1})
    >>> png = plot_throughput([run_from_lines("r", {0: [line(2, 5), line(3, 20)]})])
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    fig, ax = _figure("Throughput (all ranks)", "seconds since the run started", "samples/s")
    for i, run in enumerate(runs):
        xs: list[float] = []
        ys: list[float] = []
        for s in throughput(run):
            if xs and xs[-1] != s.start:
                xs.append(NAN)
                ys.append(NAN)
            xs += [s.start, s.end]
            ys += [s.rate, s.rate]
        ax.plot(xs, ys, color=color(i), label=run.name)
        _mark_checkpoints(ax, [c.created - run.start for c in run.checkpoints], i)
    ax.set_ylim(bottom=0)
    return _png(fig, ax)


def plot_staleness(runs: Sequence[RunData]) -> bytes:
    """PNG: pushes a lookup missed (rank 0, mean between reports), and each run's bound."""
    fig, ax = _figure("Staleness (rank 0)", "samples learned", "pushes missed by a lookup (mean)")
    _samples_axis(ax)
    top = 1.0
    for i, run in enumerate(runs):
        s = staleness_series(run)
        observed = has_missed_pushes(run)
        label = run.name if observed else f"{run.name} (pushes queued at a report)"
        ax.plot(s.x, s.y, color=color(i), label=label, linestyle="-" if observed else ":")
        bound = summarize(run).staleness_bound
        ax.axhline(
            bound,
            color=color(i),
            linestyle="--",
            linewidth=1,
            alpha=0.7,
            label=f"{run.name}: bound {bound}",
        )
        _mark_checkpoints(ax, [c.samples for c in run.checkpoints], i)
        top = max(top, bound + 0.5, *(y for y in s.y if not math.isnan(y)))
    ax.set_ylim(-0.05 * top, top * 1.1)
    return _png(fig, ax)


# (file suffix, caption, function): the figures of a report, in page order.
PLOTS: tuple[tuple[str, str, Callable[[Sequence[RunData]], bytes]], ...] = (
    (
        "loss",
        "Training loss of rank 0: the mean of its last 50 batch losses at each report.",
        plot_loss,
    ),
    (
        "auc",
        "Progressive AUC of rank 0 (every batch scored before it is learned), over the "
        "metrics window; dashed: the synthetic stream's best achievable AUC, when known.",
        plot_auc,
    ),
    (
        "throughput",
        "Samples learned per second by all ranks together, between consecutive progress "
        "reports (not the trainer's since-start average); gaps: restarts.",
        plot_throughput,
    ),
    (
        "staleness",
        "Pushes a batch's embedding lookup missed, mean over the batches between two "
        "reports of rank 0; dashed: the configured bound; dotted: older runs without the "
        "histogram, pushes still queued at each report.",
        plot_staleness,
    ),
)

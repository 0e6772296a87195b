"""``streamrec report``: loss, AUC, throughput and staleness of runs, as one HTML page.

A run directory (``run_dir`` of a job run by ``streamrec run``, ``backfill``
or ``demo``) holds ``metrics-rank<R>.jsonl``: one JSON object per progress
report of trainer rank R, appended across restarts. This module reads them
into typed series (``load_run``), draws one PNG per figure with every run
overlaid on the same axes, one line per run (``plot_*``), and writes a page
that links the PNGs relatively, so the folder can be moved (``write_report``).

The choices, in one place:

- **x axis**: samples the job had learned (restored checkpoints included), so
  a slow and a fast run line up where they have seen the same data. The
  throughput figure alone runs on seconds since the run started.
- **several ranks**: loss, AUC and staleness are rank 0's (its progressive
  AUC is the figure the CLI and the benchmarks print); throughput is the sum
  of every rank's; the x value of a rank-0 report adds the other ranks'
  samples at that time (interpolated between their reports).
- **throughput** comes from differences of ``samples_total`` between two
  reports of one rank, never from ``samples_per_s``, which is the average
  since the (re)start and would hide every slowdown after the first minutes.
- **restarts** (``samples`` and ``elapsed_s`` start again, ``time`` jumps)
  split a rank's reports into incarnations; lines break there, and a
  restored run goes back to the checkpoint's sample count, so the redone
  stretch shows as two overlapping lines. No rate spans the downtime.
- **counters** (``missed_pushes``, ``events_total``, the fresh rows' per-row
  histograms and counts) are read as Prometheus
  reads counters: a count that went down started again from zero. That holds
  whether a restarted trainer restores them or not.
- **malformed lines** (not JSON, missing or mistyped fields, a torn last
  line) are skipped, counted and listed in the page with file and line
  number, and printed by the command; ``strict=True`` (``--strict``) fails on
  the first one instead. A report on a live run must not die on the line the
  trainer is writing, and one torn line from a killed trainer must not hide
  a week of figures, but nothing is dropped unsaid.
- **checkpoints**: the manifests still in ``<run>/checkpoints`` (the job keeps
  the last ``checkpoint.keep``) are marked on the x axis; one kept elsewhere
  (``checkpoint.dir``) is not looked for.

matplotlib is imported by the functions that draw (``streamrec --help`` must
stay fast), and only ``Figure`` with the Agg canvas is used: no pyplot, no
backend switch, no global state.

>>> import json, tempfile
>>> run_dir = Path(tempfile.mkdtemp())
>>> line = {"rank": 0, "step": 1, "samples": 500, "samples_total": 500,
...         "elapsed_s": 1.0, "time": 100.0, "loss": 0.6, "metrics": {"auc": 0.7}}
>>> _ = (run_dir / "metrics-rank0.jsonl").write_text(json.dumps(line) + "\\n")
>>> page = write_report([run_dir], run_dir / "report.html", title="one run")
>>> sorted(p.name for p in run_dir.glob("report*"))  # doctest: +NORMALIZE_WHITESPACE
['report-auc.png', 'report-loss.png', 'report-staleness.png', 'report-throughput.png',
 'report.html']
"""

from __future__ import annotations

import argparse
import html
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from monitoring.report_figures import PLOTS, color
from monitoring.run_series import Summary, summarize
from monitoring.runs import ReportError, RunData, load_runs

_SHOWN_WARNINGS = 20  # skipped lines listed one by one in the page; the rest counted


# --- the page ----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _freshened(s: Summary) -> str:
    if s.rows_freshened is None:
        return "-"
    return f"{s.rows_freshened:,} / {_fmt(s.rows_predicted, ',d')} / {_fmt(s.fresh_waits, ',d')}"


def _share(share: tuple[float, ...] | None) -> str:
    if share is None:
        return "-"
    return " / ".join(f"{s:.1%}" for s in share)


def render_html(
    title: str,
    summaries: Sequence[Summary],
    images: Sequence[tuple[str, str]],
    *,
    generated: str,
) -> str:
    """The page: the table of ``summaries``, then each (PNG file name, caption) in ``images``.

    >>> page = render_html("t <1>", [], [("a b.png", "A")], generated="now")
    >>> "<title>t &lt;1&gt;</title>" in page, 'src="a%20b.png"' in page
    (True, True)
    """
    e = html.escape
    rows = "".join(_table_row(i, s) for i, s in enumerate(summaries))
    warning_html = _warnings_html(summaries)
    figures = "".join(
        f'<figure><img src="{e(quote(name))}" alt="{e(caption)}">'
        f"<figcaption>{e(caption)}</figcaption></figure>"
        for name, caption in images
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }}
td.run {{ text-align: left; }}
.path {{ color: #777; font-size: 0.8em; }}
.swatch {{ display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; }}
figure {{ margin: 2em 0; }}
figcaption {{ color: #555; max-width: 900px; }}
img {{ max-width: 100%; }}
.warnings {{ background: #fff4e5; padding: 0.5em 1em; }}
</style>
</head>
<body>
<h1>{e(title)}</h1>
<p>Generated {e(generated)}. Loss, AUC and staleness are rank 0's; throughput is every
rank's summed. Samples on the x axes are those the job had learned, restored checkpoints
included; ▲ on an x axis: a checkpoint still in the run directory.</p>
<table>
<tr><th>run</th><th>ranks</th><th>restarts</th><th>samples</th><th>duration s</th>
<th>mean samples/s</th><th>final AUC</th><th>best AUC</th><th>final loss</th>
<th>staleness bound</th><th>pushes a lookup missed (mean)</th>
<th>lookups missing 0 / 1 / 2+ pushes</th>
<th>rows missing own pushes: at lookup / as trained</th>
<th>rows freshened / predicted / waits</th><th>events read</th>
<th>checkpoints</th><th>skipped lines</th></tr>
{rows}
</table>
<p class="note">samples: learned by the job at its last report; mean samples/s: every
sample learned (redone ones after a restart again) over the time some rank trained.
rows missing own pushes (fresh rows only, every rank): the share of embedding rows whose
lookup missed one or more of their rank's own pushes, and that still missed one when
trained; rows freshened: trained with a pushed value instead of the looked-up one, of
those predicted for the push in flight; waits: pushes in flight waited for.</p>
{warning_html}
{figures}
</body>
</html>
"""


def _table_row(i: int, s: Summary) -> str:
    """Run ``s``'s row of the table (``i``: its colour)."""
    e = html.escape
    return (
        "<tr>"
        f'<td class="run"><span class="swatch" style="background:{color(i)}"></span>'
        f'{e(s.name)}<div class="path">{e(s.path)}</div></td>'
        f'<td class="ranks">{s.ranks}</td>'
        f'<td class="restarts">{s.restarts}</td>'
        f'<td class="samples">{s.samples:,}</td>'
        f'<td class="duration">{s.duration_s:,.1f}</td>'
        f'<td class="throughput">{s.mean_samples_per_s:,.0f}</td>'
        f'<td class="auc">{_fmt(s.final_auc, ".4f")}</td>'
        f'<td class="best_auc">{_fmt(s.best_auc, ".4f")}</td>'
        f'<td class="loss">{_fmt(s.final_loss, ".4f")}</td>'
        f'<td class="bound">{s.staleness_bound}</td>'
        f'<td class="missed_mean">{_fmt(s.missed_mean, ".2f")}</td>'
        f'<td class="missed">{_share(s.missed_share)}</td>'
        f'<td class="rows_stale">{_share(s.rows_stale_share)}</td>'
        f'<td class="rows_freshened">{_freshened(s)}</td>'
        f'<td class="events">{_fmt(s.events, ",d")}</td>'
        f'<td class="checkpoints">{s.checkpoints}</td>'
        f'<td class="skipped">{s.skipped_lines}</td>'
        "</tr>"
    )


def _warnings_html(summaries: Sequence[Summary]) -> str:
    """The skipped input of every run, listed (empty when none was skipped)."""
    e = html.escape
    warnings = []
    for s in summaries:
        if not s.warnings:
            continue
        shown = "".join(f"<li>{e(w)}</li>" for w in s.warnings[:_SHOWN_WARNINGS])
        more = len(s.warnings) - _SHOWN_WARNINGS
        tail = f"<li>… and {more} more</li>" if more > 0 else ""
        manifests = len(s.warnings) - s.skipped_lines
        also = f", {manifests} checkpoint manifests unreadable" if manifests else ""
        warnings.append(
            f"<p><b>{e(s.name)}</b>: {s.skipped_lines} malformed metrics lines skipped{also}"
            f"</p><ul>{shown}{tail}</ul>"
        )
    if not warnings:
        return ""
    return f'<section class="warnings"><h2>Skipped input</h2>{"".join(warnings)}</section>'


def write_report(
    run_dirs: Sequence[Path | RunData],
    out: Path | None = None,
    *,
    title: str | None = None,
    strict: bool = False,
) -> Path:
    """Write ``out`` (default ``<first run>/report.html``) and its PNGs next to it.

    ``run_dirs`` are run directories, or runs already loaded (a caller that
    deletes its run directories loads them first). The PNGs are named after
    ``out`` (``report-loss.png``, ...) and linked relatively. Returns ``out``.
    """
    paths = [r for r in run_dirs if isinstance(r, Path)]
    loaded = iter(load_runs(paths, strict=strict))
    runs = [next(loaded) if isinstance(r, Path) else r for r in run_dirs]
    if not runs:
        msg = "no run directories to report on"
        raise ReportError(msg)
    if out is None:
        out = runs[0].path / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    images = []
    for suffix, caption, plot in PLOTS:
        name = f"{out.stem}-{suffix}.png"
        (out.parent / name).write_bytes(plot(runs))
        images.append((name, caption))
    page = render_html(
        title or "streamrec: " + ", ".join(r.name for r in runs),
        [summarize(r) for r in runs],
        images,
        generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    )
    out.write_text(page, encoding="utf-8")
    return out


# --- the command -------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """``streamrec report``: 0 when written, 2 for a run it cannot read, 1 when it cannot write."""
    out: Path | None = args.out
    try:
        runs = load_runs(args.run_dirs, strict=args.strict)
        for run in runs:
            for w in run.warnings[:_SHOWN_WARNINGS]:
                print(f"streamrec report: skipped {w}", file=sys.stderr)
            if len(run.warnings) > _SHOWN_WARNINGS:
                more = len(run.warnings) - _SHOWN_WARNINGS
                print(f"streamrec report: ... and {more} more in {run.path}", file=sys.stderr)
        page = write_report(list(runs), out, title=args.title)
    except ReportError as exc:
        print(f"streamrec report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"streamrec report: cannot write the report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {page} and {len(PLOTS)} PNGs next to it")
    return 0


def add_report_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``report`` to the ``streamrec`` parser (``add_subparsers()``'s result).

    >>> parser = argparse.ArgumentParser(prog="streamrec")
    >>> add_report_command(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["report", "runs/a", "runs/b", "--out", "cmp.html"])
    >>> args.func is cmd_report, args.run_dirs, args.out
    (True, [PosixPath('runs/a'), PosixPath('runs/b')], PosixPath('cmp.html'))
    """
    report = subparsers.add_parser(
        "report",
        help="an HTML page of loss, AUC, throughput and staleness plots of one or more runs",
        description=(
            "Read the metrics-rank<R>.jsonl files of each run directory and write an HTML "
            "page with PNG plots (loss, progressive AUC, throughput, staleness) and a summary "
            "table. Several runs are drawn on the same axes, one line each, e.g. a sync, a "
            "hybrid and an async run. The PNGs are written next to the page and linked "
            "relatively: move the folder, not the page alone. Malformed metrics lines are "
            "skipped and listed (in the page and here) unless --strict."
        ),
    )
    report.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="a job's run_dir (where `streamrec run`, `backfill` or `demo` wrote its metrics)",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="the HTML file to write (default: report.html in the first RUN_DIR); its PNGs "
        "go next to it, named after it (cmp.html: cmp-loss.png, cmp-auc.png, ...)",
    )
    report.add_argument("--title", default=None, help="the page's title (default: the runs' names)")
    report.add_argument(
        "--strict",
        action="store_true",
        help="fail on a malformed metrics line instead of skipping it",
    )
    report.set_defaults(func=cmd_report)

"""`streamrec report`: real run directories in, an HTML page with readable PNGs out.

The run directories come from real jobs (``deploy.job.run_job``: store shard
processes, a Dask LocalCluster, one trainer) on the synthetic stream: one
sync run, and one hybrid run stopped half-way and resumed, so its metrics
file holds a restart as users' files do. The pure series functions are
checked on hand-written lines whose figures are known.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from connectors.synthetic import synthetic_feature_spec, synthetic_store_section
from deploy.config import JobConfig
from monitoring.report import add_report_command, write_report
from monitoring.report_figures import PLOTS
from monitoring.run_series import (
    Segment,
    job_samples,
    metric_series,
    staleness_series,
    summarize,
    throughput,
)
from monitoring.runs import (
    CheckpointMark,
    Point,
    ReportError,
    load_run,
    load_runs,
    parse_point,
    run_from_lines,
    split_incarnations,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EVENTS_PER_PARTITION = 10_000  # 2 partitions: 20k events, 40 steps of 500
HALF = 10_000  # the hybrid run stops here and is resumed


def job(run_dir: Path, mode: str) -> JobConfig:
    trainer: dict[str, Any] = {
        "mode": mode,
        "batch_size": 500,
        "model": {"kind": "ffnn", "hidden": [16]},
        "optimizer": {"kind": "adam", "lr": 0.01},
        "torch_threads": 1,
        "metrics_window": 5000,
        "log_every_s": 0.1,  # several points even in a run of a few seconds
        "checkpoint": {"every_steps": 10, "every_s": None},
    }
    if mode == "hybrid":
        trainer["staleness"] = 3
    return JobConfig.model_validate(
        {
            "store": synthetic_store_section(dim=4),
            "features": synthetic_feature_spec().model_dump(),
            "source": {
                "kind": "synthetic",
                "seed": 3,
                "partitions": 2,
                "events": EVENTS_PER_PARTITION,
            },
            "trainer": trainer,
            "cluster": {"workers": 1, "store_shards": 1, "dashboard_address": ":0"},
            "run_dir": str(run_dir),
        }
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sync run dir, hybrid run dir): real jobs, the hybrid one restarted half-way."""
    from deploy.job import run_job

    base = tmp_path_factory.mktemp("runs")
    sync_dir, hybrid_dir = base / "sync", base / "hybrid"
    run_job(job(sync_dir, "sync"))
    run_job(job(hybrid_dir, "hybrid"), max_events=HALF)
    run_job(job(hybrid_dir, "hybrid"))  # resumes at the checkpoint, appends to the file
    return sync_dir, hybrid_dir


def metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    text = (run_dir / "metrics-rank0.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def missed_cell(lines: list[dict[str, Any]]) -> str:
    """The staleness shares (0 / 1 / 2+ missed pushes) the table should show for these lines.

    Each incarnation counts from zero: its last line holds its whole histogram.
    """
    if any("missed_pushes" not in r for r in lines):
        return "-"  # a trainer from before the histogram
    lasts = [
        r
        for r, nxt in zip(lines, [*lines[1:], None], strict=True)
        if nxt is None or nxt["samples"] < r["samples"]
    ]
    counts = [0, 0, 0]
    for r in lasts:
        for k, n in r["missed_pushes"].items():
            counts[min(int(k), 2)] += n
    return " / ".join(f"{n / sum(counts):.1%}" for n in counts)


def rows_stale_cell(lines: list[dict[str, Any]]) -> str:
    """The fresh rows' cell (rows missing own pushes at lookup / as trained) for these lines."""
    if any("missed_pushes_by_row" not in r for r in lines):
        return "-"
    lasts = [
        r
        for r, nxt in zip(lines, [*lines[1:], None], strict=True)
        if nxt is None or nxt["samples"] < r["samples"]
    ]
    shares = []
    for key in ("missed_pushes_by_row", "trained_missed_pushes_by_row"):
        rows = sum(n for r in lasts for n in r[key].values())
        if not rows:
            return "-"  # fresh rows off, or sync: no row counted
        fresh = sum(r[key].get("0", 0) for r in lasts)
        shares.append(f"{(rows - fresh) / rows:.1%}")
    return " / ".join(shares)


def table_cells(page: str, column: str) -> list[str]:
    """The cells of one column of the summary table, one per run, in order."""
    return re.findall(rf'<td class="{column}">(.*?)</td>', page)


def check_png(path: Path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, f"{path}: {len(data)} bytes, too small for a plot"
    height, width, _ = imread(path).shape
    assert (width, height) == (900, 450), path


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrec")
    add_report_command(parser.add_subparsers(dest="command", required=True))
    return parser


def cli(*argv: str) -> int:
    args = report_parser().parse_args(["report", *argv])
    return int(args.func(args))


# --- real runs -----------------------------------------------------------------------------


@pytest.mark.processes  # the `runs` fixture: real jobs
def test_report_of_a_sync_and_a_restarted_hybrid_run(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    sync_dir, hybrid_dir = runs
    out = write_report([sync_dir, hybrid_dir], tmp_path / "cmp" / "cmp.html", title="modes")
    page = out.read_text(encoding="utf-8")
    assert "<title>modes</title>" in page

    images = re.findall(r'<img src="([^"]+)"', page)
    assert images == [f"cmp-{suffix}.png" for suffix, _, _ in PLOTS]
    for name in images:
        check_png(out.parent / name)  # relative links: next to the page

    names = [re.sub(r"<.*", "", cell.split("</span>")[1]) for cell in table_cells(page, "run")]
    assert names == ["sync", "hybrid"]

    # The figures of the table are those of the metrics files.
    sync_lines, hybrid_lines = metrics_lines(sync_dir), metrics_lines(hybrid_dir)
    assert sync_lines[-1]["samples_total"] == 2 * EVENTS_PER_PARTITION
    assert hybrid_lines[-1]["samples_total"] == 2 * EVENTS_PER_PARTITION
    assert table_cells(page, "samples") == [
        f"{sync_lines[-1]['samples_total']:,}",
        f"{hybrid_lines[-1]['samples_total']:,}",
    ]
    assert table_cells(page, "auc") == [
        f"{sync_lines[-1]['metrics']['auc']:.4f}",
        f"{hybrid_lines[-1]['metrics']['auc']:.4f}",
    ]
    assert table_cells(page, "loss") == [
        f"{sync_lines[-1]['loss']:.4f}",
        f"{hybrid_lines[-1]['loss']:.4f}",
    ]
    assert table_cells(page, "restarts") == ["0", "1"]
    assert table_cells(page, "missed") == [missed_cell(sync_lines), missed_cell(hybrid_lines)]
    # Fresh rows are on by default in hybrid mode: its rows are counted, sync's are not.
    assert all(r["missed_pushes_by_row"] == {} for r in sync_lines)
    assert sum(hybrid_lines[-1]["missed_pushes_by_row"].values()) > 0
    assert table_cells(page, "rows_stale") == [
        rows_stale_cell(sync_lines),
        rows_stale_cell(hybrid_lines),
    ]
    assert table_cells(page, "rows_stale")[0] == "-"
    assert table_cells(page, "rows_freshened")[0] == "-"
    assert table_cells(page, "bound") == ["0", "3"]
    assert table_cells(page, "skipped") == ["0", "0"]


@pytest.mark.processes  # the `runs` fixture: real jobs
def test_summary_and_series_follow_the_files(runs: tuple[Path, Path]) -> None:
    sync, hybrid = load_runs(list(runs))
    sync_lines, hybrid_lines = metrics_lines(runs[0]), metrics_lines(runs[1])

    s = summarize(sync)
    assert s.samples == s.samples_trained == sync_lines[-1]["samples_total"]
    assert s.duration_s == pytest.approx(sync_lines[-1]["time"] - sync.start)
    assert s.mean_samples_per_s == pytest.approx(s.samples / s.duration_s)
    # The job checkpoints every 10 steps and keeps the newest 3 manifests.
    assert [c.samples for c in sync.checkpoints] == [10_000, 15_000, 20_000]

    h = summarize(hybrid)
    restart = next(
        i
        for i in range(1, len(hybrid_lines))
        if hybrid_lines[i]["samples"] < hybrid_lines[i - 1]["samples"]
    )
    first, second = hybrid_lines[:restart], hybrid_lines[restart:]
    assert first[-1]["samples_total"] == HALF
    assert h.restarts == 1
    assert h.samples == hybrid_lines[-1]["samples_total"]
    assert h.samples_trained == first[-1]["samples"] + second[-1]["samples"]
    assert h.training_s < h.duration_s  # the downtime between the two runs is not training

    # One loss point per report, and a break where the run restarted.
    loss = metric_series(hybrid, lambda p: p.loss)
    assert len(loss.x) == len(hybrid_lines) + 1
    assert [x for x in loss.x if not math.isnan(x)] == [
        float(r["samples_total"]) for r in hybrid_lines
    ]

    # Every sample learned shows under the throughput line, no more.
    learned = sum((seg.end - seg.start) * seg.rate for seg in throughput(hybrid))
    assert learned == pytest.approx(h.samples_trained)


@pytest.mark.processes  # the `runs` fixture: real jobs
def test_default_page_lands_in_the_first_run_dir_and_moves_with_it(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "sync"
    shutil.copytree(runs[0], copy)
    out = write_report([copy])
    assert out == copy / "report.html"
    moved = tmp_path / "elsewhere"
    copy.rename(moved)
    page = (moved / "report.html").read_text(encoding="utf-8")
    for name in re.findall(r'<img src="([^"]+)"', page):
        check_png(moved / name)


@pytest.mark.processes  # the `runs` fixture: real jobs
def test_command_writes_the_page(runs: tuple[Path, Path], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "x.html"
    assert cli(str(runs[0]), str(runs[1]), "--out", str(out), "--title", "sync vs hybrid") == 0
    assert "<title>sync vs hybrid</title>" in out.read_text(encoding="utf-8")
    assert str(out) in capsys.readouterr().out


def test_command_without_metrics_names_the_directory(tmp_path: Path, capsys: Any) -> None:
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert cli(str(empty), "--out", str(tmp_path / "x.html")) == 2
    err = capsys.readouterr().err
    assert str(empty) in err
    assert "metrics-rank" in err
    assert not (tmp_path / "x.html").exists()

    assert cli(str(tmp_path / "missing")) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err


@pytest.mark.processes  # the `runs` fixture: real jobs
def test_malformed_lines_are_skipped_and_listed_or_fail_with_strict(
    runs: tuple[Path, Path], tmp_path: Path, capsys: Any
) -> None:
    run = tmp_path / "torn"
    shutil.copytree(runs[0], run)
    metrics = run / "metrics-rank0.jsonl"
    lines = metrics.read_text(encoding="utf-8").splitlines()
    lines.insert(2, '{"rank": 0, "time": 17')  # line 3: a trainer killed mid-write
    metrics.write_text("\n".join(lines) + "\n", encoding="utf-8")

    assert cli(str(run), "--out", str(tmp_path / "r.html")) == 0
    assert f"{metrics}:3: not JSON" in capsys.readouterr().err
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert table_cells(page, "skipped") == ["1"]
    assert f"{metrics}:3: not JSON" in page
    assert table_cells(page, "samples") == [f"{2 * EVENTS_PER_PARTITION:,}"]

    assert cli(str(run), "--strict", "--out", str(tmp_path / "s.html")) == 2
    assert f"{metrics}:3: not JSON" in capsys.readouterr().err


# --- the pure functions, on hand-written lines ----------------------------------------------


def line(**fields: Any) -> str:
    return json.dumps({"rank": 0, "step": 0, "staleness": 2, "pushes_queued": 0, **fields})


def same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Equal, nan matching nan."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def point(t: float, samples: int, total: int, elapsed: float, **fields: Any) -> str:
    return line(time=t, samples=samples, samples_total=total, elapsed_s=elapsed, **fields)


# A run started at t=100, restarted from a checkpoint at 250 samples after it had
# learned 400; the second incarnation starts at t=200.
RESTARTED = [
    point(102.0, 200, 200, 2.0, loss=0.7, metrics={"auc": 0.6}),
    point(104.0, 400, 400, 4.0, loss=0.6, metrics={"auc": 0.65}),
    point(201.0, 50, 300, 1.0, loss=0.55, metrics={"auc": None}),
    point(203.0, 450, 700, 3.0, loss=0.5, metrics={"auc": 0.7}),
]


def test_a_restart_splits_the_series_and_no_rate_spans_the_downtime() -> None:
    run = run_from_lines("r", {0: RESTARTED})
    first, second = run.ranks[0]
    assert (first.start, first.samples_before, len(first.points)) == (100.0, 0, 2)
    assert (second.start, second.samples_before, len(second.points)) == (200.0, 250, 2)

    assert throughput(run) == [
        Segment(0.0, 2.0, 100.0),
        Segment(2.0, 4.0, 100.0),
        Segment(100.0, 101.0, 50.0),
        Segment(101.0, 103.0, 200.0),
    ]
    auc = metric_series(run, lambda p: p.auc)
    nan = float("nan")
    assert same(auc.x, (200.0, 400.0, nan, 300.0, 700.0))  # nan: the line breaks
    assert same(auc.y, (0.6, 0.65, nan, nan, 0.7))  # nan in y alone: no AUC yet

    s = summarize(run)
    assert (s.samples, s.samples_trained, s.restarts) == (700, 850, 1)
    assert (s.duration_s, s.training_s) == (103.0, 7.0)
    assert s.mean_samples_per_s == pytest.approx(850 / 7)
    assert (s.final_auc, s.final_loss) == (0.7, 0.5)
    assert s.missed_share is None  # older lines: no histogram
    assert s.missed_mean is None
    assert s.events is None


def test_a_short_incarnation_is_told_apart_by_its_start_time() -> None:
    # The first trainer died at 1 s, after less than its successor's first report.
    points = [
        parse_point(point(11.0, 100, 100, 1.0), rank=0),
        parse_point(point(52.0, 300, 300, 2.0), rank=0),
    ]
    assert [len(i.points) for i in split_incarnations(points)] == [1, 1]


def test_ranks_add_up_in_throughput_and_in_the_samples_axis() -> None:
    run = run_from_lines(
        "two",
        {
            0: [point(101.0, 100, 100, 1.0), point(103.0, 500, 500, 3.0, loss=0.5)],
            1: [point(102.0, 400, 400, 2.0, rank=1)],
        },
    )
    # rank 0: 100/s then 200/s; rank 1: 200/s from 100 s to 102 s.
    assert throughput(run) == [
        Segment(0.0, 1.0, 300.0),
        Segment(1.0, 2.0, 400.0),
        Segment(2.0, 3.0, 200.0),
    ]
    assert job_samples(run, 0, 101.0) == 300.0  # rank 1 is interpolated
    assert metric_series(run, lambda p: p.loss).x == (300.0, 900.0)
    assert summarize(run).samples == 900


def test_the_observed_staleness_histogram_and_its_shares() -> None:
    hist = [{"0": 6, "1": 2}, {"0": 8, "1": 4, "3": 2}, {"0": 1}]  # the last after a reset
    run = run_from_lines(
        "h",
        {
            0: [
                point(11.0, 100, 100, 1.0, missed_pushes=hist[0], events_total=110),
                point(12.0, 200, 200, 2.0, missed_pushes=hist[1], events_total=205),
                point(20.0, 50, 250, 0.5, missed_pushes=hist[2], events_total=50),
            ]
        },
    )
    series = staleness_series(run)
    assert series.x[:2] == (100.0, 200.0)
    assert series.y[:2] == (2 / 8, (2 + 2 * 3) / 6)  # batches of each interval only
    assert series.y[3] == 0.0  # the reset one starts from zero
    s = summarize(run)
    assert s.missed_share == (9 / 15, 4 / 15, 2 / 15)  # 0: 8 + 1, 1: 4, 2+: 2
    assert s.missed_mean == pytest.approx((4 + 2 * 3) / 15)
    assert s.events == 255


def test_the_per_row_staleness_of_fresh_rows_and_its_shares(tmp_path: Path) -> None:
    fresh = [
        {
            "missed_pushes_by_row": {"0": 80, "1": 20},
            "trained_missed_pushes_by_row": {"0": 100},
            "rows_freshened": 20,
            "rows_predicted": 5,
            "fresh_waits": 0,
        },
        {
            "missed_pushes_by_row": {"0": 150, "1": 40, "3": 10},
            "trained_missed_pushes_by_row": {"0": 196, "1": 4},
            "rows_freshened": 50,
            "rows_predicted": 12,
            "fresh_waits": 1,
        },
        {  # after a restart: the counters start again
            "missed_pushes_by_row": {"0": 10},
            "trained_missed_pushes_by_row": {"0": 10},
            "rows_freshened": 0,
            "rows_predicted": 0,
            "fresh_waits": 0,
        },
    ]
    run = run_from_lines(
        "fresh",
        {
            0: [
                point(11.0, 100, 100, 1.0, **fresh[0]),
                point(12.0, 200, 200, 2.0, **fresh[1]),
                point(20.0, 50, 250, 0.5, **fresh[2]),
            ],
            1: [point(12.0, 100, 100, 2.0, rank=1, **fresh[0])],
        },
    )
    p = run.ranks[0][0].points[1]
    assert p.missed_pushes_by_row == (150, 40, 0, 10)
    assert p.trained_missed_pushes_by_row == (196, 4)
    assert (p.rows_freshened, p.rows_predicted, p.fresh_waits) == (50, 12, 1)
    s = summarize(run)
    # Rank 0: 200 rows, then 10 after the restart; rank 1: 100 rows.
    assert s.rows_stale_share == (70 / 310, 4 / 310)
    assert (s.rows_freshened, s.rows_predicted, s.fresh_waits) == (70, 17, 1)

    off = run_from_lines(
        "off",
        {
            0: [
                point(
                    11.0,
                    100,
                    100,
                    1.0,
                    missed_pushes={"0": 1},
                    missed_pushes_by_row={},
                    trained_missed_pushes_by_row={},
                    rows_freshened=0,
                    rows_predicted=0,
                    fresh_waits=0,
                )
            ]
        },
    )
    # Fresh rows off counts no row: no figure, rather than 0% stale.
    assert summarize(off).rows_stale_share is None
    assert summarize(off).rows_freshened is None
    page = write_report([run, off], tmp_path / "page.html").read_text(encoding="utf-8")
    assert table_cells(page, "rows_stale") == [f"{70 / 310:.1%} / {4 / 310:.1%}", "-"]
    assert table_cells(page, "rows_freshened") == ["70 / 17 / 1", "-"]


def test_older_files_without_the_per_row_figures_still_load() -> None:
    run = run_from_lines(
        "old",
        {
            0: [
                point(11.0, 100, 100, 1.0, missed_pushes={"0": 2}),
                point(12.0, 200, 200, 2.0, missed_pushes={"0": 4}),
            ]
        },
    )
    p = run.ranks[0][0].points[-1]
    assert (p.missed_pushes_by_row, p.trained_missed_pushes_by_row) == (None, None)
    assert (p.rows_freshened, p.rows_predicted, p.fresh_waits) == (None, None, None)
    s = summarize(run)
    assert s.missed_share == (1.0, 0.0, 0.0)
    assert (s.rows_stale_share, s.rows_freshened, s.fresh_waits) == (None, None, None)


def test_old_files_show_queued_pushes_as_staleness() -> None:
    run = run_from_lines(
        "old",
        {0: [point(11.0, 100, 100, 1.0, pushes_queued=1), point(12.0, 200, 200, 2.0)]},
    )
    assert staleness_series(run).y == (1.0, 0.0)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[1, 2]", "a JSON list, not an object"),
        (
            line(time=1.0, samples="10", samples_total=10, elapsed_s=1.0),
            "'samples' is '10', not an integer",
        ),
        (point(1.0, 10, 10, 1.0, loss="low"), "'loss' is 'low', not a number"),
        (point(1.0, 10, 10, 1.0, rank=3), "'rank' is 3 in the file of rank 0"),
        (
            point(1.0, 10, 10, 1.0, missed_pushes={"x": 1}),
            "'missed_pushes' key 'x' is not a count of pushes",
        ),
        (
            point(1.0, 10, 10, 1.0, trained_missed_pushes_by_row={"1": -2}),
            "'trained_missed_pushes_by_row'['1'] is -2, not a count",
        ),
        (
            point(1.0, 10, 10, 1.0, missed_pushes_by_row=[3]),
            "'missed_pushes_by_row' is [3], not an object",
        ),
        (point(1.0, 10, 10, 1.0, rows_freshened=1.5), "'rows_freshened' is 1.5, not an integer"),
        (line(time=1.0, samples=1, elapsed_s=1.0), "missing 'samples_total'"),
    ],
)
def test_malformed_lines_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_point(text, rank=0)
    with pytest.raises(ReportError, match=re.escape(f"r/metrics-rank0.jsonl:2: {why}")):
        run_from_lines("r", {0: [point(1.0, 1, 1, 1.0), text]}, strict=True)
    run = run_from_lines("r", {0: [point(1.0, 1, 1, 1.0), text]})
    assert run.skipped_lines == 1


def test_a_run_of_malformed_lines_only_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "metrics-rank0.jsonl").write_text("{oops\n\n")
    with pytest.raises(ReportError, match=rf"{re.escape(str(tmp_path))}: no progress reports"):
        load_run(tmp_path)


def test_same_named_run_dirs_get_told_apart(tmp_path: Path) -> None:
    for mode in ("a", "b"):
        (tmp_path / mode / "run").mkdir(parents=True)
        (tmp_path / mode / "run" / "metrics-rank0.jsonl").write_text(point(1.0, 1, 1, 1.0))
    names = [r.name for r in load_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"])]
    assert names == ["a/run", "b/run"]


def test_figures_draw_runs_without_auc_or_checkpoints(tmp_path: Path) -> None:
    """One report line, every metric null: the figures still come out (empty lines)."""
    bare = run_from_lines("bare", {0: [point(1.0, 0, 0, 1.0)]}, path=tmp_path / "bare")
    marked = run_from_lines(
        "marked",
        {0: RESTARTED},
        path=tmp_path / "marked",
        checkpoints=[CheckpointMark(step=4, samples=250, created=103.0)],
    )
    out = write_report([bare, marked], tmp_path / "page.html")
    for suffix, _, _ in PLOTS:
        check_png(tmp_path / f"page-{suffix}.png")
    assert "bare" in out.read_text(encoding="utf-8")


def test_a_point_knows_its_start() -> None:
    assert Point(0, 10.0, 1, 5, 5, 4.0).start == 6.0

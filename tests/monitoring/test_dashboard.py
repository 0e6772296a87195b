"""The streamrec page of the Dask dashboard and ``/metrics``: a real scheduler, a real job.

The first tests register the plugin on an in-process scheduler and feed it
reports through Dask's event log, as trainers and prediction servers do (one
of them a real server whose ``ServeReporter`` sends them). The others run a
real ``streamrec run`` (store shard processes, Dask worker processes, a
trainer) and watch it: ``/metrics`` of the scheduler and of every shard move
while it trains, and headless Chromium shows the page with live values.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from distributed import Client, LocalCluster
from prometheus_client.parser import text_string_to_metric_families

from connectors.synthetic import synthetic_store_section
from monitoring.plugin import StreamrecPlugin
from monitoring.serve_reporter import ServeReporter
from monitoring.types import TOPIC
from tests.monitoring.reports import FRESH, store_report, trainer
from tests.support.jobs import write_synthetic_job
from tests.support.processes import REPO_ROOT, STREAMREC
from tests.support.waits import wait_until

pytestmark = pytest.mark.processes

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
    return body.decode()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(get(url))
        for s in fam.samples
    }


@contextmanager
def chromium(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium driven by selenium, closed at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    setup = "Chromium is part of the test set-up (`make test` installs Debian's chromium)"
    assert shutil.which(CHROMIUM), setup
    assert shutil.which(CHROMEDRIVER), setup
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1400,1800",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield browser
    finally:
        browser.quit()


# The page rebuilds its charts and tables every second: these read them in the page,
# in one script call each, so an element replaced between a lookup and a read
# (StaleElementReferenceException) cannot happen.


def cells(browser: Any, table: str) -> list[list[str]]:
    """A table's body, row by row, as the page shows it."""
    rows: list[list[str]] = browser.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]))"
        ".map(r => Array.from(r.cells).map(c => c.textContent.trim()));",
        f"#{table} tbody tr",
    )
    return rows


def text(browser: Any, element_id: str) -> str:
    """An element's text, as the page shows it."""
    value: str = browser.execute_script(
        "return document.getElementById(arguments[0]).textContent.trim();", element_id
    )
    return value


def chart(browser: Any, svg_id: str) -> tuple[int, float | None]:
    """A chart's points drawn, and the last value of its last line."""
    points, last = browser.execute_script(
        "const e = document.getElementById(arguments[0]);"
        "return [e.getAttribute('data-points'), e.getAttribute('data-last')];",
        svg_id,
    )
    return int(points or 0), float(last) if last else None


def test_plugin_serves_the_page_its_data_and_metrics() -> None:
    with (
        LocalCluster(
            n_workers=1, processes=False, dashboard_address="127.0.0.1:0", threads_per_worker=1
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(StreamrecPlugin())
        client.register_plugin(StreamrecPlugin())  # a second rank's: the first one stays
        base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        parts = {"t/0": {"position": 90, "end": 100, "deadletter": {"bad_json": 2}}}
        client.log_event(TOPIC, trainer(time=1.0, samples_total=10, events_total=10))
        client.log_event(
            TOPIC,
            trainer(time=2.0, samples_total=30, events_total=32, partitions=parts, **FRESH),
        )
        client.log_event(TOPIC, store_report(rows=40))
        data = wait_until(
            lambda: (d := json.loads(get(f"{base}/streamrec/data.json")))["reports"] == 3 and d,
            "the reports reach the plugin",
            interval_s=0.25,
        )
        assert data["ranks"]["0"]["series"]["samples_per_s"] == [20.0]
        assert data["partitions"][0]["lag"] == 10
        assert [s["address"] for s in data["shards"]] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert data["row_staleness"]["trained"] == {"0": 995, "1": 5, "2": 0, "3": 0}
        page = get(f"{base}/streamrec")
        assert 'id="chart-throughput"' in page
        assert 'id="shards"' in page
        assert 'id="chart-row-staleness"' in page
        metrics = scrape(f"{base}/metrics")
        assert metrics[("streamrec_trainer_samples_total", (("rank", "0"),))] == 30
        assert metrics[("streamrec_store_rows", (("shard", "127.0.0.1:1"), ("table", "a")))] == 40
        assert metrics[("streamrec_trainer_rows_freshened_total", (("rank", "0"),))] == 100
        key = ("streamrec_trainer_row_staleness_trained_bucket", (("le", "0.0"), ("rank", "0")))
        assert metrics[key] == 995
        # The dashboard's own pages link to it from their menu bar.
        assert 'href="streamrec"' in get(f"{base}/status")


class Constant:
    """A model that answers 0.5 to every record: the server's own code, nothing else."""

    name, heads = "const", ("click",)

    def ready(self) -> bool:
        return True

    def metadata(self) -> dict[str, Any]:
        return {}

    def predict(self, records: Any) -> Any:
        import numpy as np

        from serving.types import Prediction

        return Prediction({"click": np.full(len(records), 0.5, np.float32)})


DASH = "\N{EN DASH}"  # what the page shows for no figure

INFER_BODY = b'{"inputs": [{"name": "records", "datatype": "BYTES", "shape": [1], "data": ["{}"]}]}'


def test_the_page_shows_serving_in_a_real_browser(tmp_path: Path) -> None:
    from serving.http import InferenceServer

    fixed = "http://10.0.0.7:8080"  # a server whose reports are written out here
    with (
        LocalCluster(
            n_workers=1, processes=False, dashboard_address="127.0.0.1:0", threads_per_worker=1
        ) as cluster,
        Client(cluster) as client,
        chromium(tmp_path) as browser,
    ):
        client.register_plugin(StreamrecPlugin())
        base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        browser.get(f"{base}/streamrec")
        wait_until(
            lambda: "updated" in text(browser, "status"),
            "the page's first update",
            timeout_s=30,
            interval_s=0.25,
        )
        # No server has reported: no Serving section.
        assert browser.execute_script("return document.getElementById('serving').hidden;")

        # A real server, its registry read and sent by a ServeReporter as `serve` wires it.
        stop = threading.Event()
        with InferenceServer(Constant()) as server:
            assert server.url is not None
            infer = f"{server.url}/v2/models/const/infer"

            def load() -> None:
                while not stop.is_set():
                    urllib.request.urlopen(infer, INFER_BODY, timeout=10).read()
                    time.sleep(0.005)

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            reporter = ServeReporter(
                lambda report: client.log_event(TOPIC, report), server.url, server.metrics.registry
            )
            reporter.start()
            try:
                # And one whose figures are known: five reports a second apart, each
                # interval 100 requests/s (the last one 99 of 100 within 5 ms), 2 errors/s,
                # 300 records/s.
                now = time.time()
                for i in range(-4, 1):
                    n = 1100 + 100 * i
                    client.log_event(
                        TOPIC,
                        {
                            "kind": "serve",
                            "server": fixed,
                            "time": now + i,
                            "requests_total": n,
                            "errors_total": 12 + 2 * i,
                            "records_total": 3 * n,
                            "latency_buckets": [0.001, 0.005, 0.01, math.inf],
                            "latency_counts": [n // 2, n - (i == 0), n, n],
                            "dense_version": 7,
                            "dense_age_s": 30.0,
                            "sparse_age_s": 0.5,
                        },
                    )

                def shown() -> dict[str, list[str]] | None:
                    table = {row[0]: row for row in cells(browser, "servers")}
                    real = table.get(server.url or "")
                    ok = fixed in table and real is not None and real[1] not in (DASH, "0.0")
                    return table if ok else None

                table = wait_until(shown, "both servers on the page", timeout_s=30, interval_s=0.25)
                assert not browser.execute_script(
                    "return document.getElementById('serving').hidden;"
                )
                row = table[fixed]
                assert row[1:6] == ["100", "5.00", "2.0", "300", "7"]
                dense_age, rows_age = (float(c.removesuffix(" s")) for c in row[6:8])
                assert 30.0 <= dense_age < 40.0  # 30 s when reported, older since
                assert 0.5 <= rows_age < 10.0
                assert row[8].endswith(" s ago")
                real = table[server.url]
                assert float(real[1]) > 0  # requests/s
                assert float(real[2]) > 0  # p99 ms
                assert float(real[4]) > 0  # records/s, one per request
                assert real[5:8] == ["none yet", DASH, DASH]  # no freshness collector here

                # The head figures: all servers, the slowest and the stalest.
                assert float(text(browser, "serve-requests-per-s").replace(",", "")) > 100
                assert float(text(browser, "serve-p99")) >= 5.0
                assert text(browser, "serve-dense-version") == "7"
                assert 0.5 <= float(text(browser, "serve-rows-age").removesuffix(" s")) < 10
                assert "2 server(s)" in text(browser, "status")
                # Charts over time: requests/s and errors/s, and the p99, of both servers.
                # 4 intervals of the known server, 1 and more of the real one.
                wait_until(
                    lambda: chart(browser, "chart-serve-requests")[0] >= 10,
                    "charts",
                    timeout_s=10,
                    interval_s=0.25,
                )
                assert chart(browser, "chart-serve-p99")[0] >= 5
                legend = text(browser, "legend-serving")
                assert fixed in legend
                assert server.url in legend

                data = json.loads(get(f"{base}/streamrec/data.json"))
                assert data["servers"][fixed]["p99_ms"] == 5.0
                assert data["servers"][server.url]["requests_total"] > 0
                metrics = scrape(f"{base}/metrics")
                assert metrics[("streamrec_serve_requests_per_second", (("server", fixed),))] == 100
                key = ("streamrec_serve_infer_latency_p99_seconds", (("server", fixed),))
                assert metrics[key] == 0.005
                shot = tmp_path / "streamrec-serving.png"
                assert browser.save_screenshot(str(shot))
            finally:
                reporter.close()
                stop.set()
                loader.join(timeout=10)
        assert reporter.failures == 0
        assert reporter.sent >= 2


# --- a real job --------------------------------------------------------------------------


@dataclass
class RunningJob:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def find(self, pattern: str) -> re.Match[str] | None:
        for line in list(self.lines):
            m = re.search(pattern, line)
            if m:
                return m
        return None

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        def check() -> re.Match[str] | None:
            if self.proc.poll() is not None:
                pytest.fail("the job ended early:\n" + "".join(self.lines)[-3000:])
            return self.find(pattern)

        m: re.Match[str] = wait_until(
            check, f"job output {pattern!r}", timeout_s=timeout, interval_s=0.25
        )
        return m


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningJob]:
    """A job that trains until the module's tests are done with it."""
    tmp = tmp_path_factory.mktemp("watched")
    path = write_synthetic_job(
        tmp,
        store=synthetic_store_section(dim=4, row_dtype="float32"),
        source={"kind": "synthetic", "seed": 4, "partitions": 2, "events": 5_000_000},
        trainer={
            "mode": "hybrid",
            "staleness": 2,
            "batch_size": 500,
            "model": {"kind": "ffnn", "hidden": [16]},
            "torch_threads": 1,
            "log_every_s": 0.5,
            "checkpoint": {"every_s": 3, "every_steps": None},
        },
        cluster={"workers": 1, "store_shards": 2, "dashboard_address": "127.0.0.1:0"},
    )
    proc = subprocess.Popen(
        [*STREAMREC, "run", str(path), "--max-time", "600"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    running = RunningJob(proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            running.lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        running.wait_for(r"Dask dashboard: (http://\S+)/status")
        yield running
    finally:
        proc.send_signal(signal.SIGINT)  # a clean stop: checkpoint, then everything down
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, "".join(running.lines)[-3000:]


def dashboard(job: RunningJob) -> str:
    return job.wait_for(r"Dask dashboard: (http://\S+)/status").group(1)


def shard_addresses(job: RunningJob) -> list[str]:
    return job.wait_for(r"store: grpc://(\S+)").group(1).split(",")


def test_metrics_move_while_the_job_trains(job: RunningJob) -> None:
    url = f"{dashboard(job)}/metrics"
    key = ("streamrec_trainer_samples_total", (("rank", "0"),))
    first = wait_until(lambda: scrape(url).get(key), "a first trainer report", interval_s=0.25)
    second = wait_until(
        lambda: (v := scrape(url).get(key, 0)) > first and v, "more samples", interval_s=0.25
    )
    assert second > first
    metrics = scrape(url)
    for shard in shard_addresses(job):
        assert metrics[("streamrec_store_rows", (("shard", shard), ("table", "c3")))] > 0
    lag = [v for (name, _), v in metrics.items() if name == "streamrec_source_lag"]
    assert len(lag) == 2
    assert all(v > 0 for v in lag)  # 5M events a partition: far from done
    assert metrics[("streamrec_trainer_auc", (("rank", "0"),))] > 0.5


def test_every_shard_serves_its_own_metrics(job: RunningJob) -> None:
    wait_until(
        lambda: len(shard_metric_urls(job)) == 2,
        "both shards announce their metrics",
        interval_s=0.25,
    )
    for i, (url, address) in enumerate(
        zip(shard_metric_urls(job), shard_addresses(job), strict=True)
    ):
        key = ("streamrec_store_lookup_seconds_count", (("shard", address),))
        first = wait_until(
            lambda u=url, k=key: scrape(u).get(k), f"shard {i} lookups", interval_s=0.25
        )
        wait_until(
            lambda u=url, k=key, f=first: scrape(u).get(k, 0) > f,
            f"shard {i} lookups move",
            interval_s=0.25,
        )


def shard_metric_urls(job: RunningJob) -> list[str]:
    return re.findall(r"store shard \d+ metrics: (http://\S+/metrics)", "".join(job.lines))


def test_the_page_shows_live_values_in_a_real_browser(job: RunningJob, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with chromium(tmp_path) as browser:
        base = dashboard(job)
        # Reached the way a user does: from the dashboard's menu bar.
        browser.get(f"{base}/status")
        WebDriverWait(browser, 60).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, 'a[href="streamrec"]')
        )
        browser.find_element(By.CSS_SELECTOR, 'a[href="streamrec"]').click()
        WebDriverWait(browser, 30).until(lambda b: b.current_url.endswith("/streamrec"))

        # The page rebuilds its charts and tables every second: read them in the page,
        # in one script call, so an element replaced between a lookup and a read
        # (StaleElementReferenceException) cannot happen.
        def live(chart: str) -> bool:
            last = browser.execute_script(
                "const e = document.getElementById(arguments[0]);"
                "return e ? e.getAttribute('data-last') : null;",
                chart,
            )
            return bool(last) and float(last) > 0

        WebDriverWait(browser, 90).until(
            lambda b: live("chart-throughput") and live("chart-auc") and live("chart-loss")
        )
        WebDriverWait(browser, 30).until(lambda b: live("chart-staleness"))
        # Hybrid trains fresh rows by default: the rows it trained are counted per row.
        WebDriverWait(browser, 30).until(lambda b: live("chart-row-staleness"))
        stale = browser.execute_script(
            "return document.getElementById('rows-trained-stale').textContent;"
        )
        assert re.fullmatch(r"\d+(\.\d+)?%", stale.strip()), stale
        total = browser.execute_script(
            "return document.getElementById('samples-total').textContent;"
        )
        assert float(total.strip().replace(",", "")) > 0

        def column(table: str, index: int) -> list[str]:
            texts = browser.execute_script(
                "return Array.from(document.querySelectorAll(arguments[0]))"
                ".map(c => c.textContent.trim());",
                f"#{table} tbody tr td:nth-child({index})",
            )
            return sorted(texts)

        WebDriverWait(browser, 30).until(lambda b: len(column("shards", 2)) == 2)
        assert column("shards", 2) == sorted(shard_addresses(job))
        assert column("partitions", 1) == ["synthetic/0", "synthetic/1"]
        WebDriverWait(browser, 30).until(lambda b: column("checkpoint", 1))
        # No server reports to this job: no Serving section.
        assert browser.execute_script("return document.getElementById('serving').hidden;")
        shot = tmp_path / "streamrec-page.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_answers_as_soon_as_its_address_is_printed(tmp_path: Path) -> None:
    """The page used to answer 404 for 4-5 s after `training page: URL` was printed."""
    path = write_synthetic_job(
        tmp_path,
        store=synthetic_store_section(dim=4),
        source={"kind": "synthetic", "seed": 1, "partitions": 1, "events": 100_000},
        trainer={"batch_size": 500, "model": {"kind": "ffnn", "hidden": [8]}},
        cluster={"workers": 1, "store_shards": 1, "dashboard_address": "127.0.0.1:0"},
    )
    proc = subprocess.Popen(
        [*STREAMREC, "run", str(path), "--max-events", "2000"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        page = None
        for line in proc.stdout:
            m = re.match(r"training page: (http://\S+/streamrec)", line)
            if m:
                page = m.group(1)
                break
        assert page is not None, "the job printed no page address"
        with urllib.request.urlopen(page, timeout=10) as reply:  # at once, no retry
            assert reply.status == 200
            assert b"streamrec" in reply.read()
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0

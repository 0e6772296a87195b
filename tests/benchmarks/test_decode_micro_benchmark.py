"""``benchmarks/decode_micro.py`` on 300 records, one round: every decoder decodes and reports.

The script first checks each decoder's verdicts against the scanner's (on the
timed records and on the awkward ones), so this short run also keeps those
checks passing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_positive, run_benchmark

pytestmark = pytest.mark.processes

DECODERS = ["json_scanner", "pyarrow_json", "pyarrow_json_lean"]
OPTIONAL = ["orjson", "simdjson"]  # skipped, and said so, where not installed


def test_every_decoder_reports_its_rate(tmp_path: Path) -> None:
    figures = run_benchmark(
        "decode_micro.py", tmp_path / "decode.json", "--records", "300", "--repeats", "1"
    )
    assert figures["records"] == 300
    installed = [
        name for name in OPTIONAL if not any(s.startswith(f"{name}:") for s in figures["skipped"])
    ]
    decoders = DECODERS + installed
    keys = ["json_bytes_per_record", "python_baseline_events_per_s", "json_vs_baseline"]
    keys += ["criteo_tsv_decode_events_per_s", "arrow_decode_events_per_s"]
    for name in decoders:
        keys += [f"{name}_events_per_s", f"{name}_1pct_bad_events_per_s"]
    for name in decoders[1:]:
        keys += [f"{name}_vs_scanner", f"{name}_vs_scanner_1pct_bad"]
    assert_positive(figures, keys)

"""Decode throughput of the codecs on Criteo-like records, one core.

    python benchmarks/decode_micro.py [--records 100000] [--repeats 5] [--json out.json]

Records have 1 label, 13 dense fields (ints, 10% missing) and 26 string fields
(8 hex digits), as Criteo's. Figures (events per second, the best of
``--repeats`` runs, each decoding all ``--records`` as one chunk):

- ``json_decode_events_per_s``: ``JsonLinesCodec.decode`` (the target figure);
- ``json_decode_1pct_bad_events_per_s``: the same with 1% of the records bad
  (a string label), the cost of isolating them;
- ``json_arrow_engine_events_per_s``: ``JsonLinesCodec(engine="arrow")``, which
  reads with ``pyarrow.json``;
- ``python_baseline_events_per_s``: a per-record ``json.loads`` loop that
  builds columns and checks the labels, as a pandas-style decoder does;
- ``json_vs_baseline``: the ratio of the first to the third;
- ``criteo_tsv_decode_events_per_s``, ``arrow_decode_events_per_s``: the other
  codecs (Arrow payloads of 1,000 rows).

Arrow and numpy may start threads; the pyarrow readers are told not to use them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import CRITEO_DENSE, CRITEO_SPARSE, criteo_spec, print_figures, write_json

from connectors.codecs import ArrowIpcCodec, Codec, CriteoTsvCodec, JsonLinesCodec
from connectors.types import Chunk, RawChunk


def criteo_table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, Any] = {"label": rng.integers(0, 2, n).astype(np.float64)}
    for d in CRITEO_DENSE:
        values = rng.integers(0, 1000, n).astype(np.float64)
        cols[d] = pa.array(values, mask=rng.random(n) < 0.1)
    for s in CRITEO_SPARSE:
        cols[s] = [f"{v:08x}" for v in rng.integers(0, 2**32, n).tolist()]
    return pa.table(cols)


def best_rate(fn: Callable[[], object], n: int, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def python_baseline(payloads: list[bytes]) -> dict[str, list[Any]]:
    """Per-record json.loads into columns with a label check: what a pandas-style reader does."""
    names = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
    cols: dict[str, list[Any]] = {k: [] for k in names}
    for p in payloads:
        rec = json.loads(p)
        label = rec.get("label")
        if not isinstance(label, (int, float)) or not 0 <= label <= 1:
            continue
        for k in names:
            cols[k].append(rec.get(k))
    return cols


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    n, repeats = args.records, args.repeats
    spec = criteo_spec()
    table = criteo_table(n)
    chunk = Chunk("bench", "events/0", 0, n)

    def rate(codec: Codec, payloads: list[bytes], records: int) -> float:
        raw = RawChunk(chunk, np.arange(len(payloads), dtype=np.int64), payloads)
        good, _ = codec.decode(raw, spec)  # warm up, and check
        assert good.num_rows > 0
        return best_rate(lambda: codec.decode(raw, spec), records, repeats)

    json_payloads = JsonLinesCodec().encode(table)
    bad = list(json_payloads)
    for i in range(0, n, 100):
        bad[i] = b'{"label":"1"' + bad[i][len(b'{"label":1.0') :]
    figures = {
        "records": n,
        "json_bytes_per_record": sum(map(len, json_payloads)) / n,
        "json_decode_events_per_s": rate(JsonLinesCodec(), json_payloads, n),
        "json_decode_1pct_bad_events_per_s": rate(JsonLinesCodec(), bad, n),
        "json_arrow_engine_events_per_s": rate(JsonLinesCodec(engine="arrow"), json_payloads, n),
        "python_baseline_events_per_s": best_rate(
            lambda: python_baseline(json_payloads), n, max(1, repeats // 2)
        ),
        "criteo_tsv_decode_events_per_s": rate(CriteoTsvCodec(), CriteoTsvCodec().encode(table), n),
        "arrow_decode_events_per_s": rate(
            ArrowIpcCodec(), ArrowIpcCodec(rows_per_payload=1000).encode(table), n
        ),
    }
    figures["json_vs_baseline"] = (
        figures["json_decode_events_per_s"] / figures["python_baseline_events_per_s"]
    )
    print_figures(figures, lambda v: f"{v:>14,.1f}", width=36, sep=" ")
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()

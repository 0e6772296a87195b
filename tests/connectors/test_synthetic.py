"""SyntheticSource: determinism, the stream's distribution, the hidden model, helpers.

It also runs the source contract suite (``tests/connectors/contract.py``), as
``test_parquet.py`` does for ``ParquetSource``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from connectors.synthetic import (
    DENSE_NAMES,
    HOT_IDS_CARDINALITIES,
    HOT_IDS_PRESET,
    SPARSE_NAMES,
    SyntheticConfig,
    SyntheticSource,
    iter_json_lines,
    synthetic_feature_spec,
    synthetic_store_tables,
    table_schema,
    write_parquet,
)
from connectors.types import Chunk, Source
from embedding_store.types import StoreConfig
from tests.connectors.contract import CONTRACT_CHECKS, check_empty, table_of
from trainer.metrics import auc, best_auc

REPO = Path(__file__).resolve().parents[2]

# --- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def src() -> SyntheticSource:
    return SyntheticSource(SyntheticConfig(seed=7))


def _digest(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


# --- contract ---------------------------------------------------------------------


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
def test_contract(check: Callable[[Source], None]) -> None:
    check(SyntheticSource(SyntheticConfig(seed=3, partitions=3, events=1500, chunk_size=400)))


def test_contract_empty() -> None:
    check_empty(SyntheticSource(SyntheticConfig(events=0, partitions=2)))


def test_is_a_source() -> None:
    source: Source = SyntheticSource(SyntheticConfig(events=1))
    assert source.name == "synthetic"


# --- determinism ------------------------------------------------------------------


def test_same_chunk_same_records(src: SyntheticSource) -> None:
    chunk = src.plan("synthetic/0", 1000, 500)
    assert chunk is not None
    assert table_of(src.read(chunk)).equals(table_of(src.read(chunk)))
    # A fresh source with an equal config (another worker) reads the same records.
    assert table_of(SyntheticSource(SyntheticConfig(seed=7)).read(chunk)).equals(
        table_of(src.read(chunk))
    )


def test_records_do_not_depend_on_chunking(src: SyntheticSource) -> None:
    whole = src.records(0, 0, 3000)
    parts = [src.records(0, s, 1000) for s in (0, 1000, 2000)]
    assert pa.concat_tables(parts).equals(whole)
    assert src.records(0, 1234, 1).equals(whole.slice(1234, 1))


@pytest.mark.processes
def test_same_records_in_another_process(src: SyntheticSource) -> None:
    code = (
        "import hashlib, pyarrow as pa\n"
        "from connectors.synthetic import SyntheticConfig, SyntheticSource\n"
        "from connectors.types import Chunk\n"
        "t = SyntheticSource(SyntheticConfig(seed=7, partitions=2)).read(\n"
        "    Chunk('synthetic', 'synthetic/1', 5000, 6000)).table\n"
        "sink = pa.BufferOutputStream()\n"
        "with pa.ipc.new_stream(sink, t.schema) as w:\n"
        "    w.write_table(t)\n"
        "print(hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    here = SyntheticSource(SyntheticConfig(seed=7, partitions=2)).records(1, 5000, 1000)
    assert out.stdout.strip() == _digest(here)


def test_seeds_and_partitions_differ(src: SyntheticSource) -> None:
    a = src.records(0, 0, 200)
    other_seed = SyntheticSource(SyntheticConfig(seed=8)).records(0, 0, 200)
    other_part = src.records(1, 0, 200)
    for t in (other_seed, other_part):
        assert not t.equals(a)
        same = np.mean(np.array(t["C1"].to_pylist()) == np.array(a["C1"].to_pylist()))
        assert same < 0.5
    # Another seed is another world: other strings for the same field.
    assert not set(a["C3"].to_pylist()) & set(other_seed["C3"].to_pylist())


# Every option changes the records (or the plan): none is accepted and ignored.
RECORD_OPTIONS: dict[str, Any] = {
    "seed": 1,
    "base_ctr": 0.05,
    "signal": 2.0,
    "drift_rate": 1.0,
    "new_id_rate": 0.2,
    "new_id_uses": 2.0,
    "new_id_window": 1000,
    "zipf_exponent": 1.5,
    "cardinalities": (7,) * 26,
    "dense_missing": (0.5,) * 13,
    "interaction": 1.0,
    "session_length": 50,
    "preset": "hot_ids",
}


@pytest.mark.parametrize(("option", "value"), RECORD_OPTIONS.items(), ids=RECORD_OPTIONS.keys())
def test_every_option_changes_the_records(option: str, value: Any) -> None:
    start = 2_000_000  # past the new-id window, with visible drift
    base = SyntheticSource(SyntheticConfig()).records(0, start, 3000)
    changed = SyntheticSource(SyntheticConfig(**{option: value})).records(0, start, 3000)
    assert not changed.equals(base)


# These shape the user x item term, so they change the records once it is on.
INTERACTION_OPTIONS: dict[str, Any] = {"interaction_fields": ("C3", "C7"), "interaction_dim": 3}


@pytest.mark.parametrize(
    ("option", "value"), INTERACTION_OPTIONS.items(), ids=INTERACTION_OPTIONS.keys()
)
def test_interaction_options_change_the_records(option: str, value: Any) -> None:
    base = SyntheticSource(SyntheticConfig(interaction=1.0)).records(0, 0, 3000)
    changed = SyntheticSource(SyntheticConfig(interaction=1.0, **{option: value}))
    assert not changed.records(0, 0, 3000).equals(base)


def test_no_interaction_leaves_the_stream_as_it_was() -> None:
    # With the term off (the default) its other options are not read: every existing
    # stream, and the calibrated bias, stay the same.
    base = SyntheticSource(SyntheticConfig(seed=4))
    other = SyntheticSource(SyntheticConfig(seed=4, **INTERACTION_OPTIONS))
    assert other.records(0, 1000, 2000).equals(base.records(0, 1000, 2000))
    assert best_auc(other, 5000) == best_auc(base, 5000)


def test_interaction_is_a_user_x_item_term() -> None:
    # Without per-field weights or dense terms the truth is the pair's term alone...
    pairs_only = SyntheticSource(SyntheticConfig(signal=0.0, interaction=2.0))
    assert best_auc(pairs_only, 50_000) > 0.75
    # ...which neither id explains by itself: the click rates of C1's head ids, over
    # all the items they meet, stay near the mean.
    t = pairs_only.records(0, 0, 100_000)
    users = np.array(t["C1"].to_pylist())
    clicks = t["click"].to_numpy()
    values, counts = np.unique(users, return_counts=True)
    head = values[np.argsort(counts)[::-1][:5]]
    rates = [clicks[users == v].mean() for v in head]
    assert max(abs(r - clicks.mean()) for r in rates) < 0.05
    # A larger term is a larger share of what can be learned.
    hot = [SyntheticConfig(preset="hot_ids", interaction=x) for x in (0.0, 2.0)]
    low, high = (best_auc(SyntheticSource(c), 50_000) for c in hot)
    assert high > low + 0.05


def test_sessions_hold_one_user() -> None:
    cfg = SyntheticConfig(session_length=100, interaction_fields=("C2", "C1"))
    t = SyntheticSource(cfg).records(0, 0, 1000)
    users = np.array(t["C2"].to_pylist()).reshape(10, 100)  # the first interaction field
    assert all(len(set(s)) == 1 for s in users)
    assert len(set(users[:, 0])) > 5  # a new draw per session
    # The other fields are drawn per event, as without sessions.
    plain = SyntheticSource(SyntheticConfig(interaction_fields=("C2", "C1"))).records(0, 0, 1000)
    assert t["C1"].equals(plain["C1"])
    assert not t["C2"].equals(plain["C2"])
    # Users are drawn uniformly per session: no user holds most of them.
    many = SyntheticSource(SyntheticConfig(session_length=10, cardinalities=(50,) * 26))
    per_session = np.array(many.records(0, 0, 20_000)["C1"].to_pylist())[::10]
    _, counts = np.unique(per_session, return_counts=True)
    assert len(counts) == 50
    assert counts.max() < 3 * counts.mean()


def test_interaction_fields_are_checked() -> None:
    for bad in (("C1", "C1"), ("C1", "C27"), ("user", "C2")):
        with pytest.raises(ValidationError, match="interaction_fields"):
            SyntheticConfig(interaction_fields=bad)


def test_hot_ids_preset() -> None:
    cfg = SyntheticConfig(preset="hot_ids")
    assert cfg.cardinalities == HOT_IDS_CARDINALITIES
    assert (cfg.new_id_rate, cfg.interaction) == (0.0, HOT_IDS_PRESET["interaction"])
    assert max(cfg.cardinalities[2:]) <= 100
    # Fields given explicitly win over the preset's; a dump validates back to the same.
    mine = SyntheticConfig(preset="hot_ids", interaction=0.5, new_id_rate=0.01)
    assert (mine.interaction, mine.new_id_rate) == (0.5, 0.01)
    assert mine.cardinalities == HOT_IDS_CARDINALITIES
    assert SyntheticConfig.model_validate(mine.model_dump()) == mine
    # Hot ids: the busiest item is in about one event in eight, so a batch of 256 holds
    # it some 30 times; a user's session of 300 events fills most of a batch or two.
    t = SyntheticSource(cfg).records(0, 0, 256 * 40)
    for field, least in (("C1", 100), ("C2", 20)):
        ids = np.array(t[field].to_pylist()).reshape(40, 256)
        top = [np.unique(b, return_counts=True)[1].max() for b in ids]
        assert np.mean(top) > least, field


def test_hot_ids_from_a_job_yaml(tmp_path: Path) -> None:
    from deploy.config import load_config
    from deploy.job import build_source

    job = tmp_path / "job.yaml"
    job.write_text(
        "source: {kind: synthetic, preset: hot_ids, events: 1000, seed: 3}\n"
        "store: {tables: {c1: {dim: 4}}}\n"
    )
    src = build_source(load_config(job))
    assert isinstance(src, SyntheticSource)
    assert src.config == SyntheticConfig(preset="hot_ids", events=1000, seed=3)
    expected = SyntheticSource(SyntheticConfig(preset="hot_ids", seed=3)).records(0, 0, 1000)
    assert src.records(0, 0, 1000).equals(expected)


def test_plan_options() -> None:
    src = SyntheticSource(SyntheticConfig(name="s2", partitions=2, events=10, chunk_size=4))
    assert src.partitions() == ["s2/0", "s2/1"]
    chunk = src.plan("s2/1", 8, 100)
    assert chunk is not None
    assert (chunk.source, chunk.start, chunk.end) == ("s2", 8, 10)
    assert src.plan("s2/0", 0, 100) == Chunk("s2", "s2/0", 0, 4)
    assert src.plan("s2/0", 0, 3) == Chunk("s2", "s2/0", 0, 3)


def test_endless_stream() -> None:
    src = SyntheticSource(SyntheticConfig())
    assert src.end_position("synthetic/0") is None
    assert not src.is_finished("synthetic/0", 10**15)
    chunk = src.plan("synthetic/0", 10**12, 10)
    assert chunk is not None
    assert table_of(src.read(chunk)).num_rows == 10


@pytest.mark.parametrize("partition", ["synthetic/2", "synthetic/01", "synthetic/-1", "other/0"])
def test_unknown_partitions(partition: str) -> None:
    src = SyntheticSource(SyntheticConfig(partitions=2))
    with pytest.raises(KeyError, match=r"synthetic/0 \.\. synthetic/1"):
        src.plan(partition, 0, 10)


def test_bad_plan_and_chunk() -> None:
    src = SyntheticSource(SyntheticConfig(events=10))
    with pytest.raises(ValueError, match="position must be >= 0"):
        src.plan("synthetic/0", -1, 10)
    with pytest.raises(ValueError, match="max_records"):
        src.plan("synthetic/0", 0, 0)
    with pytest.raises(ValueError, match="cannot read"):
        src.read(Chunk("kafka", "synthetic/0", 0, 5))


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError, match="cardinalities"):
        SyntheticConfig(cardinalities=(10, 20))
    with pytest.raises(ValidationError, match="dense_missing"):
        SyntheticConfig(dense_missing=(1.0,) * 13)
    with pytest.raises(ValidationError, match="Extra inputs"):
        SyntheticConfig(drift=0.1)  # type: ignore[call-arg]
    cfg = SyntheticConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.seed = 3  # type: ignore[misc]


# --- the distribution -------------------------------------------------------------


def test_schema_and_values(src: SyntheticSource) -> None:
    t = src.records(0, 0, 20_000)
    assert t.schema.equals(table_schema())
    assert set(np.unique(t["click"].to_numpy()).tolist()) <= {0.0, 1.0}
    for name in SPARSE_NAMES:
        values = t[name].to_pylist()
        assert all(len(v) == 8 for v in values[:100])
        int(values[0], 16)  # hex, as in Criteo's logs
        assert t[name].null_count == 0
    for name in DENSE_NAMES:
        x = t[name].to_numpy(zero_copy_only=False)
        x = x[~np.isnan(x)]
        assert (x >= 0).all()
        assert (x == np.floor(x)).all()


def test_dense_missing_shares_and_heavy_tails(src: SyntheticSource) -> None:
    t = src.records(0, 0, 40_000)
    shares = [t[n].null_count / t.num_rows for n in DENSE_NAMES]
    expected = np.array(SyntheticConfig().dense_missing)
    assert np.abs(np.array(shares) - expected).max() < 0.02
    i5 = t["I5"].to_numpy(zero_copy_only=False)
    i5 = i5[~np.isnan(i5)]
    assert np.max(i5) > 100 * np.median(i5)  # a heavy tail, as Criteo's counts


def test_zipf_skew(src: SyntheticSource) -> None:
    t = src.records(0, 0, 50_000)
    # C3 has 10M ids, yet its few head ids are a large share of the traffic...
    _, counts = np.unique(np.array(t["C3"].to_pylist()), return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[:10].sum() > 0.2 * t.num_rows
    # ...and a long tail of ids seen once.
    assert (counts == 1).sum() > 0.1 * t.num_rows
    # C9 is a closed field of 3 values: Zipf over 3, most frequent first.
    _, c9 = np.unique(np.array(t["C9"].to_pylist()), return_counts=True)
    assert len(c9) == 3
    assert sorted(c9 / t.num_rows, reverse=True)[0] > 0.45


def _distinct(t: pa.Table, field: str) -> set[str]:
    return set(t[field].to_pylist())


def test_new_ids_appear_over_time() -> None:
    # C5 has 305 base ids: 50k events see them all, so later novelties are new ids.
    def novel(cfg: SyntheticConfig) -> int:
        s = SyntheticSource(cfg)
        early = _distinct(s.records(0, 0, 50_000), "C5")
        late = _distinct(s.records(0, 5_000_000, 20_000), "C5")
        return len(late - early)

    assert novel(SyntheticConfig(new_id_rate=0.0)) < 5
    assert novel(SyntheticConfig(new_id_rate=0.05)) > 50
    # Distinct ids keep growing with the number of events seen.
    s = SyntheticSource(SyntheticConfig())
    t = s.records(0, 0, 60_000)
    sizes = [len(_distinct(t.slice(0, n), "C5")) for n in (20_000, 40_000, 60_000)]
    assert sizes[0] < sizes[1] < sizes[2]
    # New ids are shared by the partitions (they are the same world at the same time).
    a = _distinct(s.records(0, 5_000_000, 20_000), "C5")
    b = _distinct(s.records(1, 5_000_000, 20_000), "C5")
    assert len(a & b) > 0.5 * len(a)


def test_closed_fields_get_no_new_ids() -> None:
    s = SyntheticSource(SyntheticConfig(new_id_rate=0.5))
    for field, k in (("C9", 3), ("C20", 4), ("C6", 24)):
        assert len(_distinct(s.records(0, 10_000_000, 20_000), field)) <= k


def test_ctr_near_base_and_steady_under_drift() -> None:
    for ctr in (0.03, 0.2):
        s = SyntheticSource(SyntheticConfig(base_ctr=ctr, drift_rate=0.5))
        at0 = s.records(0, 0, 40_000)["click"].to_numpy().mean()
        assert abs(at0 - ctr) < 0.25 * ctr
        for start in (3_000_000, 20_000_000):  # 1.5 and 10 radians of drift
            later = s.records(0, start, 40_000)["click"].to_numpy().mean()
            assert 0.5 * ctr < later < 1.7 * ctr


def test_drift_changes_the_truth_slowly(src: SyntheticSource) -> None:
    values = sorted(_distinct(src.records(0, 0, 5000), "C4"))
    w0 = src.weights("C4", values, 0)
    assert w0.std() > 0
    corr = [float(np.corrcoef(w0, src.weights("C4", values, p))[0, 1]) for p in (10**5, 10**6)]
    assert corr[0] > 0.999  # cos(0.01)
    assert 0.98 < corr[1] < 0.999  # cos(0.1)
    far = float(np.corrcoef(w0, src.weights("C4", values, 15_000_000))[0, 1])
    assert abs(far - np.cos(1.5)) < 0.15
    frozen = SyntheticSource(SyntheticConfig(seed=7, drift_rate=0.0))
    assert (frozen.weights("C4", values, 10**9) == frozen.weights("C4", values, 0)).all()
    with pytest.raises(KeyError, match="C27"):
        src.weights("C27", values, 0)


def test_click_probability_matches_clicks(src: SyntheticSource) -> None:
    chunk = Chunk("synthetic", "synthetic/0", 0, 50_000)
    p = src.click_probability(chunk)
    clicks = table_of(src.read(chunk))["click"].to_numpy()
    assert abs(p.mean() - clicks.mean()) < 0.01
    # Calibration: clicks per decile of p follow p.
    order = np.argsort(p)
    for part in np.array_split(order, 10):
        assert abs(p[part].mean() - clicks[part].mean()) < 0.03


# --- the best AUC -----------------------------------------------------------------


def test_best_auc_in_range_and_stable() -> None:
    values = []
    for seed in (0, 1, 2):
        s = SyntheticSource(SyntheticConfig(seed=seed))
        a, b = best_auc(s, 100_000), best_auc(s, 100_000, start=3_000_000)
        assert 0.7 < a < 0.9
        assert abs(a - b) < 0.02
        values.append(a)
    assert max(values) - min(values) < 0.05
    assert best_auc(SyntheticSource(SyntheticConfig(seed=0)), 100_000) == values[0]


def test_signal_sets_the_best_auc() -> None:
    assert abs(best_auc(SyntheticSource(SyntheticConfig(signal=0.0)), 50_000) - 0.5) < 0.02
    strong = best_auc(SyntheticSource(SyntheticConfig(signal=2.0)), 50_000)
    assert strong > best_auc(SyntheticSource(SyntheticConfig()), 50_000) + 0.03


def _auc_pairs(y: list[int], s: list[float]) -> float:
    pos = [si for yi, si in zip(y, s, strict=True) if yi == 1]
    neg = [si for yi, si in zip(y, s, strict=True) if yi == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), min_size=2, max_size=40).filter(
        lambda xs: len({x[0] for x in xs}) == 2
    )
)
def test_auc_equals_pair_counting(pairs: list[tuple[int, int]]) -> None:
    y = [p[0] for p in pairs]
    s = [p[1] / 5.0 for p in pairs]  # few distinct scores: many ties
    assert auc(y, s) == pytest.approx(_auc_pairs(y, s), abs=1e-12)


def test_auc_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="0 or 1"):
        auc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="finite"):
        auc([0, 1], [0.1, float("nan")])
    with pytest.raises(ValueError, match="length"):
        auc([0, 1], [0.1])


# --- helpers ----------------------------------------------------------------------


def test_feature_spec_and_store_tables() -> None:
    spec = synthetic_feature_spec()
    assert spec.labels == ["click"]
    assert [d.name for d in spec.dense] == list(DENSE_NAMES)
    assert all(d.transform == "log1p" and d.min_value == 0 for d in spec.dense)
    assert spec.tables() == {f"c{i}": (f"C{i}",) for i in range(1, 27)}
    tables = synthetic_store_tables(dim=16)
    store = StoreConfig(tables=tables)
    assert set(store.tables) == set(spec.tables())
    assert all(t.dim == 16 for t in store.tables.values())
    assert max(t.capacity for t in tables.values()) == 1 << 19
    small = synthetic_store_tables(config=SyntheticConfig(cardinalities=(5000,) * 26))
    assert {t.capacity for t in small.values()} == {20_000}


def test_json_lines_match_records() -> None:
    cfg = SyntheticConfig(seed=5, chunk_size=64)
    lines = list(iter_json_lines(cfg, events=150))
    assert len(lines) == 150
    expected = SyntheticSource(cfg).records(0, 0, 150).to_pylist()
    assert [json.loads(b) for b in lines] == expected
    assert list(iter_json_lines(cfg, events=0)) == []
    assert (
        json.loads(next(iter_json_lines(cfg, events=1, partition=1)))
        == (SyntheticSource(cfg).records(1, 0, 1).to_pylist()[0])
    )


def test_events_bounds() -> None:
    with pytest.raises(ValueError, match="endless"):
        next(iter_json_lines(SyntheticConfig(), events=None))
    with pytest.raises(ValueError, match=r"config\.events=5"):
        next(iter_json_lines(SyntheticConfig(events=5), events=6))
    assert len(list(iter_json_lines(SyntheticConfig(events=5)))) == 5


def test_write_parquet_rejects_bad_row_groups(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row_group_size"):
        write_parquet(tmp_path / "x.parquet", SyntheticConfig(), events=5, row_group_size=0)

"""A Criteo-like synthetic click stream with a known ground-truth model.

Each record has a label ``click``, 13 dense counts ``I1..I13`` (non-negative,
heavy-tailed, some missing) and 26 categorical fields ``C1..C26`` (8-hex-digit
strings, as in Criteo's logs). Categorical ids are Zipf-distributed over
Criteo's per-field cardinalities (3 to 10M+), and fields with an open
vocabulary keep receiving new ids. The click probability is the logistic of
a hidden sum of per-(field, value) weights plus a linear term on
``log1p(dense)``; the weights rotate slowly (drift), so yesterday's optimum
decays.

With ``interaction > 0`` the truth also holds a term that no per-field
weight can express: the dot product of hidden vectors of two fields' ids (a
user and an item, by default ``C1`` and ``C2``), which only their embeddings
can learn (it does not drift). With ``session_length > 1`` the first of those
fields (the user) comes in sessions: that many consecutive events share one
user, drawn uniformly, as a rating log's users rate a run of items at a time.
``preset="hot_ids"`` (``HOT_IDS_PRESET``) turns both on over small Zipf
vocabularies: the head items are in every batch and each user in the two or
three batches of a session, so a lookup that misses recent pushes reads their
rows stale. A job YAML names it as ``source: {kind: synthetic, preset: hot_ids}``.

Every record is a pure function of ``(seed, partition, position)`` (a
counter-based generator, no sequential state), so a chunk read twice, in any
process, with any chunking, gives the same records: a lost Dask task is simply
re-read.

>>> src = SyntheticSource(SyntheticConfig(seed=1, events=1000))
>>> src.partitions()
['synthetic/0']
>>> chunk = src.plan("synthetic/0", 0, 256)
>>> raw = src.read(chunk)
>>> raw.table.num_rows, raw.table.column_names[:3], raw.table.schema.field("C1").type
(256, ['click', 'I1', 'I2'], DataType(string))
>>> raw.table.equals(src.read(chunk).table)
True
>>> len(raw.table["C3"][0].as_py())
8
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numba as nb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from connectors.spec import DenseField, FeatureSpec, SparseField
from connectors.types import Chunk, RawChunk
from embedding_store.hashing import mix64, unit_float
from embedding_store.types import TABLE_NAME_PATTERN, TableConfig

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
LABEL_NAME = "click"

# The per-field cardinalities of the Criteo Kaggle (Display Advertising Challenge)
# data set, as used by the DLRM benchmarks: from 3 to 10.1M ids.
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# Share of missing values of I1..I13 in the Criteo Kaggle data (rounded).
CRITEO_DENSE_MISSING: tuple[float, ...] = (
    0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22,
)  # fmt: skip

# The ``hot_ids`` preset: every field a small vocabulary (C1 the users and C2 the
# items of a rating log the size of MovieLens 100K; the others Criteo's fields cut
# to at most 100 ids), no new ids, a user x item term larger than the per-field
# weights, so that most of what can be learned sits in the rows of hot ids, and
# users in sessions of 300 events. Sessions are what makes stale reads cost, as on
# MovieLens 100K, whose users rate a run of movies at a time: a new user's rows
# learn over a few consecutive batches, each reading them before the last push, so
# rows read a few pushes stale lose AUC against sync with sessions and not without
# (benchmarks/quality.py shows it).
HOT_IDS_CARDINALITIES: tuple[int, ...] = (
    1000,
    1700,
    *(min(c, 100) for c in CRITEO_CARDINALITIES[2:]),
)
HOT_IDS_PRESET: dict[str, Any] = {
    "cardinalities": HOT_IDS_CARDINALITIES,
    "new_id_rate": 0.0,
    "interaction": 2.0,
    "session_length": 300,
}

# Pareto tail index and scale of each dense count: small indices give the rare
# huge counts Criteo's I5 or I2 show, large ones near-constant small counts.
_DENSE_ALPHA = np.array(
    [1.2, 1.1, 1.5, 1.6, 1.1, 1.1, 1.3, 1.8, 1.2, 2.5, 1.7, 1.4, 1.6], dtype=np.float64
)
_DENSE_SCALE = np.array(
    [2.0, 50.0, 10.0, 5.0, 5000.0, 100.0, 10.0, 20.0, 60.0, 1.0, 2.0, 1.0, 5.0], dtype=np.float64
)
# Counts are capped like an int32 counter would be, so a tail draw never yields 1e15.
_DENSE_CAP = float(2**31 - 1)

# Fields with fewer base ids than this are closed vocabularies (device type,
# country, ...): they never receive new ids, whatever ``new_id_rate`` says.
OPEN_VOCABULARY_MIN = 100

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8).copy()
_HEX.setflags(write=False)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK32 = np.uint64(0xFFFFFFFF)
_S16 = np.uint64(16)
_S15 = np.uint64(15)
_S32 = np.uint64(32)
_S48 = np.uint64(48)
_LOW16 = np.uint64(0xFFFF)
_B32_M1 = np.uint64(0x7FEB352D)
_B32_M2 = np.uint64(0x846CA68B)
# Salts that separate the independent draws made from one event key.
_SALT_FIELD = np.uint64(0xD6E8FEB86659FD93)
_SALT_NEW = np.uint64(0xA0761D6478BD642F)
_SALT_AGE = np.uint64(0xE7037ED1A0B428DB)
_SALT_MISS = np.uint64(0x8EBC6AF09C88C6E3)
_SALT_DENSE = np.uint64(0x589965CC75374CC3)
_SALT_LABEL = np.uint64(0x1D8E4E27C47D124F)
_SALT_W1 = np.uint64(0xCA5A826395121157)
_SALT_VEC = np.uint64(0x9FB21C651E98DF25)
_SALT_SESSION = np.uint64(0x2D358DCCAA6C78A5)
# Mean and std of a sum of four uniform 16-bit lanes (Irwin-Hall, n = 4).
_LANES_MEAN = 4.0 * 65535.0 / 2.0
_LANES_STD = 65536.0 * (4.0 / 12.0) ** 0.5


class SyntheticConfig(BaseModel):
    """What stream ``SyntheticSource`` generates; every field has an effect (tested).

    >>> SyntheticConfig(seed=3, events=10).partitions
    1
    >>> hot = SyntheticConfig(preset="hot_ids", interaction=1.5)
    >>> hot.cardinalities[:3], hot.new_id_rate, hot.interaction, hot.session_length
    ((1000, 1700, 100), 0.0, 1.5, 300)
    >>> SyntheticConfig(evnts=10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for SyntheticConfig
    evnts
      Extra inputs are not permitted ...
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: Literal["criteo", "hot_ids"] = Field(
        "criteo",
        description="defaults of the other fields: criteo (as listed) or hot_ids "
        "(HOT_IDS_PRESET); fields given explicitly win",
    )
    name: str = Field("synthetic", pattern=TABLE_NAME_PATTERN.pattern, description="source name")
    seed: int = Field(0, ge=0, lt=1 << 63, description="the world: ids, truth and events")
    partitions: int = Field(1, ge=1, le=1 << 16, description="partitions of the stream")
    events: int | None = Field(None, ge=0, description="events per partition; None = endless")
    chunk_size: int = Field(
        65536, ge=1, le=1 << 22, description="most records per planned chunk (and per write)"
    )
    base_ctr: float = Field(0.2, ge=0.001, le=0.5, description="mean click rate at position 0")
    signal: float = Field(1.0, ge=0.0, le=10.0, description="scale of the hidden logits")
    drift_rate: float = Field(
        0.1, ge=0.0, description="rotation of the hidden weights, radians per million events"
    )
    new_id_rate: float = Field(
        0.02, ge=0.0, le=0.5, description="share of open-field values that are recent new ids"
    )
    new_id_uses: float = Field(8.0, ge=1.0, description="mean occurrences of one new id")
    new_id_window: int = Field(
        200_000, ge=1, description="a new id is drawn from those born in the last N events"
    )
    zipf_exponent: float = Field(1.1, gt=0.0, le=4.0, description="skew of the ids' popularity")
    cardinalities: tuple[int, ...] = Field(
        CRITEO_CARDINALITIES, description="distinct ids of each sparse field"
    )
    dense_missing: tuple[float, ...] = Field(
        CRITEO_DENSE_MISSING, description="share of missing values of each dense field"
    )
    interaction: float = Field(
        0.0, ge=0.0, le=10.0, description="scale of the hidden user x item term (0: none)"
    )
    interaction_fields: tuple[str, str] = Field(
        ("C1", "C2"), description="the two sparse fields whose ids' hidden vectors meet"
    )
    interaction_dim: int = Field(8, ge=1, le=256, description="length of the hidden vectors")
    session_length: int = Field(
        1,
        ge=1,
        le=1 << 20,
        description="consecutive events that share one id of the first interaction field "
        "(a user's session); 1: drawn per event",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        # A preset only fills in what the caller left out, so that a YAML file can name
        # it and still change any one field.
        if isinstance(data, dict) and data.get("preset") == "hot_ids":
            return {**HOT_IDS_PRESET, **data}
        return data

    @field_validator("interaction_fields")
    @classmethod
    def _interaction_fields(cls, v: tuple[str, str]) -> tuple[str, str]:
        if v[0] == v[1] or any(f not in SPARSE_NAMES for f in v):
            msg = f"interaction_fields: need two different fields of C1..C{NUM_SPARSE}, got {v}"
            raise ValueError(msg)
        return v

    @field_validator("cardinalities")
    @classmethod
    def _cardinalities(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(v) != NUM_SPARSE or any(c < 1 or c > 1 << 31 for c in v):
            msg = (
                f"cardinalities: need {NUM_SPARSE} integers in [1, 2**31] "
                f"(one per C1..C26), got {len(v)}: {v}"
            )
            raise ValueError(msg)
        return v

    @field_validator("dense_missing")
    @classmethod
    def _dense_missing(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if len(v) != NUM_DENSE or any(not 0.0 <= m < 1.0 for m in v):
            msg = (
                f"dense_missing: need {NUM_DENSE} shares in [0, 1) (one per I1..I13), "
                f"got {len(v)}: {v}"
            )
            raise ValueError(msg)
        return v


# --- kernels --------------------------------------------------------------------


@nb.njit(nogil=True, cache=True, inline="always")
def _bij32(x: np.uint64) -> np.uint64:
    """A bijection of 32-bit integers (Wellons' lowbias32): distinct ids, distinct strings."""
    x &= _MASK32
    x ^= x >> _S16
    x = (x * _B32_M1) & _MASK32
    x ^= x >> _S15
    x = (x * _B32_M2) & _MASK32
    return x ^ (x >> _S16)


@nb.njit(nogil=True, cache=True, inline="always")
def _gauss(h: np.uint64) -> float:
    """An approximately standard normal value from one hash (a sum of four 16-bit lanes)."""
    s = (
        float(h & _LOW16)
        + float((h >> _S16) & _LOW16)
        + float((h >> _S32) & _LOW16)
        + float(h >> _S48)
    )
    return (s - _LANES_MEAN) / _LANES_STD


@nb.njit(nogil=True, cache=True, inline="always")
def _weight(value: np.uint64, wsalt: np.uint64, c: float, s: float) -> float:
    """The hidden weight of one (field, value) at drift angle (cos c, sin s)."""
    k = mix64(value ^ wsalt)
    return c * _gauss(k) + s * _gauss(mix64(k ^ _SALT_W1))


@nb.njit(nogil=True, cache=True, inline="always")
def _hidden_dot(
    a: np.uint64, b: np.uint64, salt_a: np.uint64, salt_b: np.uint64, dim: int
) -> float:
    """The dot product of the hidden vectors of values ``a`` and ``b``, about N(0, 1)."""
    ka = mix64(a ^ salt_a)
    kb = mix64(b ^ salt_b)
    acc = 0.0
    for k in range(dim):
        step = np.uint64(k + 1) * _SALT_VEC
        acc += _gauss(mix64(ka + step)) * _gauss(mix64(kb + step))
    return acc / float(np.sqrt(float(dim)))


@nb.njit(nogil=True, cache=True)
def _generate(
    stream_key: np.uint64,
    start: int,
    card: npt.NDArray[np.int64],
    zipf_a: npt.NDArray[np.float64],
    zipf_inv: float,
    zipf_log: bool,
    open_vocab: npt.NDArray[np.bool_],
    new_rate: float,
    births: float,
    window: float,
    salt32: npt.NDArray[np.uint64],
    wsalt: npt.NDArray[np.uint64],
    scale: npt.NDArray[np.float64],
    center0: npt.NDArray[np.float64],
    center1: npt.NDArray[np.float64],
    theta_per_event: float,
    miss: npt.NDArray[np.float64],
    alpha_inv: npt.NDArray[np.float64],
    dscale: npt.NDArray[np.float64],
    beta: npt.NDArray[np.float64],
    inter: float,
    inter_fields: npt.NDArray[np.int64],
    inter_dim: int,
    vsalt: npt.NDArray[np.uint64],
    session_len: int,
    chars: npt.NDArray[np.uint8],
    dense: npt.NDArray[np.float64],
    valid: npt.NDArray[np.bool_],
    logit: npt.NDArray[np.float64],
    u_label: npt.NDArray[np.float64],
) -> None:
    n = logit.shape[0]
    n_sparse = card.shape[0]
    n_dense = miss.shape[0]
    for i in range(n):
        t = start + i
        # Counter-based: the event's key depends on (stream, position) only.
        ev = mix64((np.uint64(t) * _GOLDEN) ^ stream_key)
        theta = theta_per_event * t
        c = np.cos(theta)
        s = np.sin(theta)
        acc = 0.0
        va = np.uint64(0)
        vb = np.uint64(0)
        for f in range(n_sparse):
            if session_len > 1 and f == inter_fields[0]:
                # One user per session, uniform over the users: hot while the session
                # lasts (as a rating log's users, who rate a batch of items at a time).
                sk = mix64((np.uint64(t // session_len) * _GOLDEN) ^ stream_key ^ _SALT_SESSION)
                h = mix64(sk + np.uint64(f + 1) * _SALT_FIELD)
                rank = min(int(unit_float(h) * card[f]), card[f] - 1)
            else:
                h = mix64(ev + np.uint64(f + 1) * _SALT_FIELD)
                u = unit_float(h)
                x = np.exp(u * zipf_a[f]) if zipf_log else (1.0 - u * zipf_a[f]) ** zipf_inv
                rank = min(max(int(x) - 1, 0), card[f] - 1)
            ident = rank
            if open_vocab[f]:
                h2 = mix64(h ^ _SALT_NEW)
                if unit_float(h2) < new_rate:
                    # A recently born id: uniform over the births of the last `window` events.
                    age = unit_float(mix64(h2 ^ _SALT_AGE)) * min(float(t), window)
                    ident = card[f] + int((float(t) - age) * births)
            v = _bij32(np.uint64(ident) ^ salt32[f])
            acc += scale[f] * (_weight(v, wsalt[f], c, s) - c * center0[f] - s * center1[f])
            if f == inter_fields[0]:
                va = v
            elif f == inter_fields[1]:
                vb = v
            base = i * 8
            for k in range(8):
                chars[f, base + k] = _HEX[(v >> np.uint64(28 - 4 * k)) & np.uint64(0xF)]
        if inter > 0.0:
            acc += inter * _hidden_dot(va, vb, vsalt[0], vsalt[1], inter_dim)
        for d in range(n_dense):
            hd = mix64(ev + np.uint64(d + 1) * _SALT_DENSE)
            if unit_float(mix64(hd ^ _SALT_MISS)) < miss[d]:
                valid[d, i] = False
                dense[d, i] = 0.0
            else:
                # Pareto counts by inversion; 1 - u is in (0, 1], so the log is finite.
                val = np.floor(
                    dscale[d] * (np.exp(-np.log(1.0 - unit_float(hd)) * alpha_inv[d]) - 1.0)
                )
                val = min(val, _DENSE_CAP)
                valid[d, i] = True
                dense[d, i] = val
                acc += beta[d] * np.log1p(val)
        logit[i] = acc
        u_label[i] = unit_float(mix64(ev ^ _SALT_LABEL))


@nb.njit(nogil=True, cache=True)
def _weights_of(
    values: npt.NDArray[np.uint64], wsalt: np.uint64, c: float, s: float
) -> npt.NDArray[np.float64]:
    out = np.empty(values.shape[0], dtype=np.float64)
    for i in range(values.shape[0]):
        out[i] = _weight(values[i], wsalt, c, s)
    return out


@nb.njit(nogil=True, cache=True)
def _string_values(ids: npt.NDArray[np.int64], salt32: np.uint64) -> npt.NDArray[np.uint64]:
    out = np.empty(ids.shape[0], dtype=np.uint64)
    for i in range(ids.shape[0]):
        out[i] = _bij32(np.uint64(ids[i]) ^ salt32)
    return out


# --- helpers --------------------------------------------------------------------


def _key(*parts: object) -> np.uint64:
    """A 64-bit key from any parts (blake2b: stable across processes and machines)."""
    digest = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _gauss_of(key: np.uint64) -> float:
    return float(_gauss(key))


def _sigmoid(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    out: npt.NDArray[np.float64] = 0.5 * (1.0 + np.tanh(0.5 * x))  # stable for any |x|
    return out


def table_schema() -> pa.Schema:
    """The Arrow schema of the synthetic records.

    >>> table_schema().names[:2], table_schema().field("I1").nullable
    (['click', 'I1'], True)
    """
    return pa.schema(
        [pa.field(LABEL_NAME, pa.float64(), nullable=False)]
        + [pa.field(n, pa.float64()) for n in DENSE_NAMES]
        + [pa.field(n, pa.string(), nullable=False) for n in SPARSE_NAMES]
    )


# --- the source -----------------------------------------------------------------


class SyntheticSource:
    """A ``Source`` of ``config.partitions`` partitions ``"<name>/<i>"`` of synthetic events.

    Positions are sample indices from 0; a partition ends at ``config.events``
    (never when None). ``plan`` returns at most ``min(max_records,
    config.chunk_size)`` records. Construction calibrates the hidden bias so the
    click rate at position 0 is ``config.base_ctr`` (deterministic from the seed).

    >>> src = SyntheticSource(SyntheticConfig(events=100, partitions=2, chunk_size=64))
    >>> src.partitions(), src.end_position("synthetic/1")
    (['synthetic/0', 'synthetic/1'], 100)
    >>> src.plan("synthetic/1", 64, 1000)
    Chunk(source='synthetic', partition='synthetic/1', start=64, end=100, extra=())
    >>> src.plan("synthetic/1", 100, 1000) is None, src.is_finished("synthetic/1", 100)
    (True, True)
    """

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        cfg = config if config is not None else SyntheticConfig()
        self.config = cfg
        self.name = cfg.name
        seed = cfg.seed
        card = np.array(cfg.cardinalities, dtype=np.int64)
        self._card = card
        sexp = cfg.zipf_exponent
        # Inverse CDF of a continuous power law on [1, K + 1): rank = floor(x) - 1.
        self._zipf_log = abs(sexp - 1.0) < 1e-9
        if self._zipf_log:
            self._zipf_a = np.log(card + 1.0)
            self._zipf_inv = 1.0
        else:
            self._zipf_a = 1.0 - (card + 1.0) ** (1.0 - sexp)
            self._zipf_inv = 1.0 / (1.0 - sexp)
        self._open = (card >= OPEN_VOCABULARY_MIN) & (cfg.new_id_rate > 0.0)
        self._births = cfg.new_id_rate / cfg.new_id_uses
        self._salt32 = np.array(
            [_key("strings", seed, f) & _MASK32 for f in range(NUM_SPARSE)], dtype=np.uint64
        )
        self._wsalt = np.array([_key("weights", seed, f) for f in range(NUM_SPARSE)], np.uint64)
        # Some fields say much about a click, some little, as in real logs. The
        # seed only permutes a fixed profile, so every seed has the same total signal
        # (and a similar best AUC).
        order = np.argsort([int(_key("scale", seed, f)) for f in range(NUM_SPARSE)])
        quantile = (np.argsort(order) + 0.5) / NUM_SPARSE
        self._scale = cfg.signal * (0.08 + 0.42 * quantile**2)
        self._center0, self._center1 = self._centers()
        self._theta = cfg.drift_rate * 1e-6
        self._miss = np.array(cfg.dense_missing, dtype=np.float64)
        self._alpha_inv = 1.0 / _DENSE_ALPHA
        self._beta = (
            cfg.signal
            * 0.15
            * np.array([_gauss_of(_key("beta", seed, d)) for d in range(NUM_DENSE)])
        )
        self._inter_fields = np.array(
            [SPARSE_NAMES.index(f) for f in cfg.interaction_fields], dtype=np.int64
        )
        self._vsalt = np.array([_key("vectors", seed, f) for f in self._inter_fields], np.uint64)
        self._bias = 0.0  # ``_calibrate`` generates with no bias, then solves for it
        self._bias = self._calibrate(cfg.base_ctr)

    # --- the hidden model ---------------------------------------------------------

    def _centers(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """The Zipf-weighted mean weight of each field (its two drift components).

        Subtracting them keeps the mean logit, and so the click rate, steady while
        the weights rotate: without it the few head ids of each field would move
        the click rate by a factor of two over a drift period. The top 2**16 ranks
        hold nearly all of the variance of the mean, so the tail is left out.
        """
        c0 = np.zeros(NUM_SPARSE)
        c1 = np.zeros(NUM_SPARSE)
        s = self.config.zipf_exponent
        for f in range(NUM_SPARSE):
            k = int(self._card[f])
            m = min(k, 1 << 16)
            edges = np.arange(1, m + 2, dtype=np.float64)
            if self._zipf_log:
                cdf = np.log(edges) / np.log(k + 1.0)
            else:
                cdf = (1.0 - edges ** (1.0 - s)) / (1.0 - (k + 1.0) ** (1.0 - s))
            p = np.diff(cdf)
            values = _string_values(np.arange(m, dtype=np.int64), self._salt32[f])
            c0[f] = float(p @ _weights_of(values, self._wsalt[f], 1.0, 0.0))
            c1[f] = float(p @ _weights_of(values, self._wsalt[f], 0.0, 1.0))
        return c0, c1

    def _calibrate(self, ctr: float) -> float:
        """The bias that gives mean click probability ``ctr`` over 32k events at 0."""
        _, logit, _ = self._generate(0, 0, 1 << 15)
        lo, hi = -30.0, 30.0
        for _ in range(60):  # bisection: the mean is increasing in the bias
            mid = 0.5 * (lo + hi)
            if float(_sigmoid(logit + mid).mean()) < ctr:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def weights(self, field: str, values: Sequence[str], position: int) -> npt.NDArray[np.float64]:
        """The hidden model's logit term of ``values`` of ``field`` at ``position``.

        The drift rotates it: a weight at position 0 and one a million events
        later correlate with ``cos(drift_rate)``.

        >>> src = SyntheticSource(SyntheticConfig(drift_rate=0.0))
        >>> w = src.weights("C1", ["68fd1e64", "05db9164"], 0)
        >>> w.shape, bool((w == src.weights("C1", ["68fd1e64", "05db9164"], 10**9)).all())
        ((2,), True)
        """
        try:
            f = SPARSE_NAMES.index(field)
        except ValueError:
            msg = f"no sparse field {field!r} (fields: C1..C{NUM_SPARSE})"
            raise KeyError(msg) from None
        nums = np.array([int(v, 16) for v in values], dtype=np.uint64)
        theta = self._theta * position
        c, s = float(np.cos(theta)), float(np.sin(theta))
        w = _weights_of(nums, self._wsalt[f], c, s)
        out: npt.NDArray[np.float64] = self._scale[f] * (
            w - c * self._center0[f] - s * self._center1[f]
        )
        return out

    def vocabulary(self, field: str, ranks: npt.ArrayLike | None = None) -> pa.StringArray:
        """The values of ``field``'s base ids of these Zipf ranks (0: the most frequent).

        Every value the stream draws for ``field`` is one of these, or (open
        fields, ``new_id_rate > 0``) a new id born later. ``ranks`` defaults to
        all of them, in rank order. A bulk load of a store's rows reads them here
        (``benchmarks/scale.py``).

        >>> src = SyntheticSource(SyntheticConfig(events=500, new_id_rate=0.0))
        >>> vocab = set(src.vocabulary("C7").to_pylist())
        >>> len(vocab) == src.config.cardinalities[6]
        True
        >>> set(src.read(src.plan("synthetic/0", 0, 500)).table["C7"].to_pylist()) <= vocab
        True
        >>> src.vocabulary("C7", [5, 0]).to_pylist() == src.vocabulary("C7")[:6].to_pylist()[5::-5]
        True
        """
        if field not in SPARSE_NAMES:
            msg = f"no sparse field {field!r} (fields: C1..C{NUM_SPARSE})"
            raise KeyError(msg)
        f = SPARSE_NAMES.index(field)
        card = int(self._card[f])
        r = np.arange(card) if ranks is None else np.asarray(ranks, dtype=np.int64).ravel()
        lo, hi = (int(r.min()), int(r.max())) if r.shape[0] else (0, 0)
        if lo < 0 or hi >= card:
            msg = f"ranks: field {field} has ranks 0..{card - 1}, got {lo}..{hi}"
            raise ValueError(msg)
        values = _string_values(r.astype(np.int64), self._salt32[f])
        shifts = np.arange(28, -1, -4, dtype=np.uint64)
        chars = _HEX[((values[:, None] >> shifts) & np.uint64(0xF)).astype(np.intp)]
        offsets = pa.py_buffer(np.arange(0, 8 * r.shape[0] + 1, 8, dtype=np.int32))
        return pa.Array.from_buffers(
            pa.string(), r.shape[0], [None, offsets, pa.py_buffer(np.ascontiguousarray(chars))]
        )

    # --- generation -----------------------------------------------------------------

    def _partition_index(self, partition: str) -> int:
        prefix = f"{self.name}/"
        idx = partition[len(prefix) :]
        if (
            partition.startswith(prefix)
            and idx.isdigit()
            and str(int(idx)) == idx
            and int(idx) < self.config.partitions
        ):
            return int(idx)
        msg = (
            f"source {self.name!r} has no partition {partition!r} "
            f"(partitions: {self.name}/0 .. {self.name}/{self.config.partitions - 1})"
        )
        raise KeyError(msg)

    def _generate(
        self, pidx: int, start: int, n: int
    ) -> tuple[pa.Table, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Records ``[start, start + n)`` of partition ``pidx``: (table, raw logit, label draw)."""
        if pidx < 0 or start < 0 or n < 0:
            msg = f"partition, start and n must be >= 0: got {pidx}, {start}, {n}"
            raise ValueError(msg)
        chars = np.empty((NUM_SPARSE, 8 * n), dtype=np.uint8)
        dense = np.empty((NUM_DENSE, n), dtype=np.float64)
        valid = np.empty((NUM_DENSE, n), dtype=np.bool_)
        logit = np.empty(n, dtype=np.float64)
        u_label = np.empty(n, dtype=np.float64)
        _generate(
            _key("stream", self.config.seed, pidx),
            start,
            self._card,
            self._zipf_a,
            self._zipf_inv,
            self._zipf_log,
            self._open,
            self.config.new_id_rate,
            self._births,
            float(self.config.new_id_window),
            self._salt32,
            self._wsalt,
            self._scale,
            self._center0,
            self._center1,
            self._theta,
            self._miss,
            self._alpha_inv,
            _DENSE_SCALE,
            self._beta,
            self.config.interaction,
            self._inter_fields,
            self.config.interaction_dim,
            self._vsalt,
            self.config.session_length,
            chars,
            dense,
            valid,
            logit,
            u_label,
        )
        logit += self._bias
        click = (u_label < _sigmoid(logit)).astype(np.float64)
        # Every value is 8 characters, so all string columns share one offsets buffer.
        offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32))
        columns: list[pa.Array] = [pa.array(click, type=pa.float64())]
        for d in range(NUM_DENSE):
            nulls = n - int(np.count_nonzero(valid[d]))
            bitmap = pa.py_buffer(np.packbits(valid[d], bitorder="little")) if nulls else None
            columns.append(
                pa.Array.from_buffers(
                    pa.float64(), n, [bitmap, pa.py_buffer(dense[d])], null_count=nulls
                )
            )
        for f in range(NUM_SPARSE):
            columns.append(
                pa.Array.from_buffers(pa.string(), n, [None, offsets, pa.py_buffer(chars[f])])
            )
        table = pa.Table.from_arrays(columns, schema=table_schema())
        return table, logit, u_label

    def records(self, partition: int, start: int, n: int) -> pa.Table:
        """Records ``[start, start + n)`` of partition number ``partition`` (ignores ``events``).

        >>> src = SyntheticSource(SyntheticConfig())
        >>> src.records(0, 10, 5).equals(src.records(0, 0, 15).slice(10))
        True
        """
        return self._generate(partition, start, n)[0]

    def click_probability(self, chunk: Chunk) -> npt.NDArray[np.float64]:
        """The true click probability of each record of ``chunk`` (what a perfect model says).

        >>> src = SyntheticSource(SyntheticConfig(events=10))
        >>> p = src.click_probability(src.plan("synthetic/0", 0, 10))
        >>> p.shape, bool(((p > 0) & (p < 1)).all())
        ((10,), True)
        """
        self._check_chunk(chunk)
        _, logit, _ = self._generate(
            self._partition_index(chunk.partition), chunk.start, len(chunk)
        )
        return _sigmoid(logit)

    def true_logits(
        self, n_samples: int = 200_000, partition: int = 0, start: int = 0
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """The sampled clicks of ``n_samples`` events of ``partition`` from ``start`` and
        their true logits (it ignores ``config.events``): what a perfect model would
        score, the oracle of :func:`trainer.metrics.best_auc`.

        >>> labels, logits = SyntheticSource(SyntheticConfig(seed=0)).true_logits(4)
        >>> labels.shape, logits.shape
        ((4,), (4,))
        """
        if n_samples < 2:
            msg = f"true_logits needs n_samples >= 2, got {n_samples}"
            raise ValueError(msg)
        table, logit, _ = self._generate(partition, start, n_samples)
        labels = np.asarray(table[LABEL_NAME].to_numpy(), dtype=np.float64)
        return labels, np.asarray(logit, dtype=np.float64)

    # --- Source ---------------------------------------------------------------------

    def partitions(self) -> list[str]:
        """``["<name>/0", ..., "<name>/<partitions - 1>"]``."""
        return [f"{self.name}/{i}" for i in range(self.config.partitions)]

    def start_position(self, partition: str) -> int:
        """Every partition starts at sample 0."""
        self._partition_index(partition)
        return 0

    def end_position(self, partition: str) -> int | None:
        """``config.events``, or None for an endless stream."""
        self._partition_index(partition)
        return self.config.events

    def plan(self, partition: str, position: int, max_records: int) -> Chunk | None:
        """``[position, position + min(max_records, chunk_size))``, cut at the end; None past it."""
        self._partition_index(partition)
        if position < 0 or max_records < 1:
            msg = (
                f"plan({partition!r}): position must be >= 0 and max_records >= 1, "
                f"got position={position}, max_records={max_records}"
            )
            raise ValueError(msg)
        end = position + min(max_records, self.config.chunk_size)
        if self.config.events is not None:
            if position >= self.config.events:
                return None
            end = min(end, self.config.events)
        return Chunk(source=self.name, partition=partition, start=position, end=end)

    def is_finished(self, partition: str, position: int) -> bool:
        """True at or after ``config.events``; never for an endless stream."""
        self._partition_index(partition)
        return self.config.events is not None and position >= self.config.events

    def _check_chunk(self, chunk: Chunk) -> None:
        if chunk.source != self.name or chunk.start < 0 or chunk.end < chunk.start:
            msg = f"source {self.name!r} cannot read {chunk!r}"
            raise ValueError(msg)

    def read(self, chunk: Chunk) -> RawChunk:
        """The chunk's records as an Arrow table (click, I1..I13, C1..C26)."""
        self._check_chunk(chunk)
        pidx = self._partition_index(chunk.partition)
        table = self._generate(pidx, chunk.start, len(chunk))[0]
        positions = np.arange(chunk.start, chunk.end, dtype=np.int64)
        return RawChunk(chunk=chunk, positions=positions, table=table)

    def close(self) -> None:
        """Nothing to release."""


# --- job helpers ----------------------------------------------------------------


def synthetic_feature_spec() -> FeatureSpec:
    """Labels ``click``, dense ``I1..I13`` (log1p, >= 0), sparse ``C1..C26`` → tables c1..c26.

    >>> spec = synthetic_feature_spec()
    >>> spec.labels, len(spec.dense), spec.tables()["c7"]
    (['click'], 13, ('C7',))
    """
    return FeatureSpec(
        labels=[LABEL_NAME],
        dense=[DenseField(name=n, transform="log1p", min_value=0.0) for n in DENSE_NAMES],
        sparse=[SparseField(name=n, table=n.lower(), type="string") for n in SPARSE_NAMES],
    )


def synthetic_store_tables(
    dim: int = 16, config: SyntheticConfig | None = None, max_capacity: int = 1 << 19
) -> dict[str, TableConfig]:
    """A ``StoreConfig.tables`` mapping for tables c1..c26, sized for a demo.

    Each table keeps four times its field's base cardinality (at least 4096
    rows, room for new ids) up to ``max_capacity`` rows per shard; the largest
    fields rely on eviction, as a production job would.

    >>> from embedding_store.types import StoreConfig
    >>> tables = StoreConfig(tables=synthetic_store_tables(dim=8)).tables
    >>> len(tables), tables["c9"].capacity, tables["c3"].capacity, tables["c3"].dim
    (26, 4096, 524288, 8)
    """
    cfg = config if config is not None else SyntheticConfig()
    out: dict[str, TableConfig] = {}
    for name, k in zip(SPARSE_NAMES, cfg.cardinalities, strict=True):
        capacity = int(min(max(4 * k, 4096), max_capacity))
        out[name.lower()] = TableConfig.model_validate(
            {
                "dim": dim,
                "capacity": capacity,
                "initializer": {"kind": "uniform", "scale": 0.01},
                "optimizer": {"kind": "adagrad", "lr": 0.05},
            }
        )
    return out


def synthetic_store_section(dim: int = 16, row_dtype: str = "float16") -> dict[str, Any]:
    """The ``store:`` section of a job YAML for the synthetic tables, as plain data.

    >>> sorted(synthetic_store_section(dim=8)["tables"])[:2]
    ['c1', 'c10']
    """
    tables = {k: v.model_dump(mode="json") for k, v in synthetic_store_tables(dim=dim).items()}
    return {"tables": tables, "row_dtype": row_dtype}


def _event_count(config: SyntheticConfig, events: int | None) -> int:
    n = events if events is not None else config.events
    if n is None:
        msg = "the stream is endless (config.events is None): pass events=N"
        raise ValueError(msg)
    if n < 0 or (config.events is not None and n > config.events):
        msg = f"events must be in [0, config.events={config.events}], got {n}"
        raise ValueError(msg)
    return n


def write_parquet(
    path: str | Path,
    config: SyntheticConfig,
    events: int | None = None,
    row_group_size: int = 65536,
    partition: int = 0,
) -> Path:
    """Write the first ``events`` records of ``partition`` to one Parquet file (zstd).

    Row ``i`` of the file is position ``i`` of the stream, in row groups of
    ``row_group_size``, so ``ParquetSource`` replays exactly the synthetic stream.

    >>> import tempfile, pyarrow.parquet as pq
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = write_parquet(f"{d}/s.parquet", SyntheticConfig(), events=100, row_group_size=40)
    ...     meta = pq.ParquetFile(p).metadata
    ...     meta.num_rows, meta.num_row_groups
    (100, 3)
    """
    import pyarrow.parquet as pq

    n = _event_count(config, events)
    if row_group_size < 1:
        msg = f"row_group_size must be >= 1, got {row_group_size}"
        raise ValueError(msg)
    src = SyntheticSource(config)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(out, table_schema(), compression="zstd") as writer:
        if n == 0:
            writer.write_table(table_schema().empty_table())
        for start in range(0, n, row_group_size):
            table = src.records(partition, start, min(row_group_size, n - start))
            writer.write_table(table, row_group_size=row_group_size)
    return out


def iter_json_lines(
    config: SyntheticConfig, events: int | None = None, partition: int = 0
) -> Iterator[bytes]:
    """One compact JSON object (UTF-8 bytes, no newline) per event of ``partition``.

    Missing dense values are ``null``.

    >>> import json
    >>> first = next(iter_json_lines(SyntheticConfig(), events=3))
    >>> rec = json.loads(first)
    >>> sorted(rec)[:3], isinstance(rec["C1"], str), rec["click"] in (0.0, 1.0)
    (['C1', 'C10', 'C11'], True, True)
    """
    from connectors.codecs import JsonLinesCodec

    n = _event_count(config, events)
    src = SyntheticSource(config)
    codec = JsonLinesCodec()
    step = config.chunk_size
    for start in range(0, n, step):
        yield from codec.encode(src.records(partition, start, min(step, n - start)))

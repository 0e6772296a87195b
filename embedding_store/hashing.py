"""Integer mixing, shard routing and deterministic row initialization, as numba kernels.

Every function here is pure: the same inputs give the same outputs on every
machine, which is what lets a checkpoint written by N shards restore onto M and
an evicted row come back with the values it started with.

>>> import numpy as np
>>> ids = np.arange(10, dtype=np.uint64)
>>> shard_of(ids, 3).tolist() == shard_of(ids, 3).tolist()
True
>>> sorted(set(shard_of(np.arange(1000, dtype=np.uint64), 4).tolist()))
[0, 1, 2, 3]
"""

from __future__ import annotations

import hashlib

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.types import NormalInit, UniformInit, ZerosInit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_S33 = np.uint64(33)
_JUMP_MUL = np.uint64(2862933555777941757)
_ONE = np.uint64(1)
# Routing re-mixes ids with a constant of its own, so the shard an id lands on is
# independent of its bucket inside the shard's hash table (both derive from mix64).
_ROUTE_SALT = np.uint64(0x5DEECE66D1CE4E5B)


@nb.njit(nogil=True, cache=True, inline="always")
def mix64(x: np.uint64) -> np.uint64:
    """SplitMix64's finalizer: a bijection of uint64 with good avalanche."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@nb.njit(nogil=True, cache=True, inline="always")
def unit_float(x: np.uint64) -> float:
    """The top 53 bits of ``x`` as a float64 in [0, 1)."""
    return float(x >> _S11) * (1.0 / 9007199254740992.0)


@nb.njit(nogil=True, cache=True, inline="always")
def jump_hash(key: np.uint64, num_buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach, 2014): moves 1/n of keys when n grows."""
    b = -1
    j = 0
    while j < num_buckets:
        b = j
        key = key * _JUMP_MUL + _ONE
        j = int((b + 1) * (2147483648.0 / float((key >> _S33) + _ONE)))
    return b


@nb.njit(nogil=True, cache=True, inline="always")
def shard_index(key: np.uint64, num_shards: int) -> int:
    """The shard (0..num_shards-1) that owns ``key``; :func:`shard_of` of one id, for
    kernels."""
    return jump_hash(mix64(key ^ _ROUTE_SALT), num_shards)


@nb.njit(nogil=True, cache=True)
def _shard_of(ids: npt.NDArray[np.uint64], num_shards: int, out: npt.NDArray[np.int32]) -> None:
    for i in range(ids.shape[0]):
        out[i] = shard_index(ids[i], num_shards)


def shard_of(ids: npt.NDArray[np.uint64], num_shards: int) -> npt.NDArray[np.int32]:
    """The shard (0..num_shards-1) that owns each id."""
    if num_shards < 1:
        msg = f"num_shards must be >= 1, got {num_shards}"
        raise ValueError(msg)
    out = np.empty(ids.shape[0], dtype=np.int32)
    _shard_of(np.ascontiguousarray(ids, dtype=np.uint64), num_shards, out)
    return out


@nb.njit(nogil=True, cache=True)
def _group_by_shard(
    shards: npt.NDArray[np.int32], num_shards: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    counts = np.zeros(num_shards + 1, dtype=np.int64)
    for i in range(shards.shape[0]):
        counts[shards[i] + 1] += 1
    for s in range(num_shards):
        counts[s + 1] += counts[s]
    order = np.empty(shards.shape[0], dtype=np.int64)
    fill = counts[:-1].copy()
    for i in range(shards.shape[0]):
        s = shards[i]
        order[fill[s]] = i
        fill[s] += 1
    return order, counts


def group_by_shard(
    ids: npt.NDArray[np.uint64], num_shards: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Positions of ``ids`` grouped by owning shard (a stable counting sort).

    Returns ``(order, bounds)``: the ids of shard ``s`` are
    ``ids[order[bounds[s]:bounds[s + 1]]]``.

    >>> order, bounds = group_by_shard(np.arange(6, dtype=np.uint64), 2)
    >>> int(bounds[-1]), sorted(order.tolist())
    (6, [0, 1, 2, 3, 4, 5])
    """
    order, bounds = _group_by_shard(shard_of(ids, num_shards), num_shards)
    return order, bounds


def table_seed(name: str, seed: int) -> np.uint64:
    """A 64-bit seed for one table, so equal ids in different tables start differently."""
    digest = hashlib.blake2b(f"{name}\x00{seed}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


INIT_ZEROS = 0
INIT_UNIFORM = 1
INIT_NORMAL = 2


def init_params(initializer: UniformInit | NormalInit | ZerosInit) -> tuple[int, float, float]:
    """``(kind, a, b)`` of ``init_row`` for an initializer config.

    >>> init_params(NormalInit(std=0.1, mean=0.5))
    (2, 0.1, 0.5)
    """
    if isinstance(initializer, UniformInit):
        return INIT_UNIFORM, initializer.scale, 0.0
    if isinstance(initializer, NormalInit):
        return INIT_NORMAL, initializer.std, initializer.mean
    return INIT_ZEROS, 0.0, 0.0


@nb.njit(nogil=True, cache=True)
def init_row(
    out: npt.NDArray[np.float32],
    key: np.uint64,
    seed: np.uint64,
    kind: int,
    a: float,
    b: float,
) -> None:
    """Fill ``out`` (one row) from (seed, key): uniform in [-a, a), or normal(mean=b, std=a)."""
    if kind == INIT_ZEROS:
        out[:] = 0.0
        return
    base = mix64(key ^ seed)
    dim = out.shape[0]
    if kind == INIT_UNIFORM:
        for j in range(dim):
            u = unit_float(mix64(base + np.uint64(j + 1) * _GOLDEN))
            out[j] = np.float32((2.0 * u - 1.0) * a)
    else:
        for j in range(dim):
            # Box-Muller from two counter-based uniforms; 1 - u keeps log() finite.
            u1 = 1.0 - unit_float(mix64(base + np.uint64(2 * j + 1) * _GOLDEN))
            u2 = unit_float(mix64(base + np.uint64(2 * j + 2) * _GOLDEN))
            z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
            out[j] = np.float32(b + a * z)


@nb.njit(nogil=True, cache=True)
def init_rows(
    out: npt.NDArray[np.float32],
    keys: npt.NDArray[np.uint64],
    seed: np.uint64,
    kind: int,
    a: float,
    b: float,
) -> None:
    """``init_row`` for each key into the matching row of ``out``."""
    for i in range(keys.shape[0]):
        init_row(out[i], keys[i], seed, kind, a, b)


@nb.njit(nogil=True, cache=True)
def init_rows_of(
    out: npt.NDArray[np.float32],
    keys: npt.NDArray[np.uint64],
    table: npt.NDArray[np.int32],
    seeds: npt.NDArray[np.uint64],
    kinds: npt.NDArray[np.int64],
    a: npt.NDArray[np.float64],
    b: npt.NDArray[np.float64],
) -> None:
    """``init_row`` for each key of several tables at once: key ``i`` with the
    initializer ``(seeds, kinds, a, b)[table[i]]``."""
    for i in range(keys.shape[0]):
        t = table[i]
        init_row(out[i], keys[i], seeds[t], kinds[t], a[t], b[t])

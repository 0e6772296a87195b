"""The data plane's raw frames (``embedding_store.wire``) and the lookup's float16 copy.

Pure encode/decode round trips and refusals first, then real shard processes
over gRPC: frames give the rows and pushes the protobuf methods give, a frame a
shard cannot parse is INVALID_ARGUMENT, and frames need the token like any call.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numba as nb
import numpy as np
import pytest

from deploy.config import load_config
from embedding_store.client import StoreClient
from embedding_store.errors import InvalidRequest
from embedding_store.kernels.float16 import f16_bits as _f16_bits
from embedding_store.kernels.float16 import f32_to_f16
from embedding_store.proto import embedding_store_pb2 as pb
from embedding_store.shard import StoreShard
from embedding_store.types import StoreConfig
from embedding_store.wire import (
    LOOKUP_FRAME_METHOD,
    PUSH_FRAME_METHOD,
    decode_lookup,
    decode_push,
    decode_rows,
    encode_lookup,
    encode_push,
    rows_frame,
)
from tests.support.processes import grpc_address

U64 = np.uint64


# --- float16 conversion -------------------------------------------------------------


def _edge_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = np.array(
        [0.0, -0.0, 1.0, -1.0, 65504, 65519.99, 65520, 1e5, -1e5, np.inf, -np.inf,
         6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-9, 1e-30, 3.4e38, 1.0009765625,
         1.00048828125, 1.00146484375],
        dtype=np.float32,
    )  # fmt: skip
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    scales = rng.normal(size=200_000).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -30, 18, 200_000
    ).astype(np.float32)
    return np.concatenate([special, -special, bits.view(np.float32), scales])


@nb.njit(cache=True)
def _portable(bits: np.ndarray, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        out[i] = _f16_bits(bits[i])


def test_the_float16_copy_rounds_as_numpy_does() -> None:
    values = _edge_floats()
    finite = ~np.isnan(values)
    with np.errstate(over="ignore"):
        want = values[finite].astype(np.float16).view(np.uint16)
        np.testing.assert_array_equal(f32_to_f16(values[finite]), want)
        portable = np.empty(values.shape, dtype=np.uint16)
        _portable(values.view(np.uint32), portable)
    np.testing.assert_array_equal(portable[finite], want)
    assert np.isnan(portable[~finite].view(np.float16)).all()
    assert np.isnan(f32_to_f16(values[~finite]).view(np.float16)).all()


def test_a_float16_lookup_is_the_float32_lookup_rounded() -> None:
    cfg = StoreConfig(tables={"t": {"dim": 5}}, row_dtype="float16")
    shard = StoreShard(cfg)
    ids = np.arange(1000, dtype=U64) * U64(2654435761)
    f32 = shard.lookup({"t": ids})["t"]
    f16 = shard.lookup({"t": ids}, train=False, dtype="float16")["t"]
    assert f16.dtype == np.float16
    np.testing.assert_array_equal(f16, f32.astype(np.float16))
    # Into a caller's buffer; ids without a row read as zeros.
    out = np.full((3, 5), 7, dtype=np.float16)
    got = shard.lookup({"t": np.array([ids[0], 5, ids[1]], U64)}, train=False, out={"t": out})
    assert got["t"] is out
    np.testing.assert_array_equal(out[[0, 2]], f16[:2])
    assert not out[1].any()
    with pytest.raises(ValueError, match="out: expected"):
        shard.lookup({"t": ids[:3]}, out={"t": np.empty((3, 4), np.float16)})


# --- frames: pure encode / decode -----------------------------------------------------


def test_lookup_frames_round_trip() -> None:
    ids = {"user": np.array([1, 2**64 - 1, 7], U64), "é": np.zeros(0, U64), "item": np.arange(5)}
    for train, step, create_only, dtype in [
        (True, None, False, "float16"),
        (True, 2**40 - 1, True, "float32"),
        (False, 0, False, "float32"),
    ]:
        frame = decode_lookup(
            encode_lookup(ids, train=train, dtype=dtype, step=step, create_only=create_only)  # type: ignore[arg-type]
        )
        assert list(frame.ids) == list(ids)
        for name, v in ids.items():
            np.testing.assert_array_equal(frame.ids[name], v)
            assert frame.ids[name].dtype == np.uint64
        assert (frame.train, frame.step, frame.create_only, frame.dtype) == (
            train,
            step,
            create_only,
            dtype,
        )


def test_row_frames_round_trip_and_are_written_in_place() -> None:
    for dtype in ("float16", "float32"):
        buf, views = rows_frame({"a": (3, 5), "b": (0, 2), "c": (2, 1)}, dtype)  # type: ignore[arg-type]
        views["a"][:] = np.arange(15).reshape(3, 5)
        views["c"][:] = [[-1], [2.5]]
        rows = decode_rows(bytes(buf), dtype)  # type: ignore[arg-type]
        assert {k: v.shape for k, v in rows.items()} == {"a": (3, 5), "b": (0, 2), "c": (2, 1)}
        np.testing.assert_array_equal(rows["a"], np.arange(15).reshape(3, 5))
        np.testing.assert_array_equal(rows["c"], [[-1], [2.5]])
        assert rows["a"].dtype == np.dtype(dtype)
    with pytest.raises(InvalidRequest, match="float32 were asked for"):
        decode_rows(bytes(rows_frame({"a": (1, 1)}, "float16")[0]), "float32")


def test_push_frames_round_trip() -> None:
    rng = np.random.default_rng(1)
    grads = {
        "user": (np.array([3, 1, 3], U64), rng.normal(size=(3, 8)).astype(np.float32)),
        "item": (np.array([9], U64), rng.normal(size=(1, 3)).astype(np.float32)),
    }
    for dtype in ("float16", "float32"):
        frame = decode_push(encode_push(grads, request_id="client-7", dtype=dtype))  # type: ignore[arg-type]
        assert frame.request_id == "client-7"
        assert frame.dtype == dtype
        for name, (i, g) in grads.items():
            np.testing.assert_array_equal(frame.grads[name][0], i)
            np.testing.assert_array_equal(frame.grads[name][1], g.astype(dtype))
    with pytest.raises(InvalidRequest, match="shape"):
        encode_push(
            {"x": (np.arange(2, dtype=U64), np.zeros((3, 2)))}, request_id="", dtype="float32"
        )


def _bad_lookup_frames() -> list[tuple[bytes, str]]:
    good = encode_lookup({"user": np.arange(4, dtype=U64)}, train=True, dtype="float16")
    head = bytearray(good)
    return [
        (b"", "shorter than a frame head"),
        (good[:-1], "needs 32 bytes"),
        (good + bytes(8), "its header describes"),
        (b"XXXX" + good[4:], "not a b'SRLQ' frame"),
        (bytes(head[:4]) + bytes([9]) + good[5:], "frame version 9"),
        (bytes(head[:5]) + bytes([5]) + good[6:], "unknown row dtype 5"),
        (bytes(head[:6]) + bytes([0x40]) + good[7:], "unknown flags"),
        (good[:28], "ends inside its table list"),
        # A count that no frame could hold.
        (good[:24] + struct.pack("<Q", 2**60) + good[32:], "needs"),
        (
            encode_lookup({"t": np.arange(1, dtype=U64)}, train=True, dtype="float16")[:38]
            + b"\xff"
            + encode_lookup({"t": np.arange(1, dtype=U64)}, train=True, dtype="float16")[39:],
            "not UTF-8",
        ),
        (
            encode_push(
                {"t": (np.arange(1, dtype=U64), np.zeros((1, 1)))}, request_id="", dtype="float32"
            ),
            "not a b'SRLQ' frame",
        ),
    ]


@pytest.mark.parametrize(("data", "match"), _bad_lookup_frames())
def test_malformed_frames_are_invalid_requests(data: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match.replace("(", r"\(")):
        decode_lookup(data)


def test_a_table_named_twice_is_refused() -> None:
    one = encode_lookup({"t": np.arange(2, dtype=U64)}, train=True, dtype="float16")
    # Rebuild by hand: two entries called "t".
    head = struct.pack("<4sBBBxqII", b"SRLQ", 1, 0, 1, 0, 2, 0)
    entry = struct.pack("<QIH", 2, 0, 1) + b"t"
    body = head + entry + entry
    body += bytes(-len(body) % 8) + one[-16:] * 2
    with pytest.raises(InvalidRequest, match="named twice"):
        decode_lookup(body)


# --- frames over gRPC, real shard processes -----------------------------------------


def _raw(proc: Any, token_file: Path, method: str, payload: bytes) -> tuple[Any, Any]:
    md = (("authorization", f"Bearer {token_file.read_text().strip()}"),)
    with grpc.insecure_channel(proc.address) as channel:
        call = channel.unary_unary(method, None, None)
        try:
            return grpc.StatusCode.OK, call(payload, metadata=md, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


@pytest.mark.processes
def test_frames_and_protobuf_calls_agree(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    job = write_job(row_dtype="float16")
    [proc] = start_shards(1, job, token_file)
    cfg = load_config(job).store
    token = token_file.read_text().strip()
    ids = np.arange(3000, dtype=U64) * U64(11)
    rng = np.random.default_rng(3)
    with (
        StoreClient.connect(grpc_address([proc]), token=token, config=cfg) as remote,
        StoreClient.connect("inproc://", config=cfg) as local,
    ):
        assert remote._transports[0]._frames  # type: ignore[attr-defined]
        for step in range(3):
            g = rng.normal(size=(3000, 8)).astype(np.float32)
            r = remote.lookup({"user": ids, "item": ids[:10]}, step=step * 5)
            want = local.lookup({"user": ids, "item": ids[:10]}, step=step * 5)
            for name in want:
                np.testing.assert_array_equal(r[name], want[name])
                assert r[name].dtype == np.float16
                assert r[name].flags.writeable
            assert remote.push({"user": (ids, g)}) == local.push({"user": (ids, g)})
        # The protobuf Lookup reads the same rows as the frame.
        code, reply = _raw(
            proc,
            token_file,
            "/streamrec.embedding_store.v1.EmbeddingStore/Lookup",
            pb.LookupRequest(
                tables=[pb.TableIds(table="user", ids=ids.astype("<u8").tobytes())]
            ).SerializeToString(),
        )
        assert code == grpc.StatusCode.OK
        rows = pb.LookupResponse.FromString(reply).tables[0].rows
        np.testing.assert_array_equal(
            np.frombuffer(rows, np.float16).reshape(-1, 8),
            remote.lookup({"user": ids}, train=False)["user"],
        )
        stats = remote.stats()[0]
        assert stats.table("user").clock == local.stats()[0].table("user").clock == 10
        assert stats.lookup_latency is not None
        assert stats.lookup_latency.count >= 3
        assert stats.push_latency is not None
        assert stats.push_latency.count == 3
        # A retried push (same request id) is not applied twice, frames or not.
        g = rng.normal(size=(3000, 8)).astype(np.float32)
        first = remote.push({"user": (ids, g)}, request_id="again")
        assert remote.push({"user": (ids, g)}, request_id="again").duplicate_request
        assert not first.duplicate_request


@pytest.mark.processes
def test_frames_a_shard_cannot_parse_get_clear_codes(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    [proc] = start_shards(1, write_job(), token_file)
    ok = encode_lookup({"user": np.arange(4, dtype=U64)}, train=True, dtype="float32")
    code, reply = _raw(proc, token_file, LOOKUP_FRAME_METHOD, ok)
    assert code == grpc.StatusCode.OK
    assert decode_rows(reply, "float32")["user"].shape == (4, 8)
    for method, payload, want, words in [
        (LOOKUP_FRAME_METHOD, ok[:-3], grpc.StatusCode.INVALID_ARGUMENT, "needs 32 bytes"),
        (LOOKUP_FRAME_METHOD, b"nonsense", grpc.StatusCode.INVALID_ARGUMENT, "frame head"),
        (
            LOOKUP_FRAME_METHOD,
            encode_lookup({"nope": np.arange(2, dtype=U64)}, train=True, dtype="float32"),
            grpc.StatusCode.NOT_FOUND,
            "'nope'",
        ),
        (
            LOOKUP_FRAME_METHOD,
            encode_lookup({"user": np.arange(2, dtype=U64)}, train=True, dtype="float32", step=-5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "step: must be in [0, 2**40)",
        ),
        (
            PUSH_FRAME_METHOD,
            encode_push(
                {"user": (np.arange(2, dtype=U64), np.zeros((2, 3)))},
                request_id="",
                dtype="float32",
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "the table's dim is 8",
        ),
        (PUSH_FRAME_METHOD, ok, grpc.StatusCode.INVALID_ARGUMENT, "not a b'SRPQ' frame"),
    ]:
        code, details = _raw(proc, token_file, method, payload)
        assert code == want, (payload[:16], details)
        assert words in details
    # Without the token, a frame is refused like any call.
    with grpc.insecure_channel(proc.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(LOOKUP_FRAME_METHOD, None, None)(ok, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_shard_without_frames_is_served_by_the_protobuf_methods() -> None:
    """A shard older than frames answers UNIMPLEMENTED: the client falls back, once."""
    from concurrent import futures

    from embedding_store.proto import embedding_store_pb2_grpc as pb_grpc
    from embedding_store.service import EmbeddingStoreServicer

    cfg = StoreConfig(tables={"t": {"dim": 3}}, row_dtype="float16")
    shard = StoreShard(cfg)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_EmbeddingStoreServicer_to_server(EmbeddingStoreServicer(shard), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with (
            StoreClient.connect(f"grpc://127.0.0.1:{port}") as old,
            StoreClient.connect("inproc://", config=cfg) as local,
        ):
            ids = np.arange(50, dtype=U64)
            g = np.ones((50, 3), dtype=np.float32)
            np.testing.assert_array_equal(
                old.lookup({"t": ids})["t"], local.lookup({"t": ids})["t"]
            )
            assert not old._transports[0]._frames  # type: ignore[attr-defined]
            assert old.push({"t": (ids, g)}) == local.push({"t": (ids, g)})
            np.testing.assert_array_equal(
                old.lookup({"t": ids}, train=False)["t"], local.lookup({"t": ids}, train=False)["t"]
            )
    finally:
        server.stop(None)


# --- shared areas ---------------------------------------------------------------------


def test_shared_call_messages_round_trip_and_refuse_garbage() -> None:
    from embedding_store.wire import SharedCall, decode_shared, encode_shared

    call = SharedCall(b"s" * 16, b"n" * 16, 64, 100, 192, 4096)
    assert decode_shared(encode_shared(call)) == call
    assert call.name == "streamrec-" + (b"s" * 16).hex()
    for bad in (b"", encode_shared(call)[:-1], b"XXXX" + encode_shared(call)[4:]):
        with pytest.raises(InvalidRequest, match="shared area:"):
            decode_shared(bad)


def test_a_shard_maps_only_an_area_it_finds_with_the_nonce(tmp_path: Path) -> None:
    import os

    from embedding_store.service import SharedAreas, _region
    from embedding_store.wire import SharedCall

    areas = SharedAreas(str(tmp_path), limit=2)
    call = SharedCall(os.urandom(16), os.urandom(16), reply_capacity=4096)
    with pytest.raises(InvalidRequest, match="cannot be opened here"):
        areas.attach(call, 1 << 20)  # another host: no such file
    (tmp_path / call.name).write_bytes(call.nonce + bytes(4096 - 16))
    with pytest.raises(InvalidRequest, match="out of range"):
        areas.attach(call, 1024)
    with pytest.raises(InvalidRequest, match="not a file of 8,192 bytes"):
        areas.attach(SharedCall(call.session, call.nonce, reply_capacity=8192), 1 << 20)
    with pytest.raises(InvalidRequest, match="does not hold the nonce"):
        areas.attach(SharedCall(call.session, bytes(16), reply_capacity=4096), 1 << 20)
    areas.attach(call, 1 << 20)
    area = areas.get(call.session)
    assert len(_region(area, 64, 100, "x")) == 100
    for offset, length in [(0, 10), (64, 4096), (4000, 97), (-1, 5)]:
        with pytest.raises(InvalidRequest, match="outside the area"):
            _region(area, offset, length, "x")
    # The oldest of more than `limit` areas is unmapped; a detached one is unknown.
    others = []
    for _ in range(2):
        other = SharedCall(os.urandom(16), os.urandom(16), reply_capacity=4096)
        (tmp_path / other.name).write_bytes(other.nonce + bytes(4096 - 16))
        areas.attach(other, 1 << 20)
        others.append(other)
    with pytest.raises(InvalidRequest, match="unknown session"):
        areas.get(call.session)
    areas.detach(others[0].session)
    with pytest.raises(InvalidRequest, match="unknown session"):
        areas.get(others[0].session)
    assert areas.get(others[1].session)


def _shm_files() -> set[str]:
    import os

    return {n for n in os.listdir("/dev/shm") if n.startswith("streamrec-")}


@pytest.mark.processes
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_a_shard_on_this_host_is_served_through_a_shared_area(
    write_job: Callable[..., Path], token_file: Path, start_shards: Any
) -> None:
    import threading

    job = write_job(row_dtype="float16")
    procs = start_shards(2, job, token_file)
    cfg = load_config(job).store
    token = token_file.read_text().strip()
    before = _shm_files()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 2**63, 20_000, dtype=np.int64).astype(U64)
    with (
        StoreClient.connect(grpc_address(procs), token=token, config=cfg) as shared,
        StoreClient.connect(
            grpc_address(procs), token=token, config=cfg, shared_memory=False
        ) as network,
        StoreClient.connect("inproc://2", config=cfg) as local,
    ):
        for step in range(3):
            g = rng.normal(size=(20_000, 8)).astype(np.float32)
            got = shared.lookup({"user": ids, "item": ids[:99]}, step=step)
            want = local.lookup({"user": ids, "item": ids[:99]}, step=step)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
                assert got[name].flags.writeable
            assert shared.push({"user": (ids, g)}) == local.push({"user": (ids, g)})
        transports = shared._transports  # type: ignore[attr-defined]
        assert all(t._area is not None for t in transports), "the shared areas were not used"
        assert not any(t._area is not None for t in network._transports)  # type: ignore[attr-defined]
        # Every file was unlinked once both sides had it mapped.
        assert _shm_files() == before
        np.testing.assert_array_equal(
            network.lookup({"user": ids}, train=False)["user"],
            local.lookup({"user": ids}, train=False)["user"],
        )
        # The shard forgets the area (as after a restart): the call is made again
        # with a new area.
        from embedding_store.wire import DETACH_METHOD, SharedCall, encode_shared

        old = transports[0]._area
        code, _ = _raw(procs[0], token_file, DETACH_METHOD, encode_shared(SharedCall(old.session)))
        assert code == grpc.StatusCode.OK
        np.testing.assert_array_equal(
            shared.lookup({"user": ids}, train=False)["user"],
            local.lookup({"user": ids}, train=False)["user"],
        )
        assert transports[0]._area not in (None, old)
        # Calls from several threads at once: one holds the area, the others go
        # over the network; all get their own rows.
        errors: list[BaseException] = []
        want_rows = local.lookup({"user": ids}, train=False)["user"]

        def reader(k: int) -> None:
            try:
                for _ in range(5):
                    sel = ids[k::4]
                    got = shared.lookup({"user": sel}, train=False)["user"]
                    np.testing.assert_array_equal(got, want_rows[k::4])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        # A reply bigger than the area makes a bigger one.
        small = transports[0]._area.size
        big = np.arange(400_000, dtype=U64)
        shared.lookup({"user": big}, train=False)
        assert transports[0]._area.size > small
    assert _shm_files() == before

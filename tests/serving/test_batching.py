"""Dynamic batching: requests that wait are joined, answered as if alone, and fail alone.

The scorer here is a stand-in that records its calls and can be held busy;
``test_a_server_joins_concurrent_requests`` runs the real HTTP server with a
real client: while the held call blocks the server's loop, the requests that
arrive meanwhile are read together and share the next call.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from serving.batching import LoopBatcher
from serving.http import InferenceServer
from serving.types import BadRecords, Prediction, RecordError


class Echo:
    """Scores a record ``{"x": v}`` as ``v``; ``{"x": "bad"}`` is a bad record."""

    name, heads = "echo", ("y",)

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def ready(self) -> bool:
        return True

    def metadata(self) -> dict[str, object]:
        return {}

    def predict(self, records: Sequence[bytes]) -> Prediction:
        self.entered.set()
        self.release.wait(10)
        self.calls.append(len(records))
        values = [json.loads(r)["x"] for r in records]
        bad = [
            RecordError(i, "x", "dense_wrong_type", "not a number")
            for i, v in enumerate(values)
            if v == "bad"
        ]
        if bad:
            raise BadRecords(bad)
        return Prediction({"y": np.array(values, np.float32)}, {"call": len(self.calls)})


def _records(*values: object) -> list[bytes]:
    return [json.dumps({"x": v}).encode() for v in values]


def test_requests_of_one_turn_are_joined_and_answered_as_alone() -> None:
    echo = Echo()
    batcher = LoopBatcher(echo)

    async def run() -> tuple[Prediction, list[Prediction]]:
        first = await batcher.submit(_records(1))  # alone: nothing else came that turn
        waiting = [batcher.submit(_records(10 * k, 10 * k + 1)) for k in range(1, 4)]
        return first, list(await asyncio.gather(*waiting))

    first, answers = asyncio.run(run())
    assert first.probabilities["y"].tolist() == [1.0]
    assert [a.probabilities["y"].tolist() for a in answers] == [[10, 11], [20, 21], [30, 31]]
    assert echo.calls == [1, 6]
    assert {a.parameters["call"] for a in answers} == {2}  # the versions of the shared call
    assert (batcher.calls, batcher.joined) == (2, 3)


def test_a_bad_record_fails_only_its_own_request() -> None:
    echo = Echo()
    batcher = LoopBatcher(echo)

    async def run() -> list[Prediction | BaseException]:
        parts = [batcher.submit(_records(1, 2)), batcher.submit(_records(3, "bad"))]
        return list(await asyncio.gather(*parts, return_exceptions=True))

    good, bad = asyncio.run(run())
    assert isinstance(good, Prediction)
    assert good.probabilities["y"].tolist() == [1.0, 2.0]
    assert isinstance(bad, BadRecords)
    assert [(e.index, e.field) for e in bad.errors] == [(1, "x")]  # its own index
    assert echo.calls == [4, 2, 2]  # the joined call, then each request alone


def test_a_request_that_would_overflow_a_call_goes_in_the_next() -> None:
    echo = Echo()
    batcher = LoopBatcher(echo, max_records=4)

    async def run() -> list[Prediction]:
        return list(await asyncio.gather(*(batcher.submit(_records(*range(n))) for n in (2, 2, 3))))

    assert [len(p.probabilities["y"]) for p in asyncio.run(run())] == [2, 2, 3]
    assert echo.calls == [4, 3]
    with pytest.raises(ValueError, match="max_records: expected at least 1, got 0"):
        LoopBatcher(echo, max_records=0)


def test_a_failing_scorer_fails_every_request_of_the_call_and_the_batcher_goes_on() -> None:
    class Broken(Echo):
        def predict(self, records: Sequence[bytes]) -> Prediction:
            if json.loads(records[0])["x"] == "boom":
                raise RuntimeError("boom")
            return super().predict(records)

    batcher = LoopBatcher(Broken())

    async def run() -> tuple[list[Prediction | BaseException], Prediction]:
        failed = await asyncio.gather(
            batcher.submit(_records("boom")), batcher.submit(_records(4)), return_exceptions=True
        )
        return list(failed), await batcher.submit(_records(5))

    failed, after = asyncio.run(run())
    assert [type(f) for f in failed] == [RuntimeError, RuntimeError]
    assert after.probabilities["y"].tolist() == [5.0]


def test_a_request_cancelled_while_it_waits_is_skipped() -> None:
    echo = Echo()
    batcher = LoopBatcher(echo)

    async def run() -> Prediction:
        gone = batcher.submit(_records(1))
        gone.cancel()  # its client went away before the call
        return await batcher.submit(_records(2))

    assert asyncio.run(run()).probabilities["y"].tolist() == [2.0]
    assert echo.calls == [2]  # scored with it, answered without error


def test_a_server_joins_concurrent_requests() -> None:
    echo = Echo()
    with InferenceServer(echo, max_batch_records=64) as server:
        assert server.url is not None
        address = server.url.removeprefix("http://")

        def ask(k: int) -> list[float]:
            client = triton.InferenceServerClient(address)
            inp = triton.InferInput("records", [2], "BYTES")
            inp.set_data_from_numpy(np.array(_records(k, k + 0.5), dtype=np.object_))
            return list(client.infer("echo", [inp]).as_numpy("y"))

        echo.release.clear()
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(ask, k) for k in range(16)]
            assert echo.entered.wait(10)
            echo.release.set()
            got = [a.result(30) for a in answers]
        assert got == [[k, k + 0.5] for k in range(16)]
        assert len(echo.calls) < 16  # requests shared calls
        assert sum(echo.calls) == 32
        client = triton.InferenceServerClient(address)
        inp = triton.InferInput("records", [1], "BYTES")
        inp.set_data_from_numpy(np.array(_records("bad"), dtype=np.object_))
        with pytest.raises(InferenceServerException, match=r"\[400\] bad record at index 0"):
            client.infer("echo", [inp])


def test_score_answers_a_lone_request_at_once_and_joins_those_that_follow_a_call() -> None:
    """A request that finds the model idle skips the loop's turn; the requests read right
    after a call (those that arrived while it ran) wait for their turn's others."""
    echo = Echo()
    batcher = LoopBatcher(echo, idle_s=0.2)
    got: list[tuple[list[float], Exception | None]] = []

    def done(prediction: Prediction | None, error: Exception | None) -> None:
        got.append(([] if prediction is None else prediction.probabilities["y"].tolist(), error))

    async def run() -> list[int]:
        batcher.score(_records(1), done)
        seen = [len(got)]  # answered before score returned
        batcher.score(_records(2), done)  # right after a call: joined with the next
        batcher.score(_records(3, "bad"), done)
        seen.append(len(got))
        await asyncio.sleep(0)  # the turn's call
        await asyncio.sleep(0.25)
        batcher.score(_records(4), done)  # idle again: at once
        seen.append(len(got))
        return seen

    assert asyncio.run(run()) == [1, 1, 4]
    assert [g[0] for g in got] == [[1.0], [2.0], [], [4.0]]
    assert isinstance(got[2][1], BadRecords)  # only its own request failed
    # 1 alone; 2 and 3 joined, then again one by one for the bad record; 4 alone.
    assert echo.calls == [1, 3, 1, 2, 1]


def test_an_answer_that_raises_does_not_fail_the_others_of_its_call() -> None:
    echo = Echo()
    batcher = LoopBatcher(echo, idle_s=10.0)
    got: list[float] = []

    def broken(prediction: Prediction | None, error: Exception | None) -> None:
        raise RuntimeError("a bug while answering")

    def done(prediction: Prediction | None, error: Exception | None) -> None:
        assert prediction is not None
        got.extend(prediction.probabilities["y"].tolist())

    async def run() -> None:
        batcher.score(_records(0), done)  # alone, at once
        batcher.score(_records(1), broken)  # these two share the next call
        batcher.score(_records(2), done)
        await asyncio.sleep(0)

    asyncio.run(run())
    assert got == [0.0, 2.0]
    assert echo.calls == [1, 2]


def test_lower_priorities_are_scored_first_and_a_full_queue_sheds() -> None:
    from serving.types import Overloaded

    echo = Echo()
    batcher = LoopBatcher(echo, max_records=1, max_queued_records=3)

    async def turn() -> list[object]:
        futures = [
            batcher.submit(_records(0)),  # no priority: after every level
            batcher.submit(_records(2), priority=2),
            batcher.submit(_records(1), priority=1),
            batcher.submit(_records(9)),  # a fourth record would pass max_queued_records
        ]
        return await asyncio.gather(*futures, return_exceptions=True)

    *answered, shed = asyncio.run(turn())
    assert isinstance(shed, Overloaded)
    assert (shed.status, shed.retry_after_s) == (503, 1)
    assert batcher.shed == 1
    # Scored one at a time, priority 1 first, then 2, then the one without.
    calls = [p.parameters["call"] for p in answered]  # type: ignore[attr-defined]
    assert calls == [3, 2, 1]

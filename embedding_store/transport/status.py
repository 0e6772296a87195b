"""gRPC status codes to the store's typed errors, and which of them a call retries."""

from __future__ import annotations

import grpc

from embedding_store.errors import (
    CheckpointError,
    InvalidRequest,
    MessageTooLarge,
    StoreError,
    StoreUnavailable,
    Unauthenticated,
    UnknownTable,
)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_ERRORS: dict[grpc.StatusCode, type[StoreError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownTable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: CheckpointError,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailable,
}


class NoFrames(StoreError):
    """The shard does not serve frames (UNIMPLEMENTED): one older than them."""


def map_rpc_error(exc: grpc.RpcError, address: str, method: str) -> StoreError:
    code = exc.code()
    cls = _ERRORS.get(code, StoreError)
    return cls(f"{method} on shard {address}: {code.name}: {exc.details()}")

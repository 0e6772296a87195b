from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RowDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT16: _ClassVar[RowDtype]
    FLOAT32: _ClassVar[RowDtype]

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUTO: _ClassVar[CheckpointKind]
    FULL: _ClassVar[CheckpointKind]
    DELTA: _ClassVar[CheckpointKind]
FLOAT16: RowDtype
FLOAT32: RowDtype
AUTO: CheckpointKind
FULL: CheckpointKind
DELTA: CheckpointKind

class TableIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("table", "dim", "rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    rows: bytes
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., rows: _Optional[bytes] = ...) -> None: ...

class TableGrads(_message.Message):
    __slots__ = ("table", "ids", "grads")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tables", "train", "dtype", "step", "create_only")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    train: bool
    dtype: RowDtype
    step: int
    create_only: bool
    def __init__(self, tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., train: _Optional[bool] = ..., dtype: _Optional[_Union[RowDtype, str]] = ..., step: _Optional[int] = ..., create_only: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tables", "dtype")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    dtype: RowDtype
    def __init__(self, tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ..., dtype: _Optional[_Union[RowDtype, str]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("request_id", "tables", "dtype", "return_rows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tables: _containers.RepeatedCompositeFieldContainer[TableGrads]
    dtype: RowDtype
    return_rows: bool
    def __init__(self, request_id: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableGrads, _Mapping]]] = ..., dtype: _Optional[_Union[RowDtype, str]] = ..., return_rows: _Optional[bool] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied", "dropped_not_admitted", "rejected_nonfinite", "duplicate_request", "incarnation", "rows", "state", "row_steps", "seen")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROW_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    applied: int
    dropped_not_admitted: int
    rejected_nonfinite: int
    duplicate_request: bool
    incarnation: str
    rows: bytes
    state: bytes
    row_steps: bytes
    seen: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, applied: _Optional[int] = ..., dropped_not_admitted: _Optional[int] = ..., rejected_nonfinite: _Optional[int] = ..., duplicate_request: _Optional[bool] = ..., incarnation: _Optional[str] = ..., rows: _Optional[bytes] = ..., state: _Optional[bytes] = ..., row_steps: _Optional[bytes] = ..., seen: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("directory", "kind", "metadata_json")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    directory: str
    kind: CheckpointKind
    metadata_json: str
    def __init__(self, directory: _Optional[str] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("manifest", "kind", "seq", "rows", "tombstones", "bytes", "seconds", "incarnation")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    manifest: str
    kind: str
    seq: int
    rows: int
    tombstones: int
    bytes: int
    seconds: float
    incarnation: str
    def __init__(self, manifest: _Optional[str] = ..., kind: _Optional[str] = ..., seq: _Optional[int] = ..., rows: _Optional[int] = ..., tombstones: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("directory", "shard_index", "num_shards", "upto_seq")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    UPTO_SEQ_FIELD_NUMBER: _ClassVar[int]
    directory: str
    shard_index: int
    num_shards: int
    upto_seq: int
    def __init__(self, directory: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., upto_seq: _Optional[int] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("manifests", "rows", "rows_by_table", "incarnation")
    class RowsByTableEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_BY_TABLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    manifests: _containers.RepeatedScalarFieldContainer[str]
    rows: int
    rows_by_table: _containers.ScalarMap[str, int]
    incarnation: str
    def __init__(self, manifests: _Optional[_Iterable[str]] = ..., rows: _Optional[int] = ..., rows_by_table: _Optional[_Mapping[str, int]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "dim", "rows", "capacity", "memory_bytes", "clock", "lookups", "lookup_ids", "pushes", "push_ids", "admissions", "rejected_admissions", "evictions", "expirations", "overflow", "dropped_not_admitted", "rejected_nonfinite", "unknown_reads", "memory_rows", "disk_rows", "disk_bytes", "tier_asked", "tier_missed", "promotions", "demotions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    PUSH_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_READS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_ASKED_FIELD_NUMBER: _ClassVar[int]
    TIER_MISSED_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    rows: int
    capacity: int
    memory_bytes: int
    clock: int
    lookups: int
    lookup_ids: int
    pushes: int
    push_ids: int
    admissions: int
    rejected_admissions: int
    evictions: int
    expirations: int
    overflow: int
    dropped_not_admitted: int
    rejected_nonfinite: int
    unknown_reads: int
    memory_rows: int
    disk_rows: int
    disk_bytes: int
    tier_asked: int
    tier_missed: int
    promotions: int
    demotions: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., rows: _Optional[int] = ..., capacity: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., clock: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_ids: _Optional[int] = ..., pushes: _Optional[int] = ..., push_ids: _Optional[int] = ..., admissions: _Optional[int] = ..., rejected_admissions: _Optional[int] = ..., evictions: _Optional[int] = ..., expirations: _Optional[int] = ..., overflow: _Optional[int] = ..., dropped_not_admitted: _Optional[int] = ..., rejected_nonfinite: _Optional[int] = ..., unknown_reads: _Optional[int] = ..., memory_rows: _Optional[int] = ..., disk_rows: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., tier_asked: _Optional[int] = ..., tier_missed: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ...) -> None: ...

class LatencyHistogram(_message.Message):
    __slots__ = ("buckets", "counts", "sum_seconds", "count")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum_seconds: float
    count: int
    def __init__(self, buckets: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum_seconds: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tables", "duplicate_pushes", "last_checkpoint", "lookup_latency", "push_latency")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_LATENCY_FIELD_NUMBER: _ClassVar[int]
    PUSH_LATENCY_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    duplicate_pushes: int
    last_checkpoint: CheckpointResponse
    lookup_latency: LatencyHistogram
    push_latency: LatencyHistogram
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., duplicate_pushes: _Optional[int] = ..., last_checkpoint: _Optional[_Union[CheckpointResponse, _Mapping]] = ..., lookup_latency: _Optional[_Union[LatencyHistogram, _Mapping]] = ..., push_latency: _Optional[_Union[LatencyHistogram, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "dims", "row_dtype", "incarnation", "current_at")
    class DimsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_AT_FIELD_NUMBER: _ClassVar[int]
    status: str
    dims: _containers.ScalarMap[str, int]
    row_dtype: RowDtype
    incarnation: str
    current_at: float
    def __init__(self, status: _Optional[str] = ..., dims: _Optional[_Mapping[str, int]] = ..., row_dtype: _Optional[_Union[RowDtype, str]] = ..., incarnation: _Optional[str] = ..., current_at: _Optional[float] = ...) -> None: ...

class ChangesRequest(_message.Message):
    __slots__ = ("table", "epoch", "since")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    table: str
    epoch: str
    since: int
    def __init__(self, table: _Optional[str] = ..., epoch: _Optional[str] = ..., since: _Optional[int] = ...) -> None: ...

class ChangesResponse(_message.Message):
    __slots__ = ("epoch", "version", "complete", "dim", "ids", "rows", "removed", "changed_at")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_AT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    version: int
    complete: bool
    dim: int
    ids: bytes
    rows: bytes
    removed: bytes
    changed_at: float
    def __init__(self, epoch: _Optional[str] = ..., version: _Optional[int] = ..., complete: _Optional[bool] = ..., dim: _Optional[int] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., removed: _Optional[bytes] = ..., changed_at: _Optional[float] = ...) -> None: ...

class RowsPageRequest(_message.Message):
    __slots__ = ("table", "cursor", "count")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    table: str
    cursor: int
    count: int
    def __init__(self, table: _Optional[str] = ..., cursor: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class RowsPageResponse(_message.Message):
    __slots__ = ("dim", "ids", "rows", "next_cursor")
    DIM_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    dim: int
    ids: bytes
    rows: bytes
    next_cursor: int
    def __init__(self, dim: _Optional[int] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., next_cursor: _Optional[int] = ...) -> None: ...

class ChangesManyRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[ChangesRequest]
    def __init__(self, tables: _Optional[_Iterable[_Union[ChangesRequest, _Mapping]]] = ...) -> None: ...

class ChangesManyResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[ChangesResponse]
    def __init__(self, tables: _Optional[_Iterable[_Union[ChangesResponse, _Mapping]]] = ...) -> None: ...

"""A store shard: named tables, exactly-once pushes and checkpoints, with no network.

The gRPC servicer (``service.py``) and the in-process client only decode,
call and encode; every decision lives here so it can be tested directly.

>>> import numpy as np
>>> from embedding_store.types import StoreConfig
>>> shard = StoreShard(StoreConfig(tables={"item": {"dim": 2}}))
>>> ids = np.array([1, 2, 3], dtype=np.uint64)
>>> shard.lookup({"item": ids})["item"].shape
(3, 2)
>>> grads = {"item": (ids, np.ones((3, 2), dtype=np.float32))}
>>> shard.push(grads, request_id="r-1").applied
3
>>> shard.push(grads, request_id="r-1").duplicate_request  # a retry is not applied twice
True
"""

from __future__ import annotations

import operator
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from embedding_store import mirror as snapshot_mirror
from embedding_store import persistence
from embedding_store.errors import (
    CheckpointError,
    InvalidRequest,
    StoreUnavailable,
    UnknownTable,
)
from embedding_store.hashing import shard_of
from embedding_store.location import Location
from embedding_store.table import MAX_STEP, EmbeddingTable, apply_changes
from embedding_store.table_group import TableGroup
from embedding_store.tier.disk_rows import RowLayout
from embedding_store.tier.snapshots import tier_rows
from embedding_store.tier.tiered_table import TieredTable, empty_rows
from embedding_store.types import (
    CheckpointKind,
    CheckpointResult,
    PushOrigin,
    PushResult,
    RestoreResult,
    RowDtype,
    RowState,
    ShardStats,
    StoreConfig,
    TableChanges,
    TableConfig,
)

F32 = npt.NDArray[np.float32]
# Groups of writers (job incarnations) whose pushes a shard keeps count of.
_GROUPS_SEEN = 64
CHANGE_LOGS_KEY = "change_logs"  # in a checkpoint's metadata
TIER_DIR = "tier"  # in a shard's data dir: the disk tiers of its tiered tables


def tier_prefix(seq: int, table: str) -> str:
    """How a tiered table's full snapshot names its tier's files in a checkpoint."""
    return f"{seq:08d}-full-{table}.tier."


U64 = npt.NDArray[np.uint64]
_NAME = operator.attrgetter("name")


def release_tables(tables: Iterable[EmbeddingTable]) -> None:
    """Close the disk tiers of the tiered ``tables`` and delete their files."""
    for table in tables:
        if isinstance(table, TieredTable):
            table.close()
            shutil.rmtree(table.disk.path, ignore_errors=True)


def _check_step(step: int | None) -> None:
    """A bad step fails a call before any of its tables changes."""
    if step is not None and not 0 <= step < MAX_STEP:
        msg = f"step: must be in [0, 2**40), got {step}"
        raise InvalidRequest(msg)


class TableGroups:
    """The groups a reader keeps, one per set of tables it reads together; a group is
    made again once a restore replaced one of its tables, and at most ``limit`` sets
    are kept (a client chooses them)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._groups: dict[tuple[str, ...], TableGroup] = {}

    def of(self, tables: Sequence[EmbeddingTable]) -> TableGroup:
        """The group of ``tables`` (the very objects, in order)."""
        key = tuple(map(_NAME, tables))
        group = self._groups.get(key)
        if group is None or not group.holds(tables):
            if len(self._groups) >= self.limit:
                self._groups.clear()
            group = self._groups[key] = TableGroup(tables)
        return group


class _PendingPush:
    """A push being applied; a retry with the same request id waits for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: PushResult | None = None


class StoreShard:
    """One shard of the embedding store (thread-safe)."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        data_dir: Path | str | None = None,
        mirror: Location | None = None,
        read_only: bool = False,
    ) -> None:
        """``mirror``: where the checkpoints of ``data_dir`` are copied, so that this shard
        can be restarted on another host (see :mod:`embedding_store.mirror`).

        ``read_only``: a serving replica (see :mod:`embedding_store.replica`): lookups
        change nothing and read an id without a row as its initial row; pushes and
        checkpoints are refused. Its rows come from ``apply_changes`` and ``restore``.
        """
        self.config = config
        self.read_only = read_only
        # A replica's reason to refuse reads (it holds nothing yet); None: it serves.
        self.unavailable: str | None = None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        if mirror is not None and self.data_dir is None:
            msg = "a snapshot mirror needs the shard's data dir (its checkpoints are copied)"
            raise ValueError(msg)
        self.mirror = mirror
        # Tells this life of the shard from any other: a client that sees it change
        # knows that what was pushed since the last checkpoint is gone.
        self.incarnation = uuid.uuid4().hex
        # Tiered tables keep their disk tier under data_dir/tier, one folder per table and
        # restore (the tables being replaced serve on until the new ones are in).
        self._tier_generation = 0
        self._retired: list[EmbeddingTable] = []  # replaced copies, released a swap later
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir / TIER_DIR, ignore_errors=True)
        self._tables = self._new_tables()
        self._groups = TableGroups()  # a replica's reads of several tables at once
        self._push_lock = threading.Lock()
        # request id -> (monotonic time first seen, its push), oldest first
        self._pushes: OrderedDict[str, tuple[float, PushResult | _PendingPush]] = OrderedDict()
        self._duplicate_pushes = 0
        # Pushes with a PushOrigin are applied one at a time, each with what it saw:
        # group -> per rank, the newest push applied (the most recent groups only).
        self._origin_lock = threading.Lock()
        self._seen: OrderedDict[str, list[int]] = OrderedDict()
        self._checkpoint_lock = threading.Lock()
        # (directory, seq of the newest checkpoint there, deltas since its full)
        self._chain: tuple[Path, int, int] | None = None
        # The training shard's change logs at the cut of the checkpoint restored last
        # (table -> (epoch, version)): where a replica restored from it follows on.
        self.restored_logs: dict[str, tuple[str, int]] = {}
        self._last_checkpoint: CheckpointResult | None = None

    @classmethod
    def open(
        cls,
        config: StoreConfig,
        data_dir: Path | str,
        *,
        mirror: Location | None = None,
        read_only: bool = False,
    ) -> StoreShard:
        """A shard persisted in ``data_dir``: restored from it when it holds a checkpoint.

        With a ``mirror`` holding a newer checkpoint than ``data_dir`` (an empty
        disk, or a shard that ran on another host since), that one is fetched and
        restored: the mirror is the truth.
        """
        shard = cls(config, data_dir=data_dir, mirror=mirror, read_only=read_only)
        local = persistence.list_manifests(Path(data_dir))
        if mirror is not None:
            remote = snapshot_mirror.newest_seq(mirror)
            if remote is not None and (not local or local[-1][0] < remote):
                snapshot_mirror.fetch_chain(mirror, Path(data_dir), remote)
                shard.restore(upto_seq=remote)
                return shard
        if local:
            shard.restore()
        return shard

    # --- tables -----------------------------------------------------------------

    @property
    def tables(self) -> Mapping[str, EmbeddingTable]:
        """The tables by name; a restore or a new table replaces the mapping, never
        changes it, so a reader that keeps tables knows them current by its identity."""
        return self._tables

    def table(self, name: str) -> EmbeddingTable:
        """The table called ``name``; ``UnknownTable`` names the ones that exist."""
        try:
            return self._tables[name]
        except KeyError:
            msg = f"table {name!r} is not served by this shard (tables: {sorted(self._tables)})"
            raise UnknownTable(msg) from None

    def lookup(
        self,
        requests: Mapping[str, npt.ArrayLike],
        *,
        train: bool = True,
        step: int | None = None,
        dtype: RowDtype = "float32",
        out: Mapping[str, npt.NDArray[np.floating]] | None = None,
    ) -> dict[str, npt.NDArray[np.floating]]:
        """Rows for the ids of each named table (see ``EmbeddingTable.lookup``).

        Rows come in ``dtype`` (float16 is rounded as the rows are copied, with
        no float32 copy between); ``out`` names arrays to write some tables' rows
        into (a reply buffer), which then decide the dtype.
        """
        _check_step(step)
        tables = [(name, self.table(name)) for name in requests]
        out = out or {}
        result = {}
        if self.read_only:
            if self.unavailable is not None:
                raise StoreUnavailable(self.unavailable)
            # A serving request's few ids in each of many tables: one kernel call for all.
            together = (
                self._groups.of([t for _, t in tables]).read_each(
                    [requests[name] for name, _ in tables]
                )
                if len(tables) > 1
                else None
            )
            for i, (name, t) in enumerate(tables):
                rows = together[i] if together is not None else t.read(requests[name])[0]
                dest = out.get(name)
                if dest is not None:
                    dest[...] = rows
                result[name] = dest if dest is not None else rows.astype(dtype, copy=False)
            return result
        for name, t in tables:
            dest = out.get(name)
            if dest is None and dtype != "float32":
                dest = np.empty((np.shape(requests[name])[0], t.dim), dtype=dtype)
            result[name] = t.lookup(requests[name], train=train, step=step, out=dest)
        return result

    def create_rows(
        self, requests: Mapping[str, npt.ArrayLike], *, step: int | None = None
    ) -> None:
        """A bulk load: each table's rows of its ids made as a training lookup makes them,
        none read out (see ``EmbeddingTable.create``)."""
        self._refuse_if_replica("create rows")
        _check_step(step)
        for name, t in [(name, self.table(name)) for name in requests]:
            t.create(requests[name], step=step)

    def peek(self, ids: Mapping[str, npt.ArrayLike]) -> dict[str, RowState]:
        """Each table's rows of ``ids`` with their optimizer state, changing nothing."""
        return {name: self.table(name).peek(table_ids) for name, table_ids in ids.items()}

    def push(
        self,
        grads: Mapping[str, tuple[npt.ArrayLike, npt.ArrayLike]],
        *,
        request_id: str | None = None,
        into: Mapping[str, RowState] | None = None,
    ) -> PushResult:
        """Apply row gradients to several tables; a request id is applied at most once.

        Every table name and shape is checked before any gradient is applied,
        so a bad request changes nothing. ``into``: per table, filled with the
        pushed rows as they are after the push (a retried request's too).
        """
        self._refuse_if_replica("push")
        checked = []
        for name, (ids, g) in grads.items():
            table = self.table(name)
            ids_arr, g_arr = np.asarray(ids), np.asarray(g)
            if g_arr.ndim != 2 or g_arr.shape != (ids_arr.shape[0], table.dim):
                msg = (
                    f"table {name!r}: grads have shape {g_arr.shape}, expected "
                    f"({ids_arr.shape[0]}, {table.dim}) for {ids_arr.shape[0]} ids"
                )
                raise InvalidRequest(msg)
            checked.append((table, ids_arr, g_arr))
        if request_id is None:
            return self._apply(checked, into)
        origin = PushOrigin.parse(request_id)
        if origin is not None and origin.read:
            return self._read_as_of(origin, checked, into)
        with self._push_lock:
            seen = self._pushes.get(request_id)
            entry = seen[1] if seen is not None else None
            if entry is None:
                first_seen = time.monotonic()
                pending = _PendingPush()
                self._pushes[request_id] = (first_seen, pending)
        if entry is not None:
            if isinstance(entry, _PendingPush):
                entry.done.wait()
                if entry.result is None:  # the first attempt failed: nothing was applied
                    return self.push(grads, request_id=request_id, into=into)
                entry = entry.result
            with self._push_lock:
                self._duplicate_pushes += 1
            if into is not None:
                for table, ids, _ in checked:
                    table.peek_into(ids, into[table.name])
            return replace(entry, duplicate_request=True)
        try:
            if origin is None:
                result = self._apply(checked, into)
            else:
                result = self._apply_from(origin, checked, into)
        except BaseException:
            with self._push_lock:
                self._pushes.pop(request_id, None)
            pending.done.set()
            raise
        pending.result = result
        with self._push_lock:
            self._pushes[request_id] = (first_seen, result)
            self._forget_old_pushes()
        pending.done.set()
        return result

    def _apply_from(
        self,
        origin: PushOrigin,
        checked: list[tuple[EmbeddingTable, np.ndarray, np.ndarray]],
        into: Mapping[str, RowState] | None,
    ) -> PushResult:
        """Apply a push of ``origin``; the result says what every rank of its group had
        applied here by then. One such push at a time: its rows (``into``) are read
        before any other push changes them, so they include exactly what ``seen`` says.
        """
        with self._origin_lock:
            seen = self._seen.get(origin.group)
            if seen is None or len(seen) != origin.ranks:
                seen = self._seen[origin.group] = [0] * origin.ranks
                while len(self._seen) > _GROUPS_SEEN:
                    self._seen.popitem(last=False)
            self._seen.move_to_end(origin.group)
            result = self._apply(checked, into)
            seen[origin.rank] = max(seen[origin.rank], origin.seq)
            return replace(result, seen=tuple(seen))

    def _read_as_of(
        self,
        origin: PushOrigin,
        checked: list[tuple[EmbeddingTable, np.ndarray, np.ndarray]],
        into: Mapping[str, RowState] | None,
    ) -> PushResult:
        """The rows of a read ``origin`` as they are (``into``), with what every rank of
        its group had applied here: nothing is applied, and the request id is not
        remembered (a read is asked again with the same id)."""
        with self._origin_lock:
            seen = self._seen.get(origin.group)
            vector = tuple(seen) if seen is not None and len(seen) == origin.ranks else None
            if into is not None:
                for table, ids, _ in checked:
                    table.peek_into(ids, into[table.name])
        return PushResult(seen=vector or (0,) * origin.ranks)

    def _forget_old_pushes(self) -> None:
        """Drop the oldest request ids beyond ``remembered_push_ids`` or older than
        ``remembered_push_s``: a retry comes within the client's retry span, and a
        count alone let the ids fill the shard's memory for an hour at a slow rate."""
        horizon = time.monotonic() - self.config.remembered_push_s
        pushes = self._pushes
        while pushes and (
            len(pushes) > self.config.remembered_push_ids
            or next(iter(pushes.values()))[0] < horizon
        ):
            pushes.popitem(last=False)

    @staticmethod
    def _apply(
        checked: list[tuple[EmbeddingTable, np.ndarray, np.ndarray]],
        into: Mapping[str, RowState] | None,
    ) -> PushResult:
        total = PushResult()
        for table, ids, g in checked:
            total = total + table.push(ids, g, into=None if into is None else into[table.name])
        return total

    # --- persistence --------------------------------------------------------------

    def _resolve_dir(self, directory: Path | str | None, what: str) -> Path:
        if directory is not None and str(directory) != "":
            return Path(directory)
        if self.data_dir is None:
            msg = f"{what}: no directory given and the shard has no data dir"
            raise CheckpointError(msg)
        return self.data_dir

    def checkpoint(
        self,
        directory: Path | str | None = None,
        kind: CheckpointKind = "auto",
        *,
        metadata: dict[str, Any] | None = None,
    ) -> CheckpointResult:
        """Write a full snapshot or a delta of every table into ``directory``.

        ``auto`` writes a delta on top of this shard's previous checkpoint in
        the same directory and a full snapshot every ``full_checkpoint_every``
        deltas; a delta asked for without such a base is written full. Each
        table is cut consistently; calls on other tables may go on meanwhile
        (callers that need one cut across tables pause their traffic first).
        """
        self._refuse_if_replica("checkpoint")
        target = self._resolve_dir(directory, "checkpoint")
        with self._checkpoint_lock:
            start = time.perf_counter()
            existing = persistence.list_manifests(target)
            seq = existing[-1][0] + 1 if existing else 1
            mirror = self.mirror if target == self.data_dir else None
            if mirror is not None:
                # Never reuse a seq the mirror holds (a shard that ran elsewhere since).
                seq = max(seq, (snapshot_mirror.newest_seq(mirror) or 0) + 1)
            chain = self._chain
            actual = self._checkpoint_kind(target, existing[-1][0] if existing else None, kind)
            # Read before the cut: a replica that starts from this checkpoint follows
            # the changes since then, a few it already holds included.
            logs = {n: p for n, t in self._tables.items() if (p := t.log_position()) is not None}
            if logs:
                metadata = {**(metadata or {}), CHANGE_LOGS_KEY: logs}
            snaps = self._export_tables(actual, target, seq)
            try:
                path, n_rows, n_tombs, n_bytes = persistence.write_checkpoint(
                    target,
                    seq,
                    "full" if actual == "full" else "delta",
                    parent=None if actual == "full" else seq - 1,
                    tables=snaps,
                    compression=self.config.compression,
                    metadata=metadata,
                )
            except BaseException:
                self._break_chain()
                raise
            if mirror is not None:
                try:
                    snapshot_mirror.upload(path, mirror)
                except BaseException:
                    self._break_chain()
                    raise
            deltas = 0 if actual == "full" else (chain[2] + 1 if chain else 1)
            self._chain = (target, seq, deltas)
            if actual == "full":
                removed = persistence.collect_garbage(target, self.config.keep_full_checkpoints)
                if mirror is not None:
                    snapshot_mirror.remove(mirror, removed)
            result = CheckpointResult(
                manifest=str(path),
                kind="full" if actual == "full" else "delta",
                seq=seq,
                rows=n_rows,
                tombstones=n_tombs,
                bytes=n_bytes,
                seconds=time.perf_counter() - start,
            )
            self._last_checkpoint = result
            return result

    def _checkpoint_kind(self, target: Path, last_seq: int | None, kind: CheckpointKind) -> str:
        """``full`` or ``delta``: what a checkpoint of ``kind`` writes into ``target``, whose
        newest checkpoint is ``last_seq`` (a delta needs this shard's last one as its base)."""
        chain = self._chain
        can_delta = (
            chain is not None
            and chain[0] == target
            and last_seq is not None
            and chain[1] == last_seq
        )
        if kind == "full" or not can_delta:
            return "full"
        if kind == "delta":
            return "delta"
        assert chain is not None
        return "delta" if chain[2] < self.config.full_checkpoint_every else "full"

    def _export_tables(self, kind: str, target: Path, seq: int) -> list[persistence.TableSnapshot]:
        """Every table's rows (all, or those dirty since the last export), each table cut
        consistently; a tiered table's full snapshot is its disk tier's checkpoint."""
        snaps = []
        for name, table in self._tables.items():
            if kind == "full" and isinstance(table, TieredTable):
                prefix = tier_prefix(seq, name)
                files, n_rows, clock = table.checkpoint_tier(target, prefix)
                snaps.append(
                    persistence.TableSnapshot(
                        name=name,
                        dim=table.dim,
                        state_width=table.state_width,
                        rows=empty_rows(table.dim, table.state_width),
                        tombstones=np.zeros(0, np.uint64),
                        clock=clock,
                        tier_files=tuple(files),
                        tier_rows=n_rows,
                    )
                )
                continue
            rows, tombs, clock = table.export(dirty_only=kind == "delta")
            snaps.append(
                persistence.TableSnapshot(
                    name=name,
                    dim=table.dim,
                    state_width=rows.state.shape[1],
                    rows=rows,
                    tombstones=tombs,
                    clock=clock,
                )
            )
        return snaps

    def _break_chain(self) -> None:
        """After a checkpoint failed: the rows it exported were marked clean, and the next
        delta would miss them, so the next checkpoint is full."""
        self._chain = None
        for table in self._tables.values():
            table.mark_all_dirty()

    def restore(
        self,
        directory: Path | str | None = None,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        upto_seq: int | None = None,
    ) -> RestoreResult:
        """Replace every table with the newest checkpoint in ``directory``.

        ``directory`` may hold one shard's checkpoints or ``shard-*`` folders of
        several; with ``num_shards > 1`` only the ids this shard owns
        (``shard_of(id, num_shards) == shard_index``) are kept, so a checkpoint
        of N shards restores onto M. Every file is verified first and the tables
        are swapped only when all loaded: a failed restore changes nothing.
        """
        if not 0 <= shard_index < num_shards:
            msg = f"shard_index must be in [0, {num_shards}), got {shard_index}"
            raise InvalidRequest(msg)
        source = self._resolve_dir(directory, "restore")
        with self._checkpoint_lock:
            if (
                self.mirror is not None
                and source == self.data_dir
                and upto_seq is not None
                and upto_seq not in {s for s, _ in persistence.list_manifests(source)}
            ):
                # Asked for a checkpoint this disk never held (the shard moved hosts).
                snapshot_mirror.fetch_chain(self.mirror, source, upto_seq)
            sources = [(d, upto_seq) for d in persistence.source_dirs(source)]
            return self._restore_chains(sources, shard_index, num_shards)

    def restore_sources(
        self, sources: Sequence[tuple[Path, int | None]], *, shard_index: int, num_shards: int
    ) -> RestoreResult:
        """Restore from the checkpoints of several shards, each up to its own seq.

        ``sources`` are (directory, seq) pairs, one per shard of the checkpoint
        (a job manifest names each shard's seq); only the ids this shard owns
        among ``num_shards`` are kept. This is how a checkpoint of N shards is
        laid out again on M (``streamrec store reshard``).
        """
        if not 0 <= shard_index < num_shards:
            msg = f"shard_index must be in [0, {num_shards}), got {shard_index}"
            raise InvalidRequest(msg)
        with self._checkpoint_lock:
            return self._restore_chains(sources, shard_index, num_shards)

    def _restore_chains(
        self, sources: Sequence[tuple[Path, int | None]], shard_index: int, num_shards: int
    ) -> RestoreResult:
        chains = [persistence.plan_restore(d, seq) for d, seq in sources]
        for chain in chains:
            persistence.verify(chain)
        fresh = self._new_tables()
        try:
            for chain in chains:
                for manifest in chain:
                    self._apply_manifest(manifest, fresh, shard_index, num_shards)
        except BaseException:
            release_tables(fresh.values())
            raise
        old, self._tables = self._tables, fresh
        release_tables(old.values())
        # The next checkpoint must be full: these rows were never written by this shard.
        self._chain = None
        newest = chains[-1][-1] if len(chains) == 1 and chains[0] else None
        logs = newest.metadata.get(CHANGE_LOGS_KEY, {}) if newest is not None else {}
        self.restored_logs = {n: (str(e), int(v)) for n, (e, v) in logs.items()}
        return RestoreResult(
            manifests=tuple(str(m.path) for chain in chains for m in chain),
            rows=sum(len(t) for t in fresh.values()),
            rows_by_table={name: len(t) for name, t in fresh.items()},
        )

    @staticmethod
    def _apply_manifest(
        manifest: persistence.Manifest,
        tables: dict[str, EmbeddingTable],
        shard_index: int,
        num_shards: int,
    ) -> None:
        for tname, tinfo in manifest.tables.items():
            if tname not in tables:
                msg = (
                    f"{manifest.path}: checkpoint has table {tname!r} that the store config "
                    f"does not define (tables: {sorted(tables)})"
                )
                raise CheckpointError(msg)
            table = tables[tname]
            tier = [manifest.directory / f["path"] for f in tinfo["files"] if f["role"] == "tier"]
            if tier:
                StoreShard._apply_tier(manifest, tname, tinfo, tier, table, shard_index, num_shards)
                table.set_clock(int(tinfo["clock"]))
                continue
            # Tombstones first: an id removed and then created again is in both files.
            for f in sorted(tinfo["files"], key=lambda f: f["role"] != "tombstones"):
                path = manifest.directory / f["path"]
                if f["role"] == "tombstones":
                    table.remove(persistence.read_tombstones(path))
                    continue
                rows = persistence.read_rows(path, tinfo["dim"], tinfo["state_width"])
                if len(rows) != f["rows"]:
                    msg = f"{path}: holds {len(rows)} rows, the manifest says {f['rows']}"
                    raise CheckpointError(msg)
                if num_shards > 1:
                    rows = rows.select(shard_of(rows.ids, num_shards) == shard_index)
                table.load(rows)
            table.set_clock(int(tinfo["clock"]))

    def _new_tables(self) -> dict[str, EmbeddingTable]:
        self._tier_generation += 1
        tables: dict[str, EmbeddingTable] = {}
        try:
            for name, cfg in self.config.tables.items():
                tables[name] = self._new_table(name, cfg)
        except BaseException:
            release_tables(tables.values())
            raise
        return tables

    def _new_table(self, name: str, cfg: TableConfig) -> EmbeddingTable:
        if cfg.tier is None:
            return EmbeddingTable(name, cfg)
        if self.data_dir is None:
            who = "a serving replica's" if self.read_only else "the shard's"
            msg = f"table {name!r} is tiered: its disk tier needs {who} data dir"
            raise InvalidRequest(msg)
        path = self.data_dir / TIER_DIR / f"{name}.{self._tier_generation}"
        return TieredTable(name, cfg, path)

    def new_table(self, name: str) -> EmbeddingTable:
        """An empty table ``name`` as this shard makes it (tiered in a folder of its own):
        a serving replica's copy, filled off to the side and swapped in by
        :meth:`replace_table`."""
        self.table(name)
        self._tier_generation += 1
        return self._new_table(name, self.config.tables[name])

    def close(self) -> None:
        """Release the tables' disk tiers (a shard that holds none has nothing to close)."""
        release_tables([*self._tables.values(), *self._retired])
        self._retired = []

    @staticmethod
    def _apply_tier(
        manifest: persistence.Manifest,
        name: str,
        tinfo: dict[str, Any],
        files: list[Path],
        table: EmbeddingTable,
        shard_index: int,
        num_shards: int,
    ) -> None:
        """A tiered table's full snapshot: linked in as the table's tier when it is whole
        here, else its rows read and loaded (an untiered table, a reshard)."""
        prefix = tier_prefix(manifest.seq, name)
        if isinstance(table, TieredTable) and num_shards == 1:
            table.load_tier(files, prefix, int(tinfo["rows"]))
            return
        layout = RowLayout(int(tinfo["dim"]), int(tinfo["state_width"]))
        for part in tier_rows(files, prefix, layout):
            mine = shard_of(part.ids, num_shards) == shard_index if num_shards > 1 else None
            table.load(part if mine is None else part.select(mine))

    # --- serving replicas -----------------------------------------------------------

    def _refuse_if_replica(self, what: str) -> None:
        if self.read_only:
            msg = f"{what}: this shard is a read-only serving replica; ask the training shard"
            raise InvalidRequest(msg)

    def changes(self, table: str, epoch: str, since: int) -> TableChanges:
        """``table``'s rows changed since version ``since`` of its log ``epoch``."""
        return self.table(table).changes(epoch, since)

    def changes_many(self, asks: Sequence[tuple[str, str, int]]) -> list[TableChanges]:
        """:meth:`changes` of several ``(table, epoch, since)``."""
        return [self.changes(t, e, s) for t, e, s in asks]

    def rows_page(self, table: str, cursor: int, count: int) -> tuple[U64, F32, int]:
        """``table``'s rows stored in slots ``[cursor, cursor + count)`` and the next cursor."""
        return self.table(table).rows_page(cursor, count)

    def apply_changes(
        self, table: str, ids: npt.NDArray[np.uint64], weights: F32, removed: npt.NDArray[np.uint64]
    ) -> None:
        """Write rows and remove ids in a replica's ``table`` (what a follower received)."""
        apply_changes(self.table(table), ids, weights, removed)

    def replace_table(self, table: EmbeddingTable) -> None:
        """Swap in a replica's new copy of a table (lookups go on on the old one meanwhile)."""
        if not self.read_only:
            msg = "replace_table: only a read-only serving replica's tables are replaced so"
            raise InvalidRequest(msg)
        old = self.table(table.name)
        self._tables = {**self._tables, table.name: table}
        # A read may still be on the old copy: its disk tier is released a swap later.
        release_tables(self._retired)
        self._retired = [old]

    def stats(self) -> ShardStats:
        """Counters of every table, and of the shard."""
        with self._push_lock:
            dups = self._duplicate_pushes
        return ShardStats(
            tables=tuple(t.stats() for t in self._tables.values()),
            duplicate_pushes=dups,
            last_checkpoint=self._last_checkpoint,
        )

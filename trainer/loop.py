"""The hybrid training loop of one trainer rank.

Per step: take the next prepared batch (its rows were looked up at most
``staleness`` pushes ago), score it (progressive validation: the forward pass
happens before the batch is learned), backward, exchange the dense gradients
with the other ranks (``DenseSync``), step the dense optimizer, and hand the
row gradients to the ``Pusher``. Before the next batch is asked for, at most
``push_queue`` pushes may be unapplied: with the runner's prefetch that is the
staleness bound. Checkpoints are decided collectively (any rank's timer or
stop request) and taken by ``JobCheckpointer``.

Every rank runs the same per-step protocol: what it does after the step's one
exchange is a pure function of its own state and every rank's sums
(:func:`trainer.step_protocol.decide`); the loop gathers that state and carries
the decision out.

The loop knows nothing about Kafka, Dask or processes: it gets an iterator of
batches, a store client and callbacks, which keeps it testable in one process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch

from connectors.spec import FeatureSpec
from embedding_store.client import StoreClient
from pipeline.types import PreparedBatch
from trainer.checkpoint import JobManifest
from trainer.config import TrainerConfig
from trainer.dense_model import DenseModel
from trainer.dense_sync import DenseSync
from trainer.errors import Rollback, StoreLost, store_failure
from trainer.event_budget import even_shares, share_spare
from trainer.joined_fields import JoinedFields
from trainer.ledger import Ledger
from trainer.loop_options import Compute, Outputs, Recovery, Start, Until
from trainer.metrics import MetricsSnapshot, ProgressiveMetrics, snapshot_of
from trainer.models import loss_fn, rate_logits
from trainer.pooling import host_tensor, pool, row_grads, to_tensors
from trainer.progress import LoopStats, Progress
from trainer.pusher import Pusher, SharedPushes
from trainer.run_files import RotatingLines
from trainer.split_step import SplitStep
from trainer.step_protocol import (
    END_OF_STREAM,
    MAX_EVENTS,
    End,
    RankState,
    RollBackAll,
    ShareSpare,
    Step,
    WaitQuietly,
    ask_stream,
    budget_at,
    decide,
    share_learned,
)

log = logging.getLogger(__name__)

_RECENT_LOSSES_KEPT = 4096
_END = object()
# While every rank's stream is quiet, the ranks meet this often (not in a busy loop).
_QUIET_SLEEP_S = 0.05


@dataclass
class _RunState:
    """What one run of the loop knows of its stream from step to step."""

    exhausted: bool = False  # the stream ended (or this rank's share is learned)
    end_reason: str = END_OF_STREAM
    asked: bool = False  # the stream was asked for a batch at least once
    hungry_checked: tuple[float, bool] = (-float("inf"), False)  # when, and the answer
    last_report: float = field(default_factory=time.monotonic)


class SharedBudget(Protocol):
    """The side of a rank's stream that a job-wide ``--max-events`` moves between ranks
    (``pipeline.runner.StreamRunner`` with ``budget_open``)."""

    def has_more(self) -> bool: ...

    def allow(self, more: int) -> None: ...


@dataclass(frozen=True)
class JobBudget:
    """A job's ``--max-events`` as the ranks share it: the job's whole budget, what
    this rank had learned of it before this attempt (a rollback keeps it), and the
    stream whose reading the shares bound."""

    max_events: int
    kept_events: int
    stream: SharedBudget


class TrainLoop:
    """One rank's loop over ``batches`` (see the module docstring)."""

    def __init__(
        self,
        config: TrainerConfig,
        spec: FeatureSpec,
        store: StoreClient,
        dense: DenseModel,
        *,
        rank: int = 0,
        compute: Compute | None = None,
        start: Start | None = None,
        until: Until | None = None,
        recovery: Recovery | None = None,
        outputs: Outputs | None = None,
    ) -> None:
        """Rank ``rank``'s loop; each group of options is described with its class
        (:mod:`trainer.loop_options`), and defaults to a loop alone on the CPU that
        starts afresh, runs to its stream's end, takes no checkpoint and writes nothing.
        """
        compute = compute or Compute()
        start = start or Start()
        until = until or Until()
        recovery = recovery or Recovery()
        outputs = outputs or Outputs()
        self.config = config
        self.best_auc = outputs.best_auc
        self.spec = spec
        self.store = store
        self.dense = dense
        self.rank = rank
        self.device = compute.device
        self.run_dir = outputs.run_dir
        self.checkpointer = recovery.checkpointer
        # Per partition, every record before this was learned (not merely yielded).
        self.positions = dict(start.positions)
        self.step = start.step
        self.samples_before = start.samples
        self.max_events = until.max_events
        self.deadline = until.deadline
        self.stop = until.stop or threading.Event()
        self.on_progress = outputs.on_progress
        self.store_changed = recovery.store_changed
        self.publisher = outputs.publisher
        self.before_checkpoint = recovery.before_checkpoint
        self.initial_checkpoint = recovery.initial_checkpoint
        self.metrics = ProgressiveMetrics(window=config.metrics_window)
        self.stats = start.stats if start.stats is not None else LoopStats()
        # What went wrong with the store since the last step (told to every rank at
        # the next collective, which then rolls back together).
        self._failure: BaseException | None = None
        self._events = 0  # records this loop learned (stats may carry earlier attempts')
        self._learned = 0  # samples this loop learned
        self._job_learned = 0  # samples every rank learned in this loop
        # (samples, events) this loop had learned at its last checkpoint: what a
        # rollback to that checkpoint keeps.
        self.checkpointed = (0, 0)
        self.sync = DenseSync(
            dense.module,
            mode="local" if config.mode == "async" else "allreduce",
            average_every=config.average_every,
        )
        # Sync mode reads every push fresh already (its lookups wait for them).
        fresh = config.fresh_rows != "off" and config.staleness > 0 and config.mode != "sync"
        self.pusher = Pusher(
            store,
            run_id=f"{uuid.uuid4().hex[:12]}-r{rank}",
            fresh_rows=fresh,
            tables=compute.store_tables
            if compute.store_tables is not None
            else store.table_configs,
            rank=rank,
            ranks=self.sync.world,
        )
        self._fresh = fresh
        # With several ranks, fresh rows include the others' pushes: the ranks tell each
        # other theirs at every step (the pushes' answers and the gradients to come).
        self._share_pushes = fresh and self.sync.world > 1
        self._losses: list[float] = []
        self._last_checkpoint_t = time.monotonic()
        self._checkpointed_step = start.step  # a restored job holds this step already
        # A checkpoint after step 0 holds a trained bias; one at step 0 holds the seeded
        # init, so measuring the same first batch again gives an uninterrupted run's start.
        self._prior_pending = config.label_prior == "first_batch" and start.step == 0
        self._log: RotatingLines | None = None
        threads = (
            compute.step_threads if compute.step_threads is not None else config.step_threads or 1
        )
        self._split = SplitStep(threads) if threads > 1 and self.device.type == "cpu" else None
        # One line per learned chunk, and a rollback line per restore: the audit
        # trail that shows each offset was learned once, across restarts.
        self._ledger: Ledger | None = None

    # --- one step -----------------------------------------------------------------

    def _forward_backward(self, batch: PreparedBatch) -> dict[str, Any]:
        """Score the batch, then the gradients of its loss (the caller zeroed the dense ones)."""
        joined_fields: JoinedFields | None = None
        if self.device.type == "cpu":
            # Every field pooled straight into the model's input matrix, and its
            # gradient scattered back in one pass, instead of torch ops per table
            # (see trainer.joined_fields; benchmarks/e2e.py's step mode).
            joined_fields = JoinedFields(batch, self.spec)
            dense = host_tensor(batch.dense)
            labels = host_tensor(batch.labels)
            joined = joined_fields.tensor()
        else:
            cuda = self.device.type == "cuda"
            bt = to_tensors(
                batch, self.spec, device=self.device, non_blocking=cuda, pin_memory=cuda
            )
            dense, labels = bt.dense, bt.labels
            joined = torch.cat(pool(bt, self.spec), dim=1)
        if self._split is not None:
            logits, loss = self._split.forward_backward(
                self.dense.module, dense, joined, labels, bf16=self.config.bf16_autocast
            )
        else:
            with torch.autocast(
                device_type=self.device.type,
                dtype=torch.bfloat16,
                enabled=self.config.bf16_autocast,
            ):
                logits = self.dense.module.forward_joined(dense, joined)
            logits = logits.float()
            loss = loss_fn(logits, labels)
            loss.backward()
        with torch.no_grad():
            probs = torch.sigmoid(logits).cpu().numpy()
        # Progressive validation: this batch was scored before it is learned (the
        # logits are the model's before this step; the backward only made gradients).
        self.metrics.update(batch.labels, probs)
        self._losses.append(float(loss.detach()))
        if len(self._losses) > 2 * _RECENT_LOSSES_KEPT:
            # A continuous job runs for weeks: keep the recent losses, not all of them.
            del self._losses[:-_RECENT_LOSSES_KEPT]
        grads = joined_fields.row_grads() if joined_fields is not None else row_grads(bt)
        return {
            name: (t.unique_ids, grads[name])
            for name, t in batch.tables.items()
            if t.unique_ids.shape[0]
        }

    def _want_checkpoint(self) -> bool:
        ck = self.config.checkpoint
        if self.checkpointer is None or not ck.enabled:
            return False
        # Decided before the step completes: the checkpoint lands after step N*every.
        if ck.every_steps is not None and (self.step + 1) % ck.every_steps == 0:
            return True
        return ck.every_s is not None and time.monotonic() - self._last_checkpoint_t >= ck.every_s

    def stop_reason(self) -> str:
        """Why the loop should stop now (a signal, --max-time), or '' to go on."""
        if self.stop.is_set():
            return "signal"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "max_time"
        return ""

    def checkpoint(self) -> JobManifest | None:
        """A coordinated checkpoint (every rank calls it at the same step)."""
        if self.checkpointer is None:
            return None
        t0 = time.perf_counter()
        try:
            self.stats.push_wait_s += self.pusher.drain()
            if self.before_checkpoint is not None and self._failure is None:
                self.before_checkpoint()
        except Exception as exc:
            self._failure = self._failure or exc
        manifest = self.checkpointer.take(
            self.sync,
            rank=self.rank,
            step=self.step,
            positions=dict(self.positions),
            samples=self._learned,
            samples_before=self.samples_before,
            dense=self.dense.state(),
            failure=self._failure,
        )
        self._last_checkpoint_t = time.monotonic()
        self._checkpointed_step = self.step
        self.checkpointed = (self._learned, self._events)
        self.stats.checkpoints += 1
        if manifest is not None:
            self.stats.last_checkpoint = {
                "step": manifest.step,
                "path": manifest.path,
                "seconds": time.perf_counter() - t0,
                "bytes": manifest.extra.get("store_bytes", 0),
                "time": manifest.created,
            }
        return manifest

    # --- the loop -----------------------------------------------------------------

    def run(
        self, batches: Iterator[PreparedBatch | None], budget: JobBudget | None = None
    ) -> LoopStats:
        """Train until every rank's stream ends, or a stop; checkpoint on the way out.

        ``batches`` may yield ``None``: this rank's stream is quiet for now (see
        ``StreamRunner(idle_ticks=True)``); the rank still takes part in the step.
        ``budget``: the job's ``--max-events`` shared by several ranks (see
        :mod:`trainer.event_budget`): every rank gives one, and shares move to the
        ranks with records. Raises :class:`Rollback` on every rank when the store
        lost state.
        """
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            kept = self.config.run_files
            self._log = RotatingLines(
                self.run_dir / f"metrics-rank{self.rank}.jsonl",
                max_bytes=kept.max_bytes,
                keep=kept.keep,
            )
            self._ledger = Ledger(
                self.run_dir / f"learned-rank{self.rank}.log",
                max_bytes=kept.max_bytes,
                keep=kept.keep,
            )
            # Whatever an earlier run (of any rank, on any host) learned after the
            # checkpoint this run starts from was rolled back with the store.
            self._ledger.rollback(self.step)
        try:
            self._run(batches, budget if self.sync.world > 1 else None)
        except Rollback:
            raise
        except BaseException as exc:
            self.stats.stopped_by = self.stats.stopped_by or f"error: {type(exc).__name__}"
            with contextlib.suppress(Exception):
                self._report()  # the metrics file says how the run ended
            raise
        finally:
            self.pusher.close()
            if self._split is not None:
                self._split.close()
            if self._log is not None:
                self._log.close()
            if self._ledger is not None:
                self._ledger.close()
        return self.stats

    def _run(self, batches: Iterator[PreparedBatch | None], budget: JobBudget | None) -> None:
        run = _RunState()
        if budget is not None:
            self._even_shares(budget)
        if self._share_pushes:
            # One name for this incarnation of the job's pushes, the same on every rank.
            group = cast(list[str], self.sync.gather(uuid.uuid4().hex[:16]))[0]
            self.pusher.join(group)
        if self.initial_checkpoint:
            self.checkpoint()
        while True:
            batch, quiet, stop_reason = self._next_batch(batches, run)
            if self._prior_pending:
                self._first_batch_prior(batch)
            missed = (
                self.pusher.missed_since(batch.looked_up_at)
                if batch is not None and batch.looked_up_at > 0
                else None
            )
            if self._fresh and batch is not None and len(batch) and batch.looked_up_at > 0:
                self._freshen(batch)
            grads = self._compute(batch)
            mine = self._rank_state(batch, quiet, stop_reason, budget, run)
            t0 = time.perf_counter()
            shared: tuple[SharedPushes, bytes] | None = None
            if self._share_pushes:
                # Told at this step's gather (its size travels with the flags).
                told = self.pusher.share(self.step + 1, grads if self._failure is None else None)
                shared = (told, pickle.dumps(told, protocol=pickle.HIGHEST_PROTOCOL))
            everyone = self.sync.exchange(mine.control, share_bytes=len(shared[1]) if shared else 0)
            self.stats.sync_s += time.perf_counter() - t0
            decision = decide(mine, everyone)
            if isinstance(decision, RollBackAll):
                # Nothing of this step is learned: the store goes back to the checkpoint.
                what = str(self._failure) if self._failure else "another rank lost the store"
                raise Rollback(what) from self._failure
            if isinstance(decision, Step):
                self._take_step(batch, missed, grads, everyone.samples, shared, run, budget)
                if decision.checkpoint:
                    self.checkpoint()
                if decision.stop_after:
                    self.stats.stopped_by = decision.stop_after
                    break
                if decision.report:
                    self._report(every_rank=True)
                    run.last_report = time.monotonic()
                continue
            if shared is not None:
                self.pusher.unshare(shared[0])  # no gather at this step: told at the next
            if isinstance(decision, ShareSpare) and budget is not None:
                self._share_spare(budget, mine.control.hungry > 0, mine.control.spare)
                run.hungry_checked = (-float("inf"), False)
            elif isinstance(decision, WaitQuietly):
                if decision.checkpoint:
                    self.checkpoint()
                if decision.report:
                    self._report(every_rank=True)
                    run.last_report = time.monotonic()
                time.sleep(_QUIET_SLEEP_S)
            elif isinstance(decision, End):
                self.stats.stopped_by = decision.stopped_by
                break
        self._finish()

    def _next_batch(
        self, batches: Iterator[PreparedBatch | None], run: _RunState
    ) -> tuple[PreparedBatch | None, bool, str]:
        """This step's batch (None: none), whether the stream is quiet for now (it gave
        None), and why the loop should stop ('' to go on)."""
        if self._failure is None and self.store_changed is not None:
            changed = self.store_changed()
            if changed:
                self._failure = StoreLost(changed)
        stop_reason = self.stop_reason()
        failed = self._failure is not None
        if not ask_stream(
            exhausted=run.exhausted, stop_reason=stop_reason, asked=run.asked, failed=failed
        ):
            return None, False, stop_reason
        run.asked = True
        t0 = time.perf_counter()
        try:
            item = next(batches, _END)
        except Exception as exc:
            if not store_failure(exc):
                raise
            self._failure, item = exc, None
        self.stats.wait_s += time.perf_counter() - t0
        if item is _END:
            run.exhausted = True
            # A stream cut short by a stop is not the stream's end.
            return None, False, self.stop_reason()
        if self._failure is not None:
            return None, False, stop_reason
        batch = cast(PreparedBatch | None, item)
        return batch, batch is None, stop_reason

    def _compute(self, batch: PreparedBatch | None) -> dict[str, Any]:
        """The batch's forward and backward: its row gradients (none without a batch)."""
        t0 = time.perf_counter()
        # A rank without a batch still steps, with no dense gradients of its own.
        self.dense.optimizer.zero_grad(set_to_none=True)
        grads = self._forward_backward(batch) if batch is not None and len(batch) else {}
        self.stats.compute_s += time.perf_counter() - t0
        return grads

    def _rank_state(
        self,
        batch: PreparedBatch | None,
        quiet: bool,
        stop_reason: str,
        budget: JobBudget | None,
        run: _RunState,
    ) -> RankState:
        """What this rank tells the others at this step, and what the decision needs."""
        now = time.monotonic()
        share = budget_at(
            shared=budget is not None,
            has_batch=batch is not None,
            max_events=self.max_events,
            events=self._events,
            exhausted=run.exhausted,
            since_hungry_check_s=now - run.hungry_checked[0],
        )
        if share.capped:
            run.end_reason = MAX_EVENTS
        if share.check_hungry and budget is not None:
            run.hungry_checked = (now, budget.stream.has_more())
        return RankState.before_exchange(
            active=batch is not None,
            samples=len(batch) if batch is not None else 0,
            quiet=quiet,
            budget=share,
            hungry=share.capped and run.hungry_checked[1],
            stop_reason=stop_reason,
            checkpoint_due=self._want_checkpoint(),
            failed=self._failure is not None,
            # Rank 0's clock says when every rank reports (at one step: a gather).
            report_due=self.rank == 0 and now - run.last_report >= self.config.log_every_s,
            end_reason=run.end_reason,
            shared_budget=budget is not None,
            steps_since_checkpoint=self.step - self._checkpointed_step,
        )

    def _take_step(
        self,
        batch: PreparedBatch | None,
        missed: int | None,
        grads: dict[str, Any],
        job_samples: int,
        shared: tuple[SharedPushes, bytes] | None,
        run: _RunState,
        budget: JobBudget | None,
    ) -> None:
        """The dense step every rank takes when some rank trained, then this rank's pushes
        and the wait that keeps the staleness bound."""
        self.stats.job_samples += job_samples
        self._job_learned += job_samples
        if shared is not None:
            t0 = time.perf_counter()
            self.pusher.take_shared(
                [pickle.loads(blob) for blob in self.sync.gather_bytes(shared[1])]
            )
            self.stats.sync_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.dense.optimizer.step()
        self.stats.compute_s += time.perf_counter() - t0
        sync_mode = self.config.mode == "sync"
        # Sync mode with several ranks: the ranks' pushes are applied one rank after
        # the other, not as they arrive, because a sparse optimizer's update depends on
        # what the row saw before (Adagrad's sum of squares).
        in_rank_order = sync_mode and self.sync.world > 1
        if batch is not None:
            self._learn(batch, missed, grads, push=not in_rank_order)
            if share_learned(events=self._events, max_events=self.max_events):
                # This rank's share is learned; the others may still have theirs (a
                # shared budget may move more to it: it keeps asking its stream).
                run.end_reason = MAX_EVENTS
                run.exhausted = budget is None
        self.step += 1
        self.stats.steps += 1
        if self.publisher is not None:
            self.publisher.maybe_publish(
                step=self.step,
                samples=self.samples_before + self._learned,
                module=self.dense.module,
            )
        # The staleness bound: the next lookup may miss at most this many pushes.
        try:
            if in_rank_order:
                self.stats.push_wait_s += self._push_in_rank_order(
                    grads if batch is not None else {}
                )
            else:
                self.stats.push_wait_s += self.pusher.wait(self.config.effective_push_queue)
        except Exception as exc:
            if not store_failure(exc):
                raise
            self._failure = exc  # every rank hears of it at the next step
        if sync_mode and not in_rank_order:
            self.sync.barrier()  # every rank's push lands before any next lookup

    def _finish(self) -> None:
        """The run's end on every rank: one dense network, published, checkpointed (or
        at least every push drained), and a last report."""
        if self.config.mode == "async":
            self.sync.average()  # the job ends with one dense network, not one per rank
        if self.publisher is not None and self.publisher.step != self.step:
            # Servers get the weights the job ends with (its last checkpoint's).
            self.publisher.maybe_publish(
                step=self.step,
                samples=self.samples_before + self._learned,
                module=self.dense.module,
                force=True,
            )
        if (
            self.checkpointer is not None
            and self.config.checkpoint.on_exit
            and self._checkpointed_step != self.step
        ):
            self.checkpoint()  # drains the pushes; a failed one rolls every rank back
        else:
            try:
                self.stats.push_wait_s += self.pusher.drain()
            except Exception as exc:
                if not store_failure(exc):
                    raise
                msg = f"the last pushes were lost: {exc}"
                raise Rollback(msg) from exc
        self._report(every_rank=True)

    def _freshen(self, batch: PreparedBatch) -> None:
        """Train the rows this rank pushed since the batch's lookup as they are now."""
        try:
            done = self.pusher.freshen(
                batch.tables, batch.looked_up_at, wait=self.config.fresh_rows == "exact"
            )
        except Exception as exc:
            if not store_failure(exc):
                raise
            self._failure = exc  # every rank hears of it at this step's collective
            return
        self.stats.push_wait_s += done.wait_s
        self.stats.rows_freshened += done.replaced
        self.stats.rows_predicted += done.predicted
        self.stats.fresh_waits += done.waited
        for into, add in (
            (self.stats.missed_pushes_by_row, done.missed_by_row),
            (self.stats.trained_missed_pushes_by_row, done.trained_missed_by_row),
        ):
            for k, n in add.items():
                into[k] = into.get(k, 0) + n

    def _even_shares(self, budget: JobBudget) -> None:
        """Every rank's share of what the job may still learn, from every rank's kept
        events (after a rollback they differ): a collective, at the loop's start."""
        kept = round(self.sync.sum([float(budget.kept_events)])[0])
        mine = even_shares(budget.max_events - kept, self.sync.world)[self.rank]
        self.max_events = self._events + mine
        budget.stream.allow(mine)

    def _share_spare(self, budget: JobBudget, hungry: bool, spare: int) -> None:
        """Move the spare events of the ranks without work to the hungry ranks (every
        rank calls it at the same step; see :mod:`trainer.event_budget`)."""
        claims = cast(list[tuple[bool, int]], self.sync.gather((hungry, spare)))
        left = share_spare([h for h, _ in claims], [e for _, e in claims])
        mine = left[self.rank]
        self.max_events = self._events + mine
        budget.stream.allow(mine)
        log.info(
            "rank %d: the job's --max-events shares moved to the ranks with records "
            "(events each rank may still learn: %s)",
            self.rank,
            left,
        )

    def _first_batch_prior(self, batch: PreparedBatch | None) -> None:
        """Set each head's output bias to logit(its label's rate in the first batch).

        Every rank calls this at the same step until it succeeds: the rates are
        summed over the ranks' first batches, so every rank sets the same bias. A
        step at which no rank has a batch (quiet streams) leaves it to the next.
        """
        tasks = len(self.spec.labels)
        mine = [0.0] * (tasks + 1)
        if batch is not None and len(batch):
            positives = np.asarray(batch.labels, dtype=np.float64).sum(axis=0)
            mine = [*(float(x) for x in positives), float(len(batch))]
        total = self.sync.sum(mine)
        if total[-1] <= 0:
            return
        # Add-one-half smoothing (Krichevsky-Trofimov): a rare label whose first batch
        # holds no positive starts near 1/(2n), not at the clip, far below its rate.
        rates = [(x + 0.5) / (total[-1] + 1.0) for x in total[:-1]]
        self.dense.module.set_output_bias(rate_logits(rates))
        self._prior_pending = False
        log.info(
            "rank %d: output biases set to the first batch's label rates %s (%d samples)",
            self.rank,
            {name: round(r, 6) for name, r in zip(self.spec.labels, rates, strict=True)},
            int(total[-1]),
        )

    def _push_in_rank_order(self, grads: dict[str, Any]) -> float:
        """Push this step's row gradients after every lower rank's, then wait for the
        higher ones: every rank's push lands before any next lookup, in rank order.

        A failed push is remembered (every rank hears of it at the next step), and
        this rank still takes part in every barrier, so no rank waits forever.
        """
        t0 = time.perf_counter()
        for turn in range(self.sync.world):
            if turn == self.rank and grads and self._failure is None:
                try:
                    self.pusher.submit(grads)
                    self.pusher.wait(0)
                except Exception as exc:
                    if not store_failure(exc):
                        raise
                    self._failure = exc
            self.sync.barrier()
        return time.perf_counter() - t0

    def _learn(
        self, batch: PreparedBatch, missed: int | None, grads: dict[str, Any], *, push: bool = True
    ) -> None:
        """Account for a batch whose step was taken, and hand its row gradients over
        (unless ``push`` is false: the caller pushes them in rank order).
        """
        self._account(batch, missed)
        self.positions[batch.partition] = batch.end
        if self._ledger is not None:
            self._ledger.learned(self.step + 1, batch.partition, batch.start, batch.end)
        self.stats.samples += len(batch)
        self._learned += len(batch)
        self._events += len(batch) + batch.bad_records
        self.stats.events += len(batch) + batch.bad_records
        if grads and push:
            try:
                self.pusher.submit(grads, step=self.step + 1)
            except Exception as exc:
                if not store_failure(exc):
                    raise
                self._failure = exc

    def _account(self, batch: PreparedBatch, missed: int | None) -> None:
        if missed is not None:
            self.stats.missed_pushes[missed] = self.stats.missed_pushes.get(missed, 0) + 1
        self.stats.bad_records += batch.bad_records
        if batch.bad_by_reason:
            reasons = self.stats.bad_by_partition.setdefault(batch.partition, {})
            for reason, n in batch.bad_by_reason.items():
                reasons[reason] = reasons.get(reason, 0) + n

    def _every_rank_metrics(self) -> MetricsSnapshot:
        """The progressive figures over every rank's window (a gather: every rank calls
        it at the same step)."""
        labels, probs = self.metrics.held()
        # Labels as bytes, probabilities in float32: a window of 100k costs 0.5 MB.
        parts = cast(
            list[tuple[np.ndarray, np.ndarray, int]],
            self.sync.gather(
                (labels.astype(np.uint8), probs.astype(np.float32), self.metrics.samples)
            ),
        )
        tasks = max(p[0].shape[1] if p[0].ndim == 2 else 0 for p in parts)
        held = [(y, p) for y, p, _ in parts if y.shape[0] and y.shape[1] == tasks]
        if not held:
            return MetricsSnapshot(sum(n for *_, n in parts), 0, None, None, None, ())
        return snapshot_of(
            np.concatenate([y for y, _ in held]).astype(np.float64),
            np.concatenate([p for _, p in held]).astype(np.float64),
            samples=sum(n for *_, n in parts),
        )

    def _report(self, *, every_rank: bool = False) -> None:
        """Write this rank's report (and tell ``on_progress``); ``every_rank``: every rank
        reports at this step, and the figures over all ranks' predictions ride along."""
        elapsed = self.stats.elapsed()
        recent = self._losses[-50:]
        progress = Progress(
            rank=self.rank,
            step=self.step,
            samples=self.stats.samples,
            samples_total=self.samples_before + self._learned,
            samples_per_s=self.stats.samples / elapsed if elapsed > 0 else 0.0,
            elapsed_s=elapsed,
            loss=float(np.mean(recent)) if recent else None,
            metrics=self.metrics.snapshot(),
            staleness=self.config.staleness,
            pushes_queued=self.pusher.outstanding,
            wait_s=self.stats.wait_s,
            compute_s=self.stats.compute_s,
            events_total=self.stats.samples + self.stats.bad_records,
            missed_pushes={str(k): n for k, n in sorted(self.stats.missed_pushes.items())},
            missed_pushes_by_row={
                str(k): n for k, n in sorted(self.stats.missed_pushes_by_row.items())
            },
            trained_missed_pushes_by_row={
                str(k): n for k, n in sorted(self.stats.trained_missed_pushes_by_row.items())
            },
            rows_freshened=self.stats.rows_freshened,
            rows_predicted=self.stats.rows_predicted,
            fresh_waits=self.stats.fresh_waits,
            positions=dict(self.positions),
            deadletter={p: dict(r) for p, r in self.stats.bad_by_partition.items()},
            best_auc=self.best_auc,
            last_checkpoint=self.stats.last_checkpoint,
            mode=self.config.mode,
            stopped_by=self.stats.stopped_by,
            recoveries=self.stats.recoveries,
            ranks=self.sync.world,
            job_samples=self.stats.job_samples,
            job_samples_per_s=self.stats.job_samples / elapsed if elapsed > 0 else 0.0,
            job_samples_total=self.samples_before + self._job_learned,
            job_metrics=self._every_rank_metrics() if every_rank and self.sync.world > 1 else None,
        )
        if self._log is not None:
            line = asdict(progress)
            line["time"] = time.time()
            self._log.write(json.dumps(line, default=_jsonable) + "\n")  # line-buffered
        if self.on_progress is not None:
            self.on_progress(progress)


def _jsonable(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)

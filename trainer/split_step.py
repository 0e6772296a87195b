"""One dense step's forward and backward in chunks of the batch, over a few threads.

On a CPU whose cores the trainer shares with the job's own Dask workers and
store shards, torch's intra-op threads are a poor fit: each parallel matmul
splits its work evenly between the threads and then waits for the slowest, so
when another process pre-empts one thread the other spins at the barrier. Here
the batch is cut into chunks that ``threads`` threads take in turn, each running
torch's ops on its own (one intra-op thread): a pre-empted thread simply takes
fewer chunks, and no CPU goes to spinning. ``benchmarks/e2e.py`` shows it: its
job modes split the default model's step over 2 threads on 2 busy cores, its
``step`` mode runs on torch's intra-op threads alone.

The result is the whole batch's step: each chunk's loss is its mean scaled by
its share of the batch, so the chunks' gradients add up to the batch's. They
are added in chunk order, whatever thread computed which, so the step is
deterministic. It differs from the unsplit step only by float rounding (the
sums over the batch are taken in another order).

>>> import torch
>>> from trainer.models import FFNNConfig, build_model
>>> _ = torch.manual_seed(0)
>>> model = build_model(FFNNConfig(hidden=[8]), num_dense=2, field_dims=[4], num_tasks=1)
>>> dense, labels = torch.randn(6, 2), torch.ones(6, 1)
>>> rows = torch.randn(6, 4, requires_grad=True)
>>> with SplitStep(threads=2, chunks=3) as split:
...     logits, loss = split.forward_backward(model, dense, rows * 2, labels)
>>> logits.shape, loss.shape
(torch.Size([6, 1]), torch.Size([]))
>>> split_grad = rows.grad.clone()
>>> rows.grad = None
>>> model.zero_grad()
>>> loss_fn(model(dense, [rows * 2]), labels).backward()  # the unsplit step
>>> torch.allclose(split_grad, rows.grad, atol=1e-6)
True
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from types import TracebackType

import torch
from torch import Tensor

from trainer.models import DenseNet, loss_fn

__all__ = ["SplitStep"]


class SplitStep:
    """Forward and backward of a batch in ``chunks`` pieces over ``threads`` threads.

    ``chunks`` defaults to twice the threads: a thread that was pre-empted
    hands the last chunks to the others. Call :meth:`close` (or use it as a
    context manager) to stop the threads.
    """

    def __init__(self, threads: int = 2, chunks: int | None = None) -> None:
        if threads < 1:
            msg = f"threads must be at least 1, got {threads}"
            raise ValueError(msg)
        self.threads = threads
        self.chunks = chunks if chunks is not None else 2 * threads
        if self.chunks < 1:
            msg = f"chunks must be at least 1, got {self.chunks}"
            raise ValueError(msg)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="streamrec-step")

    def __enter__(self) -> SplitStep:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def forward_backward(
        self,
        module: DenseNet,
        dense: Tensor,
        joined: Tensor,
        labels: Tensor,
        *,
        bf16: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """The batch's logits (float32, detached) and mean loss (detached).

        ``joined`` holds the pooled sparse fields side by side (the input of
        the module's ``forward_joined``). Adds the loss's gradients to the
        module's parameters' ``.grad`` and back-propagates that of ``joined``
        through whatever made it (pooling, down to the rows) once, put together
        from the chunks', as ``loss.backward()`` would.
        ``bf16``: the module's forward under bfloat16 autocast (each thread
        enters it: autocast is per thread).
        """
        batch = int(labels.shape[0])
        n = max(1, min(self.chunks, batch))
        bounds = [batch * i // n for i in range(n + 1)]
        spans = list(pairwise(bounds))
        # Each chunk has one leaf, a slice of the joined fields, and what made them is
        # back-propagated once: a few large ops, not a few per field and chunk.
        learn_inputs = joined.requires_grad
        cut = joined.detach()
        params = [p for p in module.parameters() if p.requires_grad]
        device_type = dense.device.type

        def chunk(lo: int, hi: int) -> tuple[Tensor, Tensor, tuple[Tensor | None, ...]]:
            x = cut[lo:hi].requires_grad_(learn_inputs)
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16):
                out = module.forward_joined(dense[lo:hi], x)
            logits = out.float()
            loss = loss_fn(logits, labels[lo:hi]) * ((hi - lo) / batch)
            wrt = [*params, x] if learn_inputs else params
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            return logits.detach(), loss.detach(), grads

        parts = list(self._pool.map(lambda span: chunk(*span), spans))
        for i, p in enumerate(params):
            total: Tensor | None = None
            for _, _, grads in parts:  # in chunk order: the same sum whichever thread ran which
                g = grads[i]
                if g is not None:
                    # The chunks' gradients are fresh tensors, ours to add into.
                    total = g if total is None else total.add_(g)
            if total is not None:
                p.grad = total if p.grad is None else p.grad + total
        if learn_inputs:
            k = len(params)
            input_grad = torch.cat(
                [
                    _or_zeros(grads[k], hi - lo, joined)
                    for (_, _, grads), (lo, hi) in zip(parts, spans, strict=True)
                ]
            )
            torch.autograd.backward([joined], [input_grad])
        logits = torch.cat([logits for logits, _, _ in parts])
        loss = torch.stack([loss for _, loss, _ in parts]).sum()
        return logits, loss


def _or_zeros(grad: Tensor | None, rows: int, like: Tensor) -> Tensor:
    """A chunk's input gradient, zeros where the input took no part in its loss."""
    if grad is not None:
        return grad
    return like.new_zeros((rows, *like.shape[1:]))

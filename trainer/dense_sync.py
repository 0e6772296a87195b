"""How trainer ranks keep their dense networks in step: one collective per step.

Every rank, whether it still has data or not, calls ``exchange`` once per
step. The call all-reduces the dense gradients (``allreduce``: hybrid and sync
modes) or only a few control numbers (``local``: async mode, where the
parameters are averaged every ``average_every`` steps instead), together
with each rank's control flags: does it still have data, does it want to
stop, is a checkpoint due, how many samples did it train. A rank whose
stream ended keeps calling with zero gradients until every rank's has, so
uneven stream ends never hang a collective; this is what
``torch.distributed.algorithms.Join`` does, done here by hand because the
finished ranks must also take part in checkpoints, which a Join shadow loop
cannot.

With one rank there is no process group and ``exchange`` only echoes.

>>> import torch
>>> from trainer.step_protocol import Control
>>> sync = DenseSync(torch.nn.Linear(2, 1), mode="allreduce")
>>> sync.exchange(Control(active=1, waiting=0, stop=0, checkpoint=1, samples=8))
Control(active=1, waiting=0, stop=0, checkpoint=1, samples=8, failed=0, hungry=0, spare=0, report=0)
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from trainer.step_protocol import Control


def _kib(n: int) -> int:
    """Bytes in whole KiB, rounded up."""
    return -(-n // 1024)


class DenseSync:
    """The per-step collective of one rank (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: Literal["allreduce", "local"],
        average_every: int = 50,
    ) -> None:
        self.model = model
        self.mode = mode
        self.average_every = average_every
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.distributed else 1
        self.exchanges = 0
        self.averages = 0
        # Per rank, the KiB each will hand gather_bytes at this step (see exchange).
        self.share_kib: list[int] = [0]

    def exchange(self, mine: Control, *, share_bytes: int = 0) -> Control:
        """All-reduce this step's dense gradients (allreduce mode) and the control flags.

        ``share_bytes``: the size of what this rank will hand :meth:`gather_bytes` at
        this step; every rank's travels with the flags (no collective of its own).
        """
        self.exchanges += 1
        self.share_kib = [_kib(share_bytes)]
        if self.world == 1:
            return mine
        params = [p for p in self.model.parameters() if p.requires_grad]
        # On the parameters' device: NCCL reduces CUDA tensors only, and the flags
        # travel in the same buffer as the gradients.
        # float32, as the gradients: ``spare`` is only asked whether it is above 0 (the
        # amounts travel by ``gather``), which no rounding changes.
        flags = torch.tensor(
            [
                mine.active,
                mine.waiting,
                mine.stop,
                mine.checkpoint,
                mine.samples,
                mine.failed,
                mine.hungry,
                mine.spare,
                mine.report,
            ],
            dtype=torch.float32,
            device=params[0].device if params else torch.device("cpu"),
        )
        # Each rank's share in KiB at its own slot: float32 holds them exactly to 16 GiB.
        sizes = torch.zeros(self.world, dtype=torch.float32, device=flags.device)
        sizes[dist.get_rank()] = float(self.share_kib[0])
        flags = torch.cat([flags, sizes])
        if self.mode == "allreduce":
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in params
            ]
            flat = torch.cat([*grads, flags])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                n = p.numel()
                # Divided by the world size even when some ranks had no data, as DDP
                # does with uneven inputs: the step stays the same on every rank.
                g = (flat[offset : offset + n] / self.world).view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)
                offset += n
            flags = flat[offset:]
        else:
            dist.all_reduce(flags)
            if self.exchanges % self.average_every == 0:
                self.average()
        values = [round(float(x)) for x in flags]
        self.share_kib = values[-self.world :]
        a, w, s, c, n, f, h, e, r = values[: -self.world]
        return Control(
            active=a, waiting=w, stop=s, checkpoint=c, samples=n, failed=f, hungry=h, spare=e,
            report=r,
        )  # fmt: skip

    def average(self) -> None:
        """Replace every rank's dense parameters by their mean (async mode)."""
        if self.world == 1:
            return
        self.averages += 1
        with torch.no_grad():
            for p in self.model.parameters():
                buf = p.detach().double()
                dist.all_reduce(buf)
                p.copy_((buf / self.world).to(p.dtype))

    def sum(self, values: list[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (every rank calls it, with as many)."""
        if self.world == 1:
            return list(values)
        params = list(self.model.parameters())
        # On the parameters' device: NCCL reduces CUDA tensors only.
        buf = torch.tensor(
            values,
            dtype=torch.float64,
            device=params[0].device if params else torch.device("cpu"),
        )
        dist.all_reduce(buf)
        return [float(x) for x in buf.cpu()]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, at a step whose :meth:`exchange` was
        told its size (one all_gather of buffers as large as the largest)."""
        if self.world == 1:
            return [data]
        if _kib(len(data)) != self.share_kib[dist.get_rank()]:
            msg = f"gather_bytes: {len(data)} bytes, but the exchange was told another size"
            raise ValueError(msg)
        width = max(self.share_kib) * 1024
        raw = np.zeros(width + 8, np.uint8)  # the length, then the data
        raw[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
        raw[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
        buf = torch.from_numpy(raw)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf)
        got = []
        for t in out:
            each = t.numpy()
            n = int.from_bytes(each[:8].tobytes(), "little")
            got.append(each[8 : 8 + n].tobytes())
        return got

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if self.world == 1:
            return [obj]
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

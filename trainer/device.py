"""The device a trainer rank runs its dense network on."""

from __future__ import annotations

import torch


def pick_device(requested: str, index: int = 0, local_ranks: int = 1) -> torch.device:
    """The device of local rank ``index`` of ``local_ranks`` ranks on this host.

    ``auto`` is ``cuda:index`` when every local rank can have a GPU of its own
    (NCCL refuses two ranks on one GPU), else the CPU; ``cuda`` insists, and
    says why it cannot be had.

    >>> pick_device("cpu", 3, 4)
    device(type='cpu')
    """
    if requested == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus == 0:
        msg = "trainer.device: 'cuda' was asked for but no CUDA device is visible"
        raise RuntimeError(msg)
    if requested == "cuda" and gpus < local_ranks:
        msg = (
            f"trainer.device: 'cuda' for {local_ranks} ranks on this host, which has {gpus} "
            "GPU(s): NCCL needs a GPU per rank; start at most that many ranks per host "
            "(trainer.ranks, torchrun --nproc-per-node) or set trainer.device: auto or cpu"
        )
        raise RuntimeError(msg)
    if gpus == 0 or gpus < local_ranks:
        return torch.device("cpu")
    return torch.device("cuda", index % gpus)

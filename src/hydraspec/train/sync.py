"""Sums and copies over the processes that ``accelerate launch`` starts, as head training needs them."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Sync"]


class Sync:
    """What training needs of the processes that `accelerate launch` starts: sums over them, and the
    main process's parameters copied to the others. With one process every call does nothing (and
    changes nothing); with several the calls are collective: every process makes them in the same order.

    No DistributedDataParallel: the heads are called directly (not through a wrapper's forward), the
    gradients of a step's sequences accumulate locally, and :meth:`grads` sums them once per optimizer
    step, in buckets."""

    BUCKET_BYTES = 32 << 20

    def __init__(self, acc):
        self.n = acc.num_processes
        self.rank = acc.process_index
        self.device = acc.device  # where the backend reduces (gloo: the CPU; nccl: this process's GPU)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the processes (in place; returned)."""
        if self.n > 1:
            x = t if t.device == self.device else t.to(self.device)
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            if x is not t:
                t.copy_(x)
        return t

    def broadcast(self, tensors) -> None:
        """Overwrite `tensors` with the main process's values."""
        if self.n > 1:
            for t in tensors:
                x = t.data if t.device == self.device else t.data.to(self.device)
                dist.broadcast(x, src=0)
                if x is not t.data:
                    t.data.copy_(x)

    def grads(self, params: list[torch.nn.Parameter], stats: torch.Tensor) -> torch.Tensor:
        """Sum the gradients of `params` and the float64 vector `stats` over the processes. A parameter
        that no process has a gradient for keeps none (AdamW then skips it, as one process would); one that
        some processes lack (their share of the step was empty, or never reached it) counts as zeros there.
        Returns the summed `stats`."""
        if self.n == 1:
            return stats
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        both = self.sum(torch.cat([stats.to(torch.float64), has]))
        stats, has = both[: stats.numel()], both[stats.numel():]
        grads = []
        for p, h in zip(params, has.tolist()):
            if h > 0:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        bucket, size = [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                           or size + nbytes > self.BUCKET_BYTES):
                self._sum_bucket(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            self._sum_bucket(bucket)
        return stats

    def _sum_bucket(self, bucket: list[torch.Tensor]) -> None:
        flat = self.sum(torch.cat([g.reshape(-1) for g in bucket]))
        off = 0
        for g in bucket:
            g.copy_(flat[off: off + g.numel()].view_as(g))
            off += g.numel()

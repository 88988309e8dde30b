"""FedAvg through dgt: push each worker's model delta instead of its gradient.

McMahan et al. 2017 (FedAvg): every worker starts a round from the same weights
``w0``, takes H local optimiser steps on its own data, and the new global weights are the
mean of the local ones. Written as a delta, ``w = w0 - mean_w(w0 - w_local,w)``, so the
delta ``w0 - w_local`` travels exactly where a gradient would: :meth:`FedAvgRound.finish`
writes it into ``p.grad``, calls ``push_pull`` (which replaces ``p.grad`` with the mean
over workers) and sets every parameter to ``w0 - p.grad``. Every replica starts the round
from the same ``w0`` and applies the same averaged delta, so the replicas are bitwise
identical after every round.

In the sidecar a delta is a gradient like any other:

- **contribution** of block b: ``c_b <- alpha c_b + (1 - alpha) mean|delta_b|``, the mean
  absolute change of those weights over the round's H steps, so the blocks whose weights
  moved most go on the reliable channel;
- **residual** (error feedback): the part of a worker's delta that did not arrive (a lost
  or late block) is added to that worker's next delta, exactly as for a gradient. Over a
  run, ``sum over rounds of (applied mean delta x N) + every worker's final residual =
  sum over rounds and workers of the computed deltas`` (the conservation invariant), so
  no weight change is lost, only applied a round later.

Example::

    fed = FedAvgRound(model, client)
    for round in range(rounds):
        fed.start()
        for _ in range(H):
            opt.zero_grad(set_to_none=False); loss_fn(model(x), y).backward(); opt.step()
        fed.finish(round, loss=loss.item())   # model <- w0 - mean delta
"""
from __future__ import annotations

import torch


class FedAvgRound:
    """One worker's side of FedAvg rounds over ``comm`` (a :class:`dgt.Client`, or
    anything with ``push_pull(step, loss)`` that replaces every ``p.grad`` with the mean
    over workers). Parameters: float32, any device."""

    def __init__(self, model: torch.nn.Module, comm):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = comm
        self.w0: list[torch.Tensor] | None = None

    @torch.no_grad()
    def start(self) -> None:
        """Remember this round's starting weights ``w0`` (a copy of every parameter)."""
        if self.w0 is None:
            self.w0 = [p.detach().clone() for p in self.params]
        else:
            for w, p in zip(self.w0, self.params):
                w.copy_(p)

    @torch.no_grad()
    def finish(self, round_: int, loss: float | None = None) -> None:
        """Push ``delta = w0 - w`` as round ``round_`` (counting from 0), then set
        ``w = w0 - mean delta``. Raises RuntimeError without :meth:`start`, and what
        ``push_pull`` raises (PeerFailure)."""
        if self.w0 is None:
            raise RuntimeError("call start() at the beginning of each round")
        for w, p in zip(self.w0, self.params):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            torch.sub(w, p, out=p.grad)          # keeps p.grad's storage: zero copy
        self.comm.push_pull(round_, loss=loss)
        for w, p in zip(self.w0, self.params):
            torch.sub(w, p.grad, out=p)

"""One optimiser step over part of the parameters: PULLs pipelined per shard range.

``dgt.Client.push_pull(step, ready=...)`` hands the trainer its parameters shard by
shard, as each shard's PULL lands. :class:`PartialStep` steps the trainer's optimiser on
those at once, so that work overlaps the PULLs still on the way (docs/architecture.md,
"PULLs pipelined per shard range").
"""
from __future__ import annotations

import torch


class PartialStep:
    """``step(params)``: one ``optimizer.step()`` that updates only ``params`` (some of
    the optimiser's parameters, each passed once per iteration). The others' ``.grad``
    is hidden (set to None) for the call and restored after: a torch optimiser skips a
    parameter without a gradient.

    For an optimiser whose update of a parameter reads only that parameter's gradient
    and state (SGD, Adam, AdamW, RMSprop, ...), stepping the parameters in parts gives
    the same values as one ``step()`` over all of them: ``dgt train`` checks that its
    replicas end bitwise equal to a run without pipelining (tests/test_pipeline_pulls.py).
    An optimiser that couples parameters (LBFGS; clipping by the global norm inside
    ``step``) must not be stepped in parts: call ``push_pull`` without ``ready`` and
    ``step()`` after it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.calls = 0   # steps taken (the trainer's report: steps per iteration)

    def step(self, params: list[torch.Tensor]) -> None:
        """Step the optimiser on ``params`` only. Raises what ``optimizer.step`` raises
        (every hidden gradient is restored first)."""
        self.calls += 1
        mine = {id(p) for p in params}
        hidden = [(p, p.grad) for p in self.params
                  if id(p) not in mine and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in hidden:
                p.grad = g

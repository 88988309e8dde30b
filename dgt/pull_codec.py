"""Two-sided error feedback, the PULL side: the shard codes its low-contribution
aggregate blocks (``--pull-codec``, ``--pull-coded-fraction``) and keeps what it rounded
away in its own residual.

Each iteration the shard adds its residual to the aggregate (``c = sum / N + r``),
ranks c's blocks by contribution (``mean |c_b|``), codes the lowest
``floor(F * n)`` of them with dgt.codec, and applies ``decode(encode(c_b))`` there and
``c_b`` elsewhere: that is what every worker receives, coded blocks and f32 ones in one
PULL over the reliable connection, and what the colocated worker takes in-process, so
every replica applies the same bits. The shard keeps ``r_b = c_b - decode(encode(c_b))``
for the next iteration (0 for the blocks sent as f32): nothing is lost, some of it is
only delayed. With error feedback off (``--no-error-feedback``) the shard keeps nothing.

Conservation (docs/architecture.md): over a run, sum of applied aggregates x N + every
worker's residual + N x every shard's residual = sum of the computed gradients.

Sources: DoubleSqueeze (Tang et al., ICML 2019), error-compensated compression on
both the worker and the server side; THC's bidirectional compression (Li et al., NSDI
2024).

Example::

    coder = PullCoder(Coding.INT8, 0.5, n_blocks=40, block_elems=352)
    acc = aggregate.reshape(40, 352)       # the shard's mean, float32
    coded = coder.code(acc)                # acc now holds what every replica applies
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import codec
from .transport.control import PullArrived
from .transport.wire import Coding


@dataclass(frozen=True)
class CodedPull:
    """One iteration's coded PULL, the same for every worker: ``coding``
    (dgt.transport.wire.Coding), ``plain`` ((n - m, E) float32: the blocks sent as f32,
    in block order), ``payloads`` ((m, coded bytes) uint8: the coded blocks, in block
    order), ``coded`` ((n,) bool: which blocks are coded). ``wire_parts()`` is the
    argument of dgt.transport.messages.pull."""

    coding: int
    plain: np.ndarray
    payloads: np.ndarray
    coded: np.ndarray

    def wire_parts(self) -> tuple:
        return self.coding, self.plain, self.payloads, self.coded


class PullCoder:
    """A shard's PULL codec and its residual ((n_blocks, block_elems) float32, zero at
    first). ``keep_residual=False`` drops the coding error (error feedback off).
    ``coded_blocks``: blocks coded so far (the report's ``pull_blocks_coded``)."""

    def __init__(self, coding: int, fraction: float, n_blocks: int, block_elems: int,
                 keep_residual: bool = True):
        if coding == Coding.FP32:
            raise ValueError("PullCoder needs a reduced coding, not fp32")
        self.coding, self.fraction, self.keep_residual = int(coding), fraction, keep_residual
        self.n_coded = int(fraction * n_blocks)
        self.residual = np.zeros((n_blocks, block_elems), np.float32)
        self.empty = True   # the residual is all zero: adding it is skipped
        self.coded_blocks = 0

    def code(self, acc: np.ndarray) -> CodedPull:
        """Compensate ``acc`` ((n_blocks, block_elems) float32, the shard's aggregate,
        changed in place) with the residual, code its ``n_coded`` lowest-contribution
        blocks (ties: the lower block index first) and write their decoded values
        back, so ``acc`` is what every replica applies; keep the coding error in the
        residual. A block whose coded form decodes to NaN or inf (fp16 above 65504)
        goes as f32 instead. Returns the PULL's coded form."""
        if not self.empty:
            acc += self.residual
        n, e = acc.shape
        idx = np.sort(np.argsort(np.abs(acc).mean(axis=1), kind="stable")[:self.n_coded])
        low = acc[idx]   # a gathered copy: encode writes the coding error over it
        dec = np.empty((idx.size, e), np.float32)   # decode(payloads), from encode's pass
        tlow = torch.from_numpy(low)
        payloads = codec.encode(self.coding, tlow, torch.from_numpy(dec),
                                error=tlow if self.keep_residual else None)
        ok = np.isfinite(dec).all(axis=1)
        if not ok.all():
            idx, payloads, dec, low = idx[ok], payloads[ok], dec[ok], low[ok]
        if self.keep_residual:
            if not self.empty:
                self.residual.fill(0)
            self.residual[idx] = low
            self.empty = not idx.size
        acc[idx] = dec
        coded = np.zeros(n, bool)
        coded[idx] = True
        self.coded_blocks += int(idx.size)
        return CodedPull(self.coding, acc[~coded], payloads, coded)

    def state_dict(self) -> dict:
        """The residual (a copy) for a checkpoint (``torch.save``-able)."""
        return {"residual": torch.from_numpy(self.residual.copy()), "empty": self.empty}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. Raises ValueError for another shape."""
        r = state["residual"].numpy()
        if r.shape != self.residual.shape:
            raise ValueError(f"checkpoint shard residual has shape {r.shape}, this "
                             f"shard's {self.residual.shape}")
        self.residual[:] = r
        self.empty = bool(state["empty"])


def decode_pull(e: PullArrived, block_elems: int) -> np.ndarray | None:
    """A coded PULL's aggregate as the shard applied it: (n_blocks * block_elems,)
    float32, a new array; None when a coded block decodes to NaN or inf (the shard
    never sends one: the caller counts ``non_finite_pull`` and drops the PULL)."""
    dec = codec.decode(e.coding, e.payloads, block_elems)
    if not np.isfinite(dec).all():
        return None
    if e.coded.all():   # the whole PULL coded (the default): no scatter
        return dec.reshape(-1)
    out = np.empty((e.coded.size, block_elems), np.float32)
    out[e.coded] = dec
    out[~e.coded] = e.aggregate.reshape(-1, block_elems)
    return out.reshape(-1)

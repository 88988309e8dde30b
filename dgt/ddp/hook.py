"""The DDP communication hook: DDP's buckets in, dgt's push-pull out.

(No ``from __future__ import annotations`` here: DDP checks the hook's return
annotation at run time.)"""

import torch

from .state import DgtState


class FlatLayout:
    """Where each parameter's gradient lies in the flat float32 vector that dgt pushes
    (the sidecar cuts it into blocks). Fixed at the first iteration: the parameters in
    the order of DDP's first buckets, which every rank computes alike. DDP rebuilds its
    buckets after that iteration; a bucket's parameters are then found by identity (the
    parameter objects, which DDP keeps and the layout holds), else by their storage
    (``data_ptr``), so any bucketing maps onto the same blocks, and so does a
    parameter whose storage was replaced (``p.data = ...``, as swapping in averaged
    weights for an evaluation does)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = list(params)   # held: an id is not reused while its object lives
        #: id(parameter) -> (offset, elements at the first iteration)
        self.by_id: dict[int, tuple[int, int]] = {}
        self.offsets: dict[tuple[int, int], int] = {}
        self.numels: list[int] = []
        off = 0
        for p in params:
            self.by_id[id(p)] = (off, p.numel())
            self.offsets[self.key(p)] = off
            self.numels.append(p.numel())
            off += p.numel()
        self.n = off
        self.device = params[0].device
        self.dev_flat = self.pinned = None
        if self.device.type == "cuda":   # gathered on the GPU, one copy each way
            self.dev_flat = torch.empty(self.n, dtype=torch.float32, device=self.device)
            self.pinned = torch.empty(self.n, dtype=torch.float32, pin_memory=True)

    @staticmethod
    def key(p: torch.Tensor) -> tuple[int, int]:
        return (p.data_ptr(), p.numel())

    def slices(self, params: list[torch.Tensor]) -> list[tuple[int, int]]:
        """(offset, elements) of each of ``params``. Raises ValueError for a parameter
        that is not in the layout (the state serves another model, or the parameter
        was replaced by a new one) or whose size changed since the first iteration."""
        out = []
        for p in params:
            hit = self.by_id.get(id(p))   # by storage only when not by identity
            off, n = hit if hit is not None else (self.offsets.get(self.key(p)), p.numel())
            if off is None:
                raise ValueError("dgt_hook: a bucket holds a parameter this DgtState has "
                                 "not laid out (it serves another model): one DgtState per "
                                 "DDP model and one such model per process; train this "
                                 "model with DDP's own all-reduce (no register_comm_hook)")
            if p.numel() != n:
                raise ValueError(f"dgt_hook: a parameter of {n} elements at "
                                 f"the first iteration now has {p.numel()}: the layout "
                                 f"of the pushed vector is fixed; keep each parameter's "
                                 f"size")
            out.append((off, p.numel()))
        return out


class _Params:
    """What :meth:`dgt.Client.register` takes: something with ``parameters()``."""

    def __init__(self, params):
        self.params = params

    def parameters(self):
        return iter(self.params)


def dgt_hook(state: DgtState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the workers through dgt's sidecars.

    Each bucket's gradients (float32, on CPU or one CUDA device) are written, as DDP
    hands the bucket over during backward, into their slices of the flat vector that
    the node's sidecar pushes (shared memory), and the sidecar is told at once which
    elements are final: it sends the blocks they complete while backward computes the
    next buckets (wait-free backpropagation: ranked by contribution among the part's
    blocks, the top k over TCP, the rest over the UDP channels with their DSCP marks,
    error feedback keeping what did not arrive; Zhou et al., DGT, FGCS 2021). When the
    iteration's last bucket arrives, the sidecar sends the blocks still unsent, then
    END, and every bucket's future resolves to its slice of the mean gradient, the same
    bytes on every replica. The first iteration (before the layout is known) and a
    state made with ``overlap=False`` push the whole vector after the last bucket,
    ranked all together, as ``dgt.Client.push_pull`` does. CUDA buckets are copied to
    the host once each (through a pinned buffer) as they come.

    Returns a ``torch.futures.Future`` whose value is ``bucket.buffer()`` (the bucket's
    tensor, float32, 1-D) overwritten with the mean. Raises TypeError for a bucket that
    is sparse (``nn.Embedding(sparse=True)``) or not float32 (float16, bfloat16,
    float64, complex, …), ValueError when ``state`` serves another model, RuntimeError
    after ``state.close()``, and :class:`dgt.PeerFailure` (through backward) when the
    job fails.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = dgt.ddp.DgtState()
        >>> ddp_model.register_comm_hook(state, dgt.ddp.dgt_hook)
    """
    if not isinstance(state, DgtState):   # register_comm_hook(None, dgt_hook): one line
        raise TypeError(f"dgt_hook's state must be a dgt.ddp.DgtState, got "
                        f"{type(state).__name__}: model.register_comm_hook(DgtState(), "
                        f"dgt_hook)")
    state._check_open()
    handed = state.now()
    buf = bucket.buffer()
    if buf.layout != torch.strided:   # DDP hands a sparse gradient over as it is
        raise TypeError(f"dgt's hook does not take sparse gradients; this bucket is "
                        f"{buf.layout} (nn.Embedding/EmbeddingBag(sparse=True)): make "
                        f"them dense (sparse=False), or use DDP's own all-reduce")
    if buf.dtype != torch.float32:
        raise TypeError(f"dgt_hook averages float32 gradients only; this bucket is "
                        f"{buf.dtype}: keep the parameters float32 (model.float() before "
                        f"DDP; torch.autocast computes in float16/bfloat16 with float32 "
                        f"parameters)")
    params, grads = bucket.parameters(), bucket.gradients()
    fut: torch.futures.Future = torch.futures.Future()
    state._record("bucket", [bucket.index(), handed, int(buf.numel())])
    if state._flat is None:
        # first iteration: the layout is known once every bucket has been seen
        state._first.append((params, grads))
    else:
        slices = state._flat.slices(params)
        _stage(state, slices, grads, to_host=state.overlap)
        if state.overlap and not bucket.is_last():   # its blocks go now
            state._record("part_s", state.now(), first=True)
            state.node.client.push_part(state.node.client.next_step, _ranges(slices))
    state._pending.append((fut, buf, params, grads))
    if bucket.is_last():
        _push_pull(state)
    return fut


def _stage(state: DgtState, slices, grads, to_host: bool) -> None:
    """Write a bucket's gradients into their slices of the pushed vector: the shared
    memory itself on CPU; on CUDA the device vector, or, with ``to_host`` (the bucket
    is pushed as a part), the shared memory through the pinned buffer (its one
    device-to-host copy)."""
    flat = state._flat
    host = torch.from_numpy(state.node.client.grad)
    for (off, n), g in zip(slices, grads):
        src = g.reshape(-1)
        if flat.dev_flat is None:
            host[off:off + n].copy_(src)
        elif to_host:
            flat.pinned[off:off + n].copy_(src)
            host[off:off + n].copy_(flat.pinned[off:off + n])
        else:
            flat.dev_flat[off:off + n].copy_(src)


def _ranges(slices) -> list[list[int]]:
    """The element ranges [lo, hi) that ``slices`` ((offset, elements) each) cover,
    adjacent ones merged."""
    out: list[list[int]] = []
    for off, n in sorted(slices):
        if out and out[-1][1] == off:
            out[-1][1] = off + n
        else:
            out.append([off, off + n])
    return out


def _first_layout(state: DgtState) -> None:
    params = [p for ps, _ in state._first for p in ps]
    flat = FlatLayout(params)
    if state.layout_numels is not None and state.layout_numels != flat.numels:
        raise ValueError(f"dgt_hook: the loaded hook state lays out {len(state.layout_numels)} "
                         f"parameters ({sum(state.layout_numels)} elements), this model "
                         f"{len(flat.numels)} ({flat.n}); load this model's checkpoint")
    client = state.node.client
    client.register(_Params(params), resume=state.sidecar_state)
    if client.next_step != state.iteration:
        raise ValueError(f"dgt_hook: the hook state is at iteration {state.iteration}, "
                         f"its sidecar resumes at {client.next_step}; save and load "
                         f"state_dict() and save_sidecar() together")
    state._flat, state.layout_numels = flat, flat.numels
    for ps, gs in state._first:
        _stage(state, flat.slices(ps), gs, to_host=False)
    state._first = []


def _push_pull(state: DgtState) -> None:
    """The last bucket is in: push (the rest), wait for the aggregate, resolve every
    bucket."""
    pending, state._pending = state._pending, []
    whole = state._flat is None or not state.overlap   # staged on the device, if CUDA
    if state._flat is None:
        _first_layout(state)
    flat, client = state._flat, state.node.client
    g = torch.from_numpy(client.grad)[: flat.n]
    if flat.dev_flat is not None and whole:   # the one device-to-host copy
        flat.pinned.copy_(flat.dev_flat)
        g.copy_(flat.pinned)
    start = state.now()
    state._record("push_s", start)
    client.push_buffer(client.next_step, None, start)
    state._record("first_sent_s", client.last_first_sent)
    state._record("pulled_s", state.now())
    state.iteration += 1
    a = torch.from_numpy(client.aggregate)[: flat.n]
    if flat.dev_flat is not None:
        flat.pinned.copy_(a)
        flat.dev_flat.copy_(flat.pinned)
        a = flat.dev_flat
    for fut, buf, params, grads in pending:
        for (off, n), gr in zip(flat.slices(params), grads):
            gr.copy_(a[off:off + n].view_as(gr))
        if not _views_of(grads, buf):   # the bucket's own tensor, filled in order
            torch.cat([gr.reshape(-1) for gr in grads], out=buf)
        fut.set_result(buf)


def _views_of(grads, buf: torch.Tensor) -> bool:
    """True when ``grads`` are views of ``buf``'s storage (writing them fills it)."""
    base = buf.untyped_storage().data_ptr()
    return all(g.untyped_storage().data_ptr() == base for g in grads)

"""Channel assignment: block ranking -> channel per block.

Pure decisions on tensors; no sockets, no dgt nodes. Vectorised in torch so that it runs
on the scores' own device (CPU or CUDA) in one pass per push.

Source: DGT (Zhou et al., FGCS 2021), section 4 ("differential transmission"): the top k
share of blocks by contribution goes on the reliable channel, the rest are split into rank
bands over the C unreliable channels. Slim-DP (Sun et al., AAMAS 2018): an epsilon share
of the reliable slots is given to randomly chosen low-score blocks (exploration).
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

#: Channel value meaning "not sent" (mode ``topk``: the sender drops the unreliable share).
DROPPED = -1


def reliable_count(n_blocks: int, k: float) -> int:
    """Number of reliable blocks for fraction ``k`` in [0, 1]: ceil(k * n_blocks).

    Raises ValueError for k outside [0, 1].
    """
    if not 0.0 <= k <= 1.0:
        raise ValueError(f"k must be in [0, 1], got {k}")
    return min(n_blocks, math.ceil(k * n_blocks))


def rank_blocks(scores: torch.Tensor, *, epsilon: float = 0.0,
                n_reliable: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Order blocks by contribution, highest first, with Slim-DP exploration.

    ``scores``: (n_blocks,) float. Returns (n_blocks,) int64 block indices, best first.
    With ``epsilon > 0`` and ``n_reliable`` given, round(epsilon * n_reliable) of the
    first ``n_reliable`` positions go to blocks drawn uniformly at random from the
    blocks ranked below them; the displaced top blocks move just below the reliable
    share. Ties are broken by block index (stable sort), so ranking is deterministic.
    """
    order = torch.sort(scores, descending=True, stable=True).indices
    if epsilon <= 0.0 or not n_reliable or n_reliable >= order.numel():
        return order
    n_explore = min(round(epsilon * n_reliable), order.numel() - n_reliable)
    if n_explore <= 0:
        return order
    rest = order[n_reliable:]
    pick = torch.randperm(rest.numel(), generator=generator, device="cpu")[:n_explore]
    pick = pick.to(order.device)
    chosen = rest[pick]
    keep = torch.ones(rest.numel(), dtype=torch.bool, device=order.device)
    keep[pick] = False
    top = order[: n_reliable - n_explore]
    displaced = order[n_reliable - n_explore: n_reliable]
    return torch.cat([top, chosen, displaced, rest[keep]])


def assign_channels(order: torch.Tensor, n_reliable: int, udp_channels: int, *,
                    drop_unreliable: bool = False) -> torch.Tensor:
    """Map a ranking to channels.

    ``order``: (n_blocks,) int64 block indices, best first. Returns (n_blocks,) int8
    channel per block (indexed by block): 0 for the first ``n_reliable`` ranks, then the
    remaining ranks split into ``udp_channels`` contiguous bands of near-equal size,
    channel 1 for the best band. With ``drop_unreliable`` the unreliable ranks get
    :data:`DROPPED` (mode ``topk``).

    Raises ValueError for ``udp_channels`` < 1 (the upper limit is the wire's,
    ``dgt.transport.channels.MAX_UDP_CHANNELS``, checked by ``TransmissionConfig``).
    """
    if udp_channels < 1:
        raise ValueError(f"udp_channels must be >= 1, got {udp_channels}")
    n = order.numel()
    by_rank = torch.empty(n, dtype=torch.int8, device=order.device)
    by_rank[:n_reliable] = 0
    n_rest = n - n_reliable
    if drop_unreliable:
        by_rank[n_reliable:] = DROPPED
    elif n_rest:
        band = torch.arange(n_rest, device=order.device) * udp_channels // n_rest
        by_rank[n_reliable:] = (band + 1).to(torch.int8)
    channel = torch.empty_like(by_rank)
    channel[order] = by_rank
    return channel


def real_value(value, name: str, none: str = "") -> float:
    """``value`` (the argument ``name``) as a Python float: a real number (a Python int
    or float, a numpy scalar, a 0-dim or one-element tensor or numpy array of an integer
    or floating dtype, on any device, requiring grad or not) is ``float(value)``, NaN
    and inf included. O(1) checks; a CUDA tensor is read once (a synchronisation).

    Raises TypeError naming ``name`` for anything else: a bool, a str, None, a complex,
    a list, a tensor or array of more than one element or of a bool or complex dtype,
    or an int too large for a float (beyond +-1.8e308: no float holds it). ``none``
    (e.g. ``" or None"``) goes into the message after what is taken."""
    try:
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
            return float(value)
        if isinstance(value, torch.Tensor):
            if value.numel() == 1 and not value.dtype.is_complex \
                    and value.dtype != torch.bool:
                return float(value.detach().reshape(()).item())
        elif isinstance(value, np.ndarray):
            if value.size == 1 and value.dtype.kind in "iuf":
                return float(value.reshape(()).item())
        what = (f"{type(value).__name__} of shape {tuple(value.shape)} and dtype "
                f"{value.dtype}" if isinstance(value, (torch.Tensor, np.ndarray))
                else repr(value))
    except OverflowError:   # an int beyond a float's range
        what = f"an int too large for a float ({type(value).__name__})"
    raise TypeError(f"{name} must be one real number (a Python number, a numpy scalar, "
                    f"a one-element tensor or array){none}, got {what}")


def loss_value(loss) -> float | None:
    """``loss`` as a Python float, or None for None: a real number (a Python int or
    float, a numpy scalar, a 0-dim or one-element tensor or numpy array of an integer or
    floating dtype, on any device, requiring grad or not) is ``float(loss)``, NaN and inf
    included (:func:`real_value`). O(1) checks; a CUDA tensor is read once (a
    synchronisation).

    Raises TypeError naming ``loss`` for anything else: a bool, a str, a complex, a
    list, a tensor or array of more than one element or of a bool or complex dtype, or
    an int too large for a float (10**400 is refused, not taken as inf).
    """
    if loss is None:
        return None
    return real_value(loss, "loss", " or None")


def number_or_nan(value) -> float:
    """A plain real number (a Python or numpy int or float, not a bool) as a float; NaN
    for anything else (a bool, a str, None, an int too large for a float), which the
    caller's range check then refuses naming its argument (AdaptiveK's fractions,
    AdaptiveDeadline's settings, dgt.Client's timeouts)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        try:
            return float(value)
        except OverflowError:
            return math.nan
    return math.nan


def check_state(owner: str, state, keys: tuple) -> None:
    """Refuse a ``state`` for ``owner``'s ``load_state_dict`` (e.g. ``"AdaptiveK"``)
    that is not a dict holding ``keys`` (what its ``state_dict()`` gives): ValueError
    in one line naming the first key missing, or the type given."""
    if not isinstance(state, dict):
        raise ValueError(f"{owner}.load_state_dict: state must be a dict with the keys "
                         f"{', '.join(keys)} (what state_dict() gives), got "
                         f"{type(state).__name__}")
    for key in keys:
        if key not in state:
            raise ValueError(f"{owner}.load_state_dict: state has no {key!r}: give what "
                             f"state_dict() gives, a dict with the keys "
                             f"{', '.join(keys)}")


class AdaptiveK:
    """Loss-driven reliable fraction: ``k_t = max(k0 * loss_t / loss_0, k_min)``.

    Source: the DGT code's DMLC_K / DMLC_K_MIN. ``k0``, ``k_min`` in [0, 1]; ``loss_0`` is
    the first usable loss seen. Returns k0 until a loss is known; never exceeds k0...
    unless the loss grows, in which case it is capped at 1. ``k0`` and ``k_min`` are
    kept as floats. Raises ValueError, in one line naming the argument, unless each is
    a finite real number (a Python or numpy number; not a bool, a str or None) with
    0 <= k_min <= k0 <= 1.
    """

    def __init__(self, k0: float, k_min: float = 0.2):
        k0_f, k_min_f = number_or_nan(k0), number_or_nan(k_min)
        for name, value, v, ok in (("k0", k0, k0_f, 0.0 <= k0_f <= 1.0),
                                   ("k_min", k_min, k_min_f, 0.0 <= k_min_f <= k0_f)):
            if not ok:   # NaN too
                raise ValueError(f"AdaptiveK({name}={value!r}): give a fraction, a "
                                 f"finite number with 0 <= k_min <= k0 <= 1 (got "
                                 f"k0={k0!r}, k_min={k_min!r})")
        self.k0, self.k_min = k0_f, k_min_f
        self.loss0: float | None = None

    def update(self, loss) -> float:
        """k (a Python float) for a step whose loss is ``loss``: one real number taken as
        ``float(loss)`` (:func:`loss_value`: a Python number, a numpy scalar, a 0-dim or
        one-element tensor or array), or None. A loss that is None, NaN, inf or <= 0 is
        no measurement: k0 before the first usable loss, k_min after it, and it is
        never taken as ``loss_0``. Raises TypeError naming ``loss`` for anything else
        (a tensor of more elements, a str, a bool)."""
        loss = loss_value(loss)
        if loss is None or not math.isfinite(loss) or loss <= 0:
            return self.k0 if self.loss0 is None else self.k_min
        if self.loss0 is None:
            self.loss0 = loss
        return float(min(1.0, max(self.k0 * loss / self.loss0, self.k_min)))

    def state_dict(self) -> dict:
        """The first loss seen (None before any): all that k depends on besides the
        configuration. Plain Python values (picklable)."""
        return {"loss0": self.loss0}

    def load_state_dict(self, state: dict) -> None:
        """Back to what :meth:`state_dict` gave (a tensor ``loss0`` that an older
        version kept is taken as its float). Raises ValueError, in one line, leaving
        the state as it was, for a ``state`` that is not a dict with the key ``loss0``
        (None, {}), and for a ``loss0`` that :meth:`update` never stores: one that is
        not None and not a finite real number > 0 (0, a negative, NaN, inf, a str, a
        bool)."""
        check_state("AdaptiveK", state, ("loss0",))
        loss0 = state["loss0"]
        try:
            v = loss_value(loss0)
        except TypeError:
            v = math.nan
        if v is not None and not (0.0 < v < math.inf):   # NaN too
            raise ValueError(f"AdaptiveK.load_state_dict: loss0={loss0!r} is no first "
                             f"loss: give None or a finite number > 0")
        self.loss0 = v

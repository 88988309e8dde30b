"""The worker generation under torchrun: one number that every worker of one start of the
worker group shares and no earlier start had, agreed through torchrun's store.

Why: torch 2.13's c10d rendezvous shares the elastic agent's TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``: ``DynamicRendezvousHandler.next_rendezvous``
creates it at the first round and hands the same ``MASTER_PORT`` to every later round),
and ``init_process_group("env://")`` scopes its keys with the fixed prefix
``default_pg``. After ``torchrun --max-restarts`` restarts the workers, the store still
holds the failed generation's keys: gloo's ``connectFullMesh`` reads a peer's address
that the dead generation wrote (when the new peer has not overwritten it yet) and fails
with "Connection refused" (pytorch/pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` is no
fix on several hosts: each agent counts its own restarts, and a host restarted because
another host's worker failed does not count it.

:func:`init_process_group` scopes the process group's store by a generation agreed here:
rank 0 takes the next number from a counter (``store.add``) and hands it to each rank
that asks with a fresh nonce, so an answer or a question a dead generation left behind
is never taken for this one's.
"""
from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

from ..rank_list import rank_list

#: keys of the agreement, in torchrun's store
PREFIX = "dgt/generation"
#: how often rank 0 looks for the other ranks' questions, in seconds
POLL_S = 0.005

#: the generation this process agreed on (None: not under torchrun's shared store)
current: int | None = None


def agree(store, rank: int, world: int, timeout_s: float) -> int:
    """The generation (an int >= 1) of this start of the worker group, the same on every
    rank. ``store``: a ``torch.distributed.Store`` every rank of the group shares, which
    may hold an earlier generation's keys. Every rank calls it once per process. Raises
    TimeoutError when a rank has not asked (or rank 0 not answered) within
    ``timeout_s`` seconds."""
    t_end = time.monotonic() + timeout_s
    if rank == 0:
        gen = int(store.add(f"{PREFIX}/counter", 1))
        pending = set(range(1, world))
        while pending:
            for r in sorted(pending):
                if store.check([f"{PREFIX}/ack/{gen}/{r}"]):
                    pending.discard(r)
                elif store.check([f"{PREFIX}/ask/{r}"]):   # maybe a dead rank's: harmless
                    nonce = store.get(f"{PREFIX}/ask/{r}").decode(errors="replace")
                    store.set(f"{PREFIX}/tell/{r}/{nonce}", str(gen))
            if pending and time.monotonic() > t_end:
                raise TimeoutError(f"ranks {rank_list(sorted(pending))} did not join generation {gen} "
                                   f"within {timeout_s:.0f} s")
            if pending:
                time.sleep(POLL_S)
        return gen
    nonce = uuid.uuid4().hex
    store.set(f"{PREFIX}/ask/{rank}", nonce)
    try:
        store.wait([f"{PREFIX}/tell/{rank}/{nonce}"],
                   timedelta(seconds=max(0.001, t_end - time.monotonic())))
    except Exception as e:   # torch raises DistStoreError (a RuntimeError) on expiry
        raise TimeoutError(f"rank 0 did not hand rank {rank} its generation within "
                           f"{timeout_s:.0f} s ({str(e).splitlines()[0]})") from None
    raw = store.get(f"{PREFIX}/tell/{rank}/{nonce}")
    try:
        gen = int(raw)
    except ValueError:   # torchrun's store has no login: another process wrote there
        gen = 0
    if gen < 1:
        raise TimeoutError(f"rank 0's answer to rank {rank} in torchrun's store is "
                           f"malformed ({raw[:40]!r}): another process wrote to it; keep "
                           f"other users off --master-port") from None
    store.set(f"{PREFIX}/ack/{gen}/{rank}", "1")
    return gen


def init_process_group(backend: str = "gloo", **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, safe across torchrun's
    restarts: where torchrun shares its store with the workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``, the c10d rendezvous of ``--standalone`` and
    ``--rdzv-backend c10d``) and neither ``init_method`` nor ``store`` is given, the
    group's store is torchrun's store under the prefix ``dgt/g<generation>/`` (see
    :func:`agree`), so a restarted generation never reads the failed one's keys.
    Otherwise it is torch's call unchanged. ``timeout`` (timedelta, default 30 min)
    bounds the agreement too; raises what torch raises, and TimeoutError."""
    global current
    import torch.distributed as dist
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or \
            kwargs.get("init_method") or kwargs.get("store") is not None:
        dist.init_process_group(backend, **kwargs)
        return
    timeout = kwargs.pop("timeout", None) or timedelta(minutes=30)
    rank = int(kwargs.pop("rank", -1))
    world = int(kwargs.pop("world_size", -1))
    rank = int(os.environ["RANK"]) if rank < 0 else rank
    world = int(os.environ["WORLD_SIZE"]) if world < 0 else world
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           world_size=world, is_master=False, timeout=timeout)
    current = agree(shared, rank, world, timeout.total_seconds())
    dist.init_process_group(backend, store=dist.PrefixStore(f"dgt/g{current}", shared),
                            rank=rank, world_size=world, timeout=timeout, **kwargs)

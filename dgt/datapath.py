"""One node's data path, built once its trainer registered the model: the shared
gradient buffer, the server shard (transport.session behind dgt.shard), the worker
agent (dgt.agent over transport.sender) and the PULL sender (dgt.pull_sender), wired to
the node's peer links (dgt.peer_links).

One shared-memory buffer serves as gradient and aggregate: the push reads the gradient
out (WorkerAgent.plan) before any PULL of that iteration can arrive, and the PULLs
write the aggregate over it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from . import ipc
from .agent import Links, WorkerAgent
from .config import TransmissionConfig
from .layout import BlockLayout
from .peer_links import PeerLinks
from .pull_codec import PullCoder
from .pull_sender import PullSender
from .scheduler.deadline import AdaptiveDeadline, DeadlinePolicy
from .shard import ServerShard
from .transport.counters import Counters
from .transport.session import ShardSession


@dataclass
class DataPath:
    grad: ipc.ShmBuffer               # (padded,) float32: gradient in, aggregate out
    shard: ServerShard
    agent: WorkerAgent
    pulls: PullSender
    adaptive: AdaptiveDeadline | None  # the shard's wait after END, when adaptive
    deadline_floor_s: float


def build(cfg: TransmissionConfig, lay: BlockLayout, rank: int, session: int,
          key: bytes | None, counters: Counters, links: PeerLinks, seed: int,
          send_pull: Callable, conn_of: Callable) -> DataPath:
    """``send_pull(worker, iteration, aggregate, received)``: where the shard's PULLs
    go; ``conn_of(worker)``: the connection a worker's PULLs go on. Raises OSError
    when the shared memory cannot be made; whatever the rest raises, the buffer's name
    is removed from /dev/shm first (breaker round 21: a seed the planner could not take
    left one per rank)."""
    grad = ipc.ShmBuffer(ipc.buffer_name(os.getpid(), session, rank), lay.padded, True)
    try:
        return _around(grad, cfg, lay, rank, session, key, counters, links, seed,
                       send_pull, conn_of)
    except BaseException:
        grad.unlink()
        grad.close()
        raise


def _around(grad: ipc.ShmBuffer, cfg: TransmissionConfig, lay: BlockLayout, rank: int,
            session: int, key: bytes | None, counters: Counters, links: PeerLinks,
            seed: int, send_pull: Callable, conn_of: Callable) -> DataPath:
    """The shard, the agent and the PULL sender around the buffer ``grad``."""
    policy = DeadlinePolicy(min_s=cfg.deadline_ms / 1000.0,
                            rate_mbit=cfg.pace_mbit or 1000.0)
    # a slow --pace-mbit makes a long drain time, a short --peer-timeout-s a short PULL
    # wait: never wait past what the workers wait for
    longest = cfg.longest_wait_after_end_s()
    floor = min(policy.after_end_s(), longest)
    adaptive = AdaptiveDeadline(floor, min(cfg.deadline_max_ms / 1000.0, longest)) \
        if cfg.adaptive_deadline else None
    shard_session = ShardSession(session=session, shard=rank, lo=lay.shard_lo(rank),
                                 hi=lay.shard_hi(rank), block_elems=lay.block_elems,
                                 n_workers=lay.n_shards, deadline_s=floor, key=key,
                                 counters=counters, deadline_policy=adaptive)
    shard = ServerShard(lay, rank, shard_session, send_pull, pull_coder(cfg, lay, rank))
    agent: WorkerAgent | None = None
    pulls = PullSender(session=session, rank=rank, key=key, layout=lay,
                       pace_mbit=cfg.pace_mbit, links=links, conn_of=conn_of,
                       sending=lambda: agent.sending, iteration=lambda: agent.iteration,
                       coded=lambda: shard.coded_pull)
    agent = WorkerAgent(cfg, lay, rank, session, key, grad.array, grad.array,
                        Links(send_tcp=links.send_tcp, send_udp=links.send_udp,
                              local_push=shard.local_push,
                              waiting_for=shard_session.waiting_for,
                              ends_refused=shard_session.ends_refused,
                              tcp_backlog=links.tcp_backlog, push_sent=pulls.flush,
                              udp_backlog=links.udp_backlog),
                        counters, seed=seed)
    return DataPath(grad, shard, agent, pulls, adaptive, floor)


def pull_coder(cfg: TransmissionConfig, lay: BlockLayout, rank: int) -> PullCoder | None:
    """Shard ``rank``'s PULL codec (``--pull-codec``, ``--pull-coded-fraction``), or
    None when its PULLs go all f32 (fp32, a fraction that codes no block, or a job of
    one node, whose only PULL never touches the wire)."""
    coding, n = cfg.pull_coding(), lay.shard_blocks(rank)
    if not coding or int(cfg.pull_coded_fraction * n) == 0 or lay.n_shards == 1:
        return None
    return PullCoder(coding, cfg.pull_coded_fraction, n, lay.block_elems,
                     keep_residual=cfg.error_feedback)

"""Goodput of dgt's reliable channel alone: one sender, one receiver, one TCP connection.

The sender pushes ``--mb`` MB of 1,408 B blocks in ``--pushes`` pushes, each one INDEXED
BLOCKS frame plus END, made by the sidecar's own push sender
(``transport.sender.PushSender``, every block reliable) and written as a sidecar writes
them (``FrameProtocol.send``, the EF-marked socket of ``sockopts.tcp_client``). The receiver is a shard's receive side: ``FrameProtocol``
(``recv_into`` one preallocated buffer) -> ``ShardSession`` (checks, bitmaps, END) -> the
blocks copied into a shard buffer. Goodput = block bytes / (first byte .. last push
complete), the same definition as iperf3's receiver goodput. ``dgt bench goodput`` runs
the two ends in two testbed hosts, then iperf3 over the same port.

Usage (each end prints one JSON line)::

    python -m dgt.tools.goodput recv --bind 10.77.1.2 --port 5400
    python -m dgt.tools.goodput send --host 10.77.1.2 --port 5400 --mb 100
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from ..config import OneLineParser, finite
from ..layout import DEFAULT_BLOCK_BYTES
from ..transport import messages, sockopts, wire
from ..transport.aio import FrameProtocol
from ..transport.channels import channel_dscp
from ..transport.counters import Counters
from ..transport.sender import PushSender, Unpaced
from ..transport.session import BlocksArrived, IterationComplete, ShardSession

SESSION = 0x600D9E7
MAX_CHANNELS = wire.MAX_CHANNELS


def plan(mb: float, pushes: int, block_bytes: int) -> tuple[int, int]:
    """(blocks per push, block elements) for ``mb`` MB (10^6 B) of blocks in ``pushes``."""
    elems = block_bytes // 4
    per_push = max(1, int(round(mb * 1e6 / pushes / block_bytes)))
    return per_push, elems


async def receive(bind: str, port: int, mb: float, pushes: int, block_bytes: int,
                  timeout_s: float) -> dict:
    """Accept one sender; once every push is complete return {bytes, seconds, mbit_s,
    pushes, block_bytes, cpu_s (this process's CPU seconds from the call on), reads and
    parses (the connection's FrameProtocol counts), rejected}. Raises TimeoutError after
    ``timeout_s``."""
    cpu0 = time.process_time()
    loop = asyncio.get_running_loop()
    per_push, elems = plan(mb, pushes, block_bytes)
    sess = ShardSession(session=SESSION, shard=0, lo=0, hi=per_push, block_elems=elems,
                        n_workers=1, deadline_s=0.0)
    shard = np.zeros((per_push, elems), np.float32)
    done = loop.create_future()
    state = {"t0": None, "complete": 0, "bad": 0, "sender": None}

    def on_frame(proto, h, payload, now):
        if h.type == wire.MsgType.HELLO and h.session == SESSION and \
                state["sender"] is None:   # as the sidecar: HELLO admits large frames
            proto.peer_rank = h.sender
            state["sender"] = proto
            state["t0"] = now
            return
        if proto is not state["sender"]:   # a stranger: counted and cut off
            on_bad(proto, "no_hello")
            proto.transport.abort()
            return
        for e in sess.receive_frame(h, payload, now):
            if isinstance(e, BlocksArrived):
                shard[e.rows] = e.data
            elif isinstance(e, IterationComplete):
                state["complete"] += 1
                sess.advance()
                if state["complete"] == pushes and not done.done():
                    done.set_result(time.monotonic())
                    proto.send(wire.encode(wire.MsgType.END, session=SESSION, sender=0,
                                           shard=0, iteration=pushes, count=pushes,
                                           payload=wire.pack_end(
                                               np.zeros(MAX_CHANNELS, np.int64))))

    def on_bad(proto, reason):
        state["bad"] += 1

    def on_lost(proto, exc):
        if proto is state["sender"] and not done.done():
            done.set_exception(ConnectionError(
                f"sender left after {state['complete']} of {pushes} pushes (rejected "
                f"{state['bad'] + sum(sess.counters.rejected.values())} messages; do "
                f"both ends use the same --mb, --pushes and --block-bytes?)"))

    server = await loop.create_server(
        lambda: FrameProtocol(on_frame, on_lost, on_bad, dscp=channel_dscp(1)[0]),
        bind, port)
    try:
        t_end = await asyncio.wait_for(done, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(
            f"no complete transfer within {timeout_s:g} s: {state['complete']} of {pushes} "
            f"pushes, {'a' if state['sender'] else 'no'} sender connected, rejected "
            f"{state['bad'] + sum(sess.counters.rejected.values())} messages (same --mb, "
            f"--pushes and --block-bytes on both ends?)") from None
    finally:
        server.close()
    seconds = t_end - state["t0"]
    nbytes = per_push * pushes * block_bytes
    conn = state["sender"]
    return {"bytes": nbytes, "seconds": seconds, "mbit_s": nbytes * 8 / seconds / 1e6,
            "pushes": pushes, "block_bytes": block_bytes,
            "cpu_s": time.process_time() - cpu0, "reads": conn.reads,
            "parses": conn.parses,
            "rejected": state["bad"] + sum(sess.counters.rejected.values())}


async def send(host: str, port: int, mb: float, pushes: int, block_bytes: int,
               timeout_s: float) -> dict:
    """Connect (retrying until ``timeout_s``), push, wait for the receiver to close."""
    loop = asyncio.get_running_loop()
    per_push, elems = plan(mb, pushes, block_bytes)
    blocks = np.random.default_rng(0).standard_normal((per_push, elems), np.float32)
    chan = np.zeros(per_push, np.int8)   # every block reliable: one BLOCKS frame per push
    sender = PushSender(session=SESSION, rank=0, key=None, counters=Counters(),
                        pacing=Unpaced())
    deadline = time.monotonic() + timeout_s
    while True:
        sock = sockopts.tcp_client(channel_dscp(1)[0])
        try:
            await loop.sock_connect(sock, (host, port))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
    acked = loop.create_future()

    def on_frame(proto, h, payload, now):   # the receiver's END: every push complete
        if h.type == wire.MsgType.END and h.session == SESSION and not acked.done():
            acked.set_result(True)

    def on_lost(proto, exc):
        if not acked.done():
            acked.set_result(False)

    _, proto = await loop.create_connection(
        lambda: FrameProtocol(on_frame, on_lost, lambda p, r: None), sock=sock)
    proto.peer_rank = 0   # the receiver is trusted to answer with a small END
    t0 = time.monotonic()
    proto.send(messages.hello(SESSION, 0, 0, None))
    for t in range(pushes):   # the sidecar's push sender: BLOCKS, then END
        for f in sender.start(t, chan, blocks, [(0, per_push)], None, time.monotonic()):
            proto.send(f.frame)
        while not sender.done:
            for out in sender.datagrams_to_send(time.monotonic(), lambda s: 0):
                proto.send(out.frame)
        while proto.transport.get_write_buffer_size() > 4 * per_push * block_bytes:
            await asyncio.sleep(0.001)   # bounded queue, like a sidecar's BSP step
    try:
        ok = await asyncio.wait_for(acked, max(1.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        ok = False
    if not ok:
        raise ConnectionError("the receiver did not confirm the transfer (its error says "
                              "why; same --mb, --pushes and --block-bytes on both ends?)")
    return {"seconds_to_ack": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m dgt.tools.goodput",
                      description="Goodput of dgt's reliable channel alone (one TCP "
                      "connection, the sidecar's own framing and receive path).")
    p.add_argument("role", choices=("recv", "send"))
    p.add_argument("--bind", default="127.0.0.1", help="recv: address to listen on")
    p.add_argument("--host", default="127.0.0.1", help="send: receiver address")
    p.add_argument("--port", type=int, default=5400, help="TCP port (default 5400)")
    p.add_argument("--mb", type=finite(float), default=100.0,
                   help="MB (10^6 B) of blocks to push (default 100)")
    p.add_argument("--pushes", type=int, default=8,
                   help="pushes, one frame + END each (default 8)")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES,
                   help=f"block size (default {DEFAULT_BLOCK_BYTES}, at most 65000)")
    p.add_argument("--timeout-s", type=finite(float), default=120.0,
                   help="give up after this long (default 120)")
    a = p.parse_args(argv)
    if not 1 <= a.port <= 65535:
        p.error(f"--port must be 1..65535, got {a.port}")
    if a.mb <= 0 or a.pushes < 1 or not 4 <= a.block_bytes <= 65000 or a.block_bytes % 4:
        p.error("--mb must be > 0, --pushes >= 1, --block-bytes a multiple of 4 in "
                "4..65000")
    if a.timeout_s <= 0:
        p.error(f"--timeout-s must be > 0, got {a.timeout_s}")
    if a.mb * 1e6 < a.pushes * a.block_bytes:
        p.error(f"--mb {a.mb:g} is less than one {a.block_bytes} B block per push; "
                f"raise --mb or lower --pushes")
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        run = asyncio.run
    fn = receive if a.role == "recv" else send
    where = a.bind if a.role == "recv" else a.host
    try:
        out = run(fn(where, a.port, a.mb, a.pushes, a.block_bytes, a.timeout_s))
    except (OSError, ConnectionError, asyncio.TimeoutError) as e:
        print(f"goodput {a.role}: {type(e).__name__}: {e or 'timed out'}", file=sys.stderr)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

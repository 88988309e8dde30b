"""transport.aio.FrameProtocol over a real loopback TCP connection: messages arrive whole
and in order whatever the write sizes, and while a large message is incomplete the
socket's SO_RCVLOWAT lets the kernel gather its rest (transport.framing.wake_bytes)."""
import asyncio
import random
import socket

import pytest

from dgt.transport import wire
from dgt.transport.aio import FrameProtocol
from dgt.transport.framing import WAKE_MAX_BYTES, WAKE_MIN_BYTES, wake_bytes
from dgt.transport.wire import MsgType

#: hang guard only (a wrong SO_RCVLOWAT would never wake the reader): no timing assert
GUARD_S = 30.0


def test_wake_bytes_is_the_rest_capped_and_1_for_a_short_rest():
    assert wake_bytes(wire.HEADER_BYTES, 0) == 1
    assert wake_bytes(WAKE_MIN_BYTES - 1, 0) == 1
    assert wake_bytes(WAKE_MIN_BYTES + 500, 500) == WAKE_MIN_BYTES
    assert wake_bytes(100_000, 0) == 100_000
    assert wake_bytes(10_000_000, 34) == WAKE_MAX_BYTES
    for need in range(0, 2 * WAKE_MAX_BYTES, 9_973):
        for have in range(0, need, 7_919):
            assert 1 <= wake_bytes(need, have) <= max(1, need - have)


def _frame(i: int, n: int) -> bytes:
    return wire.encode(MsgType.BLOCKS, session=7, sender=1, iteration=i,
                       payload=bytes([i % 251]) * n)


async def _pair():
    """(receiver protocol, the frames it got as (iteration, payload bytes), client
    transport, server)."""
    loop = asyncio.get_running_loop()
    got, protos = [], []

    def on_frame(proto, h, payload, now):
        got.append((h.iteration, bytes(payload)))

    def make():
        p = FrameProtocol(on_frame, lambda *a: None, lambda *a: None)
        p.peer_rank = 1   # as after HELLO: large frames admitted
        protos.append(p)
        return p

    server = await loop.create_server(make, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tr, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    while not protos or protos[0].transport is None:
        await asyncio.sleep(0.005)
    return protos[0], got, tr, server


async def _until(cond, what: str):
    async def wait():
        while not cond():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(wait(), GUARD_S)
    except asyncio.TimeoutError:
        pytest.fail(f"the receiver never got {what}")


def test_a_large_frame_raises_the_receive_low_water_mark_until_its_last_byte():
    big = _frame(3, 1_000_000)

    async def main():
        proto, got, tr, server = await _pair()
        sock = proto.transport.get_extra_info("socket")
        tr.write(big[:300_000])
        await _until(lambda: proto.lowat != 1, "the frame's header")
        mark = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        short_parses = proto.parses
        tr.write(big[300_000:])
        await _until(lambda: got, "the whole frame")
        after = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        tr.close()
        server.close()
        return mark, after, got, proto, short_parses

    mark, after, got, proto, short_parses = asyncio.run(main())
    assert mark == WAKE_MAX_BYTES          # the kernel holds wake-ups back meanwhile
    assert after == 1 and proto.lowat == 1  # and wakes on any byte once it is whole
    assert got == [(3, bytes([3]) * 1_000_000)]
    # reads that left the frame short were not parsed again: one parse for the header,
    # one for the whole frame
    assert short_parses == 1 and proto.parses == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_frames_in_random_writes_arrive_whole_and_in_order(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 10, 1_408, 70_000, 300_000, 2_000_000]) for _ in range(40)]
    stream = b"".join(_frame(i, n) for i, n in enumerate(sizes))

    async def main():
        proto, got, tr, server = await _pair()
        pos = 0
        while pos < len(stream):
            n = rng.choice([1, 33, 1_500, 65_536, 400_000])
            tr.write(stream[pos:pos + n])
            pos += n
            if rng.random() < 0.2:
                await asyncio.sleep(0)   # let the receiver read a partial message
        await _until(lambda: len(got) == len(sizes), f"all {len(sizes)} frames")
        tr.close()
        server.close()
        return got, proto

    got, proto = asyncio.run(main())
    assert got == [(i, bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    assert proto.lowat == 1 and proto.have == 0

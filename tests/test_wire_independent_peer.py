"""docs/wire.md is complete enough for an independent implementation: a rank written here
from the spec alone (its header struct, the rendezvous store's keys, HELLO, BLOCKS, END,
the UDP tail markers, the aggregate and PULL, BYE), with no import of dgt's wire or
sidecar code, trains with a real `dgt sidecar` and its trainer as rank 0, and both
replicas end bitwise identical.

Outside tester, stop 42: a rank written from the spec waited at the rendezvous for ever,
because the spec did not name the store keys ``dgt/n_params/<rank>`` and
``dgt/ready/<rank>``; nor did it say that the aggregate is the mean, or that BYE's
``count`` is the iterations pushed."""
from __future__ import annotations

import hashlib
import json
import math
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
from datetime import timedelta

import numpy as np
import pytest
import torch
from conftest import stop_procs

# -- from docs/wire.md ------------------------------------------------------------------
HEADER = struct.Struct("!HBBBBQHHIIII")   # "Header (34 bytes)"
MAGIC, VERSION = 0x4447, 1
HELLO, BLOCKS, END, PULL, ERROR, BYE = 1, 2, 3, 4, 5, 6
MAC, INDEXED = 0x01, 0x02
ME, WORLD = 1, 2
WAIT_S = 60.0   # no timing is asserted: a bound so a fault fails instead of hanging

#: the model both ranks train (seeded alike), and rank 0's trainer, a dgt.Client user
MODEL = "torch.manual_seed(0); net = torch.nn.Linear(50, 20)"
TRAINER = textwrap.dedent(f"""
    import hashlib, sys, torch, dgt
    {MODEL}
    c = dgt.Client(sys.argv[1]); c.register(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    for t in range(int(sys.argv[2])):
        loss = net(torch.randn(8, 50, generator=g)).pow(2).mean()
        opt.zero_grad(set_to_none=False); loss.backward()
        c.push_pull(t, loss=loss.item()); opt.step()
    print(hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                  for p in net.parameters())).hexdigest(), flush=True)
    c.close()
""")


class Peer:
    """Rank 1 of a 2-rank job, from the spec: one TCP connection dialled to shard 0 (its
    pushes, then the PULL back), one accepted from worker 0 (its pushes to our shard,
    then our PULL), and the UDP channel sockets on which worker 0's low blocks come."""

    def __init__(self, store_port: int):
        from torch.distributed import TCPStore
        self.store = TCPStore("127.0.0.1", store_port, is_master=False,
                              timeout=timedelta(seconds=WAIT_S))
        self.session = int(self.store.get("dgt/session/0"))   # step 1
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(WAIT_S)
        ep0 = json.loads(self.store.get("dgt/ep/0"))
        self.E = ep0["wire"]["block_bytes"] // 4
        self.udp = []
        for _ in range(ep0["wire"]["channels"]):
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(("127.0.0.1", 0))
            self.udp.append(u)
        self.store.set(f"dgt/ep/{ME}", json.dumps({   # step 2, "Addressing"
            "rank": ME, "host": "127.0.0.1", "tcp_port": self.listener.getsockname()[1],
            "udp_ports": [u.getsockname()[1] for u in self.udp], "pid": os.getpid(),
            "wire": ep0["wire"]}))
        self.ep0 = ep0
        self.udp_read = 0   # blocks read from the UDP channels

    def header(self, typ, shard=0, t=0, block=0, count=0, length=0, channel=0, flags=0):
        return HEADER.pack(MAGIC, VERSION, typ, channel, flags, self.session, ME, shard,
                           t, block, count, length)

    @staticmethod
    def _exact(s: socket.socket, n: int) -> bytes:
        b = b""
        while len(b) < n:
            x = s.recv(n - len(b))
            if not x:
                raise EOFError(f"closed after {len(b)} of {n} bytes")
            b += x
        return b

    def frame(self, s: socket.socket):
        h = HEADER.unpack(self._exact(s, HEADER.size))
        assert h[0] == MAGIC and h[5] == self.session, h
        payload = self._exact(s, h[11]) if h[11] else b""
        if h[4] & MAC:
            self._exact(s, 16)
        return h, payload

    def join(self, net: torch.nn.Module) -> None:
        """Steps 3 and 4 of the rendezvous, with the two TCP connections between."""
        params = list(net.parameters())
        self.P = sum(p.numel() for p in params)
        sha = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params))
        self.store.set(f"dgt/n_params/{ME}", f"{self.P} {sha.hexdigest()} 0")
        self.n_blocks = math.ceil(self.P / self.E)
        self.lo = [s * self.n_blocks // WORLD for s in range(WORLD + 1)]
        self.dialled = socket.create_connection((self.ep0["host"], self.ep0["tcp_port"]),
                                                timeout=WAIT_S)
        self.dialled.sendall(self.header(HELLO, shard=0))
        self.accepted, _ = self.listener.accept()
        self.accepted.settimeout(WAIT_S)
        h, _ = self.frame(self.accepted)
        assert h[2] == HELLO and h[6] == 0 and h[7] == ME, h
        self.store.set(f"dgt/ready/{ME}", "1")
        self.store.wait(["dgt/ready/0"])

    def iteration(self, t: int, grad: np.ndarray) -> np.ndarray:
        """Push ``grad`` ((P,) float32), aggregate our shard, send its PULL, take shard
        0's PULL; returns the whole aggregate ((P,) float32)."""
        E, lo = self.E, self.lo
        blocks = np.zeros(self.n_blocks * E, np.float32)
        blocks[:self.P] = grad
        blocks = blocks.reshape(self.n_blocks, E)
        idx = list(range(lo[0], lo[1]))   # every block of shard 0, over TCP
        payload = struct.pack(f"!{len(idx)}I", *idx) + blocks[idx].astype("<f4").tobytes()
        self.dialled.sendall(self.header(BLOCKS, 0, t, idx[0], len(idx), len(payload),
                                         flags=INDEXED) + payload)
        counts = [len(idx)] + [0] * 7
        self.dialled.sendall(self.header(END, 0, t, 0, sum(counts), 32) +
                             struct.pack("!8I", *counts))
        mine = range(lo[1], lo[2])   # worker 0's blocks of our shard: TCP, then UDP
        theirs = np.zeros((len(mine), E), np.float32)
        got: set[int] = set()
        while True:
            h, payload = self.frame(self.accepted)
            assert h[8] == t, h
            if h[2] == END:
                sent = struct.unpack("!8I", payload)
                break
            assert h[2] == BLOCKS and h[4] & INDEXED and not h[4] & 0x1C, h
            n = h[10]
            vals = np.frombuffer(payload[4 * n:], "<f4").reshape(n, E)
            for k, i in enumerate(struct.unpack(f"!{n}I", payload[:4 * n])):
                theirs[i - lo[1]] = vals[k]
                got.add(i)
        self._udp_blocks(t, sent, theirs, got)
        # "The aggregate": the mean, summed in rank order, in binary32
        agg = (np.add(theirs, blocks[lo[1]:lo[2]]) / np.float32(WORLD)).astype(np.float32)
        bitmap = np.packbits(np.array([i in got for i in mine], np.uint8)).tobytes()
        payload = agg.astype("<f4").tobytes() + bitmap
        self.accepted.sendall(self.header(PULL, ME, t, lo[1], len(mine), len(payload))
                              + payload)
        h, payload = self.frame(self.dialled)
        assert h[2] == PULL and h[6] == 0 and h[8] == t and not h[4] & 0x1C, h
        agg0 = np.frombuffer(payload[:4 * h[10] * E], "<f4").reshape(h[10], E)
        return np.concatenate([agg0, agg]).reshape(-1)[:self.P]

    def _udp_blocks(self, t, sent, theirs, got) -> None:
        """Worker 0's UDP blocks of iteration ``t`` until each channel is complete or its
        tail marker came ("END on a UDP channel"), at most WAIT_S: a block still missing
        then counts as zero, as at a shard's deadline."""
        import time
        want = {c: sent[c] for c in range(1, len(self.udp) + 1) if sent[c]}
        seen = {c: 0 for c in want}
        t_end = time.monotonic() + WAIT_S
        while want and time.monotonic() < t_end:
            ready, _, _ = select.select(self.udp, [], [], 0.5)
            for u in ready:
                data = u.recv(65535)
                h = HEADER.unpack(data[:HEADER.size])
                assert h[0] == MAGIC and h[5] == self.session, h
                if h[8] != t:
                    continue   # a late block of an earlier iteration
                c = h[3]
                if h[2] == END:   # the tail marker: what was not lost has arrived
                    want.pop(c, None)
                    continue
                assert h[2] == BLOCKS and not h[4] & 0x1C, h   # fp32 over loopback
                i = h[9]
                theirs[i - self.lo[1]] = np.frombuffer(data[HEADER.size:HEADER.size + 4 *
                                                            self.E], "<f4")
                got.add(i)
                self.udp_read += 1
                seen[c] += 1
                if seen[c] == want.get(c):
                    want.pop(c)

    def bye(self, iterations: int) -> None:
        """BYE (count: the iterations pushed) on the accepted connection, then rank 0's
        on the dialled one, then both closed."""
        self.accepted.sendall(self.header(BYE, count=iterations))
        h, _ = self.frame(self.dialled)
        assert h[2] == BYE and h[10] == iterations, h
        for s in (self.dialled, self.accepted):
            s.close()
        for u in self.udp:
            u.close()
        self.listener.close()


def _reference(iterations: int) -> str:
    """SHA-256 of the parameters after ``iterations`` steps of SGD on the mean of the two
    ranks' gradients ((g0 + g1) / 2 in float32, the spec's aggregate), in one process."""
    ns: dict = {"torch": torch}
    exec(MODEL, ns)
    net = ns["net"]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    for _ in range(iterations):
        grads = []
        for g in gens:
            opt.zero_grad()
            net(torch.randn(8, 50, generator=g)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, g0, g1 in zip(net.parameters(), *grads):
            p.grad.copy_((g0 + g1) / 2)
        opt.step()
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in net.parameters())).hexdigest()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["tcp", "dgt"])
def test_a_rank_written_from_the_spec_trains_with_dgt(tmp_path, mode):
    iterations = 6
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = tmp_path / "s0.sock"
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "dgt.sidecar", "--rank", "0", "--world", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--run-dir",
         str(tmp_path), "--socket", str(sock), "--mode", mode],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(sock), str(iterations)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        peer = Peer(port)
        ns: dict = {"torch": torch}
        exec(MODEL, ns)
        net = ns["net"]
        peer.join(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(8)   # another rank's data
        for t in range(iterations):
            loss = net(torch.randn(8, 50, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grad = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).numpy()
            out = torch.from_numpy(peer.iteration(t, grad).copy())
            off = 0
            for p in net.parameters():
                p.grad.copy_(out[off:off + p.numel()].reshape(p.shape))
                off += p.numel()
            opt.step()
        peer.bye(iterations)
        out, err = trainer.communicate(timeout=WAIT_S)
        assert trainer.returncode == 0, err[-3000:] + (tmp_path / "sidecar-0.log").read_text()
        ours = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                       for p in net.parameters())).hexdigest()
        assert out.strip() == ours   # the replicas agree, bit for bit
        assert sidecar.wait(timeout=WAIT_S) == 0
        if mode == "tcp":   # every block reliable and f32: plain data-parallel SGD with
            assert ours == _reference(iterations)   # the mean gradient, bit for bit
        # --mode dgt: the low blocks came over the UDP channels, and were read
        assert (peer.udp_read > 0) == (mode == "dgt"), peer.udp_read
    finally:
        stop_procs(trainer, sidecar)

"""Start-up attack on a job's sidecars: idle TCP connections and forged HELLO, ERROR and
BYE frames, from the moment the ports open (robustness testing, ``docs/security.md``).

Only for addresses you own: it refuses any host but a loopback address. With
``--base-port`` the job's ports are known in advance (TCP ``base + 10 * rank``), so the
attack starts before the sidecars bind and keeps going for ``--duration-s``:

- ``--idle`` connections per sidecar that never send a byte, reopened when closed;
- every ``--every-s``: a connection that says HELLO as a real rank (``sender`` = another
  rank, ``shard`` = the target) and then ERROR (blaming a rank, with the attacker's
  text) and BYE; and a connection whose first frame is ERROR, then BYE.

The forged frames carry a random session id, or, with ``--sniff`` (root: an
``AF_PACKET`` socket on ``lo``), the job's real one, read off the first dgt message seen
on the job's ports: an attacker on the path.

``python -m dgt.tools.attack --base-port 47000 --world 3 --duration-s 60 --sniff``
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import random
import select
import signal
import socket
import struct
import sys
import threading
import time

from ..transport import wire
from ..transport.wire import MsgType


#: the attack's source address on IPv4 loopback
STRANGER_ADDRESS = "127.0.0.2"


class SessionSniffer(threading.Thread):
    """Reads the session id of the first dgt message to or from ``ports`` on ``lo``."""

    def __init__(self, ports: set[int]):
        super().__init__(daemon=True)
        self.ports = ports
        self.session: int | None = None
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.5)
        self.stop = False

    def run(self) -> None:
        while not self.stop and self.session is None:
            try:
                pkt = self.sock.recv(65535)
            except OSError:
                continue
            self.session = _session_of(pkt, self.ports)
        self.sock.close()


def _session_of(pkt: bytes, ports: set[int]) -> int | None:
    if len(pkt) < 14 + 20 or pkt[12:14] != b"\x08\x00":
        return None
    ip = pkt[14:]
    if ip[12:16] == socket.inet_aton(STRANGER_ADDRESS):
        return None   # our own forged frames
    ihl = (ip[0] & 0x0F) * 4
    proto, l4 = ip[9], ip[ihl:]
    if len(l4) < 8:
        return None
    sport, dport = struct.unpack_from("!HH", l4)
    if sport not in ports and dport not in ports:
        return None
    off = 8 if proto == 17 else (l4[12] >> 4) * 4 if proto == 6 and len(l4) >= 20 else None
    data = l4[off:] if off is not None else b""
    if len(data) >= wire.HEADER_BYTES and data[:3] == b"DG\x01":
        return struct.unpack_from("!Q", data, 6)[0]
    return None


def attack(host: str, base_port: int, world: int, duration_s: float, idle: int = 256,
           every_s: float = 0.05, sniff: bool = False, seed: int = 0,
           stop: threading.Event | None = None) -> dict:
    """Run the attack for ``duration_s`` (or until ``stop`` is set); return what was sent
    (counts) and whether the session was seen. Raises ValueError for a host that is
    not loopback, PermissionError for ``sniff`` without root."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"{host} is not a loopback address: attack only your own host")
    rng = random.Random(seed)
    ports = [base_port + 10 * r for r in range(world)]
    sniffer = None
    if sniff:
        sniffer = SessionSniffer({p + c for p in ports for c in range(8)})
        sniffer.start()
    sent = {"idle_connections": 0, "forged_hello": 0, "forged_error": 0, "forged_bye": 0,
            "refused": 0, "session_sniffed": False}
    held: dict[int, list[socket.socket]] = {p: [] for p in ports}
    forged: list[socket.socket] = []
    t_end = time.monotonic() + duration_s
    next_forge = 0.0
    try:
        while time.monotonic() < t_end and not (stop is not None and stop.is_set()):
            for p in ports:
                live = [s for s in held[p] if _alive(s)]
                for s in set(held[p]) - set(live):
                    s.close()
                held[p] = live
                for _ in range(min(idle - len(live), 32)):   # a bounded churn per tick
                    s = _connect(host, p)
                    if s is None:
                        sent["refused"] += 1
                        break
                    live.append(s)
                    sent["idle_connections"] += 1
            if time.monotonic() >= next_forge:
                next_forge = time.monotonic() + every_s
                session = sniffer.session if sniffer and sniffer.session is not None \
                    else rng.getrandbits(64)
                sent["session_sniffed"] = bool(sniffer and sniffer.session is not None)
                for r, p in enumerate(ports):
                    forged += _forge(host, p, r, world, session, rng, sent)
                while len(forged) > 64:
                    forged.pop(0).close()
            time.sleep(0.01)
    finally:
        for s in forged + [s for v in held.values() for s in v]:
            s.close()
        if sniffer is not None:
            sniffer.stop = True
    return sent


def _connect(host: str, port: int, wait_s: float = 0.0) -> socket.socket | None:
    """A non-blocking connect; ``wait_s`` > 0 waits that long for it to complete."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    # from another loopback address: a connect to a port not yet listening can never
    # become a self-connect that takes the job's port
    s.bind((STRANGER_ADDRESS if host.startswith("127.") else host, 0))
    err = s.connect_ex((host, port))
    if err not in (0, errno.EINPROGRESS):
        s.close()
        return None
    if wait_s:
        _, w, _ = select.select([], [s], [], wait_s)
        if not w or s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            s.close()
            return None
    return s


def _alive(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _forge(host: str, port: int, target: int, world: int, session: int,
           rng: random.Random, sent: dict) -> list[socket.socket]:
    others = [r for r in range(world) if r != target] or [0]
    as_rank = rng.choice(others)
    blamed = rng.randrange(world)
    kw = dict(session=session, sender=as_rank, shard=target)
    hello = wire.encode(MsgType.HELLO, **kw)
    error = wire.encode(MsgType.ERROR, block=blamed,
                        payload=f"forged: rank {blamed} died".encode(), **kw)
    bye = wire.encode(MsgType.BYE, **kw)
    out = []
    for frames, names in (((hello, error, bye), ("forged_hello", "forged_error",
                                                 "forged_bye")),
                          ((error, bye), ("forged_error", "forged_bye"))):
        s = _connect(host, port, wait_s=0.05)
        if s is None:
            sent["refused"] += 1
            continue
        try:
            s.sendall(b"".join(frames))
            for n in names:
                sent[n] += 1
        except OSError:
            pass
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.attack",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="a loopback address")
    p.add_argument("--base-port", type=int, required=True, help="the job's --base-port")
    p.add_argument("--world", type=int, required=True, help="the job's --workers")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--idle", type=int, default=256, help="idle connections per sidecar")
    p.add_argument("--every-s", type=float, default=0.05,
                   help="seconds between rounds of forged frames")
    p.add_argument("--sniff", action="store_true",
                   help="learn the job's session id on lo (root)")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    stop = threading.Event()   # SIGTERM ends the attack early, with its counts printed
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        out = attack(ns.host, ns.base_port, ns.world, ns.duration_s, ns.idle, ns.every_s,
                     ns.sniff, ns.seed, stop=stop)
    except (ValueError, PermissionError) as e:
        print(f"attack: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

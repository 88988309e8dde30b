"""A classic BPF socket filter on each UDP channel socket: the kernel drops a datagram
that no peer of this job can have sent before it is queued, so a flood of forgeries
neither fills the receive buffer nor delays the real blocks behind it (docs/security.md).

The filter (``SO_ATTACH_FILTER``, socket(7); classic BPF, Documentation/networking/
filter.rst) runs on every datagram the socket would queue. For a UDP socket its offset 0
is the UDP header, so the dgt header starts at offset 8. It keeps a datagram only if

- it comes from a peer's channel socket: its source port (and, on an IPv4 socket, its
  source address) is one of ``sources`` (``dgt.sidecar.udp_sources``);
- its dgt header carries ``MAGIC``, ``VERSION``, this job's ``session``, this ``shard``
  and a ``sender`` below the world size;
- its ``iteration`` lies in a window ``[first, last]`` around the shard's open
  iteration ``n``: the receive path takes ``n - 1`` (late blocks) and ``n`` and refuses
  the rest (``stale``, ``future``). The kernel copies and compiles a filter on every
  attach (about 70 us a socket here), so the sidecar does not replace it each
  iteration: it sets ``[n - 1, n + A]`` and replaces it when ``n + 1`` leaves it
  (A = 16, ``FILTER_AHEAD`` in ``dgt/node_sockets.py``), so datagrams more than A
  iterations older than the open one (a replay of an old capture) never queue;
- it is a BLOCKS datagram whose ``block`` lies in ``[lo, hi)``, or an END (tail marker).

Everything else is what the receive path would refuse anyway (``unknown_source``,
``bad_magic``, ``bad_version``, ``stray``, ``wrong_shard``, ``bad_sender``,
``bad_block``, ``stale``, ``future``, ``bad_udp_message``): the filter moves those
refusals into the kernel.
Such a datagram is then not counted by reason; the kernel counts it in the socket's
drops (``/proc/net/udp``, column ``drops``; ``SK_MEMINFO_DROPS``). A coalesced GRO run
is judged by its first datagram's header (the receive path checks every one).

The filter is an early discard, not a check of authenticity: a forgery with the right
fields passes it and is refused by the MAC (with ``--secret``).
"""
from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct

from . import wire

SO_MEMINFO = 55
SK_MEMINFO_DROPS = 8    # index in SO_MEMINFO's u32 array (linux/sock_diag.h)
SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
SKF_NET_OFF = -0x100000   # negative offsets: from the network header (linux/filter.h)
UDP_HEADER = 8

# instruction classes and modes (linux/bpf_common.h)
_LD, _LDX, _JMP, _RET = 0x00, 0x01, 0x05, 0x06
W, H, B = 0x00, 0x08, 0x10
_ABS, _IND, _LEN, _MSH = 0x20, 0x40, 0x80, 0xA0
_JA, JEQ, JGE = 0x00, 0x10, 0x30
_K = 0x00
ACCEPT, DROP = 0xFFFFFFFF, 0
MAX_INSNS = 4096   # BPF_MAXINSNS


class Program:
    """A tiny assembler: instructions with symbolic jump targets, resolved at the end."""

    def __init__(self):
        self.code: list[list] = []   # [op, jt, jf, k]; jt/jf/k may be labels
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def ld(self, size: int, off: int) -> None:
        self.code.append([_LD | size | _ABS, 0, 0, off & 0xFFFFFFFF])

    def ldx_ip_header_len(self, off: int) -> None:
        """X = 4 * (P[off] & 0xf): the IPv4 header length (``ldxb 4*([off]&0xf)``)."""
        self.code.append([_LDX | B | _MSH, 0, 0, off])

    def ld_ind(self, size: int, off: int) -> None:
        """A = P[X + off] (``ld[h|b] [x + off]``)."""
        self.code.append([_LD | size | _IND, 0, 0, off])

    def ld_len(self) -> None:
        self.code.append([_LD | W | _LEN, 0, 0, 0])

    def jump(self, cond: int, k: int, jt, jf) -> None:
        """Compare A with ``k``: go to ``jt`` if true else ``jf`` (labels or 0 = next)."""
        self.code.append([_JMP | cond | _K, jt, jf, k & 0xFFFFFFFF])

    def ja(self, target: str) -> None:
        self.code.append([_JMP | _JA, 0, 0, target])

    def ret(self, k: int) -> None:
        self.code.append([_RET | _K, 0, 0, k])

    def assemble(self) -> bytes:
        out = []
        for i, (op, jt, jf, k) in enumerate(self.code):
            def rel(t):
                if isinstance(t, str):
                    d = self.labels[t] - i - 1
                    if d < 0:
                        raise ValueError(f"backward jump to {t}")
                    return d
                return t
            jt, jf, k = rel(jt), rel(jf), rel(k)
            if jt > 255 or jf > 255:
                raise ValueError("conditional jump too far: use ja")
            out.append(struct.pack("=HBBI", op, jt, jf, k))
        if len(out) > MAX_INSNS:
            raise ValueError(f"{len(out)} instructions > {MAX_INSNS}")
        return b"".join(out)


def program(*, session: int, shard: int, world: int, lo: int, hi: int,
            sources: list[tuple[str, int]] | None, family: int = socket.AF_INET,
            iteration: tuple[int, int] | None = None) -> bytes:
    """The filter as packed ``struct sock_filter`` instructions (8 bytes each).

    ``iteration``: (first, last), the header's iteration (u32) must lie in
    ``[first, last]`` (None: any; :class:`Windowed` moves the window without
    assembling again). ``sources``: (numeric address, port) of the peers' channel
    sockets, or None to skip the source check (a peer on a wildcard host). On an ``AF_INET6`` socket only the
    ports are checked. Raises ValueError when the program would exceed 4096
    instructions (then attach none)."""
    return _build(session=session, shard=shard, world=world, lo=lo, hi=hi,
                  sources=sources, family=family, iteration=iteration).assemble()


def _window(first: int, last: int) -> tuple[int, int]:
    """The two constants of the iteration check: keep a header iteration i with
    ``k0 <= i`` and not ``i >= k1`` (u32; an iteration of 2**32 - 1 stays out)."""
    return max(first, 0), min(last + 1, 0xFFFFFFFF)


class Windowed:
    """:func:`program` assembled once (about 0.2 ms in Python); :meth:`at` gives it
    for another iteration window by rewriting the window's two constants in place.
    Takes :func:`program`'s keywords (but ``iteration``); raises ValueError as it
    does."""

    def __init__(self, **kw):
        p = _build(**kw, iteration=(0, 0))
        self.code = bytearray(p.assemble())
        # k, the 32-bit constant, is the last field of each 8-byte struct sock_filter
        self._k = (8 * p.labels["iteration_lo"] + 4, 8 * p.labels["iteration_hi"] + 4)

    def at(self, first: int, last: int) -> bytes:
        """The program keeping header iterations in ``[first, last]``."""
        for off, k in zip(self._k, _window(first, last)):
            struct.pack_into("=I", self.code, off, k)
        return bytes(self.code)


def _build(*, session: int, shard: int, world: int, lo: int, hi: int,
           sources: list[tuple[str, int]] | None, family: int,
           iteration: tuple[int, int] | None) -> Program:
    p = Program()
    H = UDP_HEADER
    off = {name: wire.HEADER_DTYPE.fields[name][1] + H for name in wire.HEADER_DTYPE.names}
    if sources is not None:
        for i, (addr, port) in enumerate(sorted(set(sources))):
            ip = ipaddress.ip_address(addr)
            nxt = f"src{i + 1}"
            p.ld(H, 0)   # UDP source port
            if family == socket.AF_INET and ip.version == 4:
                p.jump(JEQ, port, 0, nxt)
                p.ld(W, SKF_NET_OFF + 12)   # IPv4 source address
                p.jump(JEQ, int(ip), 0, nxt)
            else:
                p.jump(JEQ, port, 0, nxt)
            p.ja("header")
            p.label(nxt)
        p.ret(DROP)
    p.label("header")
    p.ld_len()
    p.jump(JGE, H + wire.HEADER_BYTES, 0, "drop")
    p.ld(H, off["magic"])
    p.jump(JEQ, wire.MAGIC, 0, "drop")
    p.ld(B, off["version"])
    p.jump(JEQ, wire.VERSION, 0, "drop")
    p.ld(W, off["session"])
    p.jump(JEQ, session >> 32, 0, "drop")
    p.ld(W, off["session"] + 4)
    p.jump(JEQ, session & 0xFFFFFFFF, 0, "drop")
    p.ld(H, off["shard"])
    p.jump(JEQ, shard, 0, "drop")
    p.ld(H, off["sender"])
    p.jump(JGE, world, "drop", 0)
    if iteration is not None:
        lo_it, hi_it = _window(*iteration)
        p.ld(W, off["iteration"])
        p.label("iteration_lo")
        p.jump(JGE, lo_it, 0, "drop")
        p.label("iteration_hi")
        p.jump(JGE, hi_it, "drop", 0)
    p.ld(B, off["type"])
    p.jump(JEQ, wire.MsgType.END, "accept", 0)
    p.jump(JEQ, wire.MsgType.BLOCKS, 0, "drop")
    p.ld(W, off["block"])
    p.jump(JGE, lo, 0, "drop")
    p.jump(JGE, hi, "drop", "accept")
    p.label("accept")
    p.ret(ACCEPT)
    p.label("drop")
    p.ret(DROP)
    return p


def drop_all() -> bytes:
    """A filter that keeps nothing: a channel socket carries it from its bind until
    the job's session and layout are known (before that the receive path refuses
    every datagram as ``not_ready``, at a Python call each)."""
    p = Program()
    p.ret(DROP)
    return p.assemble()


def attach(sock: socket.socket, code: bytes) -> None:
    """Attach the packed classic BPF ``code`` to ``sock`` (replacing any filter).
    Raises OSError where the kernel refuses it."""
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ" if struct.calcsize("P") == 8 else "HxxI",
                        len(code) // 8, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)   # the kernel copies it


def detach(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)


def kernel_drops(sock: socket.socket) -> int | None:
    """Datagrams the kernel dropped at ``sock`` since it was made: refused by its filter,
    or no room in its receive buffer (``SK_MEMINFO_DROPS``; the ``drops`` column of
    /proc/net/udp). None where the kernel has no ``SO_MEMINFO`` (before Linux 3.17)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
    except OSError:
        return None
    return struct.unpack_from("=I", raw, 4 * SK_MEMINFO_DROPS)[0]

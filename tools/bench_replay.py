"""Benchmark: how closely ``dgt replay`` keeps a capture's timing (root, loopback).

Sends N real block datagrams with irregular gaps (uniform 0.2..2 ms), captures them,
replays the capture with original timing (and with ``--speed``) to a fresh port while
capturing again, and compares first-to-last durations measured on the capture tap.

    sudo python -m dgt.tools.bench_replay --packets 1000 [--speed 1 --speed 2] [--json out.json]

The target (timing belongs in benchmarks, never in tests) is a duration ratio within 10 %.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time

import numpy as np

from dgt.transport import wire
from dgt.tools import capture, dissect, ports, replay, synth


def _tap_duration(pcap: str) -> tuple[int, float]:
    msgs, _ = dissect.messages_from_pcap(pcap)
    if len(msgs) < 2:
        return len(msgs), 0.0
    return len(msgs), (msgs[-1].ts_ns - msgs[0].ts_ns) / 1e9


def bench(packets: int = 1000, speeds=(1.0,), gap_ms=(0.2, 2.0), seed: int = 0) -> dict:
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="dgt-bench-replay-")
    base = synth.free_base_port(1)
    orig = os.path.join(tmp, "orig.pcap")
    dgs = wire.encode_block_datagrams(session=1, sender=0, shard=0, iteration=0, channel=1,
                                      indices=np.arange(packets),
                                      blocks=np.zeros((packets, 352), np.float32))
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    rx.bind(("127.0.0.1", base + 1))
    cap = capture.Capture(capture.CaptureConfig(out=orig, ports=ports.from_ports(str(base + 1)),
                                                progress_s=1e9)).start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    t = time.monotonic()
    for row in dgs:
        t += rng.uniform(*gap_ms) / 1e3
        while time.monotonic() < t:
            d = t - time.monotonic()
            if d > 0:
                time.sleep(d)
        tx.sendto(row.tobytes(), ("127.0.0.1", base + 1))
    time.sleep(0.3)
    cap.stop()
    cap.join(10)
    n0, d0 = _tap_duration(orig)
    out = {"packets": packets, "captured": n0, "original_duration_s": d0, "runs": []}
    for speed in speeds:
        rp = os.path.join(tmp, f"replay-{speed}.pcap")
        new = base + 5
        rx2 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx2.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        rx2.bind(("127.0.0.1", new))
        cap = capture.Capture(capture.CaptureConfig(out=rp, ports=ports.from_ports(str(new)),
                                                    progress_s=1e9)).start()
        rep = replay.replay(replay.ReplayConfig(files=[orig], to_host="127.0.0.1",
                                                port_map={base + 1: new}, speed=speed))
        time.sleep(0.3)
        cap.stop()
        cap.join(10)
        rx2.close()
        n1, d1 = _tap_duration(rp)
        want = d0 / speed
        out["runs"].append({"speed": speed, "replayed": n1, "tap_duration_s": d1,
                            "wanted_s": want, "ratio": d1 / want if want else None,
                            "sender_duration_s": rep["duration_s"],
                            "max_lateness_s": rep["max_lateness_s"]})
    rx.close()
    tx.close()
    out["files"] = tmp
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packets", type=int, default=1000)
    ap.add_argument("--speed", type=float, action="append")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_replay: error: needs root (it captures on lo)", file=sys.stderr)
        return 2
    r = bench(a.packets, tuple(a.speed or [1.0]))
    print(f"original: {r['captured']} packets over {r['original_duration_s']:.4f} s")
    for run in r["runs"]:
        print(f"speed {run['speed']:g}: {run['replayed']} packets over "
              f"{run['tap_duration_s']:.4f} s, wanted {run['wanted_s']:.4f} s, "
              f"ratio {run['ratio']:.4f}, max lateness {1e3 * run['max_lateness_s']:.3f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Flood sets: one job with and without --secret, clean and flooded, and their table.

The runs of ``docs/security.md`` ("A flood during training"), side by side, and the
table printed from their reports.

One set is five runs of the same job, one after the other (root: the flood sniffs and
spoofs on ``lo``):

1. ``plain-no``: no secret, no flood;
2. ``plain-yes``: no secret, the flood (forgeries accepted, as the trust model allows);
3. ``keyed-no``: ``--secret``, no flood;
4. ``keyed-yes``: ``--secret``, the ``--keyed`` flood (MAC flag and a junk tag);
5. ``plain-refused``: no secret, the ``--keyed`` flood: the same bytes as run 4, which
   this job refuses at the flag check (``bad_udp_message``) before any MAC.

Each flood starts with its job and stops (SIGTERM) when the job ends. Run ``r`` of set
``s`` uses base port ``--base-port + 600 s + 100 r``.

``python -m dgt.tools.flood_sets run --sets 5 --out DIR --base-port 48000 --in-range``
``python -m dgt.tools.flood_sets table DIR/set*``
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ..child_argv import module_argv
from ..config import OneLineParser

RUNS = (("plain-no", False, None), ("plain-yes", False, "plain"),
        ("keyed-no", True, None), ("keyed-yes", True, "keyed"),
        ("plain-refused", False, "keyed"))
SECRET = "job-secret-1"


def job_command(dgt: str, base: int, secret: bool, report: str,
                iterations: int) -> list[str]:
    return [dgt, "train", "--workers", "3", "--iterations", str(iterations),
            "--hidden", "256", "--seed", "2", "--base-port", str(base),
            "--report", report] + (["--secret", SECRET] if secret else [])


def flood_command(base: int, keyed: bool, rate: float, in_range: bool) -> list[str]:
    return module_argv("dgt.tools.flood") + [
        "--base-port", str(base), "--world", "3", "--rate", f"{rate:g}", "--duration-s",
        "900", "--sniff", "--spoof"] + (["--in-range"] if in_range else []) + \
        (["--keyed"] if keyed else [])


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_set(out: str, base: int, rate: float, in_range: bool, nice: int,
            iterations: int) -> dict:
    """The five runs of one set into ``out``; returns what ``set.json`` holds.
    Raises PermissionError without root (the flood's sniffer and raw socket)."""
    if os.geteuid() != 0:
        raise PermissionError("the flood sniffs and spoofs on lo: run as root")
    os.makedirs(out, exist_ok=True)
    runs = []
    dgt = os.path.join(os.path.dirname(sys.executable), "dgt")   # this venv's
    dgt = dgt if os.path.exists(dgt) else "dgt"
    for i, (name, secret, flood) in enumerate(RUNS):
        b = base + 100 * i
        job = job_command(dgt, b, secret, os.path.join(out, f"{name}.json"), iterations)
        row = {"name": name, "base_port": b, "load_before": _load(),
               "start": time.strftime("%H:%M:%S", time.gmtime()), "job": job}
        fp = None
        if flood:
            cmd = flood_command(b, flood == "keyed", rate, in_range)
            if nice:
                cmd = ["nice", "-n", str(nice)] + cmd
            row["flood"] = cmd
            fp = subprocess.Popen(cmd, stdout=open(os.path.join(out, f"{name}.flood.json"),
                                                   "w"),
                                  stderr=open(os.path.join(out, f"{name}.flood.err"), "w"))
        print(f"  {name}: base port {b}, load {row['load_before']}", flush=True)
        with open(os.path.join(out, f"{name}.log"), "w") as log:
            try:
                row["rc"] = subprocess.run(job, stdout=log, stderr=subprocess.STDOUT,
                                           timeout=1800).returncode
            except subprocess.TimeoutExpired:
                row["rc"] = "timeout"
        if fp is not None:
            fp.send_signal(signal.SIGTERM)
            fp.wait(60)
        row["load_after"] = _load()
        runs.append(row)
    meta = {"runs": runs, "rate": rate, "in_range": in_range, "nice": nice}
    with open(os.path.join(out, "set.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def _run_figures(d: str, name: str) -> dict | None:
    try:
        with open(os.path.join(d, f"{name}.json")) as f:
            r = json.load(f)
    except (OSError, ValueError):
        return None
    udp = [c for c in r["channels"] if c != "tcp"]
    rate = None
    try:
        with open(os.path.join(d, f"{name}.flood.json")) as f:
            rate = json.loads(f.read().strip().splitlines()[-1])["rate_per_sidecar"]
    except (OSError, ValueError, IndexError, KeyError):
        pass
    ch = r["channels"]
    return {"it": r["train_seconds"] / r["iterations"],
            "lost": sum(ch[c]["blocks_lost"] for c in udp),
            "dup": sum(ch[c]["blocks_duplicate"] for c in udp),
            "identical": r["replicas_identical"], "sha": r["param_sha256"][0][:16],
            "rate": rate}


def table(dirs: list[str]) -> tuple[list[str], dict]:
    """The markdown rows of the sets in ``dirs`` and the totals over those complete."""
    head = ["| set | load | clean iteration s: plain / `--secret` | flooded iteration "
            "s: plain / `--secret` / refused | flood/s at each sidecar | real UDP blocks "
            "lost: plain / `--secret` / refused | `--secret` / plain | `--secret` / "
            "refused | duplicates: plain / `--secret` | replicas identical |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    tot = {"plain": 0, "keyed": 0, "refused": 0, "sets": 0, "ratios": [],
           "refused_ratios": [], "min_rate": None, "identical": True, "clean_shas": set()}
    for d in dirs:
        f = {n: _run_figures(d, n) for n, _, _ in RUNS}
        if any(v is None for v in f.values()):
            head.append(f"| {os.path.basename(d.rstrip('/'))} | incomplete: "
                        f"{[n for n, v in f.items() if v is None]} |")
            continue
        try:
            with open(os.path.join(d, "set.json")) as fh:
                loads = [x for r in json.load(fh)["runs"]
                         for x in (r["load_before"][0], r["load_after"][0])]
            load = f"{min(loads):.1f}–{max(loads):.1f}"
        except (OSError, ValueError, KeyError):
            load = "–"
        py, ky, pr = f["plain-yes"], f["keyed-yes"], f["plain-refused"]
        ident = all(v["identical"] for v in f.values())
        ratio = ky["lost"] / max(py["lost"], 1)
        rratio = ky["lost"] / max(pr["lost"], 1)
        rates = [v["rate"] for v in (py, ky, pr)]
        head.append(
            f"| {os.path.basename(d.rstrip('/'))} | {load} | {f['plain-no']['it']:.3f} / "
            f"{f['keyed-no']['it']:.3f} | {py['it']:.3f} / {ky['it']:.3f} / "
            f"{pr['it']:.3f} | {' / '.join(f'{x:,}' if x else '–' for x in rates)} | "
            f"{py['lost']} / {ky['lost']} / {pr['lost']} | {ratio:.2f} | {rratio:.2f} | "
            f"{py['dup']:,} / {ky['dup']:,} | {'yes' if ident else 'NO'} |")
        tot["plain"] += py["lost"]
        tot["keyed"] += ky["lost"]
        tot["refused"] += pr["lost"]
        tot["sets"] += 1
        tot["ratios"].append(round(ratio, 2))
        tot["refused_ratios"].append(round(rratio, 2))
        tot["identical"] &= ident
        tot["clean_shas"] |= {f["plain-no"]["sha"], f["keyed-no"]["sha"]}
        if all(rates):
            tot["min_rate"] = min(rates + ([tot["min_rate"]] if tot["min_rate"] else []))
    tot["clean_shas"] = sorted(tot["clean_shas"])
    return head, tot


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m dgt.tools.flood_sets",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run --sets sets of five runs (root)")
    r.add_argument("--sets", type=int, default=5, help="sets of five runs (default 5)")
    r.add_argument("--out", required=True, help="folder: one set<i> folder per set")
    r.add_argument("--base-port", type=int, default=48000,
                   help="set s, run r: this + 600 s + 100 r")
    r.add_argument("--rate", type=float, default=20000, help="datagrams/s per sidecar")
    r.add_argument("--in-range", action="store_true",
                   help="forge in the receiving shard's block range (passes every "
                        "check before the MAC)")
    r.add_argument("--flood-nice", type=int, default=0,
                   help="run the flood under nice -n N (e.g. -10: an attacker that "
                        "does not share the job's cores)")
    r.add_argument("--iterations", type=int, default=30, help="iterations per run")
    t = sub.add_parser("table", help="the markdown table of set folders")
    t.add_argument("dirs", nargs="+")
    ns = p.parse_args(argv)
    if ns.what == "run":
        if not 1 <= ns.sets <= 100 or not 1024 <= ns.base_port <= 65535 - 600 * ns.sets:
            p.error("--sets must be 1..100 and --base-port leave 600 ports per set "
                    "below 65536")
        dirs = []
        for s in range(ns.sets):
            d = os.path.join(ns.out, f"set{s + 1}")
            print(f"set {s + 1}/{ns.sets} -> {d}", flush=True)
            try:
                run_set(d, ns.base_port + 600 * s, ns.rate, ns.in_range, ns.flood_nice,
                        ns.iterations)
            except PermissionError as e:
                print(f"flood_sets: error: {e}", file=sys.stderr)
                return 2
            dirs.append(d)
    else:
        dirs = ns.dirs
    rows, tot = table(dirs)
    print("\n".join(rows))
    if tot["sets"]:
        print(f"\n{tot['sets']} sets: real UDP blocks lost with --secret {tot['keyed']}, "
              f"without {tot['plain']} ({tot['keyed'] / max(tot['plain'], 1):.2f} times; "
              f"per set {tot['ratios']}), refused flood {tot['refused']} "
              f"({tot['keyed'] / max(tot['refused'], 1):.2f} times; per set "
              f"{tot['refused_ratios']}); lowest flood rate {tot['min_rate']}/s per "
              f"sidecar; replicas identical in every run: {tot['identical']}; clean "
              f"runs' parameters {tot['clean_shas']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A connection flood on a ``dgt train`` job's rendezvous store port (robustness
testing, ``docs/security.md``): it starts a 2-worker job under a tight open-file limit,
reads the store's port off rank 0's sidecar's command line, and holds ``--connections``
idle loopback connections to it, either from the moment the port is known (``--when
start``, before the ranks join) or from the job's first checkpoint on (``--when
train``). It prints one JSON line: whether the job ended well, how many of its
checkpoint files were not written, and whether the store's process said it was crowded.

``--python`` runs the job with another interpreter (another checkout's virtual
environment), so that one flood can be held against the code before a change.

``python -m dgt.tools.store_flood --limit 1024 --connections 3000 --when start``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from ..child_argv import module_argv


def master_port(run_dir: str) -> int | None:
    """The --master-port of the rank 0 sidecar whose argv names ``run_dir`` (proc(5)
    /proc/PID/cmdline), or None while there is none."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
        except OSError:
            continue
        if "dgt.sidecar" in argv and run_dir in argv and "--rank" in argv and \
                argv[argv.index("--rank") + 1] == "0":
            return int(argv[argv.index("--master-port") + 1])
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.store_flood",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=1024,
                   help="the job's open-file limit, soft and hard (default 1024)")
    p.add_argument("--connections", type=int, default=3000,
                   help="idle connections held on the store's port (default 3000)")
    p.add_argument("--when", choices=("start", "train"), default="start",
                   help="start: as soon as the port is known; train: from the first "
                   "checkpoint on (default start)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter that runs the job (default: this one)")
    p.add_argument("--timeout-s", type=float, default=600,
                   help="bound on the whole job, s (default 600)")
    p.add_argument("--keep", action="store_true",
                   help="keep the job's run dir (its logs) and checkpoints; printed")
    ns = p.parse_args(argv)
    if ns.limit < 64 or ns.connections < 1:
        p.error("--limit must be >= 64 and --connections >= 1")
    tmp = tempfile.mkdtemp(prefix="dgt-store-flood-")
    run_dir, ck = os.path.join(tmp, "run"), os.path.join(tmp, "ck")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (ns.limit, ns.limit))
    t0 = time.monotonic()
    cli = module_argv("dgt.cli")
    cli[0] = ns.python   # the same Python version: module_argv's flags fit it
    job = subprocess.Popen(
        cli + ["train", "--workers", "2", "--iterations", "2000",
         "--epochs", "100", "--hidden", "16", "--seed", "1", "--checkpoint-every", "50",
         "--checkpoint-dir", ck, "--run-dir", run_dir, "--report",
         os.path.join(tmp, "report.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit,
        cwd=tmp)
    port = None
    while port is None and job.poll() is None:
        port = master_port(run_dir)
        time.sleep(0.01)
    if ns.when == "train":
        while job.poll() is None and not (
                os.path.isdir(ck) and any(x.startswith("step-") for x in os.listdir(ck))):
            time.sleep(0.02)
    flood_at = time.monotonic() - t0
    held = []
    for _ in range(ns.connections if port is not None else 0):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    try:
        out, _ = job.communicate(timeout=ns.timeout_s)
    except subprocess.TimeoutExpired:
        job.kill()
        out, _ = job.communicate()
    for s in held:
        s.close()
    try:
        with open(os.path.join(run_dir, "sidecar-0.log")) as f:
            log0 = f.read()
    except OSError:
        log0 = ""
    failed = [ln for ln in out.splitlines() if ln.startswith("dgt train: failed")]
    print(json.dumps({
        "limit": ns.limit, "when": ns.when, "port": port, "flood_at_s": round(flood_at, 2),
        "held": len(held), "exit": job.returncode,
        "checkpoint_files_not_written": out.count("not written"),
        "store_said_crowded": "the rendezvous store holds" in log0,
        "failed": failed[0] if failed else "", "wall_s": round(time.monotonic() - t0, 1),
        "run_dir": run_dir if ns.keep else ""}))
    if not ns.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``dgt bench``: dgt against gloo all-reduce on the same shaped links.

The matrix (root; builds the netns testbed itself and always tears it down)::

    dgt bench [--systems gloo,tcp,topk,dgt] [--scenarios clean,tenant,lossy,lossy-link]
              [--rates 1gbit,100mbit] [--loss-pct 1[,3,5]] [--workers 4] [--hidden 2500]
              [--iterations N] [--out docs/bench]

Systems: ``gloo`` (``dgt.tools.gloo_train``: the same training loop, gradients averaged
by one gloo ``all_reduce``), and ``dgt train --mode tcp|topk|dgt``. Scenarios:

- ``clean``: the testbed alone;
- ``tenant``: best-effort bulk TCP (iperf3, DSCP 0) from host i to host i+1 mod N for the
  whole run, so every host's port and every router port carries a tenant flow; restarted
  per run, bounded to a little more than the run's expected length, stopped when it ends;
- ``lossy``: ``--loss-pct`` random loss in the router (nftables numgen) on the DSCPs of
  dgt's unreliable channels only (34, 18, 10 by default): TCP (gloo, dgt's reliable channel) loses
  nothing;
- ``lossy-link``: the same random loss on every packet (what a lossy link does): TCP
  loses too, so ``--mode tcp`` and gloo pay for retransmissions and timeouts, and dgt's
  reliable channel does as well.

``--loss-pct`` takes one rate or a comma list: with several, each lossy scenario runs
at each of them (a loss sweep), and the outputs add a table of comm time against loss
(growth over the same system's clean cell) and ``loss_sweep.png``.

Per cell: median and p95 communication time per iteration (trainer rank 0: from the
push to the applied aggregate), time to target accuracy, final accuracy, bytes per
channel, bytes each node sends per iteration, and goodput = those bytes / median comm
time / line rate. Outputs in ``--out``: ``results.json`` (every cell), ``README.md``
(table, exact command, date, load), ``comm_time.png`` and ``time_to_accuracy.png``.

``dgt bench --loopback`` (no root) runs the systems over loopback without shaping: the
overhead check (``loopback.json``, ``loopback.md``, ``loopback_comm_time.png``).
``dgt bench goodput`` (root) compares dgt's reliable channel with iperf3 on one port.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from dgt.child_argv import module_argv, typed_command
from dgt.interrupt import deferred, interrupted, stop_on_signals
from dgt.progress import CellProgress
from dgt.tc_profiles.needs_root import not_root
from dgt.transport.channels import DEFAULT_UDP_CHANNELS, channel_dscp

log = logging.getLogger("dgt.tools.bench")

SYSTEMS = ("gloo", "tcp", "topk", "dgt")
SCENARIOS = ("clean", "tenant", "lossy", "lossy-link")
#: the router's random drop per scenario: None (no loss), or the DSCPs it drops (() = all)
LOSS_DSCP = {"lossy": channel_dscp(DEFAULT_UDP_CHANNELS)[1:], "lossy-link": ()}
SYSTEM_LABEL = {"gloo": "gloo all_reduce", "tcp": "dgt --mode tcp",
                "topk": "dgt --mode topk", "dgt": "dgt --mode dgt"}
SYSTEM_COLOR = {"gloo": "tab:blue", "tcp": "tab:orange", "topk": "tab:green",
                "dgt": "tab:red"}
UNRELIABLE_DSCP = LOSS_DSCP["lossy"]
#: Seconds a cell spends outside its iterations (process start, imports, rendezvous,
#: registration, evaluation), measured on the 2-core development VM.
STARTUP_S = 18.0
#: Per-iteration time beyond the line-rate transfer, measured there with --hidden 2500
#: (clean, 4 workers): gloo 0.37 s at 1 Gbit/s, 3.6 s at 100 Mbit/s; dgt about 1.0 s and
#: 3.3-4.2 s. Model: transfer / XFER_EFFICIENCY + COMPUTE_S_PER_ITER.
COMPUTE_S_PER_ITER = 0.6
XFER_EFFICIENCY = 0.8




#: dgt bench goodput's defaults: iperf3's seconds, MB over dgt's reliable channel
GOODPUT_SECONDS, GOODPUT_MB = 5.0, 100.0


#: a cell's time cap without --cell-timeout-s: (times its upper-bound estimate, at least
#: this many s), for the matrix and for ``dgt bench tta``
CELL_TIMEOUT = {"matrix": (4.0, 120.0), "tta": (2.0, 180.0)}


def cell_timeout_s(estimate_s: float, times: float, floor_s: float) -> float:
    """A cell's time cap, s: ``times`` × its estimate, at least ``floor_s``."""
    return max(floor_s, times * estimate_s)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says what to do."""


@dataclass
class BenchConfig:
    systems: tuple[str, ...] = SYSTEMS
    scenarios: tuple[str, ...] = SCENARIOS
    rates: tuple[str, ...] = ("1gbit", "100mbit")
    workers: int = 4
    hidden: int = 2500
    epochs: int = 10
    iterations: int = 11
    eval_every: int = 2
    target_accuracy: float = 0.8
    loss_pct: tuple[float, ...] = (1.0,)   # one lossy cell per rate and lossy scenario
    profile: str = "htb-prio"
    tcp_congestion: str = "cubic"   # the testbed namespaces' TCP congestion control
    prefix: str = "dgtbench"   # own testbed namespaces: never touches a 'dgt' testbed
    seed: int = 0
    out: str = "docs/bench"
    loopback: bool = False
    cell_timeout_s: float = 0.0   # 0: from the estimate
    keep_runs: bool = False

    def validate(self) -> None:
        for s in self.systems:
            if s not in SYSTEMS:
                raise BenchError(f"--systems: unknown system {s!r}; choose from "
                                 f"{','.join(SYSTEMS)}")
        for s in self.scenarios:
            if s not in SCENARIOS:
                raise BenchError(f"--scenarios: unknown scenario {s!r}; choose from "
                                 f"{','.join(SCENARIOS)}")
        if not self.systems or (not self.loopback and not self.scenarios) or \
                (not self.loopback and not self.rates):
            raise BenchError("--systems, --scenarios and --rates must each name at least one")
        check_shared(self)
        if self.hidden < 1 or self.epochs < 1 or self.iterations < 0 or self.eval_every < 0:
            raise BenchError("--hidden and --epochs must be >= 1, --iterations and "
                             "--eval-every >= 0")
        if not self.loss_pct:
            raise BenchError("--loss-pct must name at least one rate, e.g. 1 or 1,3,5")
        for p in self.loss_pct:
            if not 0 < p < 100:   # also false for nan
                raise BenchError(f"--loss-pct: each rate must be in (0, 100) percent, "
                                 f"got {p:g}")
        for r in self.rates:
            rate_bits_per_s(r)
        from dgt.config import MAX_PEER_TIMEOUT_S, JobConfig
        from dgt.launch import check_memory
        try:   # every cell's processes run on this machine
            check_memory(JobConfig(workers=self.workers, hidden=self.hidden))
        except ValueError as e:
            raise BenchError(str(e)) from None
        for r in self.rates:
            if peer_timeout_s(self, r) > MAX_PEER_TIMEOUT_S:
                raise BenchError(f"--hidden {self.hidden} at {r}: one iteration would take "
                                 f"over {MAX_PEER_TIMEOUT_S / 10:.0f} s; use a smaller "
                                 f"--hidden or faster --rates")


def check_shared(cfg) -> None:
    """The checks every bench mode's config shares (BenchConfig, tools.bench_tta's
    TtaConfig): --workers, --seed, --target-accuracy, --prefix, --cell-timeout-s and,
    on the testbed, --profile and --tcp-congestion. Raises BenchError."""
    from dgt.config import MAX_SEED
    if not 2 <= cfg.workers <= 64:
        raise BenchError(f"--workers must be 2..64, got {cfg.workers}")
    if not 0 <= cfg.seed <= MAX_SEED:   # breaker round 25: every cell failed on it
        raise BenchError(f"--seed must be in 0..{MAX_SEED} (each cell's dgt train "
                         f"--seed), got {cfg.seed}")
    if not 0.0 < cfg.target_accuracy <= 1.0:
        raise BenchError(f"--target-accuracy must be in (0, 1], got "
                         f"{cfg.target_accuracy:g}")
    check_prefix(cfg.prefix)
    if not 0 <= cfg.cell_timeout_s < math.inf:   # also true for nan
        raise BenchError(f"--cell-timeout-s must be a finite number >= 0 (0: from the "
                         f"estimate), got {cfg.cell_timeout_s:g}")
    if not cfg.loopback:
        check_profile(cfg.profile)
        from dgt.tc_profiles.testbed import available_congestion_controls
        have = available_congestion_controls()
        if cfg.tcp_congestion and cfg.tcp_congestion not in have:
            raise BenchError(f"--tcp-congestion: '{cfg.tcp_congestion}' is not available "
                             f"here ({' '.join(have)}); pick one of those, or '' for "
                             f"this machine's default")


def check_out_dir(out: str) -> None:
    """``--out`` must be a folder we can write, or creatable in one: checked before any
    cell runs (a matrix takes most of an hour), without creating anything. Raises
    BenchError naming the flag (an empty --out too: it would write into the current
    folder, breaker round 5)."""
    if not out:
        raise BenchError("--out is empty: give the results folder, or leave it out for "
                         "the default")
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise BenchError(f"--out {out} is a file; give a folder")
    if os.path.isdir(path):   # another user's links there would be written through
        from dgt.unixsock import NotOurs, check_owned
        try:
            check_owned(out, "--out")
        except NotOurs as e:   # (breaker round 9: a 0777 folder of uid 65534's)
            raise BenchError(str(e)) from None
    from dgt.outpath import folder_problem
    why = folder_problem(path)   # a file on the path, a link loop, /proc
    if why is not None:
        raise BenchError(f"--out {out}: {why}; give another folder")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:   # root passes os.access everywhere; only creating a file tells (/proc, ro)
        with tempfile.TemporaryFile(dir=probe, prefix=".dgt-bench-"):
            pass
    except OSError as e:
        raise BenchError(f"--out {out}: cannot write in {probe}: {e.strerror or e}") from None


def check_profile(profile: str) -> None:
    """``--profile`` must load (a shipped name or a YAML file). Raises BenchError
    naming the flag."""
    from dgt.tc_profiles.schema import ProfileError, load_profile
    try:
        load_profile(profile)
    except ProfileError as e:
        raise BenchError(f"--profile: {e}") from None


def check_prefix(prefix: str) -> None:
    """``--prefix`` must be able to name the bench's testbed namespaces. Raises
    BenchError naming the flag (the rule is the testbed's, :func:`testbed.check_prefix`)."""
    from dgt.tc_profiles.testbed import PrefixError, check_prefix as _check
    try:
        _check(prefix, "--prefix")
    except PrefixError as e:
        raise BenchError(str(e)) from None


def rate_bits_per_s(rate: str) -> float:
    """tc rate notation -> bit/s. Raises BenchError naming the bad rate."""
    from dgt.tc_profiles.schema import parse_rate
    try:
        return float(parse_rate(rate))
    except ValueError as e:
        raise BenchError(f"--rates: {e}") from None


def n_params(hidden: int) -> int:
    """Parameters of ``dgt.job.make_model(hidden)`` (``JobConfig.n_params``)."""
    from dgt.config import JobConfig
    return JobConfig(hidden=hidden).n_params()


def iterations_of(cfg: BenchConfig) -> int:
    """Iterations one cell runs: --iterations, or --epochs full epochs (the digits
    train split, 1,437 samples, over workers * 32 per iteration)."""
    per_epoch = max(1, 1437 // (cfg.workers * 32))
    full = cfg.epochs * per_epoch
    return min(full, cfg.iterations) if cfg.iterations else full


def peer_timeout_s(cfg: BenchConfig, rate: str | None) -> float:
    """dgt's --peer-timeout-s in a cell: 20 s (the default), or 10 x the line-rate
    transfer time of one iteration where that is longer (low rates)."""
    grad = 4 * n_params(cfg.hidden)
    xfer = 2 * (cfg.workers - 1) / cfg.workers * grad * 8 / rate_bits_per_s(rate) if rate else 0
    return max(20.0, round(10 * xfer))


def estimate_cell_s(cfg: BenchConfig, rate: str | None) -> float:
    """Expected seconds of one cell: start-up plus iterations x (transfer at line rate of
    the ring-equivalent 2 (N-1)/N of the gradient, + compute)."""
    grad = 4 * n_params(cfg.hidden)
    per_node = 2 * (cfg.workers - 1) / cfg.workers * grad
    xfer = per_node * 8 / rate_bits_per_s(rate) if rate else 0.0
    return STARTUP_S + iterations_of(cfg) * (xfer / XFER_EFFICIENCY + COMPUTE_S_PER_ITER)


def bounded_cell_s(cfg: BenchConfig, rate: str | None) -> float:
    """:func:`estimate_cell_s`, but no more than ``--cell-timeout-s`` when given: a cell
    is killed there."""
    est = estimate_cell_s(cfg, rate)
    return min(est, cfg.cell_timeout_s) if cfg.cell_timeout_s else est


def plan(cfg: BenchConfig) -> list[dict]:
    """The cells, in run order (one testbed build per rate x loss setting). A cell's
    ``loss_pct`` is its router's random drop, percent (None: no loss)."""
    if cfg.loopback:
        return [dict(rate=None, scenario="loopback", system=s, loss_pct=None)
                for s in cfg.systems]
    return [dict(rate=r, scenario=sc, system=s, loss_pct=p) for r in cfg.rates
            for sc in cfg.scenarios
            for p in (cfg.loss_pct if sc in LOSS_DSCP else (None,))
            for s in cfg.systems]


def testbed_settings(cells: list[dict]) -> int:
    """How many testbeds a plan builds: one per run of cells with the same rate, loss
    DSCPs and loss rate."""
    keys = [(c["rate"], LOSS_DSCP.get(c["scenario"]), c.get("loss_pct")) for c in cells]
    return sum(1 for i, k in enumerate(keys) if i == 0 or k != keys[i - 1])


def estimate_s(cfg: BenchConfig) -> float:
    cells = plan(cfg)
    return sum(bounded_cell_s(cfg, c["rate"]) for c in cells) + \
        (0 if cfg.loopback else 4.0 * testbed_settings(cells))


def scenario_label(cell: dict) -> str:
    """``lossy 3 %`` for a lossy cell, the scenario's name otherwise."""
    p = cell.get("loss_pct")
    return cell["scenario"] if p is None else f"{cell['scenario']} {p:g} %"


# ------------------------------------------------------------------------ tenant load


class TenantLoad:
    """Bulk best-effort TCP (iperf3, DSCP 0) src -> dst for each pair, in the background.

    ``start(seconds)`` starts servers and clients (clients stop by themselves after
    ``seconds``); ``stop()`` ends them early and returns [{src, dst, mbit_s}].
    """

    def __init__(self, tb, pairs: list[tuple[int, int]], port_base: int = 5401,
                 dscp: int | None = None):
        self.tb, self.pairs, self.port_base, self.dscp = tb, pairs, port_base, dscp
        self.servers: list[subprocess.Popen] = []
        self.clients: list[subprocess.Popen] = []

    def start(self, seconds: float) -> None:
        if not shutil.which("iperf3"):
            raise BenchError("the tenant scenario needs iperf3 (apt-get install iperf3)")
        from dgt.tc_profiles.testbed import _wait_listen
        for k, (s, d) in enumerate(self.pairs):
            self.servers.append(self.tb.popen_in(
                d, ["iperf3", "-s", "-1", "-p", str(self.port_base + k), "-B",
                    self.tb.host_addr(d)], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        _wait_listen(self.tb, self.pairs, self.port_base)
        for k, (s, d) in enumerate(self.pairs):
            self.clients.append(self.tb.popen_in(
                s, ["iperf3", "-c", self.tb.host_addr(d), "-p", str(self.port_base + k),
                    "-t", f"{max(1, int(seconds))}", "-J"]
                + ([] if self.dscp is None else ["--dscp", str(self.dscp)]),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))

    def stop(self) -> list[dict]:
        out = []
        for c in self.clients:
            if c.poll() is None:
                c.send_signal(signal.SIGINT)   # iperf3 still prints its JSON
        for (s, d), c in zip(self.pairs, self.clients):
            try:
                text, _ = c.communicate(timeout=5)
                j = json.loads(text)
                # interrupted clients report sum_received as 0: use the sender's sum
                end = j.get("end", {})
                bits_per_s = end.get("sum_sent", {}).get("bits_per_second")
                secs = end.get("sum_sent", {}).get("seconds")
            except (subprocess.TimeoutExpired, ValueError, AttributeError):
                bits_per_s = secs = None
            out.append(dict(src=s, dst=d, mbit_s=None if bits_per_s is None else round(bits_per_s / 1e6, 1),
                            seconds=secs))
        for p in self.servers + self.clients:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.servers, self.clients = [], []
        return out


def start_tenant(tb, workers: int, timeout_s: float, dscp: int | None = None) -> TenantLoad:
    """The tenant of a cell: iperf3 bulk TCP from host i to host i+1 mod N (marked
    ``dscp``, default 0), bounded to the cell's timeout; settled 1 s before returning."""
    tenant = TenantLoad(tb, [(i, (i + 1) % workers) for i in range(workers)], dscp=dscp)
    tenant.start(round(timeout_s + 5))
    time.sleep(1.0)   # let the tenant flows leave slow start
    return tenant


# ---------------------------------------------------------------------------- one cell


def _snmp(text: str, table: str, name: str) -> int:
    """One counter of /proc/net/snmp or /proc/net/netstat (``Tcp:`` / ``TcpExt:``
    header line, then the values line). Raises ValueError when it is not there."""
    rows = [ln.split() for ln in text.splitlines() if ln.startswith(table + ":")]
    for head, vals in zip(rows[::2], rows[1::2]):
        if name in head:
            return int(vals[head.index(name)])
    raise ValueError(f"{table}:{name} not found")


def host_counters(tb, hosts: int) -> dict | None:
    """Per-host counters of the testbed, read inside each host's namespace: eth0's
    tx_bytes (list, bytes), and the sums over hosts of TCP segments retransmitted
    (``Tcp: RetransSegs``, RFC 4022) and of retransmission timeouts (``TcpExt:
    TCPTimeouts``, Linux). None without a testbed or when a file cannot be read."""
    if tb is None:
        return None
    out = dict(tx_bytes=[], retrans_segs=0, rto_timeouts=0)
    for i in range(hosts):
        r = tb.exec_in(i, ["sh", "-c", "cat /sys/class/net/eth0/statistics/tx_bytes; "
                           "cat /proc/net/snmp /proc/net/netstat"],
                       capture_output=True, text=True)
        try:
            out["tx_bytes"].append(int(r.stdout.split("\n", 1)[0]))
            out["retrans_segs"] += _snmp(r.stdout, "Tcp", "RetransSegs")
            out["rto_timeouts"] += _snmp(r.stdout, "TcpExt", "TCPTimeouts")
        except ValueError:
            return None
    return out


def cell_argv(cfg: BenchConfig, system: str, rate: str | None, report: str,
              run_dir: str) -> list[str]:
    """The command line of one cell (what a user would type)."""
    common = ["--workers", str(cfg.workers), "--hidden", str(cfg.hidden),
              "--epochs", str(cfg.epochs), "--iterations", str(cfg.iterations),
              "--eval-every", str(cfg.eval_every),
              "--seed", str(cfg.seed), "--target-accuracy", str(cfg.target_accuracy),
              "--report", report, "--run-dir", run_dir]
    if not cfg.loopback:
        common += ["--testbed", "--testbed-prefix", cfg.prefix]
    if system == "gloo":
        return module_argv("dgt.tools.gloo_train") + common
    argv = module_argv("dgt.cli") + ["train", "--mode", system, "--peer-timeout-s",
                                     f"{peer_timeout_s(cfg, rate):g}"] + common
    if rate is not None:   # pace the UDP channels at the line rate, not above it
        argv += ["--pace-mbit", f"{rate_bits_per_s(rate) / 1e6:g}"]
    return argv


def stop_group(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop ``p``'s process group, if it still runs: SIGTERM (a ``dgt train`` then stops
    its own sidecars and trainers), SIGKILL after ``grace_s``; reap it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def run_job(argv: list[str], run_dir: str, timeout_s: float) -> tuple[int | None, float]:
    """Run one cell's job in its own session, output to ``run_dir/stdout.log``; stop
    its process group after ``timeout_s``. Returns (exit status or None when it timed
    out, seconds it ran)."""
    t0 = time.monotonic()
    with open(os.path.join(run_dir, "stdout.log"), "wb") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            code = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            code = None
        finally:   # also on SIGTERM/SIGINT to the bench (cmd_bench): stop the job
            stop_group(p)
    return code, round(time.monotonic() - t0, 1)


def run_cell(cfg: BenchConfig, cell: dict, tb, work_dir: str, log_fn=print) -> dict:
    """Run one cell; return its result row (``error`` set when it failed)."""
    system, rate, scenario = cell["system"], cell["rate"], cell["scenario"]
    name = f"{rate or 'loopback'}-{scenario}" + (
        "" if cell.get("loss_pct") is None else f"-{cell['loss_pct']:g}pct") + f"-{system}"
    run_dir = os.path.join(work_dir, name)
    os.makedirs(run_dir, exist_ok=True)
    report_path = os.path.join(run_dir, "report.json")
    argv = cell_argv(cfg, system, rate, report_path, run_dir)
    est = estimate_cell_s(cfg, rate)
    timeout_s = cfg.cell_timeout_s or cell_timeout_s(est, *CELL_TIMEOUT["matrix"])
    row = dict(cell, label=SYSTEM_LABEL[system], command=shlex.join(typed_command(argv)),
               error=None)
    tenant = None
    if scenario == "tenant":
        # bounded by the cell's own timeout; stopped as soon as the cell ends
        row["tenant_seconds_bound"] = round(timeout_s + 5)
        tenant = start_tenant(tb, cfg.workers, timeout_s)
    n0 = host_counters(tb, cfg.workers)
    code, row["cell_seconds"] = run_job(argv, run_dir, timeout_s)
    n1 = host_counters(tb, cfg.workers)
    if tenant is not None:
        row["tenant"] = tenant.stop()
    rep = None
    if code == 0 and os.path.exists(report_path):
        with open(report_path) as f:
            rep = json.load(f)
    else:
        why = "timed out" if code is None else f"exit status {code}"
        row["error"] = f"{why}; logs in {run_dir}: {_tail(os.path.join(run_dir, 'stdout.log'))}"
        rep = _salvage(cfg, system, run_dir)
        if rep is None:
            return row
        # Rank 0 ran every iteration; the job failed after (at shutdown). Its numbers
        # are real; the row says what failed.
        row["shutdown_failure"], row["error"] = row["error"], None
    row.update(_summarise(cfg, system, rate, rep))
    if n0 and n1 and rep.get("iterations"):
        its = rep["iterations"]
        if scenario != "tenant":   # the tenant's own flows share eth0 and its TCP
            row["wire_tx_bytes_per_iteration"] = float(np.mean(
                [b - a for a, b in zip(n0["tx_bytes"], n1["tx_bytes"])])) / its
            # every host together, start-up and evaluation included: what loss costs TCP
            row["tcp_retrans_per_iteration"] = (n1["retrans_segs"] - n0["retrans_segs"]) / its
            row["tcp_rto_per_iteration"] = (n1["rto_timeouts"] - n0["rto_timeouts"]) / its
    if row.get("wire_tx_bytes_per_iteration") and row.get("comm_ms_median") and rate:
        row["wire_goodput_frac"] = (row["wire_tx_bytes_per_iteration"] * 8
                                    / (row["comm_ms_median"] / 1e3) / rate_bits_per_s(rate))
    if not cfg.keep_runs and not row.get("shutdown_failure"):
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _salvage(cfg: BenchConfig, system: str, run_dir: str) -> dict | None:
    """The report of a dgt job that failed only after rank 0 finished every iteration
    (e.g. a peer missing the last PULL at shutdown), from the per-process results that
    were written; None when rank 0 did not finish."""
    if system == "gloo":
        return None
    try:
        with open(os.path.join(run_dir, "trainer-0.json")) as f:
            t0 = json.load(f)
    except (OSError, ValueError):
        return None
    if t0.get("iterations") != iterations_of(cfg):
        return None
    from dgt.config import JobConfig, TransmissionConfig
    from dgt.report import build_report
    job = JobConfig(workers=cfg.workers, epochs=cfg.epochs, iterations=cfg.iterations,
                    hidden=cfg.hidden, seed=cfg.seed, testbed=not cfg.loopback,
                    target_accuracy=cfg.target_accuracy)
    try:
        return build_report(run_dir, job, TransmissionConfig(mode=system), 0.0)
    except (OSError, ValueError, KeyError):
        return None


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    errs = [ln for ln in lines if "failed" in ln or "rror" in ln]
    return (errs or lines or [""])[-1][:300]


def _summarise(cfg: BenchConfig, system: str, rate: str | None, rep: dict) -> dict:
    """The numbers a cell reports, from a dgt train / gloo_train report."""
    iters = rep["iterations"]
    n = n_params(cfg.hidden)
    if system == "gloo":
        bytes_node = rep["bytes_per_iteration"]
        channels = {}
        bytes_source = "ring all-reduce: 2(N-1)/N x gradient"
    else:
        channels = {k: {f: v.get(f, 0) for f in ("blocks_sent", "bytes_sent",
                                                 "blocks_delivered", "blocks_lost",
                                                 "blocks_late", "blocks_dropped_local")}
                    for k, v in rep["channels"].items()}
        push = sum(v["bytes_sent"] for v in rep["channels"].values())
        pull = (cfg.workers - 1) / cfg.workers * 4 * n * cfg.workers  # all nodes' PULLs
        bytes_node = (push + pull * iters) / cfg.workers / iters if iters else 0
        bytes_source = "BLOCKS bytes counted by the sidecars + PULL payload (N-1)/N x gradient"
    med = rep["comm_ms_median"]
    row = dict(
        iterations=iters, comm_ms_median=med, comm_ms_p95=rep["comm_ms_p95"],
        final_test_accuracy=rep["final_test_accuracy"], target_accuracy=rep["target_accuracy"],
        target_reached=rep["target_reached"], wall_seconds=rep["wall_seconds"],
        train_seconds=rep.get("train_seconds"), replicas_identical=rep["replicas_identical"],
        gradient_bytes=4 * n, bytes_per_iteration_node=bytes_node, bytes_source=bytes_source,
        channels=channels, blocks_unsent=rep.get("blocks_unsent"),
        history=[{k: h[k] for k in ("iteration", "seconds", "test_accuracy", "loss")}
                 for h in rep["history"]])
    if rate and med:
        row["goodput_frac"] = bytes_node * 8 / (med / 1e3) / rate_bits_per_s(rate)
    return row


# ------------------------------------------------------------------------------ matrix


def _git_revision() -> str | None:
    """``git describe --always --dirty`` of the dgt source tree, or None."""
    try:
        r = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                           text=True, timeout=10,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


#: the settings of the testbed that --loopback does not build (its JSON leaves them out)
TESTBED_KEYS = ("scenarios", "rates", "loss_pct", "profile", "tcp_congestion", "prefix")


def config_doc(cfg: BenchConfig) -> dict:
    """The JSON output's ``config``: the settings the run used, one key per field of
    :class:`BenchConfig`; with ``--loopback`` without the testbed's (``TESTBED_KEYS``:
    no scenario, rate, loss or shaping applies to a loopback run)."""
    d = dataclasses.asdict(cfg)
    if cfg.loopback:
        for key in TESTBED_KEYS:
            del d[key]
    return d


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_matrix(cfg: BenchConfig, command: str, log_fn=print) -> dict:
    """Run every cell; write results. Raises BenchError (not root, bad config)."""
    cfg.validate()
    if not cfg.loopback and os.geteuid() != 0:
        raise BenchError(not_root("dgt bench"))
    check_out_dir(cfg.out)
    cells = plan(cfg)
    est = estimate_s(cfg)
    log_fn(f"dgt bench: {len(cells)} cells ({', '.join(cfg.systems)} x "
           f"{', '.join(['loopback'] if cfg.loopback else cfg.scenarios)}"
           + ("" if cfg.loopback else f" x {', '.join(cfg.rates)}")
           + f"), {cfg.workers} workers, hidden {cfg.hidden} "
           f"({4 * n_params(cfg.hidden) / 1e6:.1f} MB of gradient), {iterations_of(cfg)} "
           f"iterations per cell; estimate {est / 60:.1f} min; load {_load_avg()}")
    started = datetime.datetime.now(datetime.timezone.utc)
    doc = dict(command=command, date=started.isoformat(timespec="seconds"),
               host=dict(node=platform.node(), cpus=os.cpu_count(),
                         load_before=_load_avg(), kernel=platform.release()),
               config=config_doc(cfg), estimate_s=round(est), cells=[],
               git=_git_revision())
    from dgt.tc_profiles import testbed
    if not cfg.loopback and testbed.current(cfg.prefix) is not None:
        raise BenchError(f"a testbed with prefix '{cfg.prefix}' is already up (another "
                         f"bench?); pick another --prefix, or remove it: 'dgt testbed "
                         f"down --prefix {cfg.prefix}'")
    work_dir = tempfile.mkdtemp(prefix="dgt-bench-")
    tb, tb_key = None, None
    t0 = time.monotonic()
    bar = CellProgress(len(cells)).start()   # a bar with rate and ETA on a terminal only
    try:
        for i, cell in enumerate(cells):
            if not cfg.loopback:
                loss, pct = LOSS_DSCP.get(cell["scenario"]), cell["loss_pct"]
                key = (cell["rate"], loss, pct)
                if key != tb_key:
                    log_fn(f"testbed: {cfg.workers} hosts at {cell['rate']}" + (
                        "" if loss is None else f", {pct:g} % loss on "
                        + (f"DSCP {','.join(map(str, loss))}" if loss else "every packet")))
                    tb = testbed.up(cfg.workers, rate=cell["rate"], profile=cfg.profile,
                                    loss_pct=0.0 if loss is None else pct,
                                    loss_dscp=loss or None, prefix=cfg.prefix,
                                    tcp_congestion=cfg.tcp_congestion)
                    tb_key = key
            where = "loopback" if cfg.loopback else f"{cell['rate']} {scenario_label(cell)}"
            tag = f"[{i + 1}/{len(cells)}] {where} {SYSTEM_LABEL[cell['system']]}"
            log_fn(f"{tag} ...")
            row = run_cell(cfg, cell, tb, work_dir, log_fn)
            doc["cells"].append(row)
            if row["error"]:
                log_fn(f"{tag}: FAILED: {row['error']}")
            else:
                log_fn(f"{tag}: comm median {row['comm_ms_median']:.1f} ms, p95 "
                       f"{row['comm_ms_p95']:.1f} ms, acc {row['final_test_accuracy']:.3f}, "
                       f"{row['cell_seconds']:.0f} s (elapsed "
                       f"{(time.monotonic() - t0) / 60:.1f} min)"
                       + (" -- but the job failed at shutdown, see the table"
                          if row.get("shutdown_failure") else ""))
            bar.advance()
            # after every cell: a run stopped half-way keeps what it measured
            doc["elapsed_s"] = round(time.monotonic() - t0)
            doc["host"]["load_after"] = _load_avg()
            doc["complete"] = i + 1 == len(cells)
            write_outputs(doc, cfg.out, loopback=cfg.loopback)
    finally:
        bar.stop()
        if not cfg.loopback:
            testbed.down(cfg.prefix)
        failed = [c for c in doc["cells"] if c.get("error") or c.get("shutdown_failure")]
        if failed or cfg.keep_runs:
            log_fn(f"logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    if not cells:
        doc["elapsed_s"], doc["host"]["load_after"] = 0, _load_avg()
        write_outputs(doc, cfg.out, loopback=cfg.loopback)
    return doc


# ----------------------------------------------------------------------------- outputs


def _fmt(v, spec=".1f", none="–"):
    return none if v is None else format(v, spec)


def md_text(text: str) -> str:
    """``text`` as it may stand in a Markdown table cell: one line, ``|`` escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


#: characters of a failed cell's reason shown inside the table; the whole reason is in
#: the list under it (:func:`failure_notes`)
FAILED_CELL_CHARS = 80


def failed_cell(error: str) -> str:
    """A failed cell's table text: the start of its reason, ‡ pointing at the list."""
    text = md_text(error)
    cut = text if len(text) <= FAILED_CELL_CHARS else \
        text[:FAILED_CELL_CHARS].rstrip("\\") + "…"
    return f"failed ‡: {cut}"


def failure_notes(cells: list[dict], where) -> list[str]:
    """Markdown lines under a table: each failed cell (``where(cell)`` names it) with
    its whole reason, which the table cuts."""
    failed = [c for c in cells if c.get("error")]
    if not failed:
        return []
    return ["", "‡ why each failed cell failed:", ""] + [
        f"- {where(c)}: {' '.join(str(c['error']).split())}" for c in failed]


def markdown(doc: dict, loopback: bool = False) -> str:
    cfg = doc["config"]
    lines = [f"# dgt bench{' --loopback' if loopback else ''}: dgt vs gloo all_reduce", "",
             f"Command: `{doc['command']}`", "",
             f"Date: {doc['date']} (UTC). Host: {doc['host']['cpus']} CPUs, kernel "
             f"{doc['host']['kernel']}; load average (1, 5, 15 min) before "
             f"{doc['host']['load_before']}, after {doc['host'].get('load_after')}. "
             f"Elapsed {doc.get('elapsed_s', 0) / 60:.1f} min (estimate "
             f"{doc['estimate_s'] / 60:.1f} min). Source: `{doc.get('git') or '?'}`."
             + ("" if doc.get("complete", True) else f" **Partial: {len(doc['cells'])} "
                f"cells written so far; the run did not finish.**"), "",
             f"{cfg['workers']} workers, MLP hidden {cfg['hidden']} "
             f"({doc['cells'][0].get('gradient_bytes', 0) / 1e6:.1f} MB of fp32 gradient "
             f"per iteration) on the scikit-learn digits, batch 32 per worker, Adam; "
             f"{'loopback, no shaping' if loopback else 'netns star testbed, every port ' + cfg['profile'] + ' at the rate shown'}; "
             f"target accuracy {cfg['target_accuracy']}."
             + ("" if loopback else f" Lossy: {_loss_list(cfg['loss_pct'])} % random "
                f"drop in the router on DSCP {', '.join(map(str, UNRELIABLE_DSCP))} (dgt's "
                f"UDP channels) only; "
                f"lossy-link: the same on every packet. Tenant: one iperf3 "
                f"bulk TCP flow (DSCP 0) from host i to host i+1 for the whole run."), "",
             "comm = trainer rank 0's time from the gradient push to the applied aggregate, "
             "per iteration. MB/it/node = payload each node sends per iteration "
             "(gloo: ring all-reduce 2(N-1)/N of the gradient; dgt: BLOCKS bytes its "
             "sidecars counted + PULL payload). goodput = MB/it/node / median comm / "
             "line rate; wire = eth0 tx bytes per iteration (headers, ACKs, END); "
             "retrans (RTOs) = TCP segments retransmitted (retransmission timeouts) per "
             "iteration, all hosts together, start-up and evaluation included (neither "
             "is measured under the tenant, whose flows share eth0 and the hosts' TCP).",
             ""]
    hdr = ("| rate | scenario | system | iters | comm median ms | comm p95 ms | "
           "to target (it / s) | final acc | MB/it/node | goodput | wire MB/it | "
           "retrans (RTOs) /it | tcp MB | udp MB (1/2/3) | lost blocks |")
    lines += [hdr, "|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|"]
    for c in doc["cells"]:
        head = f"| {c['rate'] or 'loopback'} | {scenario_label(c)} | {c['label']} |"
        if c.get("error"):
            lines.append(head + f" {failed_cell(c['error'])} |" + " |" * 11)
            continue
        tr = c.get("target_reached")
        ch = c.get("channels") or {}
        udp = [ch[k]["bytes_sent"] / 1e6 for k in sorted(ch) if k.startswith("udp")]
        lost = sum(v["blocks_lost"] for v in ch.values()) if ch else None
        if c.get("shutdown_failure"):
            head = head[:-1] + "† |"
        lines.append(
            head + f" {c['iterations']} | {c['comm_ms_median']:.1f} | {c['comm_ms_p95']:.1f} | "
            + (f"{tr['iteration']} / {tr['seconds']:.1f}" if tr else "not reached")
            + f" | {c['final_test_accuracy']:.3f} | {c['bytes_per_iteration_node'] / 1e6:.1f} | "
            + (f"{c['goodput_frac']:.0%}" if c.get("goodput_frac") is not None else "–")
            + f" | {_fmt(c.get('wire_tx_bytes_per_iteration') and c['wire_tx_bytes_per_iteration'] / 1e6)}"
            + (f" | {c['tcp_retrans_per_iteration']:.0f} ({c['tcp_rto_per_iteration']:.1f})"
               if c.get("tcp_retrans_per_iteration") is not None else " | –")
            + f" | {_fmt(ch['tcp']['bytes_sent'] / 1e6 if 'tcp' in ch else None)}"
            + f" | {'/'.join(f'{u:.1f}' for u in udp) if udp else '–'}"
            + f" | {_fmt(lost, 'd')} |")
    lines += failure_notes(doc["cells"], lambda c: f"{c['rate'] or 'loopback'} "
                           f"{scenario_label(c)} {c['label']}")
    if any(c.get("shutdown_failure") for c in doc["cells"]):
        lines += ["", "† the job failed after trainer rank 0 had run every iteration "
                  "(the numbers are rank 0's and the sidecars' own records): "]
        lines += [f"- {c['rate'] or 'loopback'} {scenario_label(c)} {c['label']}: "
                  f"{c['shutdown_failure'].split(': ', 1)[-1][:200]}"
                  for c in doc["cells"] if c.get("shutdown_failure")]
    tenants = [c for c in doc["cells"] if c.get("tenant")]
    if tenants:
        lines += ["", "Tenant throughput (iperf3 sender side, Mbit/s per flow, over the whole load):", ""]
        for c in tenants:
            lines.append(f"- {c['rate']} {c['label']}: "
                         + ", ".join(f"h{t['src']}→h{t['dst']} {_fmt(t['mbit_s'])}"
                                     for t in c["tenant"]))
    sweep = loss_sweep(doc)
    if sweep:
        lines += ["", "Comm time against loss (median ms per iteration; in brackets the "
                  "change against the same system's clean cell at that rate):", ""]
        hdr = "| rate | scenario | system | clean | " + " | ".join(
            f"{p:g} %" for p in sweep["loss_pct"]) + " |"
        lines += [hdr, "|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|"]
        for r in sweep["rows"]:
            base = r["clean_ms"]
            cells = [_fmt(base)] + [
                "–" if v is None else f"{v:.1f}" + (
                    "" if base is None else f" ({(v / base - 1) * 100:+.0f} %)")
                for v in r["ms"]]
            lines.append(f"| {r['rate']} | {r['scenario']} | {SYSTEM_LABEL[r['system']]} | "
                         + " | ".join(cells) + " |")
    lines += ["", "Plots: " + ("`loopback_comm_time.png`" if loopback else
                               "`comm_time.png` (median, whisker to p95), "
                               "`time_to_accuracy.png`"
                               + (", `loss_sweep.png`" if sweep else "")) + ". Raw numbers: `"
              + ("loopback.json" if loopback else "results.json") + "`.", ""]
    return "\n".join(lines)


def _loss_list(v) -> str:
    """``1`` or ``1, 3, 5`` from a results.json ``loss_pct`` (a number in older files)."""
    return ", ".join(f"{p:g}" for p in (v if isinstance(v, (list, tuple)) else [v]))


def loss_sweep(doc: dict) -> dict | None:
    """The loss sweep in a matrix: for each rate, lossy scenario and system, the median
    comm time (ms) of its clean cell and of its cell at each loss rate, or None when the
    matrix ran fewer than two loss rates. Returns {loss_pct: [...], rows: [{rate,
    scenario, system, clean_ms, ms: [...]}]} (None where a cell is missing or failed)."""
    cells = [c for c in doc["cells"] if not c.get("error")]
    pcts = sorted({c["loss_pct"] for c in cells if c.get("loss_pct") is not None})
    if len(pcts) < 2:
        return None
    med = {(c["rate"], c["scenario"], c["system"], c.get("loss_pct")): c["comm_ms_median"]
           for c in cells}
    rows = []
    for rate, scenario, system in dict.fromkeys(
            (c["rate"], c["scenario"], c["system"]) for c in cells
            if c.get("loss_pct") is not None):
        rows.append(dict(rate=rate, scenario=scenario, system=system,
                         clean_ms=med.get((rate, "clean", system, None)),
                         ms=[med.get((rate, scenario, system, p)) for p in pcts]))
    return dict(loss_pct=pcts, rows=rows)


def plot_loss_sweep(doc: dict, path: str) -> None:
    """One panel per rate and lossy scenario: median comm time against loss rate, a line
    per system, the clean cell at 0 %."""
    from dgt.plot import pyplot, save_png
    plt = pyplot()
    sweep = loss_sweep(doc)
    panels = list(dict.fromkeys((r["rate"], r["scenario"]) for r in sweep["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False,
                             sharey=True)
    for ax, (rate, sc) in zip(axes[0], panels):
        for r in sweep["rows"]:
            if (r["rate"], r["scenario"]) != (rate, sc):
                continue
            pts = [(0.0, r["clean_ms"])] + list(zip(sweep["loss_pct"], r["ms"]))
            pts = [(x, y) for x, y in pts if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                    label=SYSTEM_LABEL[r["system"]], color=SYSTEM_COLOR[r["system"]])
        ax.set_title(f"{rate} {sc}")
        ax.set_xlabel("random loss, % (0 = clean)")
        ax.set_ylabel("comm time per iteration, ms (median)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, 110)
    plt.close(fig)


def plot_comm(doc: dict, path: str) -> None:
    from dgt.plot import pyplot, save_png
    plt = pyplot()
    cells = [c for c in doc["cells"] if not c.get("error")]
    rates = list(dict.fromkeys(c["rate"] or "loopback" for c in cells)) or ["loopback"]
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        sub = [c for c in cells if (c["rate"] or "loopback") == rate]
        scen = list(dict.fromkeys(scenario_label(c) for c in sub))
        systems = [s for s in SYSTEMS if any(c["system"] == s for c in sub)]
        w = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs, med, up = [], [], []
            for i, sc in enumerate(scen):
                for c in sub:
                    if c["system"] == s and scenario_label(c) == sc:
                        xs.append(i + (j - (len(systems) - 1) / 2) * w)
                        med.append(c["comm_ms_median"])
                        up.append(max(0.0, c["comm_ms_p95"] - c["comm_ms_median"]))
            ax.bar(xs, med, w, yerr=[np.zeros(len(up)), up], capsize=3,
                   label=SYSTEM_LABEL[s], color=SYSTEM_COLOR[s])
        ax.set_xticks(range(len(scen)), scen)
        ax.set_ylabel("comm time per iteration, ms (median, whisker p95)")
        ax.set_title(rate)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, 110)
    plt.close(fig)


def plot_accuracy(doc: dict, path: str) -> None:
    from dgt.plot import pyplot, save_png
    plt = pyplot()
    cells = [c for c in doc["cells"] if not c.get("error") and c.get("history")]
    panels = list(dict.fromkeys((c["rate"] or "loopback", scenario_label(c)) for c in cells))
    if not panels:
        panels = [("loopback", "loopback")]
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    target = doc["config"]["target_accuracy"]
    for ax, (rate, sc) in zip(axes.flat, panels):
        for c in cells:
            if (c["rate"] or "loopback", scenario_label(c)) == (rate, sc):
                h = c["history"]
                ax.plot([x["seconds"] for x in h], [x["test_accuracy"] for x in h],
                        marker="o", ms=3, label=SYSTEM_LABEL[c["system"]],
                        color=SYSTEM_COLOR[c["system"]])
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{rate} {sc}")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("test accuracy")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    save_png(fig, path, 110)
    plt.close(fig)


def write_outputs(doc: dict, out: str, loopback: bool = False) -> list[str]:
    """Write the matrix's results, Markdown and figures in ``out``; each file whole
    (dgt.atomic), and the set whole: a stop signal meanwhile acts once it is written
    (dgt.interrupt.deferred). Returns their paths. Raises OSError."""
    with deferred():
        return _write_outputs(doc, out, loopback)


def _write_outputs(doc: dict, out: str, loopback: bool) -> list[str]:
    from dgt.atomic import write_atomic, write_json
    os.makedirs(out, exist_ok=True)
    stem = "loopback" if loopback else "results"
    paths = [os.path.join(out, f"{stem}.json"),
             os.path.join(out, "loopback.md" if loopback else "README.md"),
             os.path.join(out, "loopback_comm_time.png" if loopback else "comm_time.png")]
    write_json(paths[0], doc, indent=1)
    text = markdown(doc, loopback).encode()
    write_atomic(paths[1], lambda f: f.write(text), fsync=False)
    plot_comm(doc, paths[2])
    if not loopback:
        paths.append(os.path.join(out, "time_to_accuracy.png"))
        plot_accuracy(doc, paths[-1])
        if loss_sweep(doc):
            paths.append(os.path.join(out, "loss_sweep.png"))
            plot_loss_sweep(doc, paths[-1])
    return paths


# ----------------------------------------------------------------------------- goodput


def run_goodput(rate: str = "1gbit", hidden: int = 2500, iterations: int = 4,
                seconds: float = 5.0, out: str = "", profile: str = "htb-prio",
                prefix: str = BenchConfig.prefix, mb: float = 100.0,
                log_fn=print) -> dict:
    """dgt's reliable channel vs iperf3 through one shaped port (root).

    Two testbed hosts at ``rate``, in one run:

    1. the reliable channel alone (the acceptance figure): ``dgt.tools.goodput`` pushes
       ``mb`` MB of blocks from h0 to h1 over one connection with the sidecar's framing
       and receive path; goodput = block bytes / (first byte .. last push complete);
    2. iperf3 h0 -> h1 for ``seconds`` over the same ports (receiver goodput);
    3. for context, a training job: ``dgt train --testbed --workers 2 --mode tcp`` with
       ``hidden`` (2500: 25 MB of gradient) for ``iterations``. Per iteration each node
       pushes the half of its gradient the other shard owns, then that shard's PULL comes
       back, so 25 MB cross each direction per iteration, with compute, aggregation and
       the BSP barrier between them: its "goodput" is bytes / comm time.

    Returns the numbers and the ratios to iperf3.
    """
    if os.geteuid() != 0:
        raise BenchError(not_root("dgt bench goodput"))
    from dgt.tc_profiles import testbed
    work = tempfile.mkdtemp(prefix="dgt-bench-goodput-")
    res: dict = dict(rate=rate, hidden=hidden, iterations=iterations, mb=mb,
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds"), load_before=_load_avg())
    try:
        if testbed.current(prefix) is not None:
            raise BenchError(f"a testbed with prefix '{prefix}' is already up; pick "
                             f"another --prefix")
        tb = testbed.up(2, rate=rate, profile=profile, prefix=prefix)
        res["line_rate_mbit"] = rate_bits_per_s(rate) / 1e6
        # 1. the reliable channel alone
        log_fn(f"goodput: dgt reliable channel, {mb:g} MB h0 -> h1 at {rate}")
        tool = module_argv("dgt.tools.goodput")
        recv = tb.popen_in(1, tool + ["recv", "--bind", tb.host_addr(1), "--port", "5400",
                                      "--mb", f"{mb:g}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            snd = tb.exec_in(0, tool + ["send", "--host", tb.host_addr(1), "--port", "5400",
                                        "--mb", f"{mb:g}"], timeout_s=180)
            rout, rerr = recv.communicate(timeout=60)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        if recv.returncode != 0 or snd.returncode != 0:
            lines = [ln for ln in (rerr + snd.stderr).strip().splitlines() if ln.strip()]
            raise BenchError(f"goodput tool failed: {lines[-1] if lines else 'no output'}")
        chan = json.loads(rout)
        res["dgt_reliable"] = chan
        res["dgt_mbit"] = chan["mbit_s"]
        log_fn(f"goodput: dgt reliable channel {res['dgt_mbit']:.0f} Mbit/s "
               f"({chan['bytes'] / 1e6:.1f} MB in {chan['seconds']:.3f} s)")
        # 2. iperf3 over the same port
        loads = testbed.bulk_tcp(tb, [(0, 1)], seconds)
        res["iperf3_mbit"] = loads[0]["mbit_s"]
        log_fn(f"goodput: iperf3 h0 -> h1 {res['iperf3_mbit']:.0f} Mbit/s")
        res["ratio"] = res["dgt_mbit"] / res["iperf3_mbit"] if res["iperf3_mbit"] else None
        # 3. context: the same bytes inside BSP training iterations
        report = os.path.join(work, "report.json")
        argv = module_argv("dgt.cli") + [
            "train", "--testbed", "--testbed-prefix", prefix, "--workers", "2",
            "--mode", "tcp", "--hidden", str(hidden), "--iterations", str(iterations),
            "--report", report, "--run-dir", os.path.join(work, "run")]
        log_fn(f"goodput: context, dgt train --mode tcp, 2 hosts, {iterations} iterations "
               f"of {4 * n_params(hidden) / 1e6:.1f} MB")
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        try:
            with open(os.path.join(work, "run", "trainer-0.json")) as f:
                comm_s = json.load(f)["comm_s"]
        except (OSError, ValueError, KeyError):
            comm_s = []
        if len(comm_s) == iterations:
            per_dir = 4 * n_params(hidden)   # push of the peer's half + PULL of own half
            res["train_comm_s"] = comm_s
            res["train_mbit_median"] = per_dir * 8 / float(np.median(comm_s)) / 1e6
            res["train_ratio_median"] = res["train_mbit_median"] / res["iperf3_mbit"] \
                if res["iperf3_mbit"] else None
            log_fn(f"goodput: in training {res['train_mbit_median']:.0f} Mbit/s per "
                   f"median iteration")
        else:
            res["train_error"] = (p.stdout + p.stderr).strip()[-300:]
            log_fn(f"goodput: training context run failed: {res['train_error']}")
    finally:
        testbed.down(prefix)
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = _load_avg()
    log_fn(f"goodput: ratio dgt reliable channel / iperf3 {_fmt(res.get('ratio'), '.2f')}")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "goodput.json"), "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return res


# --------------------------------------------------------------------------------- CLI


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def loss_list(s: str) -> tuple[float, ...]:
    """``--loss-pct``: one number or a comma list (``1,3,5``), duplicates dropped (the
    range is BenchConfig.validate's rule). Raises argparse.ArgumentTypeError (a one-line
    usage error) when a part is not a number."""
    import argparse
    try:
        return tuple(dict.fromkeys(float(x) for x in s.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{s!r} is not a percentage or a comma list of them, e.g. 1 or 1,3,5") from None


def add_arguments(p) -> None:
    d = BenchConfig()
    p.add_argument("what", nargs="?", choices=("matrix", "goodput", "tta"), default="matrix",
                   help="matrix: systems x scenarios x rates; goodput: dgt's reliable "
                        "channel vs iperf3 on one port; tta: time to accuracy per model, "
                        "the DGT paper's experiment (docs/bench/tta.md)")
    p.add_argument("--systems", default=None,
                   help=f"comma list of {','.join(SYSTEMS)} (default all; tta: "
                        f"gloo,gloo-fp16,gloo-powersgd,tcp,dgt,dgt-ddp and dgt:FLAGS variants)")
    p.add_argument("--scenarios", default=None,
                   help=f"comma list of {','.join(SCENARIOS)} (default all; tta: "
                        f"clean,tenant,share)")
    p.add_argument("--rates", default=None,
                   help=f"port rates, tc notation (default {','.join(d.rates)}; goodput: "
                        f"the first, default 1gbit)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"matrix: nodes (default {d.workers}; goodput always uses 2)")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"MLP width (default {d.hidden}: 6.4M parameters, 25 MB of fp32 "
                        f"gradient; tta: the widths are in --models)")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"matrix: epochs per cell with --iterations 0 (default {d.epochs})")
    p.add_argument("--iterations", type=int, default=None,
                   help=f"iterations per cell, 0 = every epoch (default {d.iterations}; "
                        f"goodput: 4)")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"measure test accuracy every this many iterations (default "
                        f"{d.eval_every}; tta 10)")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help=f"default {d.target_accuracy}; tta 0.85")
    p.add_argument("--loss-pct", type=loss_list, default=None,
                   help="lossy scenarios: random drop, percent (lossy: on DSCP "
                        f"{','.join(map(str, UNRELIABLE_DSCP))}; "
                        "lossy-link: on every packet); a comma list (1,3,5) runs each "
                        "lossy scenario at each rate: a loss sweep (default 1)")
    p.add_argument("--profile", default=None,
                   help=f"tc profile of every port (default {d.profile})")
    p.add_argument("--tcp-congestion", default=None,
                   help="the testbed's TCP congestion control, for every flow: the job's, "
                        "gloo's, the tenant's (default cubic, Linux's default; '' keeps "
                        "this machine's)")
    p.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    p.add_argument("--prefix", default=None,
                   help=f"name prefix of the bench's own testbed namespaces (default "
                        f"{d.prefix}; tta: dgttta)")
    p.add_argument("--out", default=d.out, help="results directory")
    p.add_argument("--loopback", action="store_true",
                   help="no testbed, no shaping, no root: the overhead check")
    p.add_argument("--cell-timeout-s", type=float, default=None,
                   help="kill a cell after this long, s (0: from its estimate: " + "; ".join(
                       f"{kind} {k:g}x, >= {floor:g} s"
                       for kind, (k, floor) in CELL_TIMEOUT.items()) + ")")
    p.add_argument("--keep-runs", action="store_true", help="keep every cell's logs")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"goodput: iperf3 seconds (default {GOODPUT_SECONDS:g})")
    p.add_argument("--mb", type=float, default=None,
                   help="goodput: MB pushed over the reliable channel (default 100)")
    p.add_argument("--estimate", "--dry-run", action="store_true",
                   help="print the plan and time estimate, run nothing")
    from dgt.tools.bench_tta import add_arguments as tta_arguments
    tta_arguments(p)


#: the flags whose parser default is None, so that one given at its default value is
#: told from one not given (a flag that does not apply is refused either way:
#: check_loopback_args, check_read); fill_defaults
#: then puts in the default (breaker round 10: '--share 0.5' to the matrix was taken
#: in silence)
LATE_DEFAULTS = dict(loss_pct=BenchConfig.loss_pct, profile=BenchConfig.profile,
                     tcp_congestion=BenchConfig.tcp_congestion, prefix=BenchConfig.prefix,
                     seconds=GOODPUT_SECONDS, mb=GOODPUT_MB, hidden=BenchConfig.hidden,
                     epochs=BenchConfig.epochs, seed=BenchConfig.seed, cell_timeout_s=0.0)
#: the flags (dests) that each mode does not read, beyond those of :data:`ONLY`: given,
#: each is refused in one line (breaker round 11: 'dgt bench tta --loss-pct 1' and
#: 'goodput --scenarios lossy' were taken in silence)
NOT_READ = {"tta": ("loss_pct", "hidden", "epochs"),
            "goodput": ("systems", "scenarios", "workers", "epochs", "eval_every",
                        "target_accuracy", "loss_pct", "tcp_congestion", "seed",
                        "cell_timeout_s", "keep_runs")}
#: the flags (dests) that one mode alone reads: given to another, each is refused as
#: "applies to 'dgt bench MODE' only" (bench_tta.LATE_DEFAULTS: tta's own)
GOODPUT_ONLY = ("seconds", "mb")


def fill_defaults(a) -> set[str]:
    """Put the default of every :data:`LATE_DEFAULTS` flag (and bench_tta's) not given
    into ``a``, and note the ones given in ``a.given`` (set of dests). Idempotent:
    returns ``a.given``."""
    if not hasattr(a, "given"):
        from dgt.tools.bench_tta import LATE_DEFAULTS as tta_defaults
        late = {**LATE_DEFAULTS, **tta_defaults}
        # every flag whose default is None or False (store_true) is given when not so
        a.given = {k for k, v in vars(a).items() if v is not None and v is not False
                   and (k in late or k in _UNSET_DEFAULTS)}
        for k, v in late.items():
            if getattr(a, k, None) is None:
                setattr(a, k, v)
    return a.given


#: the flags other than LATE_DEFAULTS' whose parser default is None or False
_UNSET_DEFAULTS = ("systems", "scenarios", "rates", "workers", "iterations", "eval_every",
                   "target_accuracy", "keep_runs", "loopback", "calibrate")


def check_read(a) -> None:
    """Refuse, in one line (BenchError), a flag given that ``dgt bench <a.what>`` does
    not read: another mode's own (:data:`GOODPUT_ONLY`, tta's), or one of
    :data:`NOT_READ`."""
    from dgt.tools.bench_tta import LATE_DEFAULTS as tta_defaults
    given = fill_defaults(a)
    only = {**{d: "goodput" for d in GOODPUT_ONLY},
            **{d: "tta" for d in (*tta_defaults, "calibrate")}}
    for dest, mode in only.items():
        if dest in given and mode != a.what:
            raise BenchError(f"--{dest.replace('_', '-')} applies to 'dgt bench {mode}' "
                             f"only")
    for dest in NOT_READ.get(a.what, ()):
        if dest in given:
            flag = "--" + dest.replace("_", "-")
            raise BenchError(f"{flag} does not apply to 'dgt bench {a.what}'; drop {flag}")


def config_from_args(a) -> BenchConfig:
    fill_defaults(a)
    d = BenchConfig()
    return BenchConfig(systems=_csv(a.systems) if a.systems is not None else d.systems,
                       scenarios=_csv(a.scenarios) if a.scenarios is not None else d.scenarios,
                       rates=_csv(a.rates) if a.rates else d.rates,
                       workers=d.workers if a.workers is None else a.workers,
                       hidden=a.hidden, epochs=a.epochs,
                       eval_every=d.eval_every if a.eval_every is None else a.eval_every,
                       iterations=d.iterations if a.iterations is None else a.iterations,
                       target_accuracy=d.target_accuracy if a.target_accuracy is None
                       else a.target_accuracy, loss_pct=a.loss_pct,
                       profile=a.profile, tcp_congestion=a.tcp_congestion,
                       prefix=a.prefix, seed=a.seed, out=a.out,
                       loopback=a.loopback, cell_timeout_s=a.cell_timeout_s,
                       keep_runs=a.keep_runs)


#: s: the longest iperf3 run dgt bench goodput takes (--seconds)
GOODPUT_MAX_S = 3600.0


def check_goodput_args(a, iterations: int) -> None:
    """``dgt bench goodput``'s own flags, checked before anything is built. Raises
    BenchError naming the flag."""
    import math
    for name, v in (("--mb", a.mb), ("--seconds", a.seconds)):
        if not math.isfinite(v) or v <= 0:
            raise BenchError(f"{name} must be a finite number > 0, got {v}")
    if a.seconds > GOODPUT_MAX_S:   # breaker round 26: 1e30 gave a 1.7e28 min estimate
        raise BenchError(f"--seconds must be at most {GOODPUT_MAX_S:g} (iperf3's run), "
                         f"got {a.seconds:g}")
    if iterations < 1:
        raise BenchError(f"--iterations must be >= 1 for goodput, got {iterations}")
    if a.hidden < 1:
        raise BenchError(f"--hidden must be >= 1, got {a.hidden}")
    if a.loopback:
        raise BenchError("goodput runs through one shaped testbed port; --loopback does "
                         "not apply (use 'dgt bench --loopback' for the overhead check)")
    if len(_csv(a.rates) if a.rates else []) > 1:
        raise BenchError("goodput takes one --rates value (one port rate)")
    check_prefix(a.prefix)
    check_profile(a.profile)   # breaker round 26: the matrix checked it, goodput not


def missing_tools(scenarios, goodput: bool = False) -> list[str]:
    """One line per system tool that the testbed cells of ``scenarios`` run and this
    machine lacks (dgt.tc_profiles.system: each names its package): the testbed's own
    (dgt.tc_profiles.testbed.missing_tools: ``ip``, and ``nft`` for the loss rule of
    ``lossy`` and ``lossy-link``), and ``iperf3`` for a tenant (``tenant``, ``share``)
    or for ``goodput`` (``dgt bench goodput``, whose reference is iperf3's figure)."""
    from dgt.tc_profiles import system, testbed
    missing = testbed.missing_tools(loss=any(sc.startswith("lossy") for sc in scenarios))
    if not system.have("iperf3"):
        if goodput:
            missing.append(system.missing_message("iperf3", "dgt bench goodput"))
        elif {"tenant", "share"} & set(scenarios):
            missing.append(system.missing_message("iperf3", "the tenant scenario"))
    return missing


def check_tools(scenarios, estimate: bool, goodput: bool = False) -> None:
    """Before any cell runs: raise BenchError naming every missing tool (see
    :func:`missing_tools`); with ``estimate``, print them as warnings instead."""
    missing = missing_tools(scenarios, goodput)
    if missing and not estimate:
        raise BenchError("; ".join(missing))
    for line in missing:
        print(f"warning: {line}")


def with_help_hint(message: str) -> str:
    """An error about a flag (its message starts with the flag) points at the flags'
    reference, as argparse's own errors do (dgt.config.OneLineParser); others (needs
    root, a missing tool) say what to do themselves."""
    message = " ".join(message.split())
    return message + " (see 'dgt bench --help')" if message.startswith("--") else message


def check_loopback_args(a) -> None:
    """``--loopback`` runs no testbed: the flags that shape one would be ignored. Raises
    BenchError naming the first one given."""
    if not a.loopback:
        return
    late = fill_defaults(a)
    for flag, given in (("--scenarios", a.scenarios is not None),
                        ("--rates", bool(a.rates)),
                        ("--loss-pct", "loss_pct" in late),
                        ("--profile", "profile" in late),
                        ("--prefix", "prefix" in late),
                        ("--tcp-congestion", "tcp_congestion" in late)):
        if given:
            raise BenchError(f"{flag} does not apply with --loopback (no testbed, no "
                             f"shaping); drop {flag}, or drop --loopback to run the "
                             f"testbed (root)")


def partial_outputs(a, since: float) -> str | None:
    """The results file this run of ``dgt bench`` wrote (after its first cell) at or
    after ``since`` (time.time()), or None."""
    name = "tta.json" if a.what == "tta" else "goodput.json" if a.what == "goodput" \
        else "loopback.json" if a.loopback else "results.json"
    path = os.path.join(a.out, name)
    try:
        return path if os.stat(path).st_mtime >= since else None
    except OSError:
        return None


def cmd_bench(a) -> int:
    """Entry point of ``dgt bench``: errors are one line on stderr, exit 2."""
    from dgt.tc_profiles.testbed import TestbedError
    command = "dgt " + shlex.join(sys.argv[1:]) if sys.argv and \
        os.path.basename(sys.argv[0]) == "dgt" else shlex.join(["dgt", "bench"] + sys.argv[2:])
    # SIGTERM and SIGHUP stop the bench as Ctrl-C does: every cell's job is stopped and
    # the testbed removed on the way out (the default action would leave them running)
    stop_on_signals()
    started = time.time()
    fill_defaults(a)
    try:
        if a.what == "tta":
            from dgt.tools.bench_tta import cmd_tta
            return cmd_tta(a, command)
        if a.what == "goodput":
            rates = _csv(a.rates) if a.rates else ("1gbit",)
            if not rates:   # breaker round 26: "--rates ," was an IndexError traceback
                raise BenchError("--rates names no rate; give one port rate, e.g. 1gbit")
            rate = rates[0]
            rate_bits_per_s(rate)
            iterations = 4 if a.iterations is None else a.iterations
            check_goodput_args(a, iterations)
            check_out_dir(a.out)
            check_read(a)
            check_tools((), estimate=a.estimate, goodput=True)
            if a.estimate:
                print(f"goodput: 2 testbed hosts at {rate}; {a.mb:g} MB over dgt's "
                      f"reliable channel, iperf3 for {a.seconds:g} s, then dgt train "
                      f"--mode tcp --workers 2 --hidden {a.hidden} for {iterations} "
                      f"iterations")
                print(f"estimate: {(20 + a.seconds + 10 + 3 * iterations) / 60:.1f} min")
                return 0
            res = run_goodput(rate=rate, hidden=a.hidden, iterations=iterations,
                              seconds=a.seconds, out=a.out, profile=a.profile,
                              prefix=a.prefix, mb=a.mb)
            return 0 if res.get("ratio") is not None and "train_error" not in res else 1
        cfg = config_from_args(a)
        cfg.validate()   # first: a bad value is named as such, given where it applies or not
        check_loopback_args(a)
        check_read(a)
        if "loss_pct" in fill_defaults(a) and \
                not any(sc.startswith("lossy") for sc in cfg.scenarios):
            raise BenchError("--loss-pct applies to the lossy scenarios only; add lossy "
                             "or lossy-link to --scenarios, or drop --loss-pct")
        if a.estimate:
            if not cfg.loopback:
                check_tools(cfg.scenarios, estimate=True)
            check_out_dir(cfg.out)   # the run it plans would write there
            for c in plan(cfg):
                print(f"{c['rate'] or 'loopback':>8} {scenario_label(c):<16} {c['system']:<5} "
                      f"~{bounded_cell_s(cfg, c['rate']):.0f} s")
            print(f"estimate: {estimate_s(cfg) / 60:.1f} min")
            print("(a dgt job that fails at shutdown adds up to its peer timeout, "
                  f"{peer_timeout_s(cfg, cfg.rates[-1] if cfg.rates else None):.0f} s)")
            return 0
        if not cfg.loopback and os.geteuid() != 0:
            raise BenchError(not_root("dgt bench"))
        if not cfg.loopback:
            check_tools(cfg.scenarios, estimate=False)
        doc = run_matrix(cfg, command)
        print()
        print(markdown(doc, cfg.loopback))
        failed = [c for c in doc["cells"] if c.get("error")]
        return 1 if failed else 0
    except (BenchError, TestbedError) as e:
        print(f"dgt bench: error: {with_help_hint(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = partial_outputs(a, started)
        return interrupted("dgt bench", "its jobs were stopped" + (
            "" if a.loopback else ", its testbed removed") + (
            f"; the cells measured so far are in {kept}" if kept else ""))

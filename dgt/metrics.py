"""The sidecar's Prometheus endpoint (``--metrics-port``), made with ``prometheus_client``.

Every sidecar has its own ``CollectorRegistry`` with one custom collector that reads the
sidecar's own counters (``dgt.transport.counters.Counters``, the per-iteration trace's
histograms, the worker agent's k and residual) when Prometheus scrapes: the data path
does no extra work per block or per iteration for the endpoint, and the numbers served
are the very numbers the report is written from. ``prometheus_client``'s
``ProcessCollector`` adds the process's CPU, memory and file descriptors.

Ports: ``dgt sidecar`` serves on ``--metrics-port`` itself; ``dgt train`` starts N
sidecars on one host (loopback) and gives rank r the port ``--metrics-port + r``.
Every metric is documented in ``docs/metrics.md``.

``prometheus_client`` is imported only when the endpoint is on (``dgt --help`` stays
fast).
"""
from __future__ import annotations

import os
import socket

from .config import MetricsConfig  # noqa: F401  (the flags live with the other config)

#: upper bounds (seconds) of the comm time and PULL wait histograms' buckets
TIME_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                  10.0, 30.0)

#: (counter field of ``ChannelCounters``, metric name, help)
CHANNEL_METRICS = (
    ("blocks_sent", "dgt_channel_blocks_sent_total",
     "Blocks this node's worker sent on the channel (network only, not to its own shard)"),
    ("bytes_sent", "dgt_channel_bytes_sent_total",
     "DGT message bytes (header + payload + MAC) of the blocks sent on the channel"),
    ("blocks_delivered", "dgt_channel_blocks_delivered_total",
     "Blocks this node's shard received on the channel in time"),
    ("bytes_delivered", "dgt_channel_bytes_delivered_total",
     "DGT message bytes of the blocks this node's shard received in time"),
    ("blocks_late", "dgt_channel_blocks_late_total",
     "Blocks that reached this node's shard after their worker was finalised (dropped)"),
    ("blocks_lost", "dgt_channel_blocks_lost_total",
     "Blocks counted in END that this node's shard did not receive in time"),
    ("blocks_duplicate", "dgt_channel_blocks_duplicate_total",
     "Blocks this node's shard received twice (the copy is dropped)"),
    ("blocks_dropped_local", "dgt_channel_blocks_dropped_local_total",
     "Blocks this host's own egress queue refused for too long (never sent; kept by "
     "error feedback)"),
)


def check_bind(host: str, ports: list[int]) -> None:
    """Bind (and release) each TCP port on ``host``: the launcher's check before any
    process starts. Raises ValueError saying which port or address is wrong and what to
    do."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError as e:
            raise ValueError(bind_error(host, port, e)) from None
        finally:
            s.close()


def bind_error(host: str, port: int, e: OSError) -> str:
    """One line for a metrics endpoint that could not bind ``host``:``port``."""
    import errno
    if e.errno == errno.EADDRINUSE:
        return (f"--metrics-port: port {port} on {host} is in use; pick another "
                f"--metrics-port (dgt train uses metrics-port + rank)")
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--metrics-host {host} is not an address of this host; use 127.0.0.1, "
                f"0.0.0.0 or one of 'ip -br addr'")
    return f"--metrics-host {host} port {port}: {e.strerror or e}"


class TimeHistogram:
    """Cumulative histogram of durations (seconds) over ``TIME_BUCKETS_S``, fed once per
    iteration; read by the collector at scrape time."""

    def __init__(self):
        self.counts = [0] * (len(TIME_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(TIME_BUCKETS_S) and seconds > TIME_BUCKETS_S[i]:
            i += 1
        self.counts[i] += 1
        self.sum_s += seconds

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip([*map(str, TIME_BUCKETS_S), "+Inf"], self.counts):
            acc += n
            out.append((bound, acc))
        return out


class SidecarCollector:
    """A ``prometheus_client`` custom collector over one ``dgt.sidecar.Sidecar``."""

    def __init__(self, sidecar):
        self.sc = sidecar

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        from . import node_report
        from .transport.channels import channel_name
        sc = self.sc
        ctr = sc.counters
        n_ch = sc.cfg.channels
        # a digest of the session id, never the id itself (it is what a HELLO must
        # carry; an unauthenticated endpoint must not hand it out). Not named "job":
        # Prometheus sets that label on every sample (the scrape job), and renamed ours
        # exported_job (breaker round 17)
        import hashlib
        digest = hashlib.sha256(sc.session_id.to_bytes(8, "big")).hexdigest()[:12]
        info = GaugeMetricFamily("dgt_sidecar_info", "This sidecar: rank, world size, mode "
                                 "and its job's session digest (value 1)",
                                 labels=["rank", "world", "mode", "session_digest"])
        info.add_metric([str(sc.rank), str(sc.world), sc.cfg.mode, digest], 1)
        yield info
        for fld, name, help_ in CHANNEL_METRICS:
            m = CounterMetricFamily(name, help_, labels=["channel"])
            for c in range(n_ch + 1):
                m.add_metric([channel_name(c)], getattr(ctr.channels[c], fld))
            yield m
        m = CounterMetricFamily("dgt_rejected_messages_total", "Messages dropped before "
                                "use, by reason (malformed, stray, replayed, ...)",
                                labels=["reason"])
        for reason, n in sorted(dict(ctr.rejected).items()):
            m.add_metric([reason], n)
        yield m
        for name, value, help_ in (
                ("dgt_blocks_unsent_total", ctr.blocks_unsent,
                 "Blocks the worker did not send (mode topk drops the unreliable share)"),
                ("dgt_blocks_local_total", ctr.blocks_local,
                 "Blocks the worker handed to its own colocated shard (in-process)"),
                ("dgt_tail_markers_total", ctr.tail_markers,
                 "UDP channel tail markers sent (END on a UDP channel)"),
                ("dgt_blocks_non_finite_total", ctr.blocks_non_finite,
                 "Blocks of this node's pushes that held a NaN or inf: sent as zeros, "
                 "kept out of the residual"),
                ("dgt_pushes_total", sc.pushes, "Iterations this sidecar completed "
                 "(push to applied aggregate)"),
                ("dgt_pulls_held_total", sc.pulls_held,
                 "PULLs that waited for this node's own push to leave first"),
                ("dgt_pull_bytes_sent_total", node_report.pull_bytes_sent(sc),
                 "PULL bytes (header + payload + MAC) this node's shard sent to remote "
                 "workers"),
                ("dgt_pull_blocks_coded_total", node_report.pull_blocks_coded(sc),
                 "Aggregate blocks this node's shard sent in a reduced form (--pull-codec)"),
                ("dgt_blocks_cut_by_budget_total", node_report.blocks_cut_by_budget(sc),
                 "Remote blocks the worker did not send to fit its time budget "
                 "(--time-budget-ms; kept by error feedback)")):
            yield CounterMetricFamily(name, help_, value=value)
        tr = sc.trace
        for name, hist, help_ in (
                ("dgt_comm_seconds", tr.comm_hist, "Communication time per iteration: "
                 "the trainer's push (its push_pull call) arriving at this sidecar to "
                 "the aggregate applied"),
                ("dgt_pull_wait_seconds", tr.pull_wait_hist,
                 "Wait per iteration from END sent to the last shard's PULL")):
            yield HistogramMetricFamily(name, help_, buckets=hist.buckets(),
                                        sum_value=hist.sum_s)
        agent = sc.agent
        yield GaugeMetricFamily("dgt_iteration", "Last iteration applied (-1: none yet)",
                                value=tr.last_iteration)
        yield GaugeMetricFamily("dgt_reliable_fraction", "k: share of blocks on the "
                                "reliable channel in the last push (0..1)",
                                value=agent.k_history[-1] if agent and agent.k_history
                                else sc.cfg.k)
        if agent is not None:
            norm = agent.residual.norm() or 0.0   # as the last push left it
            yield GaugeMetricFamily("dgt_residual_norm", "L2 norm of the worker's "
                                    "error-feedback residual (gradient units)", value=norm)
        pace = sc.cfg.pace_mbit if sc.cfg.pace_mbit > 0 else 0.0
        yield GaugeMetricFamily("dgt_pace_rate_bytes_per_second", "Egress pacing rate of "
                                "this node, all peers together (0 = unpaced)",
                                value=pace * 1e6 / 8)
        yield CounterMetricFamily("dgt_blocks_lost_own_total", "This worker's blocks that "
                                  "did not reach their shard (from the PULL bitmaps)",
                                  value=tr.lost_total)


def make_registry(sidecar):
    """A fresh registry with the sidecar's collector and the process collector."""
    from prometheus_client import CollectorRegistry, ProcessCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SidecarCollector(sidecar))
    ProcessCollector(registry=reg)
    return reg


class Endpoint:
    """The HTTP server of one sidecar's registry (dgt.metrics_server: prometheus_client's
    WSGI app in a daemon thread, with a cap on connections and a read timeout).
    ``start`` raises OSError when the port or address cannot be bound."""

    def __init__(self, sidecar, host: str, port: int):
        self.registry = make_registry(sidecar)
        self.host, self.port = host, port
        self.server = None

    def start(self) -> None:
        from .metrics_server import serve
        self.server = serve(self.registry, self.host, self.port)

    def write_textfile(self, path: str) -> None:
        """The same exposition as a file (``write_to_textfile``, atomic rename): the
        node_exporter textfile collector's format."""
        from prometheus_client import write_to_textfile
        write_to_textfile(path, self.registry)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def exposition(registry) -> str:
    """The registry's text exposition (what a scrape returns)."""
    from prometheus_client import generate_latest
    return generate_latest(registry).decode()


def metrics_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"metrics-{rank}.prom")


def check_metrics_ports(cfg: MetricsConfig, workers: int) -> None:
    """``dgt train`` on loopback: every rank's port (``metrics-port + rank``) must be
    free on ``metrics-host`` before any process starts. Raises ValueError."""
    if cfg.metrics_port + workers - 1 > 65535:
        raise ValueError(f"--metrics-port {cfg.metrics_port} leaves no room for "
                         f"{workers} ranks (rank r uses metrics-port + r <= 65535)")
    check_bind(cfg.metrics_host, [cfg.port_of(r) for r in range(workers)])

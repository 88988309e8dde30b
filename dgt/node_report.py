"""What a sidecar leaves in --run-dir when it stops: ``sidecar-<rank>.json`` (its report:
counters per channel, rejections, pacing, deadlines, warnings), the final Prometheus
exposition ``metrics-<rank>.prom`` when --metrics-port is set, and with
--check-conservation ``conservation-<rank>.npz`` (float64 running sums: raw gradient,
applied aggregate x N, final residual, the shard's final residual (--pull-codec) placed
in its range, and N) for the conservation check of
docs/architecture.md. Every key is documented in docs/reports.md."""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import asdict

import numpy as np

from . import codec, records
from .hugepages import numpy_huge_page_advice
from .transport import udpmac

log = logging.getLogger("dgt.sidecar")


def write_node_results(sc) -> None:
    """Write the files of ``sc`` (a dgt.sidecar.Sidecar that has stopped: no callback
    runs after this, so its counters are final). An unwritable metrics or conservation
    file, or a trace that stopped, is a warning in the report; a report the run dir
    refuses goes to the spill folder (dgt.records). Raises OSError only when that fails
    too."""
    socks = sc.sockets
    udp_senders = socks.senders.values()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    report = {
        "rank": sc.rank, "host": sc.node.host, "tcp_port": socks.tcp_port,
        "udp_ports": socks.udp_ports, "session": f"{sc.session_id:016x}",
        "pushes": sc.pushes, "pulls_held": sc.pulls_held,
        # PULL bytes to remote workers (header + payload + MAC), and the aggregate
        # blocks that went coded (--pull-codec)
        "pull_bytes_sent": pull_bytes_sent(sc),
        "pull_blocks_coded": pull_blocks_coded(sc),
        "failed": str(sc.failed) if sc.failed else None,
        "warnings": socks.warnings + ([udpmac.NOT_NATIVE] if sc.key and not udpmac.NATIVE
                                      else []),
        "config": {k: v for k, v in asdict(sc.cfg).items() if k != "secret"},
        "deadline_finalised": sc.shard.finalised_by_deadline if sc.shard else 0,
        "tail_finalised": sc.shard.finalised_by_tail if sc.shard else 0,
        "deadline_ms_highest": 1000.0 * (sc.adaptive.highest_s if sc.adaptive
                                         else sc.deadline_floor_s),
        "deadline_beyond_floor": sc.adaptive.beyond_floor if sc.adaptive else 0,
        # reads of datagrams still queued here when a deadline came (NodeSockets.drain)
        "deadline_drained_reads": sc.drained,
        "emulated_drops": sum(p.emulated_drops for _, p in socks.udp.values()),
        "udp_gso": all(b.gso for b in udp_senders),
        "udp_gro": socks.gro,
        "pace_mbit": sc.cfg.pace_mbit, "pace_source": sc.pace_source,
        "udp_send_syscalls": sum(b.syscalls for b in udp_senders),
        "udp_send_backoffs": sum(b.backoffs for b in udp_senders),
        "udp_icmp_errors": sum(b.icmp_errors for b in udp_senders),
        # the kernel filter's refusals and full receive buffers (transport.sockfilter)
        "udp_kernel_drops": socks.kernel_drops(),
        "blocks_cut_by_budget": blocks_cut_by_budget(sc),
        "k_mean": float(np.mean(sc.agent.k_history)) if sc.agent and
        sc.agent.k_history else None,
        **sc.counters.to_dict(sc.cfg.channels),
        # this process's CPU time so far (getrusage(2), every thread), user + system,
        # seconds; and the system part alone (the kernel on our behalf: syscalls, page
        # faults)
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "cpu_sys_s": ru.ru_stime,
        # its peak resident memory (ru_maxrss), bytes
        "max_rss_bytes": ru.ru_maxrss * 1024,
        # numpy advises huge pages for its arrays (dgt.hugepages: off unless asked)
        "numpy_huge_page_advice": numpy_huge_page_advice(),
        # who codes int8 blocks: the C helper (dgt/_int8codec.c) or torch's kernels
        "int8_codec": "C" if codec.native() else "torch",
    }
    sc.trace.close()   # its last line: what the counters grew since the last push
    if sc.trace.error:   # shown by 'dgt train', not only in this sidecar's log
        report["warnings"] = report["warnings"] + [sc.trace.error]
    run_dir = sc.node.run_dir
    if sc.endpoint is not None:   # the final exposition, beside the report
        from .metrics import metrics_path
        _optional(report, metrics_path(run_dir, sc.rank), sc.endpoint.write_textfile)
    agent = sc.agent
    if agent is not None and agent.raw_sum is not None:
        _optional(report, os.path.join(run_dir, f"conservation-{sc.rank}.npz"),
                  lambda path: np.savez(
                      path, raw_sum=agent.raw_sum.numpy(),
                      applied_sum=agent.applied_sum.numpy(),
                      residual=(agent.residual.residual.double().numpy()
                                if sc.cfg.error_feedback else np.zeros(sc.layout.padded)),
                      shard_residual=_shard_residual(sc), n_workers=sc.world))
    # a full run dir keeps the report in the spill folder (dgt.records), not lost
    records.write(os.path.join(run_dir, f"sidecar-{sc.rank}.json"), report, indent=1)


def _optional(report: dict, path: str, write) -> None:
    """``write(path)``; an OSError becomes a warning in ``report`` naming ``path``."""
    try:
        write(path)
    except OSError as e:
        msg = f"could not write {path}: {e.strerror or e}"
        try:   # np.savez leaves a torn file behind
            os.unlink(path)
        except OSError:
            pass
        log.warning("%s", msg)
        report["warnings"] = report["warnings"] + [msg]


def _shard_residual(sc) -> np.ndarray:
    """The shard's residual (dgt.pull_codec) in its range of the (padded,) float64
    vector, zero elsewhere (and everywhere without --pull-codec)."""
    out = np.zeros(sc.layout.padded)
    coder = sc.shard.coder
    if coder is not None:
        e = sc.layout.block_elems
        out[sc.layout.shard_lo(sc.rank) * e:sc.layout.shard_hi(sc.rank) * e] = \
            coder.residual.reshape(-1)
    return out


def pull_bytes_sent(sc) -> int:
    """PULL bytes (header + payload + MAC) sidecar ``sc`` sent to remote workers."""
    return sc.pulls.bytes_sent if sc.pulls else 0


def pull_blocks_coded(sc) -> int:
    """Aggregate blocks ``sc``'s shard sent in a reduced form (--pull-codec)."""
    return sc.shard.coder.coded_blocks if sc.shard and sc.shard.coder else 0


def blocks_cut_by_budget(sc) -> int:
    """Remote blocks ``sc``'s worker did not send for the time budget (--time-budget-ms)."""
    return sc.agent.meter.cut_total if sc.agent and sc.agent.meter else 0

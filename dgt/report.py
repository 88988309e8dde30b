"""The ``dgt train`` report: one JSON document and the same numbers as a summary table."""
from __future__ import annotations

import math
import os
from dataclasses import asdict

import numpy as np

from . import records
from .rank_list import rank_list
from .run_files import of_job, open_regular
from .trace import comm_times_ms, cpu_ms, read_run, skipped_note, unread
from .transport.counters import merge


def conservation_error(run_dir: str, world: int | None = None,
                       warnings: list[str] | None = None) -> float | None:
    """Relative error of the conservation invariant (docs/architecture.md):
    ``||sum(aggregate * N) + sum_w residual_w + N sum_s residual_s - sum_w,t g_w,t||
    / ||sum_w,t g_w,t||`` (residual_s: shard s's, dgt.pull_codec), from the float64
    sums the sidecars saved (``--check-conservation``); with ``world``, ranks
    0..world-1's only. One of those files that is not a regular file
    (dgt.run_files.open_regular: a FIFO, a device, a directory) or cannot be read is
    not read: with ``warnings``, said there and None returned; else raised (OSError,
    RefusedFile)."""
    files = of_job(os.path.join(run_dir, "conservation-*.npz"), world)
    if not files:
        return None
    raw = applied = residual = None
    for path in files:
        try:
            f = open_regular(path)
        except OSError as e:
            if warnings is None:
                raise
            warnings.append(f"{path}: {unread(e)}; no conservation check")
            return None
        with f:
            z = np.load(f)
            raw = z["raw_sum"] if raw is None else raw + z["raw_sum"]
            res = z["residual"]
            if "shard_residual" in z:
                res = res + float(z["n_workers"]) * z["shard_residual"]
            residual = res if residual is None else residual + res
            applied = z["applied_sum"]  # identical on every node
    denom = float(np.linalg.norm(raw)) or 1.0
    return float(np.linalg.norm(applied + residual - raw) / denom)


def comm_ms(traces: dict[int, list[dict]], trainers: list[dict]) -> np.ndarray:
    """Comm time per iteration (ms): rank 0's per-iteration trace (``traces``, dgt.trace's
    ``read_run``: the trainer's push_pull call to the aggregate applied, measured by its
    sidecar), else rank 0 trainer's own ``comm_s``."""
    ms = comm_times_ms(traces.get(0, []))
    if ms and (not trainers or len(ms) == trainers[0]["iterations"]):
        return np.array(ms)
    return np.array(trainers[0]["comm_s"]) * 1e3 if trainers else np.zeros(1)


def cpu_per_iteration(traces: dict[int, list[dict]], trainers: list[dict]) -> dict:
    """CPU per iteration of one node's processes, ms, medians over every rank and
    iteration but each one's first (start-up): ``trainer_ms`` (the trainer process from
    batch to optimiser step, every thread: a gloo baseline's all-reduce threads too;
    trainer records' ``cpu_s``), ``sidecar_ms`` and ``sidecar_sys_ms`` (its system part;
    the sidecars' trace lines, ``traces`` as dgt.trace's ``read_run`` gives them), each
    None when no record has it; and ``cores``, the CPUs this process may run on (the
    node's processes share them when the job runs on one host: dgt train, the testbed)."""
    def med(xs):
        return float(np.median(xs)) if xs else None
    return {"trainer_ms": med([1e3 * c for t in trainers for c in (t.get("cpu_s") or [])[1:]]),
            "sidecar_ms": med([x for lines in traces.values() for x in cpu_ms(lines)]),
            "sidecar_sys_ms": med([x for lines in traces.values()
                                   for x in cpu_ms(lines, "cpu_sys_s")]),
            "cores": len(os.sched_getaffinity(0))}


def _used(sidecars: list[dict], field: str, default: str) -> str:
    """The coding ``field`` (band_codec or pull_codec) the sidecars ran with (``auto``
    resolved per node: dgt.registration.agree), "a / b" when nodes differed; ``default``
    when no sidecar says."""
    used = sorted({s["config"][field] for s in sidecars
                   if isinstance(s.get("config"), dict) and field in s["config"]})
    return " / ".join(used) if used else default


def build_report(run_dir: str, job, tx, wall_s: float, spill: str | None = None) -> dict:
    """The report of a finished run from its records in ``run_dir`` and, for those the
    run dir refused, in the spill folder ``spill`` (dgt.records): of ranks
    0..job.workers-1 only, whatever else the run dir holds. A trace or record that is
    not a regular file (a FIFO, a device, a directory) or cannot be read is left out
    with a warning naming it."""
    world = job.workers
    trainers, lost_t = records.load(run_dir, "trainer-*.json", spill, world)
    sidecars, lost_s = records.load(run_dir, "sidecar-*.json", spill, world)
    refused: dict[str, str] = {}
    traces = read_run(run_dir, world=world, refused=refused)   # every rank's, read once
    not_read = skipped_note({}, refused)
    conservation = conservation_error(run_dir, world, not_read)
    comm = comm_ms(traces, trainers)
    traffic = merge(sidecars)
    total_blocks = sum(ch["blocks_sent"] for ch in traffic["channels"].values())
    shares = {name: (ch["blocks_sent"] / total_blocks if total_blocks else 0.0)
              for name, ch in traffic["channels"].items()}
    shas = [t["param_sha256"] for t in trainers]
    t0 = trainers[0] if trainers else {}
    rounds = t0.get("rounds", t0.get("iterations", 0))
    bytes_sent = sum(ch["bytes_sent"] for ch in traffic["channels"].values())
    # the codings a run without sidecar reports would have used (dgt train: loopback
    # unless --testbed)
    used = tx.resolve_codecs(loopback=not getattr(job, "testbed", False))
    r = {
        # the trainers' own: e.g. a checkpoint file not written (dgt.job)
        "warnings": lost_t + lost_s + not_read + _warnings(sidecars) +
        [w for t in trainers for w in t.get("warnings", [])],
        "mode": tx.mode,
        # what the UDP bands and the PULLs' low share were coded in (auto resolved)
        "band_codec": _used(sidecars, "band_codec", used.band_codec)
        if tx.mode in ("dgt", "random") else None,
        "pull_codec": _used(sidecars, "pull_codec", used.pull_codec),
        "reliable_codec": _used(sidecars, "reliable_codec", used.reliable_codec),
        "authenticated": bool(tx.secret),   # --secret given: a MAC on every message
        "workload": t0.get("workload"),
        "rounds": rounds,
        "bytes_per_round": bytes_sent / rounds if rounds else None,
        # PULL frames on the wire, all nodes, per round (--pull-codec shrinks them)
        "pull_bytes_per_round": (sum(s.get("pull_bytes_sent", 0) for s in sidecars)
                                 / rounds if rounds else None),
        "pull_blocks_coded": sum(s.get("pull_blocks_coded", 0) for s in sidecars),
        "class_histograms": t0.get("class_histograms"),
        "workers": job.workers,
        "iterations": trainers[0]["iterations"] if trainers else 0,
        "final_test_accuracy": trainers[0]["final_test_accuracy"] if trainers else None,
        "wall_seconds": wall_s,
        "train_seconds": max((t["train_seconds"] for t in trainers), default=None),
        # the slowest rank's register(): start-up inside train_seconds
        "register_seconds": max((t.get("register_seconds", 0.0) for t in trainers),
                                default=None),
        "comm_ms_median": float(np.median(comm)),
        "comm_ms_p95": float(np.percentile(comm, 95)),
        "comm_ms": [float(x) for x in comm],
        "target_accuracy": job.target_accuracy,
        "target_reached": trainers[0]["target_reached"] if trainers else None,
        "replicas_identical": len(set(shas)) == 1,
        "param_sha256": shas,
        "channels": traffic["channels"],
        "channel_block_share": shares,
        "blocks_unsent": traffic["blocks_unsent"],
        "blocks_local": traffic["blocks_local"],
        "blocks_cut_by_budget": sum(s.get("blocks_cut_by_budget", 0) for s in sidecars),
        "tail_markers": traffic["tail_markers"],
        "blocks_non_finite": traffic["blocks_non_finite"],
        "rejected": traffic["rejected"],
        "emulated_drops": sum(s.get("emulated_drops", 0) for s in sidecars),
        "udp_kernel_drops": sum(s.get("udp_kernel_drops", 0) for s in sidecars),
        "deadline_finalised": sum(s.get("deadline_finalised", 0) for s in sidecars),
        "tail_finalised": sum(s.get("tail_finalised", 0) for s in sidecars),
        "deadline_ms_highest": max((s.get("deadline_ms_highest", 0.0) for s in sidecars),
                                   default=None),
        "deadline_beyond_floor": sum(s.get("deadline_beyond_floor", 0) for s in sidecars),
        "deadline_drained_reads": sum(s.get("deadline_drained_reads", 0) for s in sidecars),
        # CPU ms a sidecar used per push, mean over the sidecars (start-up included)
        "sidecar_cpu_ms_per_push": sidecar_cpu_ms_per_push(sidecars),
        "cpu_per_iteration": cpu_per_iteration(traces, trainers),
        "conservation_rel_error": conservation,
        "history": trainers[0]["history"] if trainers else [],
        "sidecars": [{"rank": s["rank"], "host": s["host"], "tcp_port": s["tcp_port"],
                      "udp_ports": s["udp_ports"], "session": s["session"],
                      "pushes": s.get("pushes"), "pulls_held": s.get("pulls_held", 0),
                      "cpu_s": s.get("cpu_s"), "cpu_sys_s": s.get("cpu_sys_s"),
                      "max_rss_bytes": s.get("max_rss_bytes"),
                      "numpy_huge_page_advice": s.get("numpy_huge_page_advice"),
                      "int8_codec": s.get("int8_codec"),
                      "blocks_non_finite": s.get("blocks_non_finite", 0)}
                     for s in sidecars],
        "config": {"job": asdict(job),
                   "transmission": {k: v for k, v in asdict(tx).items() if k != "secret"}},
    }
    for bad in (divergence(r), replicas_differ(r), non_finite_pushed(r),
                conservation_broken(r)):
        if bad is not None:   # the report carries what the summary warns about
            r["warnings"].append(bad)
    r["warnings"] += strangers_accepted(r["channels"])
    return r


def strangers_accepted(channels: dict) -> list[str]:
    """A warning per channel that delivered more blocks than this job's ranks sent
    (``channels``: the report's per-channel counters). No block is sent twice (a copy
    is counted as ``blocks_duplicate``), so the surplus came from elsewhere: datagrams
    that a stranger forged with the session id, which nothing tells apart without
    --secret (breaker round, stop 33: 176,226 delivered of 176,225 sent, unflagged)."""
    out = []
    for name, ch in channels.items():
        extra = ch.get("blocks_delivered", 0) - ch.get("blocks_sent", 0)
        if extra > 0:
            out.append(f"channel {name} delivered {extra} more block(s) than the ranks "
                       f"sent: datagrams that no rank sent were accepted (forged with "
                       f"this job's session id); run every rank with --secret")
    return out


def sidecar_cpu_ms_per_push(sidecars: list[dict]) -> float | None:
    """Mean over the sidecars of CPU milliseconds (``cpu_s``: user + system, start-up
    included) per push; None when no sidecar reported both."""
    per = [1000.0 * s["cpu_s"] / s["pushes"] for s in sidecars
           if isinstance(s.get("cpu_s"), (int, float)) and s.get("pushes")]
    return float(np.mean(per)) if per else None


def _warnings(sidecars: list[dict]) -> list[str]:
    """The sidecars' warnings, each once, with the ranks that gave it."""
    ranks: dict[str, list[int]] = {}
    for s in sidecars:
        for w in s.get("warnings", []):
            ranks.setdefault(w, []).append(s["rank"])
    return [f"rank(s) {rank_list(rs)}: {w}" for w, rs in ranks.items()]


def summary_head(r: dict, log=print) -> None:
    """The summary table's first rows, shared by ``dgt train`` and the gloo baseline
    (``dgt.tools.gloo_train``), so both print the same numbers the same way: mode,
    workers, workload, iterations (rounds), final accuracy, target reached, wall time.
    ``r``: a report dict (``build_report``'s keys)."""
    w = r.get("workload")
    coded = [f"reliable {r['reliable_codec']}"] \
        if r.get("reliable_codec", "fp32") != "fp32" else []
    if r.get("band_codec"):
        coded += [f"UDP bands {r['band_codec']}", f"PULLs {r['pull_codec']}"]
    summary_row("mode", r["mode"] + (f" ({', '.join(coded)})" if coded else ""), log)
    summary_row("workers", r["workers"], log)
    if w:
        summary_row("workload", describe_workload(w), log)
    summary_row("iterations", r["iterations"], log)
    if w and w["algo"] == "fedavg":
        # a round also ends with its epoch (docs/workloads.md): say what they averaged
        per = r["iterations"] / r["rounds"] if r["rounds"] else 0.0
        summary_row("rounds", f"{r['rounds']} ({per:.3g} local steps each on average; "
                              f"--local-steps {w['local_steps']})", log)
    summary_row("final test accuracy", f"{r['final_test_accuracy']:.4f}", log)
    reached = r["target_reached"]
    summary_row(f"reached {r['target_accuracy']}",
                (f"iteration {reached['iteration']}"
                 + (f" (round {reached['round']})" if w and w["algo"] == "fedavg" and
                    "round" in reached else "")
                 + f", {reached['seconds']:.1f} s" if reached else "no"), log)
    summary_row("wall seconds", f"{r['wall_seconds']:.1f}", log)


def summary_row(key: str, value, log=print) -> None:
    """One row of the summary table: the key in 22 columns, then the value."""
    log(f"{key:<22}{value}")


def summary_comm(r: dict, log=print) -> None:
    """The communication-time row (ms per iteration, median and 95th percentile)."""
    summary_row("comm ms median/p95", f"{r['comm_ms_median']:.1f} / "
                f"{r['comm_ms_p95']:.1f}", log)


def print_summary(r: dict, log=print) -> None:
    """The summary table: the same numbers as the JSON report."""
    log("")
    w = r.get("workload")
    summary_head(r, log)
    if r.get("bytes_per_round"):
        per = "round" if w and w["algo"] == "fedavg" else "iteration"
        log(f"{'MB sent per ' + per:<22}{r['bytes_per_round'] / 1e6:.2f} (all nodes; "
            f"{r['bytes_per_round'] / 1e6 / r['workers']:.2f} per node)")
    if r.get("pull_bytes_per_round"):
        per = "round" if w and w["algo"] == "fedavg" else "iter."
        log(f"{'MB pulled per ' + per:<22}{r['pull_bytes_per_round'] / 1e6:.2f} (all "
            f"nodes; {r['pull_bytes_per_round'] / 1e6 / r['workers']:.2f} per node)")
    summary_comm(r, log)
    cpu = r.get("cpu_per_iteration") or {}
    if cpu.get("trainer_ms") is not None and cpu.get("sidecar_ms") is not None:
        log(f"{'CPU ms per iteration':<22}trainer {cpu['trainer_ms']:.1f}, sidecar "
            f"{cpu['sidecar_ms']:.1f} (system {cpu['sidecar_sys_ms']:.1f}); medians per "
            f"node, {cpu['cores']} cores here")
    log(f"{'replicas identical':<22}{r['replicas_identical']}  ({r['param_sha256'][0][:16]}…)")
    if r["conservation_rel_error"] is not None:
        log(f"{'conservation error':<22}{r['conservation_rel_error']:.2e} "
            f"({conservation_verdict(r)})")
    log("")
    log(f"{'channel':<8}{'share':>7}{'blocks sent':>13}{'MB sent':>9}{'delivered':>11}"
        f"{'late':>7}{'lost':>7}{'dropped here':>14}")
    for name, ch in r["channels"].items():
        log(f"{name:<8}{r['channel_block_share'][name]:>7.1%}{ch['blocks_sent']:>13}"
            f"{ch['bytes_sent'] / 1e6:>9.1f}{ch['blocks_delivered']:>11}"
            f"{ch['blocks_late']:>7}{ch['blocks_lost']:>7}"
            f"{ch.get('blocks_dropped_local', 0):>14}")
    extra = f"local {r['blocks_local']}, unsent (topk) {r['blocks_unsent']}"
    if r["rejected"]:
        extra += ", rejected " + ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items()))
    if r.get("udp_kernel_drops"):
        # SK_MEMINFO_DROPS counts both causes, and a GSO/GRO batch dropped whole once
        extra += (f", at least {r['udp_kernel_drops']} datagrams dropped in the kernel "
                  f"(the channel filter's refusals or a full receive buffer: "
                  f"--udp-buffer-bytes)")
    log(extra)
    if r.get("blocks_cut_by_budget"):
        log(f"time budget: {r['blocks_cut_by_budget']} remote blocks not sent (of the "
            f"unsent), kept in the residual; per iteration in trace-<rank>.jsonl")
    if r.get("deadline_finalised") or r.get("tail_finalised"):
        log(f"workers finalised with blocks lost: {r.get('tail_finalised', 0)} at their "
            f"tail markers, {r.get('deadline_finalised', 0)} at the deadline")
    if r.get("deadline_ms_highest"):
        log(f"{'deadline after END':<22}at most {r['deadline_ms_highest']:.0f} ms; "
            f"{r.get('deadline_beyond_floor', 0)} worker-iterations complete only past "
            f"the floor" + (f"; {r['deadline_drained_reads']} reads of datagrams still "
                            f"queued here when a deadline came"
                            if r.get("deadline_drained_reads") else ""))
    for msg in r.get("warnings", []):
        log(f"warning: {msg}")
    hist = r.get("class_histograms")
    if hist and w and w["partition"] != "iid":
        log("samples per class and worker (partition " + w["partition"] + "):")
        for rank, row in enumerate(hist):
            log(f"  worker {rank:<3}" + " ".join(f"{v:>6}" for v in row))
    curve = r.get("history") or []
    if len(curve) > 1:
        log("accuracy curve: " + ", ".join(f"it {h['iteration']} {h['test_accuracy']:.3f} "
                                           f"@{h['seconds']:.0f}s" for h in curve[-8:])
            + (f" (last 8 of {len(curve)}; all in the JSON report)" if len(curve) > 8 else ""))


def describe_workload(w: dict) -> str:
    """One line: model (size), parameters, dataset, partition, algorithm."""
    size = f"hidden {w['hidden']}" if w["model"] == "mlp" else f"width {w['width']:g}"
    algo = "BSP" if w["algo"] == "bsp" else f"FedAvg H={w['local_steps']}"
    return (f"{w['model']} ({size}, {w['params'] / 1e6:.2f}M params, "
            f"{w['gradient_bytes'] / 1e6:.2f} MB per push) on {w['dataset']} "
            f"({w['train_samples']} train / {w['test_samples']} test), {w['partition']}, {algo}")


#: the relative error under which the conservation invariant holds
#: (docs/architecture.md, "Conservation invariant"): float32 rounding stays far below
CONSERVATION_TOLERANCE = 1e-4


def _error_feedback(r: dict) -> bool:
    return bool(r.get("config", {}).get("transmission", {}).get("error_feedback", True))


def conservation_verdict(r: dict) -> str:
    """What the report's ``conservation_rel_error`` means, for the summary line: the
    invariant holds (at most :data:`CONSERVATION_TOLERANCE`), does not, or does not
    apply (``--no-error-feedback``: what was lost or rounded away is dropped, not
    kept, so the error is the mass dropped)."""
    if not _error_feedback(r):
        return "error feedback off: lost and rounded mass is dropped, not kept"
    if r["conservation_rel_error"] <= CONSERVATION_TOLERANCE:
        return f"holds: <= {CONSERVATION_TOLERANCE:g}"
    return f"DOES NOT HOLD: > {CONSERVATION_TOLERANCE:g}"


def conservation_broken(r: dict) -> str | None:
    """The warning for a run with error feedback on whose conservation check
    (``--check-conservation``) found more than :data:`CONSERVATION_TOLERANCE` of
    relative error, or None (no check, within it, or error feedback off)."""
    err = r.get("conservation_rel_error")
    if err is None or not _error_feedback(r) or err <= CONSERVATION_TOLERANCE:
        return None
    return (f"the conservation invariant does not hold: relative error {err:.2e} > "
            f"{CONSERVATION_TOLERANCE:g} with error feedback on, so gradient mass was "
            f"lost that the residuals should have kept (a fault: keep the run dir)")


def divergence(r: dict) -> str | None:
    """The warning for a run whose training loss went NaN or inf (:func:`diverged`),
    or None."""
    bad = diverged(r)
    if bad is None:
        return None
    return (f"the training loss is {bad['loss']} from iteration {bad['iteration']} on: "
            f"training diverged (lower --lr) or a trainer pushed non-finite gradients "
            f"({r['rejected'].get('non_finite', 0)} non-finite blocks were kept out of the "
            f"aggregate); the numbers of this run describe a broken model")


def non_finite_pushed(r: dict) -> str | None:
    """The warning for a run in which trainers pushed blocks holding NaN or inf (the
    sidecars' ``blocks_non_finite``), or None. Such a block is sent as zeros and kept
    out of the residual (dgt.contribution.drop_non_finite): training goes on, without
    that block of that rank for that iteration."""
    per = {s["rank"]: s.get("blocks_non_finite", 0) for s in r.get("sidecars", [])}
    ranks = sorted(rank for rank, n in per.items() if n)
    if not ranks:
        return None
    total = sum(per[rank] for rank in ranks)
    return (f"rank(s) {rank_list(ranks)} pushed "
            f"{total} gradient block(s) holding NaN or inf: each was sent as zeros and "
            f"kept out of the residual, so those ranks' values of those blocks are "
            f"missing from their iterations (an overflowing trainer? lower --lr; the "
            f"iterations are in the trace's blocks_non_finite)")


def replicas_differ(r: dict) -> str | None:
    """The warning for a run whose replicas ended with different parameters (the
    trainers' ``param_sha256`` differ), or None. Every rank applies the same aggregate,
    so they differ only when a rank started from other state (e.g. a checkpoint file
    damaged on disk) or a bug: such a run ends with a warning on stderr and exit status
    1 (``dgt train``), never as a result. Ranks as the trainers' records list them."""
    shas = r.get("param_sha256") or []
    if len(set(shas)) < 2:
        return None
    held: dict[str, list[int]] = {}
    for rank, sha in enumerate(shas):
        held.setdefault(sha, []).append(rank)
    which = ", ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_list(ranks)} "
                      f"{sha[:16]}…" for sha, ranks in held.items())
    return (f"the replicas are not identical at the end: {len(held)} different "
            f"parameter SHA-256 over {len(shas)} ranks ({which}); the ranks did not "
            f"train the same model (resumed from a damaged checkpoint?), so the numbers "
            f"of this run describe no single model")


def diverged(r: dict) -> dict | None:
    """The first history entry whose training loss is NaN or inf, or None. A run that
    diverged ends with a warning and exit status 1 (``dgt train``)."""
    return next((h for h in r["history"] if not math.isfinite(h.get("loss", 0.0))), None)

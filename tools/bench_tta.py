"""``dgt bench tta``: time to accuracy, the DGT paper's experiment on the testbed.

For each workload, system, scenario and port rate, one job trains until it reaches
``--target-accuracy`` on a fixed evaluation subset (``--eval-samples``, every
``--eval-every`` iterations), or until ``--max-iterations`` ("not reached"); a job still
running after ``--cell-timeout-s`` is stopped ("not reached: time cap")::

    dgt bench tta [--models alexnet:0.25,vgg11:0.25,googlenet:0.125,mlp:2500]
                  [--systems gloo,gloo-fp16,gloo-powersgd,tcp,dgt,dgt:--band-codec=int8]
                  [--scenarios clean,tenant,share] [--share 0.5]
                  [--rates calibrated,1gbit] [--comm-ratio 1] [--workers 4]
                  [--target-accuracy 0.85] [--max-iterations 400] [--out docs/bench]
    dgt bench tta --calibrate            # compute and comm per iteration, the rate per model
    dgt bench tta --estimate             # the plan and its time, nothing runs
    dgt bench tta --loopback ...         # no testbed, no root: one cell per model x system

Workloads: ``MODEL[:W]``; the MLP (``mlp:HIDDEN``) trains on the scikit-learn digits, the
others (``alexnet``, ``vgg11``, ``googlenet``, ``cnn``, ``resnet18``, width ``W``) on
Fashion-MNIST.

Systems: ``gloo`` (``dgt.tools.gloo_train``: one flat gloo all_reduce per iteration);
``gloo-fp16`` and ``gloo-powersgd`` (DDP over gloo with PyTorch's own
``fp16_compress_hook`` and ``powerSGD_hook``, see :class:`dgt.tools.gloo_train.DDPHook`;
PowerSGD gets one DDP bucket, because torch 2.13's hook deadlocks on gloo with two or
more); ``tcp`` and ``dgt`` (``dgt train --mode tcp|dgt``); ``dgt-ddp`` (DDP with dgt's
own comm hook, ``dgt.ddp.dgt_hook``, through ``gloo_train --ddp-hook dgt``: each bucket
pushed to the sidecars while backward goes on); and ``dgt:FLAGS`` (or ``tcp:FLAGS``,
``dgt-ddp:FLAGS``), a variant with extra ``dgt train`` flags passed through as given,
e.g. ``dgt:--band-codec=int8`` (several flags: separated by spaces in one quoted item).

Scenarios: ``clean``; ``tenant`` (bulk iperf3 TCP, DSCP 0, host i -> i+1, as in ``dgt
bench``); ``share``: every port's profile is ``--profile`` with each of its bands held to
``--share`` of the port (``ceil``), plus a ``tenant`` band (DSCP 24, CS3) guaranteed the
other ``1 - share`` (HTB ``rate``, lowest priority, may borrow what the job leaves), and
the same iperf3 tenant flows marked DSCP 24: the job gets at most ``share`` of each port
while a tenant uses the rest (:func:`share_profile`).

Rates: tc notation, or ``calibrated``: per workload, the rate at which the wire bytes of
one ring all-reduce of its gradient (``2 (N-1)/N`` of it per node, what ``gloo`` sends)
take ``--comm-ratio`` times its measured compute time per iteration
(:func:`calibrate`: a short ``gloo`` loopback job per workload, its median
forward+backward time per iteration with ``--workers`` ranks on this machine).

Per cell: time to target (seconds from the start of the job's training loop, rendezvous
included, on trainer rank 0), accuracy against wall time, final accuracy, median compute
and communication time per iteration, bytes per iteration and node in each direction
(push, pull), and every rank's parameter SHA-256. Outputs in ``--out``: ``tta.json``,
``tta.md`` (the paper's table next to its figures, every cell, the command, the load
average) and ``tta_accuracy.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from dgt.child_argv import module_argv, typed_command
from dgt.config import MAX_PEER_TIMEOUT_S
from dgt.tools import bench
from dgt.report import cpu_per_iteration
from dgt.trace import read_run
from dgt.tools.bench import (BenchError, _csv, _fmt, _load_avg, failed_cell, failure_notes,
                             rate_bits_per_s)
from dgt.tc_profiles.needs_root import not_root

BASES = ("gloo", "gloo-fp16", "gloo-powersgd", "tcp", "dgt", "dgt-ddp")
DDP_HOOK = {"gloo-fp16": "fp16", "gloo-powersgd": "powersgd", "dgt-ddp": "dgt"}
BASE_LABEL = {"gloo": "gloo all_reduce", "gloo-fp16": "DDP gloo + fp16_compress_hook",
              "gloo-powersgd": "DDP gloo + powerSGD_hook", "tcp": "dgt --mode tcp",
              "dgt": "dgt --mode dgt", "dgt-ddp": "DDP + dgt_hook (--mode dgt)"}
BASE_COLOR = {"gloo": "tab:blue", "gloo-fp16": "tab:cyan", "gloo-powersgd": "tab:purple",
              "tcp": "tab:orange", "dgt": "tab:red", "dgt-ddp": "darkred"}
#: The systems run by dgt.tools.gloo_train: DDP or one all_reduce (gloo's), or DDP with
#: dgt's comm hook, which pushes each bucket to the sidecars during backward
TRAINED_BY_GLOO_TRAIN = ("gloo", "gloo-fp16", "gloo-powersgd", "dgt-ddp")
#: the highest --comm-ratio: a link a hundred times slower than the compute
MAX_COMM_RATIO = 100.0
#: dgt-ddp's DDP bucket size, MB (``--ddp-bucket-cap-mb``): several buckets for each of
#: the default workloads (VGG-11 at 0.25 has 2.3 MB of gradient), so that a push starts
#: while backward runs
DGT_DDP_BUCKET_CAP_MB = 0.5
#: the variants' colours (a system with flags), in order within a panel: none of the
#: base systems' (matplotlib's default cycle gave a variant tcp's orange)
VARIANT_COLORS = ("tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:gray",
                  "black", "gold", "navy")
SCENARIOS = ("clean", "tenant", "share")
#: The DGT paper's figures: training time less than MXNet's default transmission, 6 GTX
#: 1080Ti GPUs on a 1 Gbit/s network (Zhou et al., FGCS 2021, abstract), percent.
PAPER_REDUCTION_PCT = {"googlenet": 19.4, "alexnet": 34.4, "vgg11": 36.5}
#: The share scenario's tenant marks its packets CS3: no dgt channel nor gloo uses it.
TENANT_DSCP = 24
#: Default workloads: the paper's three families at widths whose gradient and compute
#: fit this 2-core machine, plus the MLP of ``dgt train``.
DEFAULT_MODELS = ("alexnet:0.25", "vgg11:0.25", "googlenet:0.125", "mlp:2500")
#: Seconds a cell spends outside its iterations (start, imports, data, rendezvous).
STARTUP_S = bench.STARTUP_S


@dataclass(frozen=True)
class Workload:
    model: str
    width: float = 1.0      # channels x width (not the MLP)
    hidden: int = 2500      # the MLP's width

    @property
    def dataset(self) -> str:
        return "digits" if self.model == "mlp" else "fashion-mnist"

    @property
    def name(self) -> str:
        return f"mlp:{self.hidden}" if self.model == "mlp" else f"{self.model}:{self.width:g}"

    def argv(self) -> list[str]:
        size = ["--hidden", str(self.hidden)] if self.model == "mlp" else \
            ["--width", f"{self.width:g}"]   # the other is ignored (and warned about)
        return ["--model", self.model, *size, "--dataset", self.dataset]

    def n_params(self) -> int:
        from dgt.workloads import models
        shape = (1, 8, 8) if self.model == "mlp" else (1, 28, 28)
        return models.count_params(self.model, shape, 10, self.width, self.hidden)


def parse_workloads(text: str) -> tuple[Workload, ...]:
    """``--models``: ``MODEL[:W]`` items (``mlp:HIDDEN``). Raises BenchError."""
    from dgt.workloads import MODELS
    out = []
    for item in _csv(text):
        name, _, arg = item.partition(":")
        if name not in MODELS:
            raise BenchError(f"--models: unknown model {name!r}; choose from "
                             f"{','.join(MODELS)} (MODEL or MODEL:WIDTH, mlp:HIDDEN)")
        try:
            if name == "mlp":
                w = Workload("mlp", hidden=int(arg) if arg else 2500)
                ok = w.hidden >= 1
            else:
                w = Workload(name, width=float(arg) if arg else 1.0)
                ok = math.isfinite(w.width) and 0 < w.width <= 4
        except ValueError:
            ok = False
        if not ok:
            raise BenchError(f"--models: {item!r}: give MODEL:WIDTH with a width in "
                             f"(0, 4], or mlp:HIDDEN with HIDDEN >= 1")
        out.append(w)
    if not out:
        raise BenchError("--models must name at least one workload, e.g. mlp:2500")
    return tuple(out)


@dataclass(frozen=True)
class System:
    base: str
    flags: tuple[str, ...] = ()    # extra dgt train flags (tcp/dgt variants)

    @property
    def name(self) -> str:
        return self.base + (":" + " ".join(self.flags) if self.flags else "")

    @property
    def label(self) -> str:
        return BASE_LABEL[self.base] + (" " + " ".join(self.flags) if self.flags else "")


def _transmission_parser() -> argparse.ArgumentParser:
    from dgt.config import TransmissionConfig, add_arguments

    class Raising(argparse.ArgumentParser):
        def error(self, message):
            raise BenchError(message)
    p = Raising(prog="dgt train", add_help=False)
    add_arguments(p, TransmissionConfig)
    return p


def parse_systems(text: str) -> tuple[System, ...]:
    """``--systems``: base names, or ``dgt:FLAGS`` / ``tcp:FLAGS`` variants whose flags
    (``dgt train``'s transmission flags; a comma inside a flag's value stays with it)
    are checked against ``dgt train``'s parser, and their values by its validation
    (:func:`check_values`). Raises BenchError."""
    items: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if items and ":" in items[-1] and part.split(":")[0] not in BASES:
            items[-1] += "," + part   # a flag value with a comma: '--loss-dscp=34,18'
        else:
            items.append(part)
    out = []
    for item in items:
        base, sep, rest = item.partition(":")
        if base not in BASES:
            raise BenchError(f"--systems: unknown system {base!r}; choose from "
                             f"{','.join(BASES)}, or dgt:FLAGS for a variant")
        flags = tuple(shlex.split(rest)) if sep else ()
        if sep and not flags:
            raise BenchError(f"--systems: {item!r} names no flags; e.g. "
                             f"dgt:--band-codec=int8")
        if flags and base not in ("tcp", "dgt", "dgt-ddp"):
            raise BenchError(f"--systems: {item!r}: only tcp, dgt and dgt-ddp take dgt "
                             f"train flags")
        if flags:
            try:
                _, unknown = _transmission_parser().parse_known_args(list(flags))
            except BenchError as e:
                raise BenchError(f"--systems {item!r}: {e}") from None
            if unknown:
                raise BenchError(f"--systems {item!r}: dgt train has no transmission flag "
                                 f"{unknown[0]!r} (see 'dgt train --help')")
            if any(f.startswith("--mode") for f in flags):
                raise BenchError(f"--systems {item!r}: the base name sets --mode")
            # the loosest peer timeout: check_cells checks each cell's own
            check_values(item, base, ["--peer-timeout-s", f"{MAX_PEER_TIMEOUT_S:g}",
                                      *flags])
        out.append(System(base, flags))
    if not out:
        raise BenchError("--systems must name at least one system")
    return tuple(out)


def check_values(item: str, base: str, argv: list[str]) -> None:
    """The transmission flags ``argv`` of system ``item`` as its cell's ``dgt train``
    (a dgt-ddp cell: its sidecars) takes them, under the base's --mode: parsed and
    validated by dgt.config.from_args, DGT_* variables included, so that a bad value
    is refused before anything starts, not when its cell runs. Raises BenchError."""
    from dgt.config import TransmissionConfig, from_args
    mode = "dgt" if base == "dgt-ddp" else base
    try:
        ns, _ = _transmission_parser().parse_known_args(["--mode", mode, *argv])
        from_args(TransmissionConfig, ns)
    except (BenchError, ValueError) as e:
        raise BenchError(f"--systems {item!r}: {e}") from None


def check_cells(cfg: "TtaConfig", cells: list[dict]) -> None:
    """Every variant cell's transmission flags with the peer timeout and pacing its
    rate gives it (:func:`check_values`); before any testbed or cell. A ``calibrated``
    rate not resolved yet (--estimate) is left out. Raises BenchError."""
    for cell in cells:
        s = cell["system"]
        if s.flags and cell["rate"] != "calibrated":
            check_values(s.name, s.base, _timeout_and_pace(cfg, cell) + list(s.flags))


@dataclass
class TtaConfig:
    workloads: tuple[Workload, ...] = ()
    systems: tuple[System, ...] = ()
    scenarios: tuple[str, ...] = SCENARIOS
    rates: tuple[str, ...] = ("calibrated", "1gbit")
    share: float = 0.5
    comm_ratio: float = 1.0
    workers: int = 4
    target_accuracy: float = 0.85
    eval_every: int = 10
    eval_samples: int = 1000
    max_iterations: int = 400
    batch_size: int = 32
    seed: int = 0
    profile: str = "htb-prio"
    tcp_congestion: str = "cubic"
    prefix: str = "dgttta"
    out: str = "docs/bench"
    loopback: bool = False
    cell_timeout_s: float = 0.0
    calibrate_iterations: int = 12
    keep_runs: bool = False
    ddp_bucket_cap_mb: float = DGT_DDP_BUCKET_CAP_MB   # dgt-ddp's DDP buckets

    def __post_init__(self):
        if not self.workloads:
            self.workloads = parse_workloads(",".join(DEFAULT_MODELS))
        if not self.systems:
            self.systems = parse_systems(",".join(BASES))

    def validate(self) -> None:
        for s in self.scenarios:
            if s not in SCENARIOS:
                raise BenchError(f"--scenarios: unknown scenario {s!r}; tta runs "
                                 f"{','.join(SCENARIOS)}")
        if not self.loopback and (not self.scenarios or not self.rates):
            raise BenchError("--scenarios and --rates must each name at least one")
        for r in self.rates:
            if r != "calibrated":
                rate_bits_per_s(r)
        bench.check_shared(self)
        if not 0.05 <= self.share <= 0.9:   # also false for nan
            raise BenchError(f"--share must be in [0.05, 0.9] (the job's fraction of each "
                             f"port), got {self.share:g}")
        if not (math.isfinite(self.ddp_bucket_cap_mb) and 0 < self.ddp_bucket_cap_mb < 1e6):
            raise BenchError(f"--ddp-bucket-cap-mb must be a size > 0 MB, got "
                             f"{self.ddp_bucket_cap_mb:g}")
        if not 0 < self.comm_ratio <= MAX_COMM_RATIO:   # nan too; 1e30 was taken
            raise BenchError(f"--comm-ratio must be in (0, {MAX_COMM_RATIO:g}] (the link "
                             f"time per iteration over the compute time), got "
                             f"{self.comm_ratio:g}")
        if self.max_iterations < 1 or self.eval_every < 1 or self.eval_samples < 0 \
                or self.batch_size < 1 or self.calibrate_iterations < 2:
            raise BenchError("--max-iterations, --eval-every and --batch-size must be "
                             ">= 1, --eval-samples >= 0 (0: the whole test split)")


# ------------------------------------------------------------------------- share profile


def share_profile(base: str, share: float, path: str) -> str:
    """Write the ``share`` scenario's tc profile to ``path`` (YAML) and return ``path``.

    ``base``'s bands each get ``ceil_pct = 100 share`` and ``rate_pct`` times ``share``;
    a ``tenant`` band (DSCP :data:`TENANT_DSCP`, HTB priority 7, ``rate_pct = 100 (1 -
    share)``, ``ceil_pct`` 100) is added last. HTB serves every class up to its rate
    first, then lends the rest in priority order: a tenant that always has data keeps
    ``1 - share`` of the port, the job's classes share the other ``share`` and never
    exceed it; what the job leaves idle the tenant may borrow. Raises ProfileError.
    """
    import yaml
    from dgt.tc_profiles.schema import load_profile
    prof = load_profile(base)
    if prof.root_kind != "htb":
        raise BenchError(f"--profile {base}: the share scenario needs an HTB profile")
    bands = [dict(name=b.name, priority=b.priority, dscp=list(b.dscp),
                  rate_pct=round((b.rate_pct or 1) * share, 4),
                  ceil_pct=round(100 * share, 4),
                  **({"limit_bytes": b.limit_bytes} if b.limit_bytes is not None
                     else {"limit_packets": b.limit_packets})) for b in prof.bands]
    if any(TENANT_DSCP in b["dscp"] for b in bands):
        raise BenchError(f"--profile {base} maps DSCP {TENANT_DSCP}, the share tenant's mark")
    bands.append(dict(name="tenant", priority=7, dscp=[TENANT_DSCP],
                      rate_pct=round(100 * (1 - share), 4), ceil_pct=100,
                      limit_bytes=262144))
    doc = dict(schema=1, name="share", description=f"{base}, the job held to {share:g} of "
               f"the port, a tenant band (DSCP {TENANT_DSCP}) guaranteed the rest",
               root=dict(kind="htb", rate="1gbit"), bands=bands,
               default_band=prof.default_band)
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    load_profile(path)   # validated as any profile
    return path


# ----------------------------------------------------------------------------- the plan


def ring_wire_bytes(w: Workload, workers: int) -> float:
    """Bytes each node sends per ring all-reduce of ``w``'s fp32 gradient."""
    return 2 * (workers - 1) / workers * 4 * w.n_params()


def calibrated_rate(cal: dict, comm_ratio: float) -> str:
    """The rate (tc notation, whole kbit/s) at which one ring all-reduce of the gradient
    takes ``comm_ratio`` x the measured compute per iteration."""
    bits = cal["ring_wire_bytes"] * 8 / (comm_ratio * cal["compute_ms_median"] / 1e3)
    return f"{max(64, int(round(bits / 1e3)))}kbit"


def plan(cfg: TtaConfig, calibration: dict | None = None) -> list[dict]:
    """The cells in run order: one testbed per (rate, scenario's profile). A
    ``calibrated`` rate is resolved per workload from ``calibration`` (None: left as
    ``calibrated``)."""
    cells = []
    if cfg.loopback:
        return [dict(rate=None, scenario="loopback", workload=w, system=s)
                for w in cfg.workloads for s in cfg.systems]
    for r in cfg.rates:
        for w in cfg.workloads:
            rate = r
            if r == "calibrated" and calibration and w.name in calibration:
                rate = calibrated_rate(calibration[w.name], cfg.comm_ratio)
            for sc in cfg.scenarios:
                cells += [dict(rate=rate, rate_spec=r, scenario=sc, workload=w, system=s)
                          for s in cfg.systems]
    order = {sc: i for i, sc in enumerate(cfg.scenarios)}
    return sorted(cells, key=lambda c: (cfg.rates.index(c["rate_spec"]), c["rate"],
                                        order[c["scenario"]]))


def estimate_cell_s(cfg: TtaConfig, cell: dict, calibration: dict | None = None) -> float:
    """Upper bound of one cell: start-up + --max-iterations x (compute + line-rate ring
    transfer). Compute: the calibration's where known, else bench's per-iteration guess."""
    w = cell["workload"]
    cal = (calibration or {}).get(w.name)
    compute = cal["compute_ms_median"] / 1e3 if cal else bench.COMPUTE_S_PER_ITER
    rate = cell["rate"]
    xfer = 0.0 if rate in (None, "calibrated") else \
        ring_wire_bytes(w, cfg.workers) * 8 / rate_bits_per_s(rate) / bench.XFER_EFFICIENCY
    if rate == "calibrated":
        xfer = cfg.comm_ratio * compute
    return STARTUP_S + cfg.max_iterations * (compute + xfer)


def estimate_s(cfg: TtaConfig, cells: list[dict], calibration: dict | None = None) -> float:
    return sum(estimate_cell_s(cfg, c, calibration) for c in cells)


# ---------------------------------------------------------------------------- one cell


def cell_argv(cfg: TtaConfig, cell: dict, report: str, run_dir: str,
              iterations: int | None = None, stop_at_target: bool = True) -> list[str]:
    """The command line of one cell (what a user would type)."""
    s, w, rate = cell["system"], cell["workload"], cell["rate"]
    its = cfg.max_iterations if iterations is None else iterations
    common = ["--workers", str(cfg.workers)] + w.argv() + [
        "--epochs", str(its), "--iterations", str(its), "--eval-every",
        str(cfg.eval_every), "--eval-samples", str(cfg.eval_samples), "--batch-size",
        str(cfg.batch_size), "--seed", str(cfg.seed), "--target-accuracy",
        str(cfg.target_accuracy), "--report", report, "--run-dir", run_dir]
    if stop_at_target:
        common.append("--stop-at-target")
    if rate is not None:
        common += ["--testbed", "--testbed-prefix", cfg.prefix]
    tx = _timeout_and_pace(cfg, cell)
    timeout, pace = tx[:2], tx[2:]
    if s.base in TRAINED_BY_GLOO_TRAIN:
        hook = ["--ddp-hook", DDP_HOOK[s.base]] if s.base in DDP_HOOK else []
        if s.base == "dgt-ddp":   # the sidecars take what a dgt cell gives dgt train
            hook += ["--bucket-cap-mb", f"{cfg.ddp_bucket_cap_mb:g}", "--sidecar-args",
                     shlex.join(["--mode", "dgt"] + timeout + pace + list(s.flags))]
        return module_argv("dgt.tools.gloo_train") + common + hook
    return module_argv("dgt.cli") + ["train", "--mode", s.base] + timeout + \
        common + pace + list(s.flags)


def _timeout_and_pace(cfg: TtaConfig, cell: dict) -> list[str]:
    """A cell's --peer-timeout-s (ten times a ring all-reduce of the gradient at its
    rate, at least 20 s), then, on a testbed, its --pace-mbit (the line rate)."""
    w, rate = cell["workload"], cell["rate"]
    grad = 4 * w.n_params()
    xfer = 2 * (cfg.workers - 1) / cfg.workers * grad * 8 / rate_bits_per_s(rate) \
        if rate else 0.0
    timeout = ["--peer-timeout-s", f"{max(20.0, round(10 * xfer)):g}"]
    # pace the UDP channels at the line rate, not above it
    pace = ["--pace-mbit", f"{rate_bits_per_s(rate) / 1e6:g}"] if rate is not None else []
    return timeout + pace


def _command(argv: list[str]) -> str:
    return shlex.join(typed_command(argv))


def _trainers(run_dir: str, workers: int) -> list[dict]:
    out = []
    for r in range(workers):
        try:
            with open(os.path.join(run_dir, f"trainer-{r}.json")) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            pass
    return out


def run_cell(cfg: TtaConfig, cell: dict, tb, work_dir: str) -> dict:
    """Run one cell; return its row (``error`` set when it failed)."""
    s, w = cell["system"], cell["workload"]
    name = "-".join([cell["rate"] or "loopback", cell["scenario"], w.name, s.name])
    run_dir = os.path.join(work_dir, "".join(ch if ch.isalnum() or ch in ".-" else "_"
                                             for ch in name))
    os.makedirs(run_dir, exist_ok=True)
    report_path = os.path.join(run_dir, "report.json")
    argv = cell_argv(cfg, cell, report_path, run_dir)
    timeout_s = cfg.cell_timeout_s or bench.cell_timeout_s(estimate_cell_s(cfg, cell),
                                                           *bench.CELL_TIMEOUT["tta"])
    row = dict(rate=cell["rate"], rate_spec=cell.get("rate_spec"),
               scenario=cell["scenario"], workload=w.name, model=w.model,
               dataset=w.dataset, system=s.name, base=s.base, label=s.label,
               command=_command(argv).replace(run_dir, "RUN_DIR"), error=None)
    tenant = None
    if cell["scenario"] in ("tenant", "share"):
        tenant = bench.start_tenant(tb, cfg.workers, timeout_s,
                                    TENANT_DSCP if cell["scenario"] == "share" else None)
        row["tenant_dscp"] = TENANT_DSCP if cell["scenario"] == "share" else 0
    row["load_before"] = _load_avg()
    drops0 = tb.queue_drops() if tb is not None else None
    code, row["cell_seconds"] = bench.run_job(argv, run_dir, timeout_s)
    row["load_after"] = _load_avg()
    if drops0 is not None:
        row["queue_drops"] = queue_drops_since(drops0, tb.queue_drops())
    if tenant is not None:
        row["tenant"] = tenant.stop()
    rep = None
    if code == 0 and os.path.exists(report_path):
        with open(report_path) as f:
            rep = json.load(f)
    trainers = _trainers(run_dir, cfg.workers)
    if rep is None:
        why = "timed out: time cap" if code is None else f"exit status {code}"
        row["error"] = f"{why}; logs in {run_dir}: " \
                       f"{bench._tail(os.path.join(run_dir, 'stdout.log'))}"
        if code is None:
            row["not_reached"] = "time cap"
        if len(trainers) == cfg.workers:   # every rank finished: the job failed after
            row["shutdown_failure"], row["error"] = row["error"], None
        else:
            return row
    row.update(summarise(cfg, cell, rep, trainers, run_dir))
    if not cfg.keep_runs and not row.get("shutdown_failure"):
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def queue_drops_since(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """Per side (``host``, ``router``) and band (lowest DSCP), the packets dropped
    between two :meth:`Testbed.queue_drops` readings; bands without a drop are left
    out. The tenant's own drops are counted too (its band, or best effort)."""
    return {side: {k: n - before.get(side, {}).get(k, 0) for k, n in bands.items()
                   if n > before.get(side, {}).get(k, 0)}
            for side, bands in after.items()}


def summarise(cfg: TtaConfig, cell: dict, rep: dict | None, trainers: list[dict],
              run_dir: str) -> dict:
    """A cell's numbers from its report (None: from the trainers' own records) and the
    per-rank results."""
    t0 = trainers[0] if trainers else {}
    iters = t0.get("iterations") or (rep or {}).get("iterations") or 0
    compute = t0.get("compute_s") or []
    comm = t0.get("comm_s") or []
    n = cell["workload"].n_params()
    base = cell["system"].base
    if base in TRAINED_BY_GLOO_TRAIN:   # gloo_train's own accounting (dgt-ddp: the wire)
        push = rep.get("push_bytes_per_iteration") if rep else None
        pull = rep.get("pull_bytes_per_iteration") if rep else None
        src = (rep or {}).get("bytes_source",
                              "ring model: (N-1)/N of the bytes all-reduced, each direction")
    else:
        chans = (rep or {}).get("channels") or {}
        push = sum(v["bytes_sent"] for v in chans.values()) / cfg.workers / iters \
            if iters and chans else None
        counted = (rep or {}).get("pull_bytes_per_round")
        if counted:   # PULL frames on the wire, as the sidecars counted them
            pull = counted / cfg.workers
            src = "push: BLOCKS bytes, pull: PULL frames, both counted by the sidecars"
        else:   # a report from before the sidecars counted PULL bytes
            pull = (cfg.workers - 1) / cfg.workers * 4 * n
            src = ("push: BLOCKS bytes counted by the sidecars; pull: PULL payload "
                   "(N-1)/N x the fp32 gradient")
    shas = [t.get("param_sha256") for t in trainers]
    reached = t0.get("target_reached")
    return dict(
        iterations=iters, params=n, gradient_bytes=4 * n,
        target_reached=reached,
        time_to_target_s=reached["seconds"] if reached else None,
        # the same, less the evaluations' own time (every rank evaluates the same model
        # on the same samples, so it is alike for every system; a trainer from before
        # it was recorded: None)
        train_time_to_target_s=reached["seconds"] - reached["eval_seconds"]
        if reached and "eval_seconds" in reached else None,
        iterations_to_target=reached["iteration"] if reached else None,
        final_test_accuracy=t0.get("final_test_accuracy"),
        compute_ms_median=float(np.median(compute)) * 1e3 if compute else None,
        comm_ms_median=float(np.median(comm)) * 1e3 if comm else None,
        comm_ms_p95=float(np.percentile(comm, 95)) * 1e3 if comm else None,
        cpu=cpu_budget(cfg.workers, cpu_per_iteration(
            read_run(run_dir, world=cfg.workers), trainers), compute, comm),
        push_bytes_per_iteration=push, pull_bytes_per_iteration=pull, bytes_source=src,
        wire_tx_bytes_per_iteration=(rep or {}).get("wire_tx_bytes_per_iteration"),
        train_seconds=t0.get("train_seconds"),
        param_sha256=shas, replicas_identical=len(shas) == cfg.workers and
        len(set(shas)) == 1,
        channels=(rep or {}).get("channels") or {},
        history=[{k: h[k] for k in ("iteration", "seconds", "eval_seconds",
                                    "test_accuracy", "loss") if k in h}
                 for h in t0.get("history", [])])


def cpu_budget(workers: int, cpu: dict, compute: list[float], comm: list[float]) -> dict:
    """``cpu`` (dgt.report.cpu_per_iteration) with what it means on this host: the job's
    CPU per iteration (``workers`` x (trainer + sidecar), ms) over the cores
    (``floor_ms``: no iteration can be shorter while the job has the host to itself)
    next to the trainer's median compute + comm (``iteration_ms``, rank 0). When the
    floor is near the iteration, the host's CPU sets the pace, not the network."""
    side = cpu["sidecar_ms"] or 0.0
    job = workers * (cpu["trainer_ms"] + side) if cpu["trainer_ms"] is not None else None
    it = [a + b for a, b in zip(compute, comm)]
    return dict(cpu, job_ms=job, floor_ms=job / cpu["cores"] if job is not None else None,
                iteration_ms=float(np.median(it)) * 1e3 if it else None)


# --------------------------------------------------------------------------- calibration


def calibration_bound_s(cfg: TtaConfig) -> float:
    """Seconds one calibration job may take before it is killed."""
    return max(180.0, 30.0 * cfg.calibrate_iterations)


def calibrate(cfg: TtaConfig, log_fn=print) -> dict:
    """Per workload: a ``gloo`` job on loopback for ``calibrate_iterations`` iterations
    (no stop at target) with ``--workers`` ranks; its median compute time per iteration
    (batch, forward, backward on trainer rank 0), its median comm time on loopback, and
    the ring all-reduce bytes per node. Returns {workload name: numbers}."""
    out = {}
    work = tempfile.mkdtemp(prefix="dgt-tta-cal-")
    try:
        for w in cfg.workloads:
            cell = dict(rate=None, scenario="loopback", workload=w, system=System("gloo"))
            run_dir = os.path.join(work, w.name.replace(":", "_"))
            os.makedirs(run_dir)
            argv = cell_argv(cfg, cell, os.path.join(run_dir, "report.json"), run_dir,
                             iterations=cfg.calibrate_iterations, stop_at_target=False)
            code, secs = bench.run_job(argv, run_dir, calibration_bound_s(cfg))
            t = _trainers(run_dir, 1)
            if code != 0 or not t:
                raise BenchError(f"calibration of {w.name} failed ({secs:.0f} s): "
                                 f"{bench._tail(os.path.join(run_dir, 'stdout.log'))}")
            comp = t[0]["compute_s"][1:]   # the first iteration warms up
            comm = t[0]["comm_s"][1:]
            cal = dict(compute_ms_median=float(np.median(comp)) * 1e3,
                       loopback_comm_ms_median=float(np.median(comm)) * 1e3,
                       ring_wire_bytes=ring_wire_bytes(w, cfg.workers),
                       params=w.n_params(), iterations=cfg.calibrate_iterations,
                       workers=cfg.workers, load=_load_avg(), command=_command(argv))
            cal["rate"] = calibrated_rate(cal, cfg.comm_ratio)
            cal["comm_ms_at_1gbit"] = cal["ring_wire_bytes"] * 8 / 1e9 * 1e3
            out[w.name] = cal
            log_fn(f"calibrate {w.name}: compute {cal['compute_ms_median']:.1f} ms/it, "
                   f"ring {cal['ring_wire_bytes'] / 1e6:.2f} MB/node/it "
                   f"({cal['comm_ms_at_1gbit']:.1f} ms at 1 Gbit/s): rate for comm:compute "
                   f"= {cfg.comm_ratio:g} is {cal['rate']} (load {cal['load']})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------- matrix


def run_tta(cfg: TtaConfig, command: str, log_fn=print) -> dict:
    """Calibrate where a rate is ``calibrated``, run every cell, write the outputs."""
    cfg.validate()
    if not cfg.loopback and os.geteuid() != 0:
        raise BenchError(not_root("dgt bench tta"))
    bench.check_out_dir(cfg.out)
    from dgt.tc_profiles import testbed
    if not cfg.loopback and testbed.current(cfg.prefix) is not None:
        raise BenchError(f"a testbed with prefix '{cfg.prefix}' is already up; pick "
                         f"another --prefix, or 'dgt testbed down --prefix {cfg.prefix}'")
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    doc = dict(command=command, date=started.isoformat(timespec="seconds"),
               host=dict(node=platform.node(), cpus=os.cpu_count(),
                         load_before=_load_avg(), kernel=platform.release()),
               config=_config_doc(cfg), git=bench._git_revision(), cells=[])
    calibration = None
    if not cfg.loopback and "calibrated" in cfg.rates:
        log_fn(f"tta: calibrating {len(cfg.workloads)} workloads (gloo on loopback, "
               f"{cfg.calibrate_iterations} iterations each)")
        calibration = calibrate(cfg, log_fn)
        doc["calibration"] = calibration
    cells = plan(cfg, calibration)
    check_cells(cfg, cells)
    est = estimate_s(cfg, cells, calibration)
    doc["estimate_s"] = round(est)
    log_fn(f"tta: {len(cells)} cells, {cfg.workers} workers, target "
           f"{cfg.target_accuracy:g}, at most {cfg.max_iterations} iterations per cell; "
           f"estimate at most {est / 60:.1f} min; load {_load_avg()}")
    work_dir = tempfile.mkdtemp(prefix="dgt-tta-")
    tb, tb_key = None, None
    bar = bench.CellProgress(len(cells)).start()
    try:
        for i, cell in enumerate(cells):
            if not cfg.loopback:
                key = (cell["rate"], cell["scenario"] == "share")
                if key != tb_key:
                    prof = cfg.profile if not key[1] else share_profile(
                        cfg.profile, cfg.share, os.path.join(work_dir, "share.yaml"))
                    log_fn(f"testbed: {cfg.workers} hosts at {cell['rate']}"
                           + (f", job held to {cfg.share:g} of each port" if key[1] else ""))
                    tb = testbed.up(cfg.workers, rate=cell["rate"], profile=prof,
                                    prefix=cfg.prefix, tcp_congestion=cfg.tcp_congestion)
                    tb_key = key
            tag = (f"[{i + 1}/{len(cells)}] {cell['rate'] or 'loopback'} {cell['scenario']} "
                   f"{cell['workload'].name} {cell['system'].label}")
            log_fn(f"{tag} ...")
            row = run_cell(cfg, cell, tb, work_dir)
            doc["cells"].append(row)
            if row["error"]:
                log_fn(f"{tag}: FAILED: {row['error']}")
            else:
                tt = row["time_to_target_s"]
                log_fn(f"{tag}: " + (f"target at {tt:.1f} s (iteration "
                                     f"{row['iterations_to_target']})" if tt is not None
                                     else f"not reached in {row['iterations']} iterations")
                       + f", acc {row['final_test_accuracy']:.3f}, compute "
                       f"{_fmt(row['compute_ms_median'])} ms, comm "
                       f"{_fmt(row['comm_ms_median'])} ms, replicas "
                       f"{'identical' if row['replicas_identical'] else 'DIFFER'}, "
                       f"{row['cell_seconds']:.0f} s (elapsed "
                       f"{(time.monotonic() - t0) / 60:.1f} min)")
            bar.advance()
            # after every cell: a run stopped half-way keeps what it measured
            doc["elapsed_s"] = round(time.monotonic() - t0)
            doc["host"]["load_after"] = _load_avg()
            doc["complete"] = i + 1 == len(cells)
            write_outputs(doc, cfg.out)
    finally:
        bar.stop()
        if not cfg.loopback:
            testbed.down(cfg.prefix)
        if cfg.keep_runs or any(c.get("error") or c.get("shutdown_failure")
                                for c in doc["cells"]):
            log_fn(f"logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    if not cells:
        write_outputs(doc, cfg.out)
    return doc


def _config_doc(cfg: TtaConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["workloads"] = [w.name for w in cfg.workloads]
    d["systems"] = [s.name for s in cfg.systems]
    return d


# ------------------------------------------------------------------------------ outputs


def reductions(doc: dict, field: str = "time_to_target_s") -> list[dict]:
    """The paper's table: for each rate, scenario, workload and dgt system (base
    ``dgt`` or ``dgt-ddp``), the time-to-target reduction against ``tcp`` and each gloo system:
    ``1 - t_dgt / t_ref`` (None where either did not reach the target or failed).
    ``field``: the cells' time to target to compare (``train_time_to_target_s``:
    evaluation excluded)."""
    cells = [c for c in doc["cells"] if not c.get("error")]
    ttt = {(c["rate"], c["scenario"], c["workload"], c["system"]): c.get(field)
           for c in cells}
    rows = []
    for c in cells:
        if c["base"] not in ("dgt", "dgt-ddp"):
            continue
        k = (c["rate"], c["scenario"], c["workload"])
        row = dict(rate=c["rate"], scenario=c["scenario"], workload=c["workload"],
                   model=c["model"], system=c["system"], seconds=c.get(field),
                   paper_pct=PAPER_REDUCTION_PCT.get(c["model"]), vs={})
        for ref in ("tcp", "gloo", "gloo-fp16", "gloo-powersgd"):
            t_ref = ttt.get(k + (ref,))
            if (k + (ref,)) in ttt:
                row["vs"][ref] = (None if t_ref is None or row["seconds"] is None
                                  else 1 - row["seconds"] / t_ref)
        rows.append(row)
    return rows


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    h = doc["host"]
    lines = ["# dgt bench tta: time to accuracy", "",
             f"Command: `{doc['command']}`", "",
             f"Date: {doc['date']} (UTC). Host: {h['cpus']} CPUs, kernel {h['kernel']}; "
             f"load average (1, 5, 15 min) before {h['load_before']}, after "
             f"{h.get('load_after')}. Elapsed {doc.get('elapsed_s', 0) / 60:.1f} min "
             f"(estimate at most {doc.get('estimate_s', 0) / 60:.1f} min). Source: "
             f"`{doc.get('git') or '?'}`."
             + ("" if doc.get("complete", True) else f" **Partial: {len(doc['cells'])} "
                f"cells written so far; the run did not finish.**"), "",
             f"{cfg['workers']} workers, batch {cfg['batch_size']} per worker, Adam; target "
             f"{cfg['target_accuracy']} on "
             + (f"the first {cfg['eval_samples']} test samples" if cfg['eval_samples']
                else "the whole test split") + f", evaluated every {cfg['eval_every']} iterations, at most "
             f"{cfg['max_iterations']} iterations per cell. Scenarios: tenant = bulk iperf3 "
             f"TCP (DSCP 0) host i -> i+1; share = every port's bands held to "
             f"{cfg['share']:g} of it, the same tenant flows marked DSCP {TENANT_DSCP} in a "
             f"band guaranteed the other {1 - cfg['share']:g}."
             + ("" if cfg.get("loopback") else
                f" TCP congestion control on the testbed: "
                f"{cfg.get('tcp_congestion') or 'this machine’s default'}"
                + (" (every flow)." if cfg.get("tcp_congestion") else ".")), ""]
    cal = doc.get("calibration")
    if cal:
        lines += ["## Calibration", "",
                  f"Rate `calibrated` = the port rate at which one ring all-reduce of the "
                  f"fp32 gradient (2 (N-1)/N of it per node) takes {cfg['comm_ratio']:g} x "
                  f"the compute time per iteration measured here (gloo on loopback, "
                  f"median over iterations 2..):", "",
                  "| workload | params | compute ms/it | ring MB/node/it | comm ms at 1 Gbit/s "
                  "| comm:compute at 1 Gbit/s | calibrated rate | load |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, c in cal.items():
            lines.append(f"| {name} | {c['params']:,} | {c['compute_ms_median']:.1f} | "
                         f"{c['ring_wire_bytes'] / 1e6:.2f} | {c['comm_ms_at_1gbit']:.1f} | "
                         f"{c['comm_ms_at_1gbit'] / c['compute_ms_median']:.3f} | "
                         f"{c['rate']} | {c['load']} |")
        lines.append("")
    for field, title, what in (
            ("time_to_target_s", "The paper's table: training-time reduction of dgt",
             "1 - (dgt's time to target) / (the other system's)"),
            ("train_time_to_target_s", "The same, evaluation time excluded",
             "1 - (dgt's time to target) / (the other system's), each less the time its "
             "evaluations took")):
        red = reductions(doc, field)
        if not red or (field != "time_to_target_s" and   # the second: only with data
                       all(r["seconds"] is None for r in red)):
            continue
        lines += [f"## {title}", "",
                  f"{what}; the paper: less "
                  "training time than MXNet's default transmission, 6 GPUs, 1 Gbit/s.", "",
                  "| rate | scenario | workload | dgt system | dgt s | vs tcp | vs gloo | "
                  "vs gloo+fp16 | vs gloo+PowerSGD | paper |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in red:
            lines.append(f"| {r['rate'] or 'loopback'} | {r['scenario']} | {r['workload']} "
                         f"| {r['system']} | {_fmt(r['seconds'])} | "
                         + " | ".join(_pct(r["vs"].get(k)) if k in r["vs"] else "not run"
                                      for k in ("tcp", "gloo", "gloo-fp16", "gloo-powersgd"))
                         + f" | {_fmt(r['paper_pct'], '.1f')}"
                         + (" %" if r["paper_pct"] is not None else "") + " |")
        lines.append("")
    lines += ["## Every cell", "",
              "to target = seconds from the start of trainer rank 0's training loop "
              "(rendezvous included) to the first evaluation at or above the target; "
              "without evaluation = the same less the time rank 0's evaluations took "
              "until then (every rank evaluates at the same iterations). "
              "compute = batch + forward + backward per iteration (DDP systems: minus the "
              "hook's span); comm = from the push to the applied aggregate (DDP: from the "
              "first bucket handed to the hook to the last one's result, overlapping "
              "backward); medians. push / pull = KB per iteration and node (gloo family: "
              "ring model of the bytes all-reduced; dgt: BLOCKS and PULL bytes its "
              "sidecars counted). replicas: every rank's parameter "
              "SHA-256 equal.", "",
              "| rate | scenario | workload | system | to target (it / s) | without "
              "evaluation s | final acc | iters "
              "| compute ms | comm ms | push KB/it | pull KB/it | replicas | load before |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cells"]:
        head = f"| {c['rate'] or 'loopback'} | {c['scenario']} | {c['workload']} | {c['label']} |"
        if c.get("error"):
            lines.append(head + f" {failed_cell(c['error'])} |" + " |" * 9)
            continue
        tt = c.get("time_to_target_s")
        lines.append(
            head + (f" {c['iterations_to_target']} / {tt:.1f}" if tt is not None
                    else " not reached") + f" | {_fmt(c.get('train_time_to_target_s'))}"
            f" | {_fmt(c['final_test_accuracy'], '.3f')} | "
            f"{c['iterations']} | {_fmt(c['compute_ms_median'])} | {_fmt(c['comm_ms_median'])} | "
            f"{_fmt(c['push_bytes_per_iteration'] and c['push_bytes_per_iteration'] / 1e3)} | "
            f"{_fmt(c['pull_bytes_per_iteration'] and c['pull_bytes_per_iteration'] / 1e3)} | "
            f"{'identical' if c['replicas_identical'] else 'DIFFER'} | {c.get('load_before')} |"
            + (" †" if c.get("shutdown_failure") else ""))
    lines += failure_notes(doc["cells"], lambda c: f"{c['rate'] or 'loopback'} "
                           f"{c['scenario']} {c['workload']} {c['label']}")
    lines += _cpu_table(doc["cells"])
    drops = [c for c in doc["cells"] if c.get("queue_drops") is not None]
    if drops:
        lines += ["", "Queue drops: packets the bands' queues dropped during each cell "
                  "(tc class counters), on the hosts' egress and on the router's ports, "
                  "by the band's DSCP (46: dgt's reliable channel; 0: best effort, gloo "
                  f"and the tenant; {TENANT_DSCP}: the share tenant).", "",
                  "| rate | scenario | workload | system | host egress | router ports |",
                  "|---|---|---|---|---|---|"]
        for c in drops:
            d = c["queue_drops"]
            lines.append(f"| {c['rate']} | {c['scenario']} | {c['workload']} | {c['label']} "
                         f"| {_drops_text(d.get('host', {}))} "
                         f"| {_drops_text(d.get('router', {}))} |")
    lines += ["", "Commands of the cells:", ""]
    lines += [f"- {c['rate'] or 'loopback'} {c['scenario']} {c['workload']} {c['system']}: "
              f"`{c['command']}`" for c in doc["cells"]]
    lines += ["", "Plot: `tta_accuracy.png` (test accuracy against training seconds, a "
              "panel per rate, scenario and workload). Raw numbers: `tta.json`.", ""]
    return "\n".join(lines)


def _cpu_table(cells: list[dict]) -> list[str]:
    """The cells' CPU per iteration (:func:`cpu_budget`) as markdown lines; none when no
    cell has it (a run from before it was recorded)."""
    rows = [c for c in cells if (c.get("cpu") or {}).get("job_ms") is not None]
    if not rows:
        return []
    cores = sorted({c["cpu"]["cores"] for c in rows})
    out = ["", "CPU per iteration, ms (medians over ranks and iterations, each rank's "
           "first left out): trainer = one trainer process from batch to optimiser step "
           "(every thread: a gloo baseline's all-reduce too); sidecar = one dgt sidecar "
           "(its system part in brackets); job = workers x (trainer + sidecar); floor = "
           f"job / cores ({'/'.join(map(str, cores))} here), the shortest iteration this "
           "host's CPU allows the job; iteration = trainer rank 0's compute + comm. Where "
           "the floor is near the iteration, the CPU sets the pace, not the network.", "",
           "| rate | scenario | workload | system | trainer | sidecar (system) | job | "
           "floor | iteration |", "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        u = c["cpu"]
        side = "–" if u["sidecar_ms"] is None else \
            f"{u['sidecar_ms']:.1f} ({_fmt(u['sidecar_sys_ms'])})"
        out.append(f"| {c['rate'] or 'loopback'} | {c['scenario']} | {c['workload']} | "
                   f"{c['label']} | {u['trainer_ms']:.1f} | {side} | {u['job_ms']:.1f} | "
                   f"{u['floor_ms']:.1f} | {_fmt(u['iteration_ms'])} |")
    return out


def _drops_text(bands: dict[str, int]) -> str:
    return ", ".join(f"DSCP {k}: {n:,}" for k, n in sorted(bands.items(),
                                                          key=lambda kv: -int(kv[0]))) \
        or "none"


def curve_colors(cells: list[dict]) -> list[str | None]:
    """The colour of each of one panel's ``cells``' curves: a base system its own
    (:data:`BASE_COLOR`; None, matplotlib's next, for one without), each variant the
    next of :data:`VARIANT_COLORS`, so no two curves of a panel share one (up to 8
    variants)."""
    out, variants = [], 0
    for c in cells:
        if c["system"] == c["base"]:
            out.append(BASE_COLOR.get(c["base"]))
        else:
            out.append(VARIANT_COLORS[variants % len(VARIANT_COLORS)])
            variants += 1
    return out


def plot_accuracy(doc: dict, path: str) -> None:
    from dgt.plot import pyplot, save_png
    plt = pyplot()
    cells = [c for c in doc["cells"] if not c.get("error") and c.get("history")]
    panels = list(dict.fromkeys((c["rate"] or "loopback", c["scenario"], c["workload"])
                                for c in cells)) or [("loopback", "loopback", "")]
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        mine = [c for c in cells if (c["rate"] or "loopback", c["scenario"],
                                     c["workload"]) == key]
        for c, color in zip(mine, curve_colors(mine)):
            h = c["history"]
            ax.plot([x["seconds"] for x in h], [x["test_accuracy"] for x in h],
                    marker="o", ms=3, label=c["label"], color=color)
        ax.axhline(doc["config"]["target_accuracy"], color="grey", lw=0.8, ls="--")
        ax.set_title(" ".join(key))
        ax.set_xlabel("training seconds")
        ax.set_ylabel("test accuracy")
        if ax.get_legend_handles_labels()[0]:   # no curve (every cell failed): none
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    save_png(fig, path, 110)
    plt.close(fig)


def write_outputs(doc: dict, out: str) -> list[str]:
    """Write tta's results, Markdown and figure in ``out``, each file whole and the set
    whole (dgt.tools.bench.write_outputs says how). Returns their paths. Raises
    OSError."""
    from dgt.atomic import write_atomic, write_json
    from dgt.interrupt import deferred
    with deferred():
        os.makedirs(out, exist_ok=True)
        paths = [os.path.join(out, n) for n in ("tta.json", "tta.md", "tta_accuracy.png")]
        write_json(paths[0], doc, indent=1)
        text = markdown(doc).encode()
        write_atomic(paths[1], lambda f: f.write(text), fsync=False)
        plot_accuracy(doc, paths[2])
    return paths


# ----------------------------------------------------------------------------------- CLI


#: tta's flags whose parser default is None (dgt.tools.bench.LATE_DEFAULTS says why)
LATE_DEFAULTS = dict(models=",".join(DEFAULT_MODELS), share=TtaConfig.share,
                     comm_ratio=TtaConfig.comm_ratio,
                     max_iterations=TtaConfig.max_iterations,
                     eval_samples=TtaConfig.eval_samples, batch_size=TtaConfig.batch_size,
                     ddp_bucket_cap_mb=TtaConfig.ddp_bucket_cap_mb)


def add_arguments(p) -> None:
    """tta's own flags on ``dgt bench`` (the shared ones are bench's)."""
    g = p.add_argument_group("tta (dgt bench tta)")
    for flag, typ, help_ in (
            ("--models", str, "tta: workloads, MODEL[:WIDTH] (mlp:HIDDEN on digits, the "
                              "others on fashion-mnist; default {})"),
            ("--share", float, "tta share scenario: the job's fraction of each port "
                               "(default {:g})"),
            ("--comm-ratio", float, "tta: rate 'calibrated' makes ring all-reduce time "
                                    "this many times the measured compute per iteration "
                                    "(default {:g})"),
            ("--max-iterations", int, "tta: a cell that has not reached the target by "
                                      "then is 'not reached' (default {})"),
            ("--eval-samples", int, "tta: evaluate on the first this many test samples "
                                    "(0: all; default {})"),
            ("--batch-size", int, "tta: samples per worker per iteration (default {})"),
            ("--ddp-bucket-cap-mb", float, "tta: the DDP bucket size of system dgt-ddp, "
                                           "MB (above the gradient's size: one bucket, the "
                                           "whole push after backward; default {:g})")):
        # None in the parser: see dgt.tools.bench.LATE_DEFAULTS
        g.add_argument(flag, type=typ, default=None, help=help_.format(
            LATE_DEFAULTS[flag[2:].replace("-", "_")]))
    g.add_argument("--calibrate", action="store_true",
                   help="tta: only measure compute per iteration per workload and print "
                        "the calibrated rates")


#: flags that --calibrate does not read: it runs one gloo job per workload on loopback
CALIBRATE_NOT_READ = ("share", "max_iterations", "scenarios", "systems", "rates",
                      "ddp_bucket_cap_mb", "profile", "tcp_congestion", "prefix",
                      "keep_runs", "cell_timeout_s")


def check_combination(a, cfg: "TtaConfig") -> None:
    """Refuse, in one line (BenchError), a tta flag that this combination leaves unread
    (breaker round 11: '--scenarios clean --share 0.3', '--loopback --comm-ratio 1' and
    '--calibrate --max-iterations 400' were taken in silence)."""
    given = bench.fill_defaults(a)
    if a.calibrate:
        for dest in CALIBRATE_NOT_READ:
            if dest in given:
                flag = "--" + dest.replace("_", "-")
                raise BenchError(f"{flag} does not apply with --calibrate (one gloo job "
                                 f"per workload on loopback); drop {flag}")
        return
    if "share" in given and (cfg.loopback or "share" not in cfg.scenarios):
        raise BenchError("--share applies to the share scenario only; add share to "
                         "--scenarios (the testbed's), or drop --share")
    if "comm_ratio" in given and (cfg.loopback or "calibrated" not in cfg.rates):
        raise BenchError("--comm-ratio applies to the calibrated rate only; add "
                         "calibrated to --rates (the testbed's), or drop --comm-ratio")


def config_from_args(a) -> TtaConfig:
    given = bench.fill_defaults(a)
    d = TtaConfig()
    return TtaConfig(
        workloads=parse_workloads(a.models),
        systems=parse_systems(a.systems) if a.systems else d.systems,
        scenarios=_csv(a.scenarios) if a.scenarios else d.scenarios,
        rates=_csv(a.rates) if a.rates else d.rates, share=a.share,
        comm_ratio=a.comm_ratio, workers=d.workers if a.workers is None else a.workers,
        target_accuracy=d.target_accuracy if a.target_accuracy is None else a.target_accuracy,
        eval_every=d.eval_every if a.eval_every is None else a.eval_every,
        eval_samples=a.eval_samples,
        max_iterations=a.max_iterations, batch_size=a.batch_size, seed=a.seed,
        profile=a.profile, tcp_congestion=a.tcp_congestion,
        prefix=a.prefix if "prefix" in given else d.prefix, out=a.out,
        loopback=a.loopback, cell_timeout_s=a.cell_timeout_s,
        keep_runs=a.keep_runs, ddp_bucket_cap_mb=a.ddp_bucket_cap_mb)


def cmd_tta(a, command: str) -> int:
    """``dgt bench tta``. Raises BenchError (one line, exit 2 in bench.cmd_bench)."""
    if a.iterations is not None:
        raise BenchError("tta trains to the target: use --max-iterations, not --iterations")
    cfg = config_from_args(a)
    cfg.validate()   # first: a bad value is named as such, given where it applies or not
    bench.check_read(a)
    bench.check_loopback_args(a)
    check_combination(a, cfg)
    if a.calibrate and a.estimate:   # breaker round 11: --estimate ran the jobs
        bench.check_out_dir(cfg.out)
        bound = calibration_bound_s(cfg)
        for w in cfg.workloads:
            print(f"calibrate {w.name}: gloo on loopback, {cfg.workers} workers, "
                  f"{cfg.calibrate_iterations} iterations, at most {bound:.0f} s")
        print(f"estimate: at most {len(cfg.workloads) * bound / 60:.1f} min for "
              f"{len(cfg.workloads)} calibration jobs; writes "
              f"{os.path.join(cfg.out, 'tta_calibration.json')}")
        return 0
    if a.calibrate:
        cal = calibrate(cfg)
        bench.check_out_dir(cfg.out)
        from dgt.atomic import write_json
        os.makedirs(cfg.out, exist_ok=True)
        write_json(os.path.join(cfg.out, "tta_calibration.json"),
                   dict(command=command, comm_ratio=cfg.comm_ratio, calibration=cal),
                   indent=1)
        return 0
    if a.estimate:
        if not cfg.loopback:
            bench.check_tools(cfg.scenarios, estimate=True)
        bench.check_out_dir(cfg.out)
        cells = plan(cfg)
        check_cells(cfg, cells)
        for c in cells:
            print(f"{c['rate'] or 'loopback':>10} {c['scenario']:<8} {c['workload'].name:<16} "
                  f"{c['system'].name:<28} ~{estimate_cell_s(cfg, c):.0f} s at most")
        print(f"estimate: at most {estimate_s(cfg, cells) / 60:.1f} min for {len(cells)} cells"
              + (" (calibrated rates: after a calibration of "
                 f"{len(cfg.workloads)} short loopback jobs)"
                 if "calibrated" in cfg.rates and not cfg.loopback else ""))
        return 0
    if not cfg.loopback and os.geteuid() != 0:
        raise BenchError(not_root("dgt bench tta"))
    if not cfg.loopback:
        bench.check_tools(cfg.scenarios, estimate=False)
    doc = run_tta(cfg, command)
    print()
    print(markdown(doc))
    return 1 if any(c.get("error") for c in doc["cells"]) else 0

"""The gloo baseline: the training loop of ``dgt train``, averaged by ``all_reduce``.

Each rank runs :func:`dgt.job.train` itself (same data split, model, optimiser, lr,
batch, seed and the same comm-time measurement: from the gradient push to the applied
aggregate), but its ``comm`` is :class:`GlooAllReduce`: the gradients are copied into
one flat float32 buffer, summed with ``torch.distributed.all_reduce`` over the gloo
backend (ring all-reduce: each node sends and receives ``2 (N-1)/N`` of the buffer),
divided by N and copied back into ``p.grad``. Rendezvous: ``MASTER_ADDR``/``MASTER_PORT``
(``init_process_group('gloo', init_method='env://')``).

One rank (started by the launcher below, or by torchrun)::

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python -m dgt.tools.gloo_train \\
        --rank 0 --world 2 --result r0.json

The whole job, on loopback or one rank per testbed host (root)::

    python -m dgt.tools.gloo_train --workers 4 --hidden 2500 --iterations 20 \\
        [--testbed] --report gloo.json

The report has the keys of ``dgt train``'s report where they make sense
(``comm_ms_median``, ``comm_ms_p95``, ``target_reached``, ``final_test_accuracy``,
``iterations``, ``wall_seconds``, ``history``, ``replicas_identical``) plus
``bytes_per_iteration`` (payload each node sends per iteration, ring model) and
``wire_tx_bytes_per_iteration`` (measured on the host's ``eth0`` in the testbed; None on
loopback, where ``lo`` counts every rank together).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from dgt.atomic import write_json
from dgt.child_argv import module_argv
from dgt.config import JobConfig
from dgt.process import die_with_parent
from dgt.report import summary_comm, summary_head, summary_row

MODE = "gloo"


def _tx_bytes(iface: str) -> int | None:
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class GlooAllReduce:
    """Gradient averaging with one gloo ``all_reduce`` of a flat float32 buffer.

    The same interface as :class:`dgt.Client` (``register``, ``push_pull``, ``close``,
    ``last_k``), so :func:`dgt.job.train` runs unchanged. ``register`` joins the
    process group (``env://`` rendezvous), so the rendezvous counts in the job's time as
    the sidecar registration does for dgt. Raises RuntimeError from gloo on a peer failure.

    Example::

        comm = GlooAllReduce(rank=0, world=2, timeout_s=60)
        comm.register(model)
        loss.backward(); comm.push_pull(step); opt.step()
    """

    last_k = None

    def __init__(self, rank: int, world: int, timeout_s: float = 60.0,
                 iface: str | None = None):
        self.rank, self.world, self.timeout_s, self.iface = rank, world, timeout_s, iface
        self.flat: torch.Tensor | None = None
        self.tx0 = self.tx1 = None

    def register(self, model: torch.nn.Module) -> None:
        import datetime
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://", rank=self.rank,
                                world_size=self.world,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(self.n_params, dtype=torch.float32)
        dist.barrier()
        self.tx0 = _tx_bytes(self.iface) if self.iface else None

    def push_pull(self, step: int, loss: float | None = None) -> None:
        """Replace every ``p.grad`` with the mean over ranks (float32, in place)."""
        import torch.distributed as dist
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat[off:off + n].copy_(p.grad.reshape(-1) if p.grad is not None
                                         else torch.zeros(n))
            off += n
        dist.all_reduce(self.flat)
        self.flat.div_(self.world)
        off = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.view(-1).copy_(self.flat[off:off + n])
            off += n

    def close(self) -> None:
        import torch.distributed as dist
        self.tx1 = _tx_bytes(self.iface) if self.iface else None
        if dist.is_initialized():
            dist.destroy_process_group()


def ring_bytes_per_iteration(n_params: int, world: int) -> int:
    """Payload bytes each node sends per ring all-reduce of ``n_params`` float32:
    ``2 (N-1)/N * 4 n`` (reduce-scatter, then all-gather)."""
    return int(round(2 * (world - 1) / world * 4 * n_params)) if world > 1 else 0


HOOKS = ("none", "fp16", "powersgd", "dgt")
#: PowerSGD settings: those of the example in PyTorch's powerSGD_hook docstring
#: (rank-1 approximation, vanilla all-reduce for the first 10 iterations).
POWERSGD_RANK = 1
POWERSGD_START_ITER = 10
POWERSGD_MIN_COMPRESSION_RATE = 0.5
#: DDP's own default bucket size, MB
DDP_BUCKET_CAP_MB = 25.0


class DDPHook:
    """DDP over gloo with one of PyTorch's own gradient compression comm hooks.

    ``hook``: ``"none"`` (DDP's all-reduce), ``"fp16"``
    (``default_hooks.fp16_compress_hook``: each bucket cast to float16, all-reduced,
    cast back) or ``"powersgd"`` (``powerSGD_hook.powerSGD_hook`` with
    ``PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=10,
    min_compression_rate=0.5)``, the example of its docstring). The same interface as
    :class:`GlooAllReduce`; ``wrap(model)`` returns the DDP module that
    :func:`dgt.job.train` runs forward through, so the averaging happens during
    ``backward()`` and ``push_pull`` only records the iteration.

    ``"dgt"`` is dgt's own hook (:func:`dgt.ddp.dgt_hook`): each bucket's blocks are pushed
    to the sidecars as DDP hands the bucket over, while backward goes on, and each
    bucket's future resolves to its slice of the PULLed aggregate (docs/ddp.md). The
    rank's sidecar is started by :class:`dgt.ddp.DgtState` with ``sidecar_args``
    (``dgt sidecar`` flags); the process group then only rendezvouses and broadcasts the
    initial parameters. Its bytes are measured on the wire (``iface``), not counted.

    torch 2.13's ``powerSGD_hook`` deadlocks on gloo once DDP has two or more buckets,
    so PowerSGD gets ONE bucket (``bucket_cap_mb`` above the gradient's size); the others
    take ``bucket_cap_mb`` (default: DDP's 25 MB).

    Per iteration it records ``spans_s`` (seconds from the first bucket handed to the
    hook to the last bucket's result: the communication, which overlaps the rest of
    backward) and ``allreduced_bytes`` (payload bytes all-reduced: fp16 two bytes per
    gradient element; PowerSGD the P and Q matrices and the uncompressed tensors it
    all-reduces, or the whole bucket in its vanilla iterations). Raises RuntimeError from
    gloo on a peer failure.
    """

    last_k = None

    def __init__(self, rank: int, world: int, hook: str = "none", timeout_s: float = 60.0,
                 iface: str | None = None, bucket_cap_mb: float | None = None,
                 sidecar_args: list[str] | tuple[str, ...] = ()):
        if hook not in HOOKS:
            raise ValueError(f"hook must be one of {', '.join(HOOKS)}, got {hook!r}")
        self.rank, self.world, self.hook, self.timeout_s = rank, world, hook, timeout_s
        self.iface = iface
        self.bucket_cap_mb = DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.sidecar_args = list(sidecar_args)
        self.dgt_state = None
        self.tx0 = self.tx1 = None
        self.spans_s: list[float] = []
        self.allreduced_bytes: list[int] = []
        self._first = self._last = None
        self._bytes = 0

    def register(self, model: torch.nn.Module) -> None:
        import datetime
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://", rank=self.rank,
                                world_size=self.world,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        self.model = model
        self.n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        dist.barrier()
        self.tx0 = _tx_bytes(self.iface) if self.iface else None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The DDP module with the comm hook registered (call after ``register``)."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
        cap_mb = self.bucket_cap_mb
        if self.hook == "powersgd":   # one bucket: see the class docstring
            cap_mb = 4 * self.n_params / 2 ** 20 + 1
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        if self.hook == "dgt":
            from dgt.ddp import DgtState, dgt_hook
            # the sidecar's rank, world and rendezvous as torchrun would give them
            os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world))
            self.dgt_state = DgtState(sidecar_args=self.sidecar_args)
            ddp.register_comm_hook(self.dgt_state, self._timed(dgt_hook))
            return ddp
        if self.hook == "none":
            state, inner = dist.group.WORLD, default_hooks.allreduce_hook
        elif self.hook == "fp16":
            state, inner = dist.group.WORLD, default_hooks.fp16_compress_hook
        else:
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                start_powerSGD_iter=POWERSGD_START_ITER,
                min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE)
            inner = powerSGD_hook.powerSGD_hook
        self._count_all_reduce()
        ddp.register_comm_hook(state, self._timed(inner))
        return ddp

    def _count_all_reduce(self) -> None:
        """Every hook all-reduces with ``torch.distributed.all_reduce`` (PowerSGD: P, Q
        and the uncompressed tensors; fp16: the float16 bucket): count their bytes."""
        import torch.distributed as dist
        orig = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            self._bytes += tensor.numel() * tensor.element_size()
            return orig(tensor, *args, **kwargs)
        dist.all_reduce = counted

    def _timed(self, inner):
        def hook(state, bucket):
            if self._first is None:
                self._first = time.monotonic()
            fut = inner(state, bucket)

            def done(f):
                self._last = time.monotonic()
                return f.value()
            return fut.then(done)
        return hook

    def push_pull(self, step: int, loss: float | None = None) -> None:
        """Record the iteration's comm span and bytes (DDP averaged during backward)."""
        first, last = self._first, self._last
        self.spans_s.append(last - first if first is not None and last is not None else 0.0)
        if self.hook != "dgt":   # dgt's hook all-reduces nothing: the wire's bytes count
            self.allreduced_bytes.append(self._bytes)
        self._first = self._last = None
        self._bytes = 0

    def close(self) -> None:
        """Count tx bytes, then wait for every rank, then stop dgt's sidecar (hook
        ``dgt``: no rank still waits for a PULL then). The process group is not destroyed:
        with a DDP module alive, ``destroy_process_group`` hung on one rank of two
        (torch 2.13, gloo) after the other had returned; the rank exits right after."""
        import torch.distributed as dist
        self.tx1 = _tx_bytes(self.iface) if self.iface else None
        if dist.is_initialized():
            dist.barrier()
        if self.dgt_state is not None:   # every rank has its last PULL: the sidecars stop
            self.dgt_state.close()


# ---------------------------------------------------------------------------- one rank


def rank_main(ns: argparse.Namespace) -> int:
    from dgt.job import train
    torch.set_num_threads(1)
    hook = getattr(ns, "ddp_hook", None)
    from dgt.errors import PeerFailure
    comm = (GlooAllReduce(ns.rank, ns.world, ns.timeout_s, ns.iface) if not hook else
            DDPHook(ns.rank, ns.world, hook, ns.timeout_s, ns.iface, ns.bucket_cap_mb,
                    shlex.split(ns.sidecar_args or "")))
    try:
        result = train(ns, comm=comm)
    except (RuntimeError, PeerFailure) as e:
        print(f"gloo trainer {ns.rank}: job failed: {str(e).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 3
    result["n_params"] = comm.n_params
    if hook:   # DDP averaged inside backward: comm is the hook's span, compute the rest
        result["comm_s"] = comm.spans_s
        result["compute_s"] = [max(0.0, c - s) for c, s in
                               zip(result["compute_s"], comm.spans_s)]
        result["allreduced_bytes"] = comm.allreduced_bytes
    else:
        result["allreduced_bytes"] = [4 * comm.n_params] * len(result["comm_s"])
    result["tx_bytes"] = (comm.tx1 - comm.tx0) if None not in (comm.tx0, comm.tx1) else None
    write_json(ns.result, result)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, as dgt.job does


# ------------------------------------------------------------------------- the launcher


@dataclass
class GlooJob:
    """A whole gloo job. Defaults: those of ``dgt train`` (:class:`dgt.config.JobConfig`)."""
    workers: int = JobConfig.workers
    epochs: int = JobConfig.epochs
    iterations: int = JobConfig.iterations
    eval_every: int = JobConfig.eval_every
    batch_size: int = JobConfig.batch_size
    lr: float = JobConfig.lr
    hidden: int = JobConfig.hidden
    seed: int = JobConfig.seed
    target_accuracy: float = JobConfig.target_accuracy
    model: str = JobConfig.model
    width: float = JobConfig.width
    dataset: str = JobConfig.dataset
    data_dir: str = JobConfig.data_dir
    eval_samples: int = JobConfig.eval_samples
    stop_at_target: bool = False
    ddp_hook: str = ""   # "": one flat all_reduce; none|fp16|powersgd|dgt: DDP with that hook
    bucket_cap_mb: float | None = None   # DDP's buckets (None: DDP's 25 MB)
    sidecar_args: str = ""   # ddp_hook dgt: the sidecars' flags (one shell-quoted string)
    testbed: bool = False
    testbed_prefix: str = JobConfig.testbed_prefix
    timeout_s: float = 60.0
    run_dir: str = ""


def run_gloo(job: GlooJob, log=print, stdout=None) -> tuple[int, dict | None]:
    """Start ``job.workers`` ranks (loopback, or testbed host r's netns with
    ``job.testbed``), wait, and return (exit code, report dict or None).

    Any rank failing stops the others (SIGKILL after 10 s). ``stdout``: where rank 0's
    progress lines go (default: this terminal).
    """
    t0 = time.monotonic()
    own_run_dir = not job.run_dir
    run_dir = job.run_dir or tempfile.mkdtemp(prefix="dgt-gloo-")
    os.makedirs(run_dir, exist_ok=True)
    n = job.workers
    if job.testbed:
        from dgt.tc_profiles import testbed
        if os.geteuid() != 0:
            log("gloo_train: --testbed needs root (network namespaces); run as root, or "
                "drop --testbed to train over loopback")
            return 2, None
        try:
            tb = testbed.current(job.testbed_prefix)
        except testbed.PrefixError as e:
            log(f"gloo_train: {e}")
            return 2, None
        if tb is None or tb.hosts < n:
            log(f"gloo_train: --testbed needs {n} testbed hosts with prefix "
                f"'{job.testbed_prefix}'; run 'dgt testbed up --hosts {n}' first")
            return 2, None
        hosts = [(tb.host_addr(i), ["ip", "netns", "exec", tb.host_netns(i)], "eth0")
                 for i in range(n)]
        master_port = 29500 + os.getpid() % 400
    else:
        from dgt.launch import free_port
        hosts = [("127.0.0.1", [], "lo") for _ in range(n)]
        master_port = free_port()
    env = dict(os.environ, MASTER_ADDR=hosts[0][0], MASTER_PORT=str(master_port),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=hosts[0][2])
    if job.ddp_hook == "dgt":   # the sidecars' files beside the trainers', one job id
        env.update(DGT_RUN_DIR=run_dir,
                   TORCHELASTIC_RUN_ID=f"gloo-train-{os.getpid()}-{master_port}")
    log(f"gloo_train: {n} workers, gloo "
        f"{'DDP, hook ' + job.ddp_hook if job.ddp_hook else 'all_reduce'}, model "
        f"{job.model}, "
        f"{'testbed' if job.testbed else 'loopback'}; logs in {run_dir}")
    procs = []
    for r in range(n):
        argv = hosts[r][1] + [
            *module_argv("dgt.tools.gloo_train"), "--rank", str(r), "--world", str(n),
            "--result", os.path.join(run_dir, f"trainer-{r}.json"),
            "--epochs", str(job.epochs), "--iterations", str(job.iterations),
            "--eval-every", str(job.eval_every),
            "--batch-size", str(job.batch_size), "--lr", str(job.lr),
            "--hidden", str(job.hidden), "--seed", str(job.seed),
            "--target-accuracy", str(job.target_accuracy), "--timeout-s", str(job.timeout_s),
            "--model", job.model, "--width", str(job.width), "--dataset", job.dataset,
            "--data-dir", job.data_dir, "--eval-samples", str(job.eval_samples)]
        if job.stop_at_target:
            argv.append("--stop-at-target")
        if job.ddp_hook:
            argv += ["--ddp-hook", job.ddp_hook]
        if job.bucket_cap_mb is not None:
            argv += ["--bucket-cap-mb", str(job.bucket_cap_mb)]
        if job.sidecar_args:
            argv += ["--sidecar-args", job.sidecar_args]
        if hosts[r][2] != "lo":
            argv += ["--iface", hosts[r][2]]
        logf = open(os.path.join(run_dir, f"trainer-{r}.log"), "wb")
        out = (stdout if stdout is not None else None) if r == 0 else logf
        # a launcher stopped by a signal (dgt bench on SIGTERM) takes its workers along
        procs.append(subprocess.Popen(argv, stdout=out, stderr=logf, env=env,
                                      start_new_session=True, preexec_fn=functools.partial(
                                          die_with_parent, os.getpid())))
        logf.close()
    failure, fail_at = None, None
    try:
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                if failure is None and p.returncode not in (None, 0):
                    failure = f"rank {r} exited with status {p.returncode}"
                    fail_at = time.monotonic()
            if fail_at is not None and time.monotonic() - fail_at > 10:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
            p.wait()
    for r, p in enumerate(procs):
        if failure is None and p.returncode != 0:
            failure = f"rank {r} exited with status {p.returncode}"
    if failure:
        log(f"gloo_train: failed: {failure}; logs kept in {run_dir}")
        return 1, None
    report = build_report(run_dir, job, time.monotonic() - t0)
    if own_run_dir:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0, report


def build_report(run_dir: str, job: GlooJob, wall_s: float) -> dict:
    ranks = []
    for r in range(job.workers):
        with open(os.path.join(run_dir, f"trainer-{r}.json")) as f:
            ranks.append(json.load(f))
    t0 = ranks[0]
    comm = np.array(t0["comm_s"]) * 1e3
    iters = t0["iterations"]
    tx = [t.get("tx_bytes") for t in ranks]
    wire = (float(np.mean(tx)) / iters if iters and all(x is not None for x in tx)
            else None)
    shas = [t["param_sha256"] for t in ranks]
    # ring model: reduce-scatter sends (N-1)/N of what is all-reduced (the push), the
    # all-gather as much again (the pull)
    share = (job.workers - 1) / job.workers
    allreduced = t0.get("allreduced_bytes") or []
    dgt_hook = job.ddp_hook == "dgt"   # nothing all-reduced: the wire's bytes only
    compute = t0.get("compute_s") or []
    return {
        "mode": MODE if not job.ddp_hook else f"{MODE}-ddp-{job.ddp_hook}",
        "workload": t0.get("workload"),
        "compute_ms_median": float(np.median(compute)) * 1e3 if compute else None,
        "push_bytes_per_iteration": share * float(np.mean(allreduced)) if allreduced else None,
        "pull_bytes_per_iteration": share * float(np.mean(allreduced)) if allreduced else None,
        "bytes_source": ("the wire: wire_tx_bytes_per_iteration, each host's tx bytes "
                         "(push and PULLs, not split)" if dgt_hook else
                         "ring model: (N-1)/N of the bytes all-reduced, each direction"),
        "workers": job.workers,
        "iterations": iters,
        "final_test_accuracy": t0["final_test_accuracy"],
        "wall_seconds": wall_s,
        "train_seconds": max(t["train_seconds"] for t in ranks),
        # the slowest rank's register() (init_process_group): inside train_seconds
        "register_seconds": max(t.get("register_seconds", 0.0) for t in ranks),
        "comm_ms_median": float(np.median(comm)),
        "comm_ms_p95": float(np.percentile(comm, 95)),
        "comm_ms": [float(x) for x in comm],
        "target_accuracy": job.target_accuracy,
        "target_reached": t0["target_reached"],
        "replicas_identical": len(set(shas)) == 1,
        "param_sha256": shas,
        "n_params": t0["n_params"],
        "gradient_bytes": 4 * t0["n_params"],
        "bytes_per_iteration": (wire if dgt_hook else
                                2 * share * float(np.mean(allreduced)) if allreduced else
                                ring_bytes_per_iteration(t0["n_params"], job.workers)),
        "wire_tx_bytes_per_iteration": wire,
        "channels": {},
        "history": t0["history"],
        "config": {"job": job.__dict__.copy()},
    }


def print_summary(r: dict, log=print) -> None:
    """The gloo baseline's summary: dgt train's rows (``dgt.report.summary_head``), then
    its own traffic model."""
    summary_head(r, log)
    summary_comm(r, log)
    wire = r["wire_tx_bytes_per_iteration"]
    if r["push_bytes_per_iteration"] is None:   # nothing all-reduced: the wire tells
        summary_row("MB/iteration/node", f"{wire / 1e6:.2f} on the wire" if wire else
                    "not counted (loopback: one interface for every rank)", log)
    else:
        summary_row("MB/iteration/node", f"{r['bytes_per_iteration'] / 1e6:.2f} (ring "
                    f"model)" + (f", {wire / 1e6:.2f} on the wire" if wire else ""), log)
    summary_row("replicas identical", r["replicas_identical"], log)


def main(argv: list[str] | None = None) -> int:
    from dgt.config import OneLineParser
    p = OneLineParser(
        prog="python -m dgt.tools.gloo_train",
        description="The gloo all_reduce baseline of 'dgt train': the same training loop. "
                    "Without --rank: launch --workers ranks and write --report. With "
                    "--rank: be one rank (MASTER_ADDR/MASTER_PORT from the environment).")
    p.add_argument("--rank", type=int, help="be this rank (needs --world, --result)")
    p.add_argument("--world", type=int)
    p.add_argument("--result", help="with --rank: write this rank's result JSON here")
    p.add_argument("--iface", help="with --rank: count tx bytes on this interface")
    p.add_argument("--workers", type=int, default=JobConfig.workers)
    p.add_argument("--testbed", action="store_true",
                   help="one rank per testbed host (root; 'dgt testbed up' first)")
    p.add_argument("--testbed-prefix", default=JobConfig.testbed_prefix,
                   help="with --testbed: the testbed's name prefix")
    p.add_argument("--ddp-hook", choices=HOOKS, default=None,
                   help="DDP over gloo with this comm hook instead of one flat all_reduce: "
                        "none (DDP's all-reduce), fp16 (fp16_compress_hook), powersgd "
                        "(powerSGD_hook, rank 1, from iteration 10, one bucket), dgt "
                        "(dgt.ddp.dgt_hook: each bucket pushed to a dgt sidecar per rank "
                        "during backward)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="with --ddp-hook: DDP's bucket size in MB (default DDP's 25; "
                        "PowerSGD always gets one bucket)")
    p.add_argument("--sidecar-args", default="",
                   help="with --ddp-hook dgt: the sidecars' flags, one quoted string "
                        "(e.g. '--mode dgt --pace-mbit 1000')")
    p.add_argument("--report", default="", help="write the JSON report here")
    p.add_argument("--run-dir", default="", help="keep logs and per-rank results here")
    from dgt.job import add_loop_arguments
    add_loop_arguments(p)
    ns = p.parse_args(argv)
    if ns.bucket_cap_mb is not None and not (ns.ddp_hook and 0 < ns.bucket_cap_mb < 1e6):
        p.error(f"--bucket-cap-mb {ns.bucket_cap_mb:g}: give a size > 0 MB, with --ddp-hook")
    if ns.sidecar_args and ns.ddp_hook != "dgt":
        p.error("--sidecar-args goes with --ddp-hook dgt")
    try:
        shlex.split(ns.sidecar_args)
    except ValueError as e:
        p.error(f"--sidecar-args {ns.sidecar_args!r}: {e}")
    if ns.rank is not None:
        if ns.world is None or not ns.result:
            p.error("--rank needs --world and --result")
        ns.device = "cpu"
        return rank_main(ns)
    from dgt.tc_profiles.testbed import PrefixError, check_prefix
    try:
        check_prefix(ns.testbed_prefix, "--testbed-prefix")
    except PrefixError as e:
        p.error(str(e))
    from dgt import outpath
    why = outpath.foreign(ns.report, "json") if ns.report else None
    if why is not None:   # before the training, not after it
        p.error(f"--report {ns.report}: {why}")
    job = GlooJob(workers=ns.workers, epochs=ns.epochs, iterations=ns.iterations,
                  eval_every=ns.eval_every,
                  batch_size=ns.batch_size, lr=ns.lr, hidden=ns.hidden, seed=ns.seed,
                  target_accuracy=ns.target_accuracy, model=ns.model, width=ns.width,
                  dataset=ns.dataset, data_dir=ns.data_dir, eval_samples=ns.eval_samples,
                  stop_at_target=ns.stop_at_target, ddp_hook=ns.ddp_hook or "",
                  bucket_cap_mb=ns.bucket_cap_mb, sidecar_args=ns.sidecar_args,
                  testbed=ns.testbed,
                  testbed_prefix=ns.testbed_prefix,
                  timeout_s=ns.timeout_s, run_dir=ns.run_dir)
    code, report = run_gloo(job)
    if report is None:
        return code
    print_summary(report)
    if ns.report:
        write_json(ns.report, report, indent=1, fsync=True)
        print(f"report: {ns.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The training job run by each trainer process of ``dgt train``.

Workload (``dgt.workloads``): ``--model`` on ``--dataset``, the training set split over the
workers by ``--partition``, optimiser Adam. Default: an MLP 64 -> H -> H -> 10 (H = 1024:
1.13M parameters) on the UCI handwritten digits that scikit-learn ships (1,797 8x8
images, 10 classes, stratified 80/20 split), IID.

Algorithms (``--algo``):

- ``bsp``: each iteration every worker takes ``batch_size`` samples of its share, pushes
  its gradient, and every replica applies the same aggregate (mean gradient);
- ``fedavg``: each worker takes ``local_steps`` (H) optimiser steps on its own data, then
  pushes its model delta ``w0 - w`` (:class:`dgt.workloads.fedavg.FedAvgRound`) and every
  replica sets ``w = w0 - mean delta``. A round also ends at the end of an epoch, so an
  evaluation always sees identical replicas. Iterations count local steps.

Test accuracy is measured on the whole test split (never trained on) at every epoch's
end and every ``--eval-every`` iterations (FedAvg: at the first round end after each).
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import logging
import os
import signal
import sys
import time
import traceback

import numpy as np
import torch
from torch import nn

from . import checkpoint, failure, records
from .client import Client
from .config import CheckpointConfig, JobConfig
from .errors import PeerFailure, one_line
from .failure import FailureReason
from .partial_step import PartialStep

log = logging.getLogger("dgt.job")
EVAL_BATCH = 1000   # test samples per forward pass when evaluating


def load_digits_split(seed: int):
    """(x_train, y_train, x_test, y_test): float32 (n, 64) scaled to [0, 1], int64 (n,)."""
    from .workloads.datasets import load_digits
    d = load_digits(seed)
    return d.x_train.reshape(-1, 64), d.y_train, d.x_test.reshape(-1, 64), d.y_test


def make_model(hidden: int, seed: int) -> nn.Module:
    """The digits MLP, initialised identically on every rank from ``seed``."""
    from .workloads.models import build
    return build("mlp", (1, 8, 8), 10, hidden=hidden, seed=seed)


def param_sha256(model: nn.Module) -> str:
    """SHA-256 over every parameter's float32 bytes, in ``parameters()`` order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` on (x, y), in eval mode (dropout off), in batches of
    ``EVAL_BATCH``; the model is back in train mode after."""
    model.eval()
    try:   # no autograd graph: the same forward, less time and memory
        with torch.inference_mode():
            correct = sum(int((model(x[i:i + EVAL_BATCH]).argmax(1) ==
                               y[i:i + EVAL_BATCH]).sum())
                          for i in range(0, len(x), EVAL_BATCH))
    finally:
        model.train()
    return correct / max(1, len(x))


def _ns(ns, name):
    return getattr(ns, name, getattr(JobConfig, name))


def check_workload(job: JobConfig) -> list[str]:
    """Before any process starts: the dataset's files load, and the partition can give
    every worker data. Raises ValueError (a ``DatasetError`` too) with one line.
    Returns warnings, one line each: a dataset that is not the whole published one
    (:meth:`Dataset.subset_note`; breaker round 24's CIFAR-10 of 100 images a batch
    trained to 0.08 without a word)."""
    from .config import fit_advice
    from .workloads import datasets, partition
    if job.dataset == "digits":
        if job.partition != "iid":
            partition.check(job.partition, datasets.load_digits(job.seed).y_train.numpy(),
                            job.workers)
        return []
    data = datasets.load(job.dataset, job.data_dir, job.seed)
    n = len(data.y_train)
    if job.workers * job.batch_size > n:
        raise ValueError(f"--workers {job.workers} x --batch-size {job.batch_size} "
                         f"exceeds the {n} training samples in {data.source}; "
                         f"{fit_advice(n, job.workers, job.batch_size)}")
    partition.check(job.partition, data.y_train.numpy(), job.workers)
    note = data.subset_note()
    return [note] if note else []


def workload_description(ns, data, model) -> dict:
    """The report's ``workload``: model, parameters, dataset, partition, algorithm."""
    from .workloads.models import gradient_bytes, uses_torchvision_definition
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fed = _ns(ns, "algo") == "fedavg"
    return {"model": _ns(ns, "model"), "width": _ns(ns, "width"),
            "hidden": ns.hidden if _ns(ns, "model") == "mlp" else None, "params": n,
            "gradient_bytes": gradient_bytes(n),
            "torchvision_definition": uses_torchvision_definition(
                _ns(ns, "model"), data.shape, _ns(ns, "width")),
            **data.describe(), "partition": _ns(ns, "partition"), "algo": _ns(ns, "algo"),
            "local_steps": _ns(ns, "local_steps") if fed else None,
            "optimizer": "Adam", "lr": ns.lr, "batch_size": ns.batch_size,
            "eval_samples": _ns(ns, "eval_samples") or len(data.y_test)}


def train(ns: argparse.Namespace, comm=None) -> dict:
    """Run the loop; return this rank's result dict. Raises PeerFailure.

    ``comm``: what averages the gradients; anything with ``register(model)``,
    ``push_pull(step, loss)`` (replaces every ``p.grad`` with the mean over workers),
    ``close()`` and ``last_k``. Default: a :class:`dgt.Client` on ``ns.socket``. The
    gloo baseline (``dgt.tools.gloo_train``) passes its all-reduce here, so both run
    this very loop. ``ns.iterations`` > 0 stops after that many iterations (the last
    epoch may be partial; it is evaluated all the same). ``ns.eval_every`` > 0 also
    evaluates test accuracy every that many iterations (more points in ``history``,
    finer time-to-accuracy). Workload flags absent from ``ns`` take JobConfig's defaults.
    """
    from .workloads import datasets, models, partition
    from .workloads.fedavg import FedAvgRound
    device = torch.device(ns.device)
    torch.set_num_threads(1)
    data = datasets.load(_ns(ns, "dataset"), _ns(ns, "data_dir"), ns.seed)
    xtr, ytr = data.x_train.to(device), data.y_train.to(device)
    n_eval = _ns(ns, "eval_samples") or len(data.y_test)
    xte, yte = data.x_test[:n_eval].to(device), data.y_test[:n_eval].to(device)
    model = models.build(_ns(ns, "model"), data.shape, data.classes, _ns(ns, "width"),
                         ns.hidden, seed=ns.seed).to(device)
    workload = workload_description(ns, data, model)
    ylab = data.y_train.numpy()
    parts = partition.split(_ns(ns, "partition"), ylab, ns.world, ns.seed)
    sampler = partition.Sampler(parts, len(ylab), ns.world, ns.rank, ns.batch_size, ns.seed)
    aug = torch.Generator().manual_seed(ns.seed * 1000003 + ns.rank) if data.augment else None
    opt = torch.optim.Adam(model.parameters(), lr=ns.lr)
    loss_fn = nn.CrossEntropyLoss()
    client = comm if comm is not None else Client(ns.socket, timeout_s=ns.timeout_s)
    max_iterations = int(getattr(ns, "iterations", 0) or 0)
    eval_every = int(getattr(ns, "eval_every", 0) or 0)
    fedavg = _ns(ns, "algo") == "fedavg"
    local_steps = _ns(ns, "local_steps") if fedavg else 1
    stop_at_target = bool(_ns(ns, "stop_at_target"))
    ckpt_every = int(getattr(ns, "checkpoint_every", 0) or 0)
    ckpt_dir = getattr(ns, "checkpoint_dir", "") or ""
    resume = getattr(ns, "resume", "") or ""
    t_start = time.monotonic()
    comm_s: list[float] = []
    compute_s: list[float] = []   # per iteration: batch, forward and backward (seconds)
    # per iteration: this process's CPU (all its threads, user + system, seconds) from
    # the batch to the optimiser step done (evaluations not included)
    cpu_s: list[float] = []
    comm_at: list[tuple[float, float]] = []   # (push, pull) on CLOCK_MONOTONIC: host-wide
    stepped_at: list[float] = []
    history = []
    reached = None
    step = rounds = 0
    evaluated_at = 0        # iteration of the last evaluation
    eval_s = 0.0            # seconds spent evaluating so far (in every "seconds" below)
    first_epoch = skip = 0  # where a resumed run picks up: epoch, batches done in it
    resumed_losses: list[float] = []
    warnings: list[str] = []   # one line each: a checkpoint file not written
    if resume:   # before register(): the sidecars compare the parameters' SHA-256
        st = checkpoint.load(checkpoint.trainer_file(resume, ns.rank), writer="dgt train")
        if (st["rank"], st["world"]) != (ns.rank, ns.world):
            raise ValueError(f"--resume {resume}: the checkpoint is of rank {st['rank']} "
                             f"of {st['world']}; resume with the same --workers")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        torch.set_rng_state(st["rng"])
        if aug is not None:
            aug.set_state(st["aug"])
        step, rounds, evaluated_at = st["step"], st["rounds"], st["evaluated_at"]
        first_epoch, skip, resumed_losses = st["epoch"], st["index"], st["losses"]
        history, reached = st["history"], st["reached"]
        comm_s, comm_at = st["comm_s"], [tuple(x) for x in st["comm_at"]]
        t_start -= st["seconds"]
        eval_s = float(st.get("eval_seconds", 0.0))
    t_register = time.monotonic()
    if resume:
        client.register(model, resume=checkpoint.sidecar_file(resume, ns.rank))
    else:
        client.register(model)
    register_s = time.monotonic() - t_register
    fed = FedAvgRound(model, client) if fedavg else None
    # PULLs pipelined per shard range (dgt.Client.push_pull's ready): our Client only
    pipelined = bool(_ns(ns, "pipeline_pulls")) and isinstance(client, Client) \
        and not fedavg
    partial = PartialStep(opt)
    pipelined_its = 0
    # a comm that hooks into the model's backward (the DDP baselines of dgt bench tta,
    # dgt.tools.gloo_train) gives the module to run forward through
    forward = client.wrap(model) if hasattr(client, "wrap") else model
    iters_per_epoch = sampler.iterations
    saved_at = step         # iteration of the last checkpoint
    stop = False

    def save_checkpoint(epoch: int, index: int, losses: list[float]) -> None:
        """After ``step`` iterations (between two, every replica alike): the sidecar's
        state, then ours, then both files' SHA-256 (dgt.checkpoint.seal); rank 0 prunes
        old steps. A file that cannot be written (a full disk, EIO) leaves this step
        incomplete (this rank's files removed: checkpoint.discard) and is one line in
        ``warnings``; training goes on."""
        folder = path = checkpoint.step_dir(ckpt_dir, step)
        try:
            os.makedirs(folder, exist_ok=True)
            path = checkpoint.sidecar_file(folder, ns.rank)
            if hasattr(client, "save_state"):
                client.save_state(path)
            path = checkpoint.trainer_file(folder, ns.rank)
            checkpoint.save({"format": checkpoint.FORMAT, "writer": "dgt train",
                             "rank": ns.rank, "world": ns.world,
                             "step": step, "rounds": rounds, "epoch": epoch,
                             "index": index, "epoch_iterations": iters_per_epoch,
                             "evaluated_at": evaluated_at,
                             "losses": list(losses),
                             "model": model.state_dict(), "optimizer": opt.state_dict(),
                             "rng": torch.get_rng_state(),
                             "aug": aug.get_state() if aug is not None else None,
                             "flags": checkpoint.run_flags(ns),
                             "history": history, "reached": reached, "comm_s": comm_s,
                             "comm_at": comm_at, "seconds": time.monotonic() - t_start,
                             "eval_seconds": eval_s}, path)
            path = checkpoint.digest_file(folder, ns.rank)   # their SHA-256, last
            checkpoint.seal(folder, ns.rank, sidecar=hasattr(client, "save_state"))
        except OSError as e:
            checkpoint.discard(folder, ns.rank)
            warnings.append(checkpoint.not_written(path, e))
            log.warning("%s", warnings[-1])
        if ns.rank == 0:   # never the newest complete step (checkpoint.prune)
            checkpoint.prune(ckpt_dir, ns.world, writing=step)

    def evaluate(epoch, losses):
        nonlocal reached, evaluated_at, eval_s
        t_eval = time.monotonic()
        acc = accuracy(model, xte, yte)
        eval_s += time.monotonic() - t_eval
        elapsed = time.monotonic() - t_start
        evaluated_at = step
        history.append({"epoch": epoch + 1, "iteration": step, "round": rounds,
                        "loss": float(np.mean(losses)) if losses else float("nan"),
                        "test_accuracy": acc, "seconds": elapsed, "eval_seconds": eval_s,
                        "k": client.last_k})
        if reached is None and acc >= ns.target_accuracy:
            reached = {"iteration": step, "round": rounds, "seconds": elapsed,
                       "eval_seconds": eval_s}
        return acc

    for epoch in range(first_epoch, ns.epochs):
        losses = list(resumed_losses) if epoch == first_epoch else []
        round_losses = []
        for i, idx in enumerate(sampler.epoch(epoch)):
            if max_iterations and step >= max_iterations:
                break
            if epoch == first_epoch and i < skip:   # done before the checkpoint
                continue
            t_batch, cpu_batch = time.monotonic(), time.process_time()
            idx = idx.to(device)
            xb = xtr[idx]
            if aug is not None:
                xb = datasets.augment(xb, aug)
            if fed is not None and not round_losses:
                fed.start()
            loss = loss_fn(forward(xb), ytr[idx])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            loss_value = loss.item()
            compute_s.append(time.monotonic() - t_batch)
            last = i == iters_per_epoch - 1 or bool(max_iterations and
                                                    step + 1 >= max_iterations)
            if fed is None:
                t0 = time.monotonic()
                if pipelined:   # each shard's parameters stepped as its PULL lands
                    client.push_pull(step, loss=loss_value, ready=partial.step)
                    pipelined_its += 1
                    t1 = time.monotonic()   # the steps are inside push_pull
                else:
                    client.push_pull(step, loss=loss_value)
                    t1 = time.monotonic()
                    opt.step()
                comm_s.append(t1 - t0)
                comm_at.append((t0, t1))
                stepped_at.append(time.monotonic())
                rounds += 1
                synced = True
            else:
                opt.step()
                round_losses.append(loss_value)
                synced = len(round_losses) == local_steps or last
                if synced:
                    t0 = time.monotonic()
                    fed.finish(rounds, loss=float(np.mean(round_losses)))
                    t1 = time.monotonic()
                    comm_s.append(t1 - t0)
                    comm_at.append((t0, t1))
                    rounds += 1
                    round_losses = []
            cpu_s.append(time.process_time() - cpu_batch)
            losses.append(loss_value)
            step += 1
            if eval_every and synced and not last and step // eval_every > \
                    evaluated_at // eval_every:
                acc = evaluate(epoch, losses)
                if ns.rank == 0:   # long epochs show progress at every evaluation
                    print(f"           iter {_count(step, max_iterations)}  loss "
                          f"{np.mean(losses):.4f}  test acc "
                          f"{acc:.4f}  {history[-1]['seconds']:.1f} s", flush=True)
                if stop_at_target and acc >= ns.target_accuracy:
                    stop = True
                    break
            if ckpt_every and synced and step // ckpt_every > saved_at // ckpt_every:
                save_checkpoint(epoch, i + 1, losses)
                saved_at = step
        if not stop:
            acc = evaluate(epoch, losses)
            stop = stop_at_target and acc >= ns.target_accuracy
        if ns.rank == 0:
            recent = comm_s[-max(1, iters_per_epoch // local_steps):]
            print(f"epoch {epoch + 1:3d}/{ns.epochs}  iter {_count(step, max_iterations)}  loss "
                  f"{np.mean(losses):.4f}  test acc {history[-1]['test_accuracy']:.4f}  "
                  f"comm median {1e3 * float(np.median(recent)):.1f} ms  "
                  f"k {_fmt_k(client.last_k)}  {history[-1]['seconds']:.1f} s", flush=True)
        if stop or (max_iterations and step >= max_iterations):
            break
    client.close()
    return {"rank": ns.rank, "iterations": step, "rounds": rounds,
            "final_test_accuracy": history[-1]["test_accuracy"],
            "history": history, "param_sha256": param_sha256(model), "comm_s": comm_s,
            "compute_s": compute_s, "cpu_s": cpu_s,
            # CLOCK_MONOTONIC when each BSP iteration's optimiser step had finished
            # (dgt.tools.bench_pipeline: push to step done)
            "stepped_at": stepped_at,
            # PULLs pipelined: optimiser steps on parts of the model (one per group of
            # parameters a shard's PULL completed), per iteration; 1 when not pipelined
            "steps_per_iteration": (partial.calls / pipelined_its if pipelined_its
                                    else 1.0),
            "comm_at": comm_at, "workload": workload,
            "class_histograms": partition.class_histograms(parts, ylab, ns.world,
                                                           data.classes),
            "train_seconds": time.monotonic() - t_start, "target_reached": reached,
            # register() alone (the sidecars' or gloo's rendezvous), inside train_seconds
            "register_seconds": register_s,
            "device": str(device), "warnings": warnings}


def _fmt_k(k) -> str:
    return "-" if k is None else f"{k:.2f}"


def _count(step: int, max_iterations: int) -> str:
    """The progress lines' iteration count: ``12/12`` when ``--iterations`` caps the
    job (so 'epoch 1/10' that ends the job reads as the cap, not an early stop)."""
    return f"{step:5d}/{max_iterations}" if max_iterations else f"{step:5d}"


def add_loop_arguments(p: argparse.ArgumentParser) -> None:
    """The training-loop flags shared by this trainer and the gloo baseline; defaults
    from :class:`~dgt.config.JobConfig`."""
    p.add_argument("--epochs", type=int, default=JobConfig.epochs)
    p.add_argument("--iterations", type=int, default=JobConfig.iterations)
    p.add_argument("--eval-every", type=int, default=JobConfig.eval_every)
    p.add_argument("--batch-size", type=int, default=JobConfig.batch_size)
    p.add_argument("--lr", type=float, default=JobConfig.lr)
    p.add_argument("--hidden", type=int, default=JobConfig.hidden)
    p.add_argument("--model", default=JobConfig.model)
    p.add_argument("--width", type=float, default=JobConfig.width)
    p.add_argument("--dataset", default=JobConfig.dataset)
    p.add_argument("--data-dir", default=JobConfig.data_dir)
    p.add_argument("--partition", default=JobConfig.partition)
    p.add_argument("--algo", default=JobConfig.algo)
    p.add_argument("--local-steps", type=int, default=JobConfig.local_steps)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--no-pipeline-pulls", dest="pipeline_pulls", action="store_false")
    p.add_argument("--eval-samples", type=int, default=JobConfig.eval_samples)
    p.add_argument("--seed", type=int, default=JobConfig.seed)
    p.add_argument("--target-accuracy", type=float, default=JobConfig.target_accuracy)
    p.add_argument("--timeout-s", type=float, default=60.0)


def exception_line(e: BaseException) -> str:
    """``e`` as the last line of its traceback says it (``RuntimeError: boom``; a
    chained exception's outermost one), made one line of at most 300 characters: a
    message of many lines, or an exception whose ``str()`` fails, too."""
    return one_line("".join(traceback.format_exception_only(type(e), e)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.job",
                                description="One trainer of 'dgt train' (started by it).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--socket", required=True, help="the node sidecar's Unix socket")
    p.add_argument("--result", required=True, help="write this rank's result JSON here")
    add_loop_arguments(p)
    p.add_argument("--device", default=JobConfig.device)
    p.add_argument("--checkpoint-every", type=int,
                   default=CheckpointConfig.checkpoint_every,
                   help="save a checkpoint every this many iterations (dgt.checkpoint)")
    p.add_argument("--checkpoint-dir", default="", help="...under this folder")
    p.add_argument("--resume", default="", help="a complete step folder to resume from")
    ns = p.parse_args(argv)
    # SIGINT as SIGTERM: the default action, no KeyboardInterrupt traceback (dgt train
    # starts us with it ignored until here: dgt.launch._child_setup)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    logging.basicConfig(level=logging.WARNING)
    from .console import survive_closed_stdout
    survive_closed_stdout()   # rank 0 prints to the user's stdout, which may close
    faulthandler.enable()   # a crash in native code leaves its Python stack in the log
    try:
        result = train(ns)
    except PeerFailure as e:
        # no rank: our own sidecar (gone, silent), which the message names itself
        who = f" (rank {e.rank})" if e.rank is not None else ""
        print(f"dgt trainer {ns.rank}: job failed{who}: {e}", file=sys.stderr, flush=True)
        # the sidecar's failure relayed (its error line, or a rank named): blaming whom it
        # blames, maybe nobody; else our own sidecar (gone, silent) is at fault
        relayed = e.rank is not None or e.reason is FailureReason.PEER_REPORTED
        failure.write(os.path.dirname(os.path.abspath(ns.result)), failure.FailureRecord(
            "trainer", ns.rank,
            FailureReason.PEER_REPORTED if relayed else FailureReason.OTHER,
            str(e), e.ranks if relayed else [ns.rank]))
        return 3
    except Exception as e:
        # our own code raised (e.g. the optimiser's overflow at --lr 1e300): record its
        # one line before the interpreter prints the traceback and our socket closes, so
        # the record is older than our sidecar's "disconnected" and the launcher's
        # headline quotes the exception, not the disconnect (an outside tester)
        failure.write(os.path.dirname(os.path.abspath(ns.result)), failure.FailureRecord(
            "trainer", ns.rank, FailureReason.RAISED, exception_line(e), [ns.rank]))
        raise
    try:   # a full run dir keeps the result in the spill folder (dgt.records)
        records.write(ns.result, result)
    except OSError as e:
        print(f"dgt trainer {ns.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    from .process import exit_now
    exit_now(0)  # skip interpreter teardown (torch/sklearn take ~1.5 s to unload)


if __name__ == "__main__":
    sys.exit(main())

"""The training job run by each trainer process of ``dgt train``.

Data: the UCI handwritten digits that scikit-learn ships (1,797 8x8 images, 10 classes;
``sklearn.datasets.load_digits``), stratified 80/20 train/test split. Model: an MLP
64 -> H -> H -> 10 (H = 1024: 1.13M parameters). Optimiser: Adam. BSP data parallelism:
each iteration every worker takes ``batch_size`` samples of its own shard of a per-epoch
shuffle and pushes its gradient; all replicas apply the same aggregate.
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import sys
import time

import numpy as np
import torch
from torch import nn

from .client import Client
from .config import JobConfig
from .errors import PeerFailure

log = logging.getLogger("dgt.job")


def load_digits_split(seed: int):
    """(x_train, y_train, x_test, y_test): float32 (n, 64) scaled to [0, 1], int64 (n,)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y,
                                          random_state=seed)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def make_model(hidden: int, seed: int) -> nn.Module:
    """The MLP, initialised identically on every rank from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, 10))


def param_sha256(model: nn.Module) -> str:
    """SHA-256 over every parameter's float32 bytes, in ``parameters()`` order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def train(ns: argparse.Namespace, comm=None) -> dict:
    """Run the loop; return this rank's result dict. Raises PeerFailure.

    ``comm``: what averages the gradients; anything with ``register(model)``,
    ``push_pull(step, loss)`` (replaces every ``p.grad`` with the mean over workers),
    ``close()`` and ``last_k``. Default: a :class:`dgt.Client` on ``ns.socket``. The
    gloo baseline (``dgt.tools.gloo_train``) passes its all-reduce here, so both run
    this very loop. ``ns.iterations`` > 0 stops after that many iterations (the last
    epoch may be partial; it is evaluated all the same). ``ns.eval_every`` > 0 also
    evaluates test accuracy every that many iterations (more points in ``history``,
    finer time-to-accuracy).
    """
    device = torch.device(ns.device)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_digits_split(ns.seed)
    xtr, ytr, xte, yte = xtr.to(device), ytr.to(device), xte.to(device), yte.to(device)
    model = make_model(ns.hidden, ns.seed).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=ns.lr)
    loss_fn = nn.CrossEntropyLoss()
    client = comm if comm is not None else Client(ns.socket, timeout_s=ns.timeout_s)
    max_iterations = int(getattr(ns, "iterations", 0) or 0)
    eval_every = int(getattr(ns, "eval_every", 0) or 0)
    t_start = time.monotonic()
    client.register(model)
    per_iter = ns.world * ns.batch_size
    iters_per_epoch = max(1, len(xtr) // per_iter)
    comm_s: list[float] = []
    comm_at: list[tuple[float, float]] = []   # (push, pull) on CLOCK_MONOTONIC: host-wide
    history = []
    reached = None
    step = 0
    for epoch in range(ns.epochs):
        g = torch.Generator().manual_seed(ns.seed * 100003 + epoch)
        perm = torch.randperm(len(xtr), generator=g).to(device)
        losses = []
        for i in range(iters_per_epoch):
            if max_iterations and step >= max_iterations:
                break
            lo = i * per_iter + ns.rank * ns.batch_size
            idx = perm[lo:lo + ns.batch_size]
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            loss_value = loss.item()
            t0 = time.monotonic()
            client.push_pull(step, loss=loss_value)
            t1 = time.monotonic()
            comm_s.append(t1 - t0)
            comm_at.append((t0, t1))
            opt.step()
            losses.append(loss_value)
            step += 1
            last = i == iters_per_epoch - 1 or (max_iterations and step >= max_iterations)
            if eval_every and step % eval_every == 0 and not last:
                acc = accuracy(model, xte, yte)
                elapsed = time.monotonic() - t_start
                history.append({"epoch": epoch + 1, "iteration": step,
                                "loss": float(np.mean(losses)), "test_accuracy": acc,
                                "seconds": elapsed, "k": client.last_k})
                if reached is None and acc >= ns.target_accuracy:
                    reached = {"iteration": step, "seconds": elapsed}
        acc = accuracy(model, xte, yte)
        elapsed = time.monotonic() - t_start
        history.append({"epoch": epoch + 1, "iteration": step, "loss": float(np.mean(losses)),
                        "test_accuracy": acc, "seconds": elapsed, "k": client.last_k})
        if reached is None and acc >= ns.target_accuracy:
            reached = {"iteration": step, "seconds": elapsed}
        if ns.rank == 0:
            print(f"epoch {epoch + 1:3d}/{ns.epochs}  iter {step:5d}  loss "
                  f"{np.mean(losses):.4f}  test acc {acc:.4f}  comm median "
                  f"{1e3 * float(np.median(comm_s[-iters_per_epoch:])):.1f} ms  "
                  f"k {_fmt_k(client.last_k)}  {elapsed:.1f} s", flush=True)
        if max_iterations and step >= max_iterations:
            break
    client.close()
    return {"rank": ns.rank, "iterations": step, "final_test_accuracy": history[-1]["test_accuracy"],
            "history": history, "param_sha256": param_sha256(model), "comm_s": comm_s,
            "comm_at": comm_at,
            "train_seconds": time.monotonic() - t_start, "target_reached": reached,
            "device": str(device)}


def _fmt_k(k) -> str:
    return "-" if k is None else f"{k:.2f}"


def add_loop_arguments(p: argparse.ArgumentParser) -> None:
    """The training-loop flags shared by this trainer and the gloo baseline; defaults
    from :class:`~dgt.config.JobConfig`."""
    p.add_argument("--epochs", type=int, default=JobConfig.epochs)
    p.add_argument("--iterations", type=int, default=JobConfig.iterations)
    p.add_argument("--eval-every", type=int, default=JobConfig.eval_every)
    p.add_argument("--batch-size", type=int, default=JobConfig.batch_size)
    p.add_argument("--lr", type=float, default=JobConfig.lr)
    p.add_argument("--hidden", type=int, default=JobConfig.hidden)
    p.add_argument("--seed", type=int, default=JobConfig.seed)
    p.add_argument("--target-accuracy", type=float, default=JobConfig.target_accuracy)
    p.add_argument("--timeout-s", type=float, default=60.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.job",
                                description="One trainer of 'dgt train' (started by it).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--socket", required=True, help="the node sidecar's Unix socket")
    p.add_argument("--result", required=True, help="write this rank's result JSON here")
    add_loop_arguments(p)
    p.add_argument("--device", default=JobConfig.device)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    faulthandler.enable()   # a crash in native code leaves its Python stack in the log
    try:
        result = train(ns)
    except PeerFailure as e:
        who = f"rank {e.rank}" if e.rank is not None else "a peer"
        print(f"dgt trainer {ns.rank}: job failed ({who}): {e}", file=sys.stderr, flush=True)
        return 3
    tmp = ns.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, ns.result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (torch/sklearn take ~1.5 s to unload)


if __name__ == "__main__":
    sys.exit(main())

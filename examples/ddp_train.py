"""Plain PyTorch DDP training, with dgt as its communication hook (the lines marked dgt).

Fashion-MNIST from Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist)
when present, else scikit-learn's digits; an MLP, Adam, DistributedSampler.

    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py --comm dgt
    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py --comm gloo

Several hosts: the same script, one torchrun per host:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id job1 examples/ddp_train.py --comm dgt

``--comm dgt`` reads the sidecars' settings from DGT_* variables (DGT_MODE=tcp, DGT_K,
…) or ``--mode``. ``--report DIR`` writes each rank's result (test accuracy, parameter
SHA-256, bucket timings) to DIR/rank-<r>.json.

Checkpoint and resume (bitwise: a resumed run ends with the uninterrupted run's bits):
``--checkpoint-every N --checkpoint-dir D`` writes D/step-<t>/trainer-<r>.pt (model,
optimiser, loop position, the hook's state_dict()) and, under ``--comm dgt``,
sidecar-<r>.pt (the sidecar's residual, scores, ...); ``--resume D`` (its newest
complete step whose files all load; a damaged one is skipped with a warning) or
``--resume D/step-<t>``. dgt's own errors (a bad DGT_* value, a damaged checkpoint, a
failed peer) and the environment's (OSError: a DGT_RUN_DIR other users can write, a
folder that cannot be made) end each trainer with one line and exit status 2, no
traceback. Under ``torchrun --max-restarts M`` a restarted generation resumes from the
newest complete step in D by itself; ``dgt.ddp.init_process_group`` gives each
generation its own keys in torchrun's store.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dgt.ddp   # dgt
from dgt import checkpoint

#: the live DgtState, for the close of an error at the end of this file            # dgt
LIVE: list = []                                                                     # dgt


def load_data(name: str, seed: int):
    """(train, test, shape, name): TensorDatasets of float32 images and int64 labels.
    ``name`` "auto": Fashion-MNIST when installed, else digits."""
    from dgt.workloads import datasets
    if name == "auto":
        name = "fashion-mnist" if datasets.fashion_mnist_missing() is None else "digits"
    d = datasets.load(name, seed=seed)
    return (TensorDataset(d.x_train, d.y_train), TensorDataset(d.x_test, d.y_test),
            d.shape, name)


def make_model(shape, hidden: int) -> nn.Module:
    c, h, w = shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                  for i in range(0, len(y), 1000))
    model.train()
    return correct / len(y)


def sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(root: str, step: int, epoch: int, batch: int, model, opt,
                    state) -> None:
    """D/step-<t>/: the sidecar's file first (dgt), then the trainer's (atomic), so a
    folder with every trainer-<r>.pt is complete, then sha256-<r>.txt (checked at
    --resume); rank 0 keeps the newest two."""
    folder = checkpoint.step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    rank = dist.get_rank()
    if state is not None:
        state.save_sidecar(checkpoint.sidecar_file(folder, rank))                   # dgt
    checkpoint.save({"format": checkpoint.FORMAT, "writer": "ddp",
                     "model": model.module.state_dict(),
                     "opt": opt.state_dict(), "step": step, "epoch": epoch,
                     "batch": batch, "rng": torch.get_rng_state(),
                     "dgt": state.state_dict() if state is not None else None},   # dgt
                    checkpoint.trainer_file(folder, rank))
    checkpoint.seal(folder, rank, sidecar=state is not None)   # sha256-<r>.txt, last
    dist.barrier()
    if rank == 0:
        checkpoint.prune(root, dist.get_world_size())


def resume_from(a) -> str | None:
    """The step folder to resume from: the newest complete one in --checkpoint-dir when
    torchrun restarted us, else --resume (a step folder, or a folder of them)."""
    world = dist.get_world_size()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and a.checkpoint_dir:
        newest = checkpoint.latest(a.checkpoint_dir, world)
        if newest:
            return newest
    if not a.resume:
        return None
    if os.path.exists(checkpoint.trainer_file(a.resume, dist.get_rank())):
        for r in range(world):   # every rank checks every rank's files: all stop alike
            why = checkpoint.tampered(a.resume, r)
            if why:
                raise SystemExit(f"--resume {a.resume}: {why}; resume from another step")
        return a.resume
    newest = checkpoint.latest(a.resume, world)
    if newest is None:
        raise SystemExit(f"--resume {a.resume}: no complete checkpoint of {world} "
                         f"trainers there; give --checkpoint-dir's folder or a step-<t> "
                         f"folder in it")
    return newest


class TimedAllReduce:
    """State of :func:`timed_allreduce`: ``timings`` as ``DgtState.timings`` has them
    (per iteration, ``{"buckets": [[index, handed_s, elements]]}``, time.monotonic())."""

    def __init__(self):
        self.timings: list[dict] = []
        self.buckets: list[list] = []


def timed_allreduce(state, bucket):   # no annotations: DDP checks them at run time
    """DDP's all-reduce (torch's ``allreduce_hook``) of ``bucket``
    (``dist.GradBucket``), noting when it came; returns its future."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state.buckets.append([bucket.index(), time.monotonic(), bucket.buffer().numel()])
    if bucket.is_last():
        state.timings.append({"buckets": state.buckets})
        state.buckets = []
    return allreduce_hook(None, bucket)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm", choices=("gloo", "gloo-timed", "dgt"), default="dgt",
                   help="gloo: DDP's own all-reduce; gloo-timed: the same through torch's "
                        "allreduce_hook, noting when each bucket is handed over (the "
                        "hook's timings, for comparing comm time); dgt: the dgt comm hook")
    p.add_argument("--mode", default=None, help="dgt's --mode (dgt, tcp, topk, random)")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="per trainer")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=("auto", "fashion-mnist", "digits"), default="auto")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25)
    p.add_argument("--no-overlap", action="store_true",
                   help="--comm dgt: push the whole vector after backward (as dgt.Client) "
                        "instead of each bucket as DDP hands it over")
    p.add_argument("--report", default="", help="write DIR/rank-<r>.json")
    env = os.environ.get
    p.add_argument("--checkpoint-every", type=int,
                   default=int(env("DGT_CHECKPOINT_EVERY", "0")),
                   help="checkpoint every N iterations (0 = never; $DGT_CHECKPOINT_EVERY)")
    p.add_argument("--checkpoint-dir", default=env("DGT_CHECKPOINT_DIR", ""),
                   help="where: one step-<t> folder each ($DGT_CHECKPOINT_DIR)")
    p.add_argument("--resume", default=env("DGT_RESUME", ""),
                   help="a step-<t> folder, or a checkpoint folder (its newest complete "
                        "step; $DGT_RESUME)")
    a = p.parse_args()
    if a.checkpoint_every < 0:
        p.error(f"--checkpoint-every {a.checkpoint_every}: give N >= 1 iterations, or 0 "
                f"for no checkpoints")
    if a.checkpoint_every and not a.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir D (or $DGT_CHECKPOINT_DIR)")

    torch.set_num_threads(1)
    # torchrun's env (RANK, WORLD_SIZE, ...); dgt's call scopes the group's store by the
    # restart generation, so a restarted gloo never reads the failed one's addresses
    dgt.ddp.init_process_group("gloo")                                              # dgt
    rank = dist.get_rank()
    torch.manual_seed(a.seed)
    train, test, shape, name = load_data(a.dataset, a.seed)
    net = make_model(shape, a.hidden)
    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    folder = resume_from(a)
    # writer: dgt train's files have other keys (one line here, not a KeyError later)
    ck = checkpoint.load(checkpoint.trainer_file(folder, rank), writer="ddp") \
        if folder else None
    if ck is not None:   # before DDP, which broadcasts rank 0's parameters
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"])
        if rank == 0:
            print(f"resuming from {folder} (iteration {ck['step']})", flush=True)
    model = DDP(net, bucket_cap_mb=a.bucket_cap_mb)
    state = timed = None
    if a.comm == "dgt":
        state = dgt.ddp.DgtState(sidecar_args=["--mode", a.mode] if a.mode else [],  # dgt
                                 overlap=not a.no_overlap)                           # dgt
        LIVE.append(state)   # for an error's close, at the end of this file        # dgt
        if ck is not None:                                                            # dgt
            state.load_state_dict(ck["dgt"])                                          # dgt
        model.register_comm_hook(state, dgt.ddp.dgt_hook)                              # dgt
    elif a.comm == "gloo-timed":
        timed = TimedAllReduce()
        model.register_comm_hook(timed, timed_allreduce)
    sampler = DistributedSampler(train, seed=a.seed, drop_last=True)
    loader = DataLoader(train, batch_size=a.batch_size, sampler=sampler, drop_last=True)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, skip = (ck["step"], ck["epoch"], ck["batch"]) if ck else (0, 0, 0)
    t0 = time.monotonic()
    backward_end: list[float] = []
    while step < a.iterations:
        sampler.set_epoch(epoch)
        for batch, (x, y) in enumerate(itertools.islice(loader, skip, None), skip):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            backward_end.append(time.monotonic())
            opt.step()
            step += 1
            if a.checkpoint_every and step % a.checkpoint_every == 0:
                save_checkpoint(a.checkpoint_dir, step, epoch, batch + 1, model, opt, state)
            if step >= a.iterations:
                break
        epoch, skip = epoch + 1, 0
    acc = accuracy(model.module, test)
    result = {"rank": rank, "comm": a.comm, "mode": a.mode, "dataset": name,
              "iterations": step, "test_accuracy": acc, "param_sha256": sha256(model),
              "seconds": time.monotonic() - t0, "world": dist.get_world_size(),
              "resumed_from": folder,
              "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
              "backward_end_s": backward_end[-50:],
              "timings": (state or timed).timings[-50:] if (state or timed) else []}
    if rank == 0:
        print(f"{a.comm}: {step} iterations on {name}, test accuracy {acc:.4f}, "
              f"SHA-256 {result['param_sha256'][:16]}, {result['seconds']:.1f} s", flush=True)
    if a.report:
        os.makedirs(a.report, exist_ok=True)
        with open(os.path.join(a.report, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
    if state is not None:
        state.close()                                                                # dgt
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    # dgt's errors say what to do in one line; so do the environment's that it meets
    # (OSError: a DGT_RUN_DIR other users can write, a folder it cannot create, an
    # address it cannot bind)
    except (ValueError, OSError, dgt.PeerFailure) as e:
        who = f" rank {os.environ['RANK']}" if "RANK" in os.environ else ""
        # one write: every rank's stderr is torchrun's, and print() would write the
        # line and its newline apart (unbuffered), so two ranks' lines could interleave
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}{who}: error: {e}\n")
        sys.stderr.flush()
        for state in LIVE:   # the other ranks are told this rank failed, and why:   # dgt
            state.close(failed=f"{type(e).__name__}: {e}")   # not "fewer steps"    # dgt
        sys.exit(2)
    except KeyboardInterrupt:   # Ctrl-C: one line, the shell's status, no traceback
        who = f" rank {os.environ['RANK']}" if "RANK" in os.environ else ""
        kept = "".join(f"; dgt's logs kept in {state.run_dir}"                      # dgt
                       for state in LIVE if state.run_dir)                          # dgt
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}{who}: interrupted{kept}\n")
        sys.stderr.flush()
        for state in LIVE:                                                          # dgt
            state.close(failed="interrupted (Ctrl-C)")                              # dgt
        sys.exit(130)

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
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dgt.ddp   # dgt


def load_data(seed: int):
    """(train, test, shape, name): TensorDatasets of float32 images and int64 labels."""
    from dgt.workloads import datasets
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm", choices=("gloo", "dgt"), default="dgt",
                   help="gloo: DDP's own all-reduce; dgt: the dgt comm hook")
    p.add_argument("--mode", default=None, help="dgt's --mode (dgt, tcp, topk, random)")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="per trainer")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=0.25)
    p.add_argument("--report", default="", help="write DIR/rank-<r>.json")
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")            # torchrun's env: RANK, WORLD_SIZE, ...
    rank = dist.get_rank()
    torch.manual_seed(a.seed)
    train, test, shape, name = load_data(a.seed)
    model = DDP(make_model(shape, a.hidden), bucket_cap_mb=a.bucket_cap_mb)
    state = None
    if a.comm == "dgt":
        state = dgt.ddp.DgtState(sidecar_args=["--mode", a.mode] if a.mode else [])  # dgt
        model.register_comm_hook(state, dgt.ddp.dgt_hook)                              # dgt
    sampler = DistributedSampler(train, seed=a.seed, drop_last=True)
    loader = DataLoader(train, batch_size=a.batch_size, sampler=sampler, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, t0 = 0, 0, time.monotonic()
    backward_end: list[float] = []
    while step < a.iterations:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            backward_end.append(time.monotonic())
            opt.step()
            step += 1
            if step >= a.iterations:
                break
        epoch += 1
    acc = accuracy(model.module, test)
    result = {"rank": rank, "comm": a.comm, "mode": a.mode, "dataset": name,
              "iterations": step, "test_accuracy": acc, "param_sha256": sha256(model),
              "seconds": time.monotonic() - t0, "world": dist.get_world_size(),
              "backward_end_s": backward_end[-50:],
              "timings": state.timings[-50:] if state is not None else []}
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
    main()

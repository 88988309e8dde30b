"""A DDP job whose first layer's backward is slow (tests/test_ddp.py, the overlap test):
run under ``torchrun --nproc-per-node 2``; writes OUT/rank-<r>.json with the hook's
timings and the parameters' SHA-256.

The first layer's input passes through :class:`SlowBackward`, whose backward sleeps
``--sleep-s`` before the first layer's gradients are computed: DDP hands over the
buckets of the later layers that long before backward ends.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dgt.ddp


class SlowBackward(torch.autograd.Function):
    """Identity; its backward sleeps ``sleep_s`` seconds."""

    @staticmethod
    def forward(ctx, x, sleep_s):
        ctx.sleep_s = sleep_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.sleep_s)
        return g, None


class Net(torch.nn.Module):
    def __init__(self, sleep_s: float):
        super().__init__()
        self.sleep_s = sleep_s
        self.first = torch.nn.Linear(32, 64)
        self.rest = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 256),
                                        torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def forward(self, x):
        return self.rest(SlowBackward.apply(self.first(x), self.sleep_s))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--sleep-s", type=float, default=0.3)
    p.add_argument("--mode", default="tcp")
    p.add_argument("--band-codec", default="auto")
    p.add_argument("--no-overlap", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(a.sleep_s), bucket_cap_mb=0.02)   # 86 KB of gradient: 4+ buckets
    state = dgt.ddp.DgtState(sidecar_args=["--mode", a.mode, "--band-codec", a.band_codec],
                             overlap=not a.no_overlap)
    model.register_comm_hook(state, dgt.ddp.dgt_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + rank)
    backward_end = []
    for _ in range(a.iterations):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        backward_end.append(time.monotonic())
        opt.step()
    h = hashlib.sha256()
    for q in model.module.parameters():
        h.update(q.detach().numpy().tobytes())
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"timings": state.timings, "backward_end_s": backward_end,
                   "param_sha256": h.hexdigest()}, f)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

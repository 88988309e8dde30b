"""A small DDP job with the dgt hook in which one rank ends early (tests/test_ddp_misuse.py):
run under ``torchrun --nproc-per-node 2``. Every rank trains ``--iterations`` steps,
except ``--short-rank``, which stops before step ``--short-step``:

- ``--how raise``: it raises RuntimeError there, uncaught (the trainer crashes);
- ``--how return``: it returns from main() there, without ``state.close()`` (an orderly
  end with fewer steps; the hook's state is closed at interpreter exit).

A rank whose own step fails with dgt.PeerFailure prints one line to stderr,
``ddp_misuse_job.py rank <r>: error: PeerFailure: <message>``, and exits with status 2.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dgt
import dgt.ddp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--short-rank", type=int, default=1)
    p.add_argument("--short-step", type=int, default=5)
    p.add_argument("--how", choices=("raise", "return"), default="raise")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, a.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(a.hidden, 2)))
    state = dgt.ddp.DgtState(sidecar_args=["--mode", "tcp"])
    model.register_comm_hook(state, dgt.ddp.dgt_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(a.iterations):
        if rank == a.short_rank and step == a.short_step:
            if a.how == "raise":
                raise RuntimeError(f"injected at step {step}")
            return
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).sum().backward()
        opt.step()
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except dgt.PeerFailure as e:
        print(f"{os.path.basename(sys.argv[0])} rank {os.environ['RANK']}: error: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)

"""A small DDP job with the dgt hook in which one rank ends early (tests/test_ddp_misuse.py):
run under ``torchrun --nproc-per-node 2``. Every rank trains ``--iterations`` steps,
except ``--short-rank``, which stops before step ``--short-step``:

- ``--how raise``: it raises RuntimeError there, uncaught (the trainer crashes);
- ``--how return``: it returns from main() there, without ``state.close()`` (an orderly
  end with fewer steps; the hook's state is closed at interpreter exit).
- ``--how exit``: it catches its own ValueError there, says so to its sidecar with
  ``state.close(failed=...)`` and calls ``sys.exit(2)``, as a script that handles its
  own errors does.
- ``--how nan`` (no rank ends early): its loss is multiplied by NaN at that step only,
  so its gradient is NaN once (an overflowing step);
- ``--how second-state`` (no rank ends early): a second DDP model, GAN-style, whose
  DgtState is refused while the first is live (each rank prints ``rank <r>: refused:
  <message>``) and which trains with DDP's own all-reduce; then, after the first
  state's ``close()``, a third model trains through a new DgtState (``rank <r>: third
  model trained``).

A rank whose own step fails with dgt.PeerFailure prints one line to stderr,
``ddp_misuse_job.py rank <r>: error: PeerFailure: <message>``, and exits with status 2.
"""
import argparse
import os
import sys
import time

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
    p.add_argument("--how", choices=("raise", "return", "exit", "nan", "second-state"),
                   default="raise")
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
        poison = rank == a.short_rank and step == a.short_step and a.how == "nan"
        if rank == a.short_rank and step == a.short_step and a.how not in ("nan",
                                                                            "second-state"):
            if a.how == "raise":
                raise RuntimeError(f"injected at step {step}")
            if a.how == "exit":
                try:
                    raise ValueError(f"injected at step {step}")
                except ValueError as e:
                    state.close(failed=f"{type(e).__name__}: {e}")
                    sys.exit(2)
            return
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=gen)).sum()
        (loss * float("nan") if poison else loss).backward()
        opt.step()
    if a.how == "nan":   # every replica ends finite and identical
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        sys.stdout.write(f"rank {rank}: finite {bool(torch.isfinite(flat).all())} "
                         f"sum {float(flat.double().sum())!r}\n")
        sys.stdout.flush()
    if a.how == "second-state":
        second_state(rank, model, state, gen)
    state.close()
    dist.destroy_process_group()


def second_state(rank: int, model, state, gen) -> None:
    other = DDP(torch.nn.Linear(8, 2))
    try:
        dgt.ddp.DgtState(sidecar_args=["--mode", "tcp"])
    except RuntimeError as e:
        # one write: the two ranks share torchrun's stdout, and print() writes the
        # line and its newline apart, so the lines could interleave (CI saw it)
        sys.stdout.write(f"rank {rank}: refused: {e}\n")
        sys.stdout.flush()
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)
        model(x).sum().backward()
        other(x).sum().backward()
    state.close()
    third = DDP(torch.nn.Linear(8, 2))
    if rank == 0:   # rank 1 asks for its sidecars' store first: not the closed one's
        time.sleep(2)
    new = dgt.ddp.DgtState(sidecar_args=["--mode", "tcp"])
    third.register_comm_hook(new, dgt.ddp.dgt_hook)
    for _ in range(2):
        third(torch.randn(4, 8, generator=gen)).sum().backward()
    new.close()
    sys.stdout.write(f"rank {rank}: third model trained\n")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except dgt.PeerFailure as e:
        sys.stderr.write(f"{os.path.basename(sys.argv[0])} rank {os.environ['RANK']}: "
                         f"error: {type(e).__name__}: {e}\n")   # one write: see above
        sys.stderr.flush()
        sys.exit(2)

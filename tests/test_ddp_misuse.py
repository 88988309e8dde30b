"""dgt.ddp misused (an outside tester's torchrun runs): gradients the hook does not take,
DgtState arguments of the wrong kind, a closed state trained on, and a rank whose
trainer crashes. Each misuse is one line naming it, not an internal error, and a crash
is not blamed on the others as fewer steps."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import test_ddp
import torch
from test_ddp import REPO, _ddp, _logs, _step

group = test_ddp.group   # the fixture: a one-rank gloo group, as torchrun sets it up
DOCS = pathlib.Path(REPO) / "docs" / "ddp.md"
JOB = os.path.join(REPO, "tests", "ddp_misuse_job.py")


def _errors_section() -> str:
    text = DOCS.read_text()
    return text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]


# ------------------------------------------------------------------ gradients


def test_a_sparse_gradient_is_one_line(group):
    # before: NotImplementedError "Cannot access storage of SparseTensorImpl" from
    # dgt/ddp/hook.py _views_of, after the whole push
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dgt.ddp import DgtState, dgt_hook
    model = DDP(torch.nn.Sequential(torch.nn.Embedding(50, 20, sparse=True),
                                    torch.nn.Linear(20, 2)))
    model.register_comm_hook(DgtState(connect=False), dgt_hook)
    with pytest.raises(TypeError) as e:
        model(torch.tensor([[1, 2, 3]])).sum().backward()
    text = str(e.value)
    assert "\n" not in text.strip(), text
    assert "does not take sparse gradients" in text and "torch.sparse_coo" in text, text
    assert "sparse=False" in text, text   # what to do
    assert "sparse" in _errors_section()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_every_refused_dtype_is_one_line_and_documented(group, dtype):
    # before: float64 was refused but docs/ddp.md's Errors named float16/bfloat16 only
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dgt.ddp import DgtState, dgt_hook
    model = DDP(torch.nn.Linear(8, 2).to(dtype))
    model.register_comm_hook(DgtState(connect=False), dgt_hook)
    with pytest.raises(TypeError) as e:
        model(torch.ones(4, 8, dtype=dtype)).sum().backward()
    assert f"this bucket is {dtype}" in str(e.value) and ".float()" in str(e.value)
    assert str(dtype).removeprefix("torch.") in _errors_section(), dtype


# ------------------------------------------------------------------ DgtState's arguments


@pytest.mark.parametrize("kwargs, exc, says", [
    # before: "sidecar did not start ... unrecognized arguments: - - m o d e t c p"
    ({"sidecar_args": "--mode tcp"}, TypeError,
     "DgtState(sidecar_args='--mode tcp'): give a list of 'dgt sidecar' flags"),
    ({"sidecar_args": ["--k", 0.1]}, TypeError,
     "DgtState(sidecar_args=['--k', 0.1]): item 1 is float"),
    ({"sidecar_args": None}, TypeError, "DgtState(sidecar_args=None): give a list"),
    ({"sidecar_args": ["--mode", "tcp", "--rank", "3"]}, ValueError,
     "sets --rank itself"),
    ({"sidecar_args": ["--run-dir=/tmp/x"]}, ValueError, "DGT_RUN_DIR"),
    # before: TypeError "a bytes-like object is required, not 'int'" from node.py
    ({"socket_path": 123}, TypeError,
     "DgtState(socket_path=123): give the path of a 'dgt sidecar' socket"),
    ({"socket_path": b"/run/s.sock"}, TypeError, "DgtState(socket_path=b'/run/s.sock')"),
    # before: silently True
    ({"overlap": "no"}, TypeError, "DgtState(overlap='no'): give True or False"),
    ({"overlap": None}, TypeError, "DgtState(overlap=None)"),
    ({"connect": "yes"}, TypeError, "DgtState(connect='yes'): give True or False"),
    ({"process_group": "gloo"}, TypeError,
     "DgtState(process_group='gloo'): give a torch.distributed.ProcessGroup"),
    ({"timeout_s": True}, ValueError, "a finite number > 0"),
])
def test_a_constructor_argument_of_the_wrong_kind_is_one_line(kwargs, exc, says):
    from dgt.ddp import DgtState
    kwargs.setdefault("connect", False)
    with pytest.raises(exc) as e:
        DgtState(**kwargs)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("var, value, says", [
    ("DGT_WORLD", "3", "DGT_WORLD='3' is not torch.distributed's world size (1): under "
                       "DDP, dgt's world size is the process group's; unset DGT_WORLD"),
    ("DGT_RANK", "5", "DGT_RANK='5' is not torch.distributed's rank (0)"),
    ("DGT_RANK", "", "DGT_RANK is set but empty; unset it"),
    ("DGT_WORLD", "one", "DGT_WORLD='one' is not torch.distributed's world size (1)"),
])
def test_a_dgt_rank_or_world_that_contradicts_torch_is_one_line(group, monkeypatch, var,
                                                                 value, says):
    """Breaker round 12: DGT_WORLD=3 (or DGT_RANK=5) under a torchrun job of 2 was read by
    nobody and said nothing, where the README's precedence reads as if it counted."""
    from dgt.ddp import DgtState
    monkeypatch.setenv(var, value)
    try:
        state = DgtState()
    except ValueError as e:
        text = str(e)
    else:   # a live state would make the next test's a second one
        state.close()
        pytest.fail(f"{var}={value!r} was taken")
    assert says in text and "\n" not in text, text


def test_a_dgt_rank_and_world_that_agree_with_torch_are_taken(group, monkeypatch):
    from dgt.ddp import DgtState
    monkeypatch.setenv("DGT_RANK", "0")
    monkeypatch.setenv("DGT_WORLD", "01")   # as dgt sidecar reads it (round 12's re-check)
    state = DgtState()
    state.close()


def test_good_constructor_arguments_are_taken():
    from dgt.ddp import DgtState
    s = DgtState(socket_path=pathlib.Path("/run/s.sock"), sidecar_args=("--mode", "tcp"),
                 overlap=False, connect=False, timeout_s=5)
    assert (s.socket_path, s.sidecar_args, s.overlap, s.timeout_s) == \
        ("/run/s.sock", ["--mode", "tcp"], False, 5.0)


@pytest.mark.parametrize("failed", [3, b"boom", ValueError("boom")])
def test_close_failed_of_the_wrong_kind_is_one_line(failed):
    from dgt.ddp import DgtState
    state = DgtState(connect=False)
    with pytest.raises(TypeError) as e:
        state.close(failed=failed)
    assert str(e.value).startswith(f"DgtState.close(failed={failed!r}): give the error "
                                   "as a str"), str(e.value)
    assert "\n" not in str(e.value)
    state._check_open()   # still open: the refused close changed nothing


def test_training_on_after_close_is_one_line(group):
    # before: TypeError "expected np.ndarray (got NoneType)" at dgt/ddp/hook.py
    from dgt.ddp import DgtState, dgt_hook
    model = _ddp()
    state = DgtState()
    model.register_comm_hook(state, dgt_hook)
    _step(model)
    state.close()
    for call in (lambda: _step(model), lambda: state.save_sidecar(str(group / "s.pt"))):
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value).startswith("the DgtState was closed"), str(e.value)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ a rank that crashes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["raise", "exit", "return"])
def test_a_crashed_rank_is_named_with_its_error_and_a_short_one_as_fewer_steps(tmp_path,
                                                                              how):
    """Rank 1 of 2 stops before step 5 of 8: ``raise`` (an uncaught RuntimeError; before
    the fix rank 0 said "rank 1 closed after step 4 ... every rank must run the same
    number of steps", as the orderly close at interpreter exit told it), ``exit`` (its
    own ValueError caught, ``state.close(failed=...)``, ``sys.exit(2)``: before
    ``close`` took ``failed``, such a script could only end as an orderly close) or
    ``return`` (an orderly end with fewer steps: that message stays)."""
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", JOB, "--how", how],
                       capture_output=True, text=True, timeout=240, cwd=REPO,
                       env=dict(os.environ, DGT_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1"))
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:] + _logs(run_dir)
    ours = [ln for ln in p.stderr.splitlines()
            if re.search(r"ddp_misuse_job\.py rank 0: error: ", ln)]
    assert len(ours) == 1, p.stderr[-3000:] + _logs(run_dir)
    if how != "return":
        error = "RuntimeError" if how == "raise" else "ValueError"
        assert f"rank 1's trainer failed ({error}: injected at step 5) at step 5" \
            in ours[0], ours[0]
        assert "same number of steps" not in ours[0], ours[0]
    else:
        assert "rank 1 closed after step 4; rank 0 is at step 5: every rank must run " \
            "the same number of steps" in ours[0], ours[0]


@pytest.mark.timeout(300)
def test_one_nan_step_of_a_rank_costs_that_step_only(tmp_path):
    """Rank 1's loss is NaN at step 3 of 8 (one overflowing step). Before the fix its
    residual kept the NaN: every later push of rank 1 was g + NaN, kept out at the
    shards in every iteration (rejected non_finite at iterations 3 to 7, an outside
    tester's run), with no word. Now rank 1's sidecar drops the NaN blocks at step 3
    (sent as zeros, counted in its trace's blocks_non_finite, said in its log) and no
    shard ever sees a non-finite block; the replicas end finite and identical."""
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", JOB, "--how", "nan", "--short-step", "3",
                        "--hidden", "400"],
                       capture_output=True, text=True, timeout=240, cwd=REPO,
                       env=dict(os.environ, DGT_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + _logs(run_dir)
    ends = sorted(ln for ln in p.stdout.splitlines() if re.match(r"rank \d: finite", ln))
    assert len(ends) == 2 and all("finite True" in ln for ln in ends), p.stdout
    assert ends[0].split(" sum ")[1] == ends[1].split(" sum ")[1], ends
    lines = {r: [json.loads(ln) for ln in (run_dir / f"trace-{r}.jsonl").read_text()
                 .splitlines() if '"iteration"' in ln] for r in (0, 1)}
    kept_out = [(r, x["t"]) for r in (0, 1) for x in lines[r]
                if x.get("rejected", {}).get("non_finite")]
    assert kept_out == [], kept_out
    dropped = [(x["t"], x["blocks_non_finite"]) for x in lines[1]
               if x.get("blocks_non_finite")]
    assert [t for t, _ in dropped] == [3], dropped
    assert not any(x.get("blocks_non_finite") for x in lines[0])
    assert "push 3 held NaN or inf" in (run_dir / "sidecar-1.log").read_text()


@pytest.mark.timeout(300)
def test_a_second_live_dgt_state_in_one_process_is_refused_in_one_line(tmp_path):
    """Two DDP models in one trainer (GAN-style), a DgtState for each: before the fix
    the second state's sidecar took the first one's socket and store key and failed
    after 35 s with "rendezvous store lost (rank 0 died?)" or "this sidecar already
    has a trainer" (the hook's own message had said to create another). Now it is
    refused at once; the second model trains with DDP's all-reduce, and a state made
    after the first one's close() trains a third model."""
    from dgt.ddp.state import ONE_PER_PROCESS
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", JOB, "--how", "second-state",
                        "--iterations", "2"],
                       capture_output=True, text=True, timeout=240, cwd=REPO,
                       env=dict(os.environ, DGT_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + _logs(run_dir)
    for rank in (0, 1):   # each rank's line whole (the ranks' lines may come in any order)
        assert f"rank {rank}: refused: {ONE_PER_PROCESS}" in p.stdout, p.stdout
        assert f"rank {rank}: third model trained" in p.stdout, p.stdout
    assert "\n" not in ONE_PER_PROCESS and "close() the first DgtState" in ONE_PER_PROCESS
    assert "one DDP model per process" in _errors_section()

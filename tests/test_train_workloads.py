"""'dgt train' on the new workloads, multi-process over loopback: small widths, few
iterations. The acceptance figures (full runs to target accuracy) are in
docs/workloads.md."""
import subprocess
import sys

import pytest

from conftest import logs_of, run_train
from test_workloads import needs_fmnist, write_cifar

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["cnn", "googlenet"])
def test_tcp_and_dgt_modes_end_with_the_same_parameters(tmp_path, model):
    """The rank-ordered sum: without loss, mode dgt (TCP + 3 UDP channels) and mode tcp
    give bit-identical parameters for a conv net too, with every reduced form off
    (named here, so a change of the defaults keeps this test what it is)."""
    shas = {}
    for mode in ("dgt", "tcp"):
        d = tmp_path / mode
        d.mkdir()
        _, r = run_train(d, "--workers", 3, "--model", model, "--width", 0.125,
                         "--iterations", 8, "--seed", 3, "--deadline-ms", 3000,
                         "--mode", mode, "--band-codec", "fp32", "--pull-codec", "fp32")
        assert sum(ch["blocks_lost"] for ch in r["channels"].values()) == 0
        assert r["replicas_identical"]
        assert r["workload"]["model"] == model and r["workload"]["dataset"] == "digits"
        shas[mode] = r["param_sha256"][0]
    assert shas["dgt"] == shas["tcp"]


def test_fedavg_non_iid_under_loss_keeps_replicas_and_conserves_deltas(train, tmp_path):
    p, r = train("--workers", 4, "--model", "cnn", "--width", 0.25, "--algo", "fedavg",
                 "--local-steps", 3, "--iterations", 9, "--partition", "shards:2",
                 "--drop-udp", 0.2, "--check-conservation", "--eval-every", 6)
    assert r["iterations"] == 9 and r["rounds"] == 3
    assert all(s["pushes"] == 3 for s in r["sidecars"])         # one push per round
    assert r["replicas_identical"]
    assert sum(ch["blocks_lost"] for ch in r["channels"].values()) > 0
    assert r["conservation_rel_error"] < 1e-4
    assert r["bytes_per_round"] > r["workload"]["gradient_bytes"]   # N pushes, each ~3/4
    assert [h["round"] for h in r["history"]] == [2, 3]
    hist = r["class_histograms"]
    assert len(hist) == 4 and all(sum(1 for v in row if v) <= 6 for row in hist)
    assert "samples per class and worker (partition shards:2)" in p.stdout
    assert "FedAvg H=3" in p.stdout and "MB sent per round" in p.stdout
    # breaker round, stop 27: the row said "(H local steps each)" for any H, also
    # where a round ends with its epoch first
    assert "3 (3 local steps each on average; --local-steps 3)" in p.stdout
    assert "Traceback" not in logs_of(tmp_path / "run")


def test_cnn_trains_on_a_cifar10_folder_in_the_real_format(train, tmp_path):
    write_cifar(tmp_path / "data", per_batch=100, test=100)
    _, r = train("--workers", 2, "--model", "cnn", "--width", 0.5, "--dataset", "cifar10",
                 "--data-dir", tmp_path / "data", "--epochs", 4, "--batch-size", 16,
                 "--lr", 3e-3)
    w = r["workload"]
    assert w["dataset"] == "cifar10" and w["train_samples"] == 500 and w["augment"]
    losses = [h["loss"] for h in r["history"]]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert r["replicas_identical"]


@pytest.mark.parametrize("damage,message", [
    ("corrupt", "data_batch_2 is not a CIFAR-10 batch"),
    ("shards", "needs 64 shards but the training set has only 50 samples")])
def test_bad_cifar10_input_is_one_line_before_anything_starts(tmp_path, damage, message):
    d = write_cifar(tmp_path, per_batch=10, test=10)
    if damage == "corrupt":
        (d / "data_batch_2").write_bytes(b"\x80\x04not a pickle")
    extra = ["--workers", "32", "--batch-size", "1", "--partition", "shards:2"] \
        if damage == "shards" else []
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--dataset", "cifar10",
                        "--data-dir", str(tmp_path), *extra], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


@needs_fmnist
def test_fashion_mnist_job_describes_its_workload(train):
    _, r = train("--workers", 2, "--model", "cnn", "--width", 0.25, "--dataset",
                 "fashion-mnist", "--iterations", 20, "--eval-samples", 500,
                 "--partition", "dirichlet:0.5")
    w = r["workload"]
    assert (w["model"], w["dataset"], w["partition"], w["algo"]) == \
        ("cnn", "fashion-mnist", "dirichlet:0.5", "bsp")
    assert w["train_samples"] == 60000 and w["eval_samples"] == 500
    assert w["params"] == 26698 and w["gradient_bytes"] == 4 * 26698
    assert sum(map(sum, r["class_histograms"])) == 60000
    assert r["replicas_identical"] and r["iterations"] == 20

"""Every wrong flag gets one line that says what to do, exit status 2, no traceback."""
import os
import subprocess
import sys

import pytest

from dgt.config import OneLineParser

BAD = [
    (["train", "--k", "2"], "--k must be in [0, 1]"),
    (["train", "--workers", "0"], "--workers must be"),
    (["train", "--channels", "9"], "--channels must be 1..7"),
    (["train", "--block-bytes", "3"], "--block-bytes must be a multiple of 4"),
    (["train", "--lr", "inf"], "finite"),
    (["train", "--target-accuracy", "7"], "--target-accuracy"),
    (["train", "--mode", "fast"], "invalid choice"),
    (["train", "--bogus"], "dgt train: error: unrecognized arguments: --bogus"),
    # breaker round, stop 25: a plugin command's wrong flag pointed at 'dgt --help'
    (["bench", "--bogus"], "dgt bench: error: unrecognized arguments: --bogus (see "
                           "'dgt bench --help')"),
    (["train", "--run-dir", "/proc/self/status"], "--run-dir"),
    (["train", "--report", "/proc/nonexistent/r.json"], "--report"),
    (["sidecar", "--rank", "0", "--world", "0"], "--world must be 1..64"),
    (["sidecar", "--rank", "0", "--world", "1", "--base-port", "65535"], "--base-port"),
    (["sidecar", "--rank", "0", "--world", "2", "--master-port", "99999"], "--master-port"),
    (["sidecar", "--rank", "0", "--world", "1", "--log-level", "LOUD"], "--log-level"),
    (["sidecar", "--rank", "0", "--world", "1", "--socket", "/nonexistent/x.sock"],
     "--socket"),
    (["sidecar", "--rank", "0", "--world", "1", "--host", "10.255.255.1"],
     "not an address of this host"),
    # a BLAKE2b key is at most 64 bytes: refused before any process starts
    (["train", "--secret", "x" * 65], "--secret must be at most 64 bytes"),
    # breaker round 5: bytes that are not UTF-8 gave "'utf-8' codec can't encode ..."
    (["train", "--secret", "ab\udcff\udcfecd"], "--secret must be text"),
    (["sidecar", "--rank", "0", "--world", "1", "--secret", "x" * 100],
     "--secret must be at most 64 bytes"),
    (["train", "--tcp-rto-min-ms", "3"], "--tcp-rto-min-ms must be 0"),
    (["train", "--register-timeout-s", "0"], "--register-timeout-s must be in (0, 3600]"),
    (["sidecar", "--world", "2"], "--rank must be in 0..1 (the flag, env DGT_RANK or "
                                  "torchrun's RANK); it is required"),
    (["sidecar", "--rank", "0", "--world", "1", "--register-timeout-s", "-1"],
     "--register-timeout-s must be in 0..3600"),
    (["bench", "--profile", "nope", "--estimate"], "--profile: unknown profile 'nope'"),
    (["bench", "--cell-timeout-s", "-1", "--estimate"], "--cell-timeout-s must be a finite number >= 0"),
    # breaker round 25: every cell ran and failed on it, the testbed built first
    (["bench", "--seed", "-1", "--estimate"], "--seed must be in 0..4294967295 (each cell's"),
    (["bench", "--seed", str(2**64), "--estimate"], "--seed must be in 0..4294967295"),
    # breaker round 2026-12-01: each of these was accepted, then failed later or silently
    (["train", "--seed", "-1"], "--seed must be in 0..4294967295"),
    (["train", "--seed", str(2**32)], "--seed must be in 0..4294967295"),
    (["train", "--k-min", "0.1"], "--k-min only applies with --adaptive-k"),
    # the default ceiling over a short --peer-timeout-s: the line named no way out
    (["train", "--peer-timeout-s", "0.5"], "--deadline-max-ms must be in 0..--peer-timeout-s "
                                           "x 1000 (500), got 1000; lower it or raise "
                                           "--peer-timeout-s"),
    # breaker round 21: int() and float() took '1_0' (10 workers) and full-width digits
    (["train", "--workers", "1_0"], "argument --workers: expected a whole number written "
                                    "in ASCII digits without '_', got '1_0'"),
    (["train", "--workers", "\uff15"], "argument --workers: expected a whole number"),
    (["train", "--lr", "1_0.5"], "argument --lr: expected a number written in ASCII"),
    (["train", "--pace-mbit", "\uff15"], "argument --pace-mbit: expected 'auto' or Mbit/s"),
    (["testbed", "up", "--hosts", "\uff12", "--prefix", "dgtq"],
     "argument --hosts: expected a whole number"),
    (["sidecar", "--rank", "0", "--world", "1_0"], "argument --world: expected a whole"),
    (["train", "--workers", "abc"], "argument --workers: expected a whole number such as "
                                    "42, got 'abc'"),
    # breaker round 23: argparse's bare "invalid int value: '1e3'"
    (["train", "--workers", "1e3"], "argument --workers: expected a whole number such as "
                                    "42, got '1e3'"),
    (["train", "--lr", "fast"], "argument --lr: expected a number such as 0.5 or 1e-3, "
                                "got 'fast'"),
    # breaker round 23: a traceback (OverflowError from os.fstat), and ports taken as 10
    (["sidecar", "--rank", "0", "--world", "1", "--master-listen-fd", "2147483648"],
     "--master-listen-fd 2147483648 is not open in this process (no such descriptor)"),
    (["capture", "--ports", "1_0", "--seconds", "1", "-q"], "bad port item '1_0'"),
    # breaker round 25: "cannot write .: Is a directory; 0 packets ... were written"
    (["capture", "--ports", "47000", "--seconds", "1", "-w", ""], "-w is empty; give a "
                                                                   "file name"),
    (["capture", "--ports", "47000", "--seconds", "1", "-w", "", "--file-mb", "1"],
     "-w is empty; give a file name"),
    (["pcap", "summary", "/dev/null", "--json", ""], "--json is empty; give a file name"),
    (["capture", "--ports", "\u0661\u0660", "--seconds", "1", "-q"], "bad port item"),
    # breaker round 22: the numbers inside --partition and --band-codec
    (["train", "--partition", "shards:1_0"], "--partition shards:1_0: K (classes per "
                                             "worker) must be an integer in 1..10"),
    (["train", "--partition", "shards:\uff11"], "--partition shards:\uff11: K (classes"),
    (["train", "--partition", "dirichlet:1_0"], "--partition dirichlet:1_0: the Dirichlet "
                                                "concentration must be a finite number"),
    (["train", "--partition", "dirichlet:\uff11"], "the Dirichlet concentration must be"),
    (["train", "--band-codec", "\uff11:int8"], "--band-codec takes auto or one of"),
    # breaker round 21: a sidecar took any seed, then its planner raised at register()
    (["sidecar", "--rank", "0", "--world", "1", "--seed", "9" * 23],
     "--seed must be in 0..4294967295 (the flag or env DGT_SEED), got 9999"),
    (["sidecar", "--rank", "0", "--world", "1", "--seed", "-1"],
     "--seed must be in 0..4294967295 (the flag or env DGT_SEED), got -1"),
    # breaker round, stop 40: a UDP band coding for a mode without UDP channels
    (["train", "--mode", "tcp", "--band-codec", "int8"],
     "--mode tcp sends none over UDP; drop --band-codec or use --mode dgt"),
    (["sidecar", "--rank", "0", "--world", "1", "--mode", "topk", "--band-codec", "fp16"],
     "--mode topk sends none over UDP; drop --band-codec or use --mode dgt"),
    (["train", "--report", "/proc/x.json"], "--report /proc/x.json: no file can be made "
                                            "in /proc"),
    # breaker round 7: '[Errno 2] No such file or directory', naming no path
    (["sidecar", "--rank", "0", "--world", "1", "--socket", "/proc/x.sock"],
     "--socket /proc/x.sock: cannot create a socket there (No such file or directory)"),
    (["train", "--workers", "64", "--batch-size", "8", "--hidden", "20000"],
     "GiB of memory"),
    (["bench", "--out", "/proc/nope", "--estimate"],
     "--out /proc/nope: no folder can be made in /proc"),
    (["bench", "--eval-every", "-1", "--estimate"], "--eval-every >= 0"),
    (["bench", "--target-accuracy", "2", "--estimate"], "--target-accuracy must be in"),
    # breaker round 2, 2026-12-01: tracebacks, or accepted and wrong later
    (["bench", "--estimate", "--rates", "9" * 320 + "gbit"], "is too large"),
    (["bench", "goodput", "--estimate", "--rates", "9" * 320 + "gbit"], "is too large"),
    (["testbed", "up", "--hosts", "2", "--prefix", "dgtq", "--rate", "9" * 320 + "gbit"],
     "is too large"),
    (["train", "--peer-timeout-s", "1e10"], "--peer-timeout-s must be in (0, 3600] s"),
    (["train", "--batch-size", "500"], "exceeds the 1437 training samples"),
    (["bench", "--cell-timeout-s", "nan", "--estimate"], "--cell-timeout-s must be a finite "
                                                          "number >= 0"),
    # breaker round 6: infinity was taken
    (["bench", "tta", "--cell-timeout-s", "1e309", "--estimate"],
     "--cell-timeout-s must be a finite number >= 0 (0: from the estimate), got inf"),
    (["bench", "--hidden", "1000000000", "--estimate"], "GiB of memory"),
    # field faults, issue 12
    (["sidecar", "--rank", "1", "--world", "2", "--master-addr", "no-such-host.invalid"],
     "--master-addr no-such-host.invalid does not resolve"),
    (["sidecar", "--world", "2"], "--rank must be in 0..1 (the flag, env DGT_RANK or "
                                  "torchrun's RANK)"),
    (["train", "--report", "/nonexistent-dgt-dir/sub/r.json"], "does not exist"),
    # breaker round 3
    (["replay", "--dry-run", "--to", "127.0.0.1:31000", "/nonexistent.pcap"],
     "is not an address; give a host only"),
    (["replay", "--dry-run", "--to", "nonsense.invalid", "/nonexistent.pcap"],
     "does not resolve"),
    (["top", "/nonexistent-dgt-run", "--once"], "/nonexistent-dgt-run does not exist"),
    (["top", "--endpoints", "127.0.0.1:1", "--once"], "no metrics endpoint answered"),
    (["top", "/tmp", "--interval-s", "-1"], "--interval-s must be in 0.05..3600"),
    # breaker round, stop 33: ports out of range read as 'Connection refused' or as
    # 'nothing to send'
    (["top", "--endpoints", "127.0.0.1:99999", "--once"],
     "--endpoints: '127.0.0.1:99999' is not HOST:PORT (a port is 1..65535)"),
    (["replay", "--dry-run", "--to", "127.0.0.1", "--base-port", "70000", "/nonexistent.pcap"],
     "argument --base-port: must be a port, 1..65535, got '70000'"),
    (["capture", "--base-port", "0", "-o", "/tmp/x.pcap"],
     "argument --base-port: must be a port, 1..65535, got '0'"),
    (["train", "--secret", ""], "--secret (or DGT_SECRET) is empty"),
    (["sidecar", "--rank", "0", "--world", "1", "--secret", ""],
     "--secret (or DGT_SECRET) is empty"),
    # breaker round 5: an empty path was taken as not given (--resume "$CKPT" with CKPT
    # unset started from step 0 in silence)
    (["train", "--resume", ""], "--resume (or DGT_RESUME) is empty: give a step-<t> "
                                "folder or a --checkpoint-dir; leave it out to start from "
                                "step 0"),
    (["train", "--report", ""], "--report (or DGT_REPORT) is empty"),
    (["train", "--run-dir", ""], "--run-dir (or DGT_RUN_DIR) is empty"),
    (["train", "--checkpoint-dir", ""], "--checkpoint-dir (or DGT_CHECKPOINT_DIR) is empty"),
    (["train", "--data-dir", ""], "--data-dir (or DGT_DATA_DIR) is empty"),
    (["train", "--testbed-prefix", ""], "--testbed-prefix (or DGT_TESTBED_PREFIX) is empty"),
    (["sidecar", "--rank", "0", "--world", "1", "--socket", ""],
     "--socket (or DGT_SOCKET) is empty"),
    (["sidecar", "--rank", "0", "--world", "1", "--run-dir", ""],
     "--run-dir (or DGT_RUN_DIR) is empty"),
    (["sidecar", "--rank", "0", "--world", "1", "--master-addr", ""],
     "--master-addr (or DGT_MASTER_ADDR) is empty"),
    (["sidecar", "--rank", "0", "--world", "1", "--host", ""], "--host (or DGT_HOST) is empty"),
    (["bench", "--loopback", "--out", ""], "--out is empty: give the results folder"),
    # breaker round 14: a value that starts with '-' got argparse's bare 'expected one
    # argument'
    (["tc", "apply", "htb-prio", "--dev", "lo", "--rate", "-5mbit"],
     "argument --rate: expected one argument: give it one (a value that starts with '-' "
     "is written --rate=VALUE)"),
    (["capture", "-w", "-x"], "argument -w/--write: expected one argument: give it one (a "
                              "value that starts with '-' is written --write=VALUE)"),
    # re-check of breaker round 14: a path that starts with '-' got argparse's bare
    # 'required' or 'unrecognized' line; a mistyped long flag gets no such hint
    (["plot", "-r.json"], "the following arguments are required: REPORT|RUN_DIR; if "
                          "-r.json is a REPORT|RUN_DIR, give it after '--', options "
                          "first: dgt plot [OPTIONS] -- -r.json"),
    (["top", "-run"], "unrecognized arguments: -run; if -run is a RUN_DIR, give it after "
                      "'--', options first: dgt top [OPTIONS] -- -run"),
    (["pcap", "summary", "-x.pcap"], "if -x.pcap is a FILE, give it after '--', options "
                                     "first: dgt pcap summary [OPTIONS] -- -x.pcap"),
    (["plot", "r.json", "--outt", "x"], "unrecognized arguments: --outt x (see"),
    (["train", "-x"], "unrecognized arguments: -x (see 'dgt train --help')"),
    (["tc", "apply", "htb-prio", "--dev", "lo", "--dry-run", "--rate=-5mbit"],
     "rate '-5mbit' is not a rate like '1gbit'"),
    # breaker round 14's re-check: finite but huge, then a sidecar's or the capture's
    # int() of it failed ('cannot convert float infinity to integer')
    (["train", "--pace-mbit", "1e308"], "argument --pace-mbit: expected 'auto' or Mbit/s "
                                        "in 0..1000000, got '1e308'"),
    (["capture", "-i", "lo", "--ports", "1-2", "-w", "/tmp/dgt-test-x.pcap", "--file-mb",
      "1e308"], "--file-mb must be a number in (0, 1000000], got 1e+308"),
    # workloads (docs/workloads.md)
    (["train", "--model", "lenet"], "argument --model: invalid choice: 'lenet'"),
    (["train", "--dataset", "mnist"], "argument --dataset: invalid choice: 'mnist'"),
    (["train", "--algo", "sgd"], "argument --algo: invalid choice: 'sgd'"),
    (["train", "--partition", "zipf:2"], "--partition 'zipf:2' is unknown"),
    (["train", "--partition", "dirichlet:0"], "must be a finite number > 0"),
    (["train", "--partition", "dirichlet:-0.5"], "must be a finite number > 0"),
    (["train", "--partition", "shards:11"], "must be an integer in 1..10"),
    (["train", "--algo", "fedavg", "--local-steps", "0"], "--local-steps must be >= 1"),
    (["train", "--local-steps", "2"], "--local-steps only applies with --algo fedavg"),
    (["train", "--model", "cnn", "--width", "0"], "--width must be in (0, 16]"),
    (["train", "--eval-samples", "-1"], "--eval-samples must be >= 0"),
    # breaker round 4, 2026-12-02: catch-all messages named no flag
    (["train", "--peer-timeout-s", "0"], "--peer-timeout-s must be in (0, 3600] s, got 0"),
    (["train", "--deadline-ms", "-1"], "--deadline-ms must be >= 0, got -1"),
    (["train", "--deadline-ms", "60000", "--peer-timeout-s", "5"],   # breaker, stop 33
     "--deadline-ms must be in 0..2500 (half of --peer-timeout-s 5 s"),
    (["train", "--lr", "-1"], "--lr must be > 0, got -1"),
    (["train", "--hidden", "0"], "--hidden must be >= 1, got 0"),
    (["train", "--dataset", "fashion-mnist", "--data-dir", "/nonexistent/fm"],
     "--data-dir /nonexistent/fm lacks train-images-idx3-ubyte"),
    (["train", "--dataset", "cifar10"], "--dataset cifar10 needs --data-dir"),
    (["train", "--dataset", "cifar10", "--data-dir", "/nonexistent/c"], "is not a folder"),
    (["train", "--model", "vgg11", "--workers", "64", "--batch-size", "8"],
     "--model vgg11 --width 1 needs about"),
    # breaker round, stop 31: weak wording, or accepted silently
    (["sidecar", "--rank", "-3", "--world", "2"], "--rank must be in 0..1 (the flag, env "
                                                   "DGT_RANK or torchrun's RANK), got -3"),
    (["train", "--base-port", "-5"], "--base-port must be in 0..65487 (room for the ports "
                                     "of 4 nodes), got -5"),
    (["train", "--band-codec", "1:int8,1:fp16"], "--band-codec names channel 1 twice"),
    (["sidecar", "--rank", "0", "--world", "1", "--master-listen-fd", "99"],
     "--master-listen-fd 99 is not open in this process"),
    (["tc", "apply", "/", "--dev", "lo", "--dry-run"], "profile file '/' is a folder"),
    # breaker round 25: a device was a profile that "does not exist"
    (["tc", "apply", "/dev/zero", "--dev", "lo", "--dry-run"],
     "profile file '/dev/zero' is not a regular file (a device, a FIFO or a socket)"),
    (["train", "--reliable-codec", "fp8"], "argument --reliable-codec: invalid choice"),
    # outside tester, 2026-12: the clash passed every check, then rank 0's sidecar
    # failed at bind blaming --base-port alone
    (["train", "--base-port", "45000", "--metrics-port", "45000"],
     "--metrics-port 45000 overlaps --base-port 45000: port 45000 would be rank 0's "
     "metrics endpoint (metrics-port + rank) and rank 0's TCP listener"),
    (["train", "--base-port", "45000", "--metrics-port", "44998"],   # 4 ranks: 44998..45001
     "--metrics-port 44998 overlaps --base-port 45000: port 45000 would be rank 2's "
     "metrics endpoint (metrics-port + rank) and rank 0's TCP listener"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_is_one_line(args, message):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", *args], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("env,message", [({"DGT_K": "abc"}, "DGT_K"),
                                         ({"DGT_PACE_MBIT": "1e400"}, "DGT_PACE_MBIT"),
                                         ({"MASTER_PORT": "abc"}, "MASTER_PORT"),
                                         ({"DGT_SEED": str(2**64)}, "env DGT_SEED"),
                                         ({"DGT_WORLD": "1_0"}, "DGT_WORLD='1_0': expected "
                                          "a whole number written in ASCII digits"),
                                         ({"DGT_K_MIN": "0x10"}, "DGT_K_MIN='0x10': "
                                          "expected a number such as 0.5 or 1e-3, got "
                                          "'0x10' (see")])
def test_bad_env_var_is_one_line(env, message):
    import os
    cmd = "sidecar --rank 0 --world 2" if {"MASTER_PORT", "DGT_SEED"} & set(env) \
        else "sidecar --rank 0" if "DGT_WORLD" in env else "train"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", *cmd.split()], capture_output=True,
                       text=True, timeout=60, env={**os.environ, **env})
    assert p.returncode == 2 and message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("cmd", ["", "train", "sidecar", "tc", "testbed", "capture", "pcap",
                                 "replay"])
def test_help_on_every_command(cmd):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", *cmd.split(), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "usage:" in p.stdout


def test_bad_testbed_prefix_for_train_is_one_line():
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--testbed-prefix", "b/r"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "bad --testbed-prefix 'b/r'" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_memory_check_reads_memavailable_and_names_a_job_that_fits(tmp_path):
    """The job's memory estimate against /proc/meminfo's MemAvailable (a file of that
    format here): refused with a --workers that fits; no check without the field."""
    from dgt.config import JobConfig
    from dgt.launch import PROCESS_BASE_BYTES, check_memory
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    job = JobConfig(workers=64, hidden=1024)
    with pytest.raises(ValueError, match=r"--workers 64 --hidden 1024 needs about") as e:
        check_memory(job, str(info))
    fit = int(str(e.value).split("use --workers ")[1].split()[0])
    assert 1 <= fit < 64
    check_memory(JobConfig(workers=fit, hidden=1024), str(info))   # the advice holds
    assert 2 * PROCESS_BASE_BYTES * 64 > 0.9 * 4000000 * 1024      # premise of the case
    info.write_text("MemTotal: 8000000 kB\n")
    check_memory(job, str(info))                                   # no field: no check


def test_only_a_metrics_port_that_is_a_tcp_port_of_the_job_is_refused():
    """Rank r's sidecar listens on TCP base-port + 10 r, its UDP channels on
    base-port + 10 r + c: an endpoint (TCP) may share a number with a UDP channel. On
    the testbed each rank binds in its own namespace: only its own ports clash."""
    from dgt.config import JobConfig, MetricsConfig
    from dgt.launch import check_ports, testbed_master_port
    loopback, testbed = JobConfig(base_port=45000), JobConfig(base_port=45000, testbed=True)
    check_ports(loopback, MetricsConfig(metrics_port=45001))   # UDP channel 1 of rank 0
    check_ports(loopback, MetricsConfig(metrics_port=0))       # off
    check_ports(JobConfig(), MetricsConfig(metrics_port=45000))   # the kernel's ports
    with pytest.raises(ValueError, match="rank 0's metrics endpoint .* rank 1's TCP"):
        check_ports(loopback, MetricsConfig(metrics_port=45010))
    check_ports(testbed, MetricsConfig(metrics_port=45010))    # rank 1's port, in 0's netns
    with pytest.raises(ValueError, match="rank 1's metrics endpoint .* rank 1's TCP"):
        check_ports(testbed, MetricsConfig(metrics_port=45009))
    # the advice holds
    with pytest.raises(ValueError) as e:
        check_ports(loopback, MetricsConfig(metrics_port=45000))
    check_ports(loopback, MetricsConfig(metrics_port=int(str(e.value).split()[-1])))
    # the testbed's rendezvous store steps past rank 0's own ports
    pid = 29450 - 29400
    assert testbed_master_port(pid, {0}) == 29450
    assert testbed_master_port(pid, {29450, 29451, 0}) == 29452


def test_the_digits_split_has_the_samples_that_batch_sizes_are_checked_against():
    from dgt.config import DIGITS_TRAIN_SAMPLES
    from dgt.job import load_digits_split
    assert len(load_digits_split(0)[0]) == DIGITS_TRAIN_SAMPLES


def test_a_report_in_a_missing_folder_creates_no_folder(tmp_path):
    target = tmp_path / "missing" / "deeper" / "r.json"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--report", str(target)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "does not exist" in p.stderr
    assert not (tmp_path / "missing").exists()


def test_node_flags_read_dgt_then_torchrun_variables():
    """Precedence: flag > DGT_* > torchrun's variable > default."""
    from dgt.config import NodeConfig, add_sidecar_arguments, from_args
    p = OneLineParser(prog="t")
    add_sidecar_arguments(p)
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.9",
                "MASTER_PORT": "1234"}
    node = from_args(NodeConfig, p.parse_args([]), environ=torchrun)
    assert (node.rank, node.world, node.master_addr, node.master_port) == \
        (1, 4, "10.0.0.9", 1234)
    # the default socket is in the per-user run folder, never in shared /tmp itself
    assert node.socket == os.path.join(node.run_dir, "sidecar-1.sock") and node.run_dir != "."
    env = {**torchrun, "DGT_RANK": "2", "DGT_MASTER_PORT": "2000", "DGT_SEED": "7"}
    node = from_args(NodeConfig, p.parse_args(["--master-port", "3000"]), environ=env)
    assert (node.rank, node.world, node.master_port, node.seed) == (2, 4, 3000, 7)
    node = from_args(NodeConfig, p.parse_args(["--rank", "0", "--world", "1"]), environ={})
    assert (node.master_addr, node.master_port) == ("127.0.0.1", 29500)


@pytest.mark.parametrize("raw", ["", "four", "2.5"])
def test_a_torchrun_variable_that_is_no_whole_number_says_so(raw):
    # breaker round, stop 41: WORLD_SIZE= gave Python's "invalid literal for int() with
    # base 10: ''"
    from dgt.config import NodeConfig, add_sidecar_arguments, from_args
    p = OneLineParser(prog="t")
    add_sidecar_arguments(p)
    with pytest.raises(ValueError) as e:
        from_args(NodeConfig, p.parse_args([]), environ={"RANK": "0", "WORLD_SIZE": raw})
    assert str(e.value) == (f"WORLD_SIZE={raw!r}: expected a whole number such as 42, "
                            f"got {raw!r}")


def test_a_parser_error_quoting_multiline_text_is_one_line(capsys):
    """A message that quotes a library's own text (which may hold newlines) still
    comes out as one line."""
    p = OneLineParser(prog="t")
    with pytest.raises(SystemExit) as e:
        p.error("cannot read x (A load persistent id instruction was encountered,\n"
                "but no persistent_load function was specified.)")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "encountered, but no persistent_load" in err and "see 't --help'" in err


def test_top_without_a_terminal_checks_its_run_dir_as_once_does():
    # breaker round, stop 27: with stdin not a terminal, 'dgt top' prints the table once
    # (as --once) but skipped --once's checks: a waiting frame and exit 0 for a folder
    # that does not exist
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", "/nonexistent-dgt-run"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "/nonexistent-dgt-run does not exist" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "waiting" not in p.stdout


def test_a_model_too_large_for_one_worker_asks_for_a_smaller_model(tmp_path):
    """breaker: --hidden 100000 said 'use --workers 1 or fewer', which does not fit
    either: when one worker does not fit, the message asks for a smaller model."""
    from dgt.config import JobConfig
    from dgt.launch import check_memory
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    with pytest.raises(ValueError) as e:
        check_memory(JobConfig(workers=4, hidden=100000), str(info))
    assert str(e.value).startswith("--hidden 100000 needs about "), e.value
    assert "not even --workers 1 fits; use a smaller --hidden" in str(e.value)
    assert "or fewer" not in str(e.value)



def test_a_link_local_host_without_its_scope_is_one_line_saying_so():
    """Breaker round 6: ``dgt sidecar --host fe80::1`` said only ``[Errno 22] Invalid
    argument``. (Only a bind is tried: nothing is sent.)"""
    import socket
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip(reason="this host has no IPv6 loopback")
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                        "--world", "1", "--host", "fe80::1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("dgt sidecar: error: --host fe80::1: cannot listen there "
                                "(Invalid argument); a link-local IPv6 address needs its "
                                "interface, e.g. fe80::1%eth0"), p.stderr

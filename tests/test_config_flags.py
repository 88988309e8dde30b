"""Every flag of 'dgt train' and 'dgt sidecar' is one dataclass field with one DGT_* env
var and one default (the dataclass's), through dgt.config.add_arguments/from_args."""
import argparse
import dataclasses

import pytest

from dgt.cli import build_parser
from dgt.config import (CheckpointConfig, JobConfig, MetricsConfig, NodeConfig,
                        TransmissionConfig, from_args)

COMMANDS = {"train": (JobConfig, TransmissionConfig, MetricsConfig, CheckpointConfig),
            "sidecar": (NodeConfig, TransmissionConfig, MetricsConfig)}
#: what a field needs from the others to validate (a node needs its rank and world)
BASE_ENV = {NodeConfig: {"DGT_RANK": "0", "DGT_WORLD": "2"}}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flags(name: str):
    return [a for a in _subparser(name)._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _candidates(f, default):
    """Values other than the default that the field may take, as env text."""
    if f.type in ("bool", bool):
        return [str(not default).lower()]
    if f.metadata.get("choices"):
        return [c for c in f.metadata["choices"] if c != default]
    if f.type in ("int", int):
        return [str(v) for v in (default + 1, 2 * default, 1, 2, 20000, 3) if v != default]
    if f.type in ("float", float):
        return [str(v) for v in (default / 2, default + 1, 0.25, 5.0, 2.0, 0.0)
                if v != default]
    return ["127.0.0.2", "dirichlet:0.5", "abc", "/tmp", "cuda", "2:bf16"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_is_one_field_with_its_env_var_and_one_default(command, tmp_path):
    classes = COMMANDS[command]
    owner = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert f.name not in owner, f"{f.name} is a field of two classes"
            owner[f.name] = (cls, f)
    seen = set()
    for action in _flags(command):
        flag = action.option_strings[0]
        if action.dest == "version":
            continue
        assert action.dest in owner, f"dgt {command} {flag} is no dataclass field"
        cls, f = owner[action.dest]
        assert flag == "--" + f.name.replace("_", "-")
        # the parser holds no default of its own: the dataclass's is the only one
        assert action.default is None, f"{flag} has its own default {action.default!r}"
        assert f"env DGT_{f.name.upper()}" in action.help
        seen.add(f.name)
        # the env var alone sets the field to a value other than the default
        ns = _subparser(command).parse_args([])
        base = dict(BASE_ENV.get(cls, {}))
        base.pop(f"DGT_{f.name.upper()}", None)
        if f.name == "rank":
            base["DGT_WORLD"] = "4"
        taken = None
        for raw in _candidates(f, f.default):
            try:
                taken = (raw, getattr(from_args(cls, ns, {**base, f"DGT_{f.name.upper()}":
                                                          raw}), f.name))
                break
            except ValueError:
                continue
        assert taken, f"no value of DGT_{f.name.upper()} was taken"
        raw, got = taken
        assert got != f.default, (f.name, raw, got)
        want = {"int": int, "float": float}.get(f.type, None)
        assert got == (want(raw) if want else raw.upper() if f.name == "log_level"
                       else raw.lower() == "true" if f.type == "bool" else raw), \
            (f.name, raw, got)
    assert seen == set(owner), f"fields without a flag: {set(owner) - seen}"


def test_a_testbed_prefix_without_testbed_is_a_warning():
    """Breaker round 4: --testbed-prefix without --testbed was taken in silence, where
    --k-min and --local-steps without what they need are refused."""
    from dgt.config import JobConfig
    assert any("--testbed-prefix lab is ignored without --testbed" in w
               for w in JobConfig(testbed_prefix="lab").warnings())
    assert JobConfig(testbed_prefix="lab", testbed=True).warnings() == []
    assert JobConfig().warnings() == []


def test_a_size_flag_the_model_does_not_use_is_a_warning():
    """Breaker round 9: --width with --model mlp and --hidden with a CNN were taken in
    silence, and the job trained the default size."""
    from dgt.config import JobConfig
    assert JobConfig(model="mlp", width=4.0).warnings() == [
        "--width 4 (or DGT_WIDTH) is ignored: --model mlp is sized by --hidden"]
    assert JobConfig(model="vgg11", hidden=64).warnings() == [
        "--hidden 64 (or DGT_HIDDEN) is ignored: --model vgg11 is sized by --width"]
    assert JobConfig(model="mlp", hidden=64).warnings() == []
    assert JobConfig(model="vgg11", width=0.25).warnings() == []


def test_a_data_dir_with_both_forms_of_a_file_is_a_warning(tmp_path):
    """Breaker round 9: a --data-dir holding train-images-idx3-ubyte both gzipped and
    plain (two versions, perhaps) read the .gz in silence."""
    from dgt.config import JobConfig
    job = JobConfig(dataset="fashion-mnist", data_dir=str(tmp_path))
    assert job.warnings() == []
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    assert job.warnings() == []
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    assert job.warnings() == [f"{tmp_path} holds train-images-idx3-ubyte both gzipped "
                              f"and plain; the .gz file is read"]
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"")
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"")
    assert job.warnings()[0].endswith("both gzipped and plain; the .gz files are read")


def test_restarts_without_checkpoints_are_a_warning():
    """Breaker round 9: --max-restarts without --checkpoint-every said nothing, and each
    restart trained from iteration 0 again."""
    from dgt.config import CheckpointConfig
    assert CheckpointConfig(max_restarts=2).warnings() == [
        "--max-restarts 2 without --checkpoint-every: a restart starts the job again "
        "from iteration 0"]
    assert CheckpointConfig(max_restarts=2, checkpoint_every=5).warnings() == []
    assert CheckpointConfig(max_restarts=2, resume="/x/step-4").warnings() == []
    assert CheckpointConfig().warnings() == []


def test_a_negative_zero_is_zero():
    """Breaker round 4: '--k -0.0' was logged as 'k -0.0' and '--pull-coded-fraction -0'
    as 'the lowest -0 of each PULL'."""
    from dgt.config import finite
    assert repr(finite(float)("-0.0")) == "0.0" and repr(finite(float)("-0")) == "0.0"
    assert finite(int)("-0") == 0 and finite(float)("-2.5") == -2.5


def test_the_start_up_grace_grows_with_the_processes_per_cpu():
    """Breaker round 10: 'dgt train --workers 16' on 2 CPUs (33 processes starting at
    once) named rank 0, alive, dead: its store had not answered within --peer-timeout-s
    + 10 s of start-up. dgt train now gives its sidecars a grace that grows with the
    processes per CPU, and its trainers a timeout longer than the sidecars' first wait."""
    import os
    from dgt.config import (MAX_PEER_TIMEOUT_S, START_SKEW_S, STARTUP_GRACE_S, JobConfig,
                            TransmissionConfig, startup_grace_s, trainer_timeout_s)
    from dgt.launch import Job
    assert startup_grace_s(3, 16) == STARTUP_GRACE_S
    assert startup_grace_s(33, 2) == 82.5 and startup_grace_s(9, 2) == 22.5
    # the machine's own load queues for the CPUs too (CI of d97866f: 2 workers under a
    # load average of 21.8 on 2 CPUs were named dead after 30 s)
    assert startup_grace_s(5, 2, load=21.8) == 5.0 * 26.8 / 2
    assert startup_grace_s(5, 2, load=1e9) == MAX_PEER_TIMEOUT_S   # a valid flag
    cpus = len(os.sched_getaffinity(0))
    low = startup_grace_s(33, cpus)
    job = Job(JobConfig(workers=16), TransmissionConfig())
    assert low <= job.startup_grace_s <= startup_grace_s(33, cpus, os.getloadavg()[0] + 5)
    for peer in (1.0, 20.0, 200.0):
        for grace in (STARTUP_GRACE_S, 82.5, 300.0):
            assert trainer_timeout_s(peer, grace) > peer + max(START_SKEW_S, grace)
    assert trainer_timeout_s(20.0) == 60.0 + START_SKEW_S   # the default: unchanged


def test_flags_this_configuration_does_not_use_are_warnings():
    """Breaker round 10: these were taken in silence; each changes nothing here."""
    from dgt.config import CheckpointConfig, MetricsConfig, TransmissionConfig
    assert TransmissionConfig(mode="tcp", k=0.1, channels=7, drop_udp=0.5).warnings() == [
        "--k 0.1, --channels 7, --drop-udp 0.5 are ignored with --mode tcp (every block "
        "goes over the reliable channel)"]
    assert TransmissionConfig(mode="tcp").warnings() == []
    assert TransmissionConfig(mode="dgt", k=0.1, channels=7).warnings() == []
    assert TransmissionConfig(pull_codec="fp32", pull_coded_fraction=0.3).warnings() == [
        "--pull-coded-fraction 0.3 is ignored with --pull-codec fp32 (no PULL block is "
        "coded)"]
    assert TransmissionConfig(adaptive_deadline=False, deadline_max_ms=500.0
                              ).warnings() == [
        "--deadline-max-ms 500.0 is ignored with --no-adaptive-deadline (the wait after "
        "END is --deadline-ms)"]
    # breaker round 23: DGT_K_MIN (or a sidecar's --k-min) alone was taken in silence
    assert TransmissionConfig(k_min=0.1).warnings() == [
        "--k-min 0.1 (or DGT_K_MIN) is ignored without --adaptive-k or --time-budget-ms "
        "(k stays --k)"]
    assert TransmissionConfig(k_min=0.1, adaptive_k=True).warnings() == []
    assert TransmissionConfig(k_min=0.1, time_budget_ms=50.0).warnings() == []
    assert TransmissionConfig(mode="tcp", k_min=0.1).warnings() == [
        "--k-min 0.1 is ignored with --mode tcp (every block goes over the reliable "
        "channel)"]
    assert MetricsConfig(metrics_host="::1").warnings() == [
        "--metrics-host ::1 is ignored without --metrics-port (no metrics endpoint)"]
    assert MetricsConfig(metrics_host="::1", metrics_port=9100).warnings() == []
    assert CheckpointConfig(checkpoint_dir="/x").warnings() == [
        "--checkpoint-dir /x is ignored without --checkpoint-every (no checkpoint is "
        "saved)"]
    assert CheckpointConfig(checkpoint_dir="/x", checkpoint_every=5).warnings() == []


def test_dgt_train_prints_each_ignored_flag_once_at_the_start(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "2",
                        "--hidden", "8", "--iterations", "1", "--eval-every", "0",
                        "--mode", "tcp", "--k", "0.1", "--metrics-host", "::1",
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "is ignored" in ln]
    assert lines == [
        "dgt train: warning: --k 0.1 is ignored with --mode tcp (every block goes over "
        "the reliable channel)",
        "dgt train: warning: --metrics-host ::1 is ignored without --metrics-port (no "
        "metrics endpoint)"], p.stderr[-3000:]

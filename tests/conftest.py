import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from dgt.tc_profiles import system

pytest_plugins = ["stop_on_sigterm"]   # SIGTERM tears the fixtures down, as Ctrl-C does


def pytest_configure(config):
    """Every process the tests start makes its temporary folders (``dgt train``'s run
    dir without --run-dir, kept with its logs when a job fails on purpose, ``dgt
    bench``'s cells) in one folder of this session, removed when the session ends:
    they are the tests' to clean up, not /tmp's to collect (breaker round, stop 40:
    a dozen /tmp/dgt-run-* left by one afternoon's tests). The folder is 1777, as /tmp
    is, for the processes run as uid 65534. This process keeps /tmp (pytest's own
    tmp_path folders are kept there for a look after a failure)."""
    tempfile.gettempdir()   # cached now: this process (and pytest) keeps /tmp
    folder = tempfile.mkdtemp(prefix="dgt-tests-", dir="/tmp")
    os.chmod(folder, 0o1777)
    os.environ["TMPDIR"] = folder
    config.stash[_CHILDREN_TMPDIR] = folder


def pytest_unconfigure(config):
    folder = config.stash.get(_CHILDREN_TMPDIR, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


_CHILDREN_TMPDIR = pytest.StashKey[str]()


def children_tmpdir() -> str:
    """The folder where the tests' child processes make their temporary folders."""
    return os.environ["TMPDIR"]


def requires_tool(tool: str, why: str = ""):
    """A skip mark for a test that needs system tool ``tool`` (``"libpcap"`` for the
    library): the reason names the tool and the Debian package to install. Checked
    against ``PATH`` (libpcap: loaded the way scapy loads it), never assumed from root."""
    return pytest.mark.skipif(not system.have(tool),
                              reason=system.missing_message(tool, why or "this test"))


def needs(*tools: str, root: str = ""):
    """Decorator: :func:`requires_tool` for each of ``tools``, and :func:`requires_root`
    (``root`` says what root is for) when given."""
    def deco(fn):
        for tool in tools:
            fn = requires_tool(tool)(fn)
        return requires_root(root)(fn) if root else fn
    return deco


def requires_root(why: str):
    """Skip without root, saying what root is for."""
    return pytest.mark.skipif(os.geteuid() != 0, reason=f"needs root ({why})")


def run_train(tmp_path, *args, timeout=240, check=True):
    """Run 'dgt train' as a user would; return (CompletedProcess, report dict or None)."""
    tmp_path.mkdir(parents=True, exist_ok=True)   # --report's folder must exist
    report = tmp_path / "report.json"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dgt.cli", "train", "--report", str(report),
           "--run-dir", str(run_dir), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(report.read_text()) if report.exists() else None
    return p, rep


def logs_of(run_dir) -> str:
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.endswith(".log"):
            with open(os.path.join(run_dir, name), errors="replace") as f:
                out.append(f"== {name}\n" + f.read())
    return "\n".join(out)


def stop_procs(*procs, timeout_s=30):
    """SIGTERM what is still running, wait for it, SIGKILL what does not stop."""
    import signal
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def kill_after_checkpoint(p, ck, world: int, victim, timeout_s: float = 240) -> int:
    """Once a complete checkpoint of ``world`` ranks is under ``ck`` (while ``p`` runs),
    SIGSTOP then SIGKILL the pid ``victim()`` returns (stopped first: the job cannot end
    in between). Returns that pid."""
    import signal
    import time

    from dgt import checkpoint
    t_end = time.monotonic() + timeout_s
    while checkpoint.latest(str(ck), world) is None:
        assert p.poll() is None, p.communicate()[0]
        assert time.monotonic() < t_end, f"no checkpoint within {timeout_s} s"
        time.sleep(0.02)
    pid = victim()
    os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture
def train(tmp_path):
    return lambda *a, **kw: run_train(tmp_path, *a, **kw)


@pytest.fixture
def veth():
    """(netns, dev): a veth pair 'va'/'vb' in a fresh netns, removed even on failure."""
    from pyroute2 import netns as pr_netns

    from dgt.tc_profiles._nl import open_ipr
    ns = f"dgttest-{uuid.uuid4().hex[:8]}"
    pr_netns.create(ns)
    try:
        with open_ipr(ns) as ipr:
            ipr.link("add", ifname="va", kind="veth", peer={"ifname": "vb"})
            for n in ("va", "vb"):
                ipr.link("set", index=ipr.link_lookup(ifname=n)[0], state="up")
        yield ns, "va"
    finally:
        pr_netns.remove(ns)


def as_nobody() -> list[str]:
    """argv prefix that runs a command as uid/gid 65534 (setpriv, util-linux); skips the
    test, saying why, when not root or without setpriv."""
    import shutil
    if os.geteuid() != 0:
        pytest.skip(reason="needs root: the test runs a process as another user (uid 65534)")
    if not shutil.which("setpriv"):
        pytest.skip(reason="needs setpriv (Debian package util-linux)")
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]


@pytest.fixture
def shared_tmp():
    """A new folder in /tmp for a test that another user must reach (``tmp_path`` is
    0700), removed after the test whether it passes, fails or skips part-way: made in
    the test body, one left behind by a skip (breaker round, stop 40: a drwxrwxrwt
    /tmp/dgt-squat-* after every run as a normal user)."""
    path = tempfile.mkdtemp(prefix="dgt-test-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def device_node(tmp_path, name: str, minor: int) -> str:
    """A character device node of the mem driver (major 1: /dev/null is minor 3,
    /dev/full 7) made in ``tmp_path``, so a writer that wrongly renamed over it (as
    dgt.atomic once did) replaces that copy, never the machine's own. Skips when not
    root or where ``tmp_path`` is mounted nodev."""
    import stat
    if os.geteuid() != 0:
        pytest.skip(reason="needs root: makes a device node (mknod)")
    path = str(tmp_path / name)
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    try:
        open(path, "wb").close()
    except PermissionError:
        pytest.skip(reason=f"{tmp_path} is mounted nodev: a device node there cannot be "
                    f"opened")
    return path


@pytest.fixture
def dev_full(tmp_path):
    """A path that behaves as /dev/full (every write fails with ENOSPC): as root a node
    of the test's own (:func:`device_node`), as another user the real /dev/full, which
    that user cannot replace."""
    return device_node(tmp_path, "full", 7) if os.geteuid() == 0 else "/dev/full"


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(size, name="tiny", mode="")``: a tmpfs of ``size`` (mount's size=, e.g.
    "8k", "1m") at ``tmp_path/name`` (``mode``: mount's mode=, e.g. "700"), for a disk
    that fills; unmounted after the test. Skips when not root or mount(8) fails."""
    if os.geteuid() != 0:
        pytest.skip(reason="needs root: mounts a small tmpfs (a disk that fills)")
    mounted = []

    def mount(size: str, name: str = "tiny", mode: str = ""):
        mnt = tmp_path / name
        mnt.mkdir()
        opts = f"size={size}" + (f",mode={mode}" if mode else "")
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "dgt-test", str(mnt)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(reason=f"cannot mount a tmpfs here: {p.stderr.strip()}")
        mounted.append(mnt)
        return mnt
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def doc_names(path: str, heading: str) -> set[str]:
    """The names in backticks (`` `name` ``, a word) in the section of ``path`` (from
    the repository root) under ``heading``, to the next heading of its level or
    higher: what a test checks the keys a tool writes against."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / path).read_text()
    start = text.index(heading + "\n") + len(heading)
    level = len(heading.split(" ")[0])
    end = re.compile(r"^#{1,%d} " % level, re.M).search(text, start)
    return set(re.findall(r"`(\w+)`", text[start:end.start() if end else None]))


def doc_table_keys(path: str, heading: str) -> list[str]:
    """The first column's names (`` | `name` | ``) of the table rows in the section of
    ``path`` under ``heading``, to the next heading of any level: the keys a page
    documents one per row, which a test compares with the keys a tool writes."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / path).read_text()
    start = text.index(heading + "\n") + len(heading)
    end = text.find("\n#", start)
    return re.findall(r"^\| `(\w+)` \|", text[start:end if end >= 0 else None], re.M)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sidecar(tmp_path):
    """A hand-started sidecar of a one-worker job: (its socket's path, the process).
    Stopped after the test, and its shared-memory buffers removed (a sidecar killed
    with SIGKILL, here or by a test, cannot unlink them)."""
    import glob
    path = str(tmp_path / "s.sock")
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                          "--world", "1", "--master-port", str(free_port()), "--socket",
                          path, "--run-dir", str(tmp_path)], stderr=subprocess.PIPE,
                         text=True)
    yield path, p
    if p.poll() is None:
        p.kill()
    p.wait(timeout=30)
    for f in glob.glob(os.path.join("/dev/shm", f"dgt-{p.pid}-*")):
        os.unlink(f)

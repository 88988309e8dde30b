"""The files a ``dgt train`` job leaves in its run dir, by name: which are one rank's,
how many ranks the job that wrote them has, and removing what a previous job left.

A run dir given again (``--run-dir``) to a job with fewer workers kept the old job's
files of the ranks the new one lacks, and every reader that globbed ``trace-*.jsonl``
or ``sidecar-*.json`` mixed them in: the report counted the old job's blocks and its
``param_sha256`` (docs/architecture.md, "What a run leaves in its run dir"). So the
launcher removes them before it starts (:func:`clear_previous`), and the readers take
only ranks ``0..world-1`` (:func:`job_world`, :func:`in_job`).
"""
from __future__ import annotations

import errno
import glob
import os
import re

from .jsonparse import loads

#: every file of one rank that a job writes in its run dir, ``{}`` for the rank: the
#: launcher's logs and socket (dgt.launch.Job._spawn, Job._socket_path), the trainer's
#: result (dgt.job), the sidecar's endpoints (dgt.sidecar), its trace (dgt.trace), its
#: report, final metrics and conservation sums (dgt.node_report), and the failure
#: records of both processes (dgt.failure.record_path)
RANK_FILES = ("sidecar-{}.json", "sidecar-{}.log", "sidecar-{}.sock", "trainer-{}.json",
              "trainer-{}.log", "trace-{}.jsonl", "endpoints-{}.json", "metrics-{}.prom",
              "conservation-{}.npz", "failure-sidecar-{}.json", "failure-trainer-{}.json")
#: the launcher's own files of one job: what it started (the readers' world) and the
#: failure it stopped the job for (read by a sidecar that gets SIGTERM)
JOB_FILES = ("pids.json", "failure.json")
#: what else dgt leaves in a run dir, which clear_previous keeps: the launcher's lock
#: (dgt.launch.Job.lock), a report where dgt's benches write it (``--report
#: <run-dir>/report.json``), their capture of the job's output (``stdout.log``,
#: dgt.tools.bench.run_job), and the figures of ``dgt plot RUN_DIR`` (dgt.plot.plot)
KEPT_FILES = ("lock", "report.json", "stdout.log", "accuracy_time.png",
              "accuracy_iteration.png", "comm_time.png", "channel_bytes.png")
#: the checkpoint folder of a job that checkpoints without --checkpoint-dir
#: (dgt.launch.Job.checkpoint_dir)
CHECKPOINTS = "checkpoints"
#: where a restart moved a failed attempt's files (dgt.launch.Job.restart_from)
ATTEMPT = re.compile(r"attempt-[1-9][0-9]*")
#: a torchrun restart's own run dir under DGT_RUN_DIR (dgt.ddp.node.NodeLink.spawn)
RESTART = re.compile(r"restart-[1-9][0-9]*")
#: dgt.atomic.write_json's temporary file of NAME (``.NAME.<random>.tmp``), left when a
#: process died mid-write
_ATOMIC_TMP = re.compile(r"\.(.+)\.[a-z0-9_]+\.tmp")
#: a checkpoint's step folder (dgt.checkpoint.step_dir), when --checkpoint-dir is the
#: run dir itself
_STEP = re.compile(r"step-[0-9]+")
# a rank as dgt writes it: no sign, no leading zero
_RANKED = [re.compile(re.escape(a) + r"(0|[1-9][0-9]*)" + re.escape(b))
           for a, b in (t.split("{}") for t in RANK_FILES)]


def rank_of(name: str) -> int | None:
    """The rank of ``name`` when it is one of RANK_FILES (a base name, e.g.
    ``trace-2.jsonl`` -> 2); None for any other name."""
    for pattern in _RANKED:
        m = pattern.fullmatch(name)
        if m:
            return int(m.group(1))
    return None


#: the most bytes a reader takes of a JSON record it reads whole (``trainer-<r>.json``,
#: ``sidecar-<r>.json``, ``pids.json``, a failure record, a ``--report``): far beyond
#: any run's (a trainer's record of a million iterations holds some 60 MB), yet a file
#: of many GB where kilobytes are expected is refused rather than read into memory
MAX_RECORD = 256 << 20
#: bytes :func:`read_json` reads at a time
READ_CHUNK = 1 << 20


class RefusedFile(OSError):
    """A run dir's file that a reader does not read: not a regular file (a FIFO would
    block it, a device such as /dev/zero never ends, a directory is no file), or larger
    than it may be. ``filename``: its path; ``strerror``: what it is, e.g. ``a FIFO,
    not a regular file``; ``str()``: both, one line."""

    def __init__(self, path: str, why: str):
        super().__init__(None, why, path)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _kind(path: str, st: os.stat_result) -> str:
    """What the file at ``path`` (``st``: its stat, through a link) is when not a regular
    file: ``a FIFO``, ``a directory``, ``a symbolic link to a character device
    (/dev/zero)``..."""
    import stat
    what = next((name for test, name in (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket")) if test(st.st_mode)), "a special file")
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        shown = target if target.isprintable() else ascii(target)
        what = f"a symbolic link to {what} ({shown[:80]})"
    return what


def not_regular(path: str) -> str | None:
    """What ``path`` is when it is there but is not a regular file, in the words of
    :class:`RefusedFile` (``a FIFO``, ``a directory``, ``a symbolic link to …``), or
    ``a dangling symbolic link``; None when it is a regular file or is not there.
    Raises OSError when it cannot be looked at (EACCES on a folder above it)."""
    import stat
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "a dangling symbolic link" if os.path.islink(path) else None
    return None if stat.S_ISREG(st.st_mode) else _kind(path, st)


def open_regular(path: str, limit: int | None = None):
    """``path`` opened for reading (binary, O_CLOEXEC) when it is a regular file,
    through a symbolic link (a run dir's files may be links to regular files). Nothing
    else is opened or read: a FIFO (whose open and read wait for a writer), a device
    (``/dev/zero`` never ends; opening some acts), a directory, a socket. Checked
    before the open and again, on what was opened, after it (O_NONBLOCK: a FIFO put
    there meanwhile does not block the open). ``limit``: the most bytes the file may
    have (None: any size). Raises RefusedFile (an OSError, one line naming ``path`` and
    what it is, or its size), OSError when it cannot be opened (missing, no
    permission)."""
    import stat
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFile(path, f"{_kind(path, st)}, not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(path, f"{_kind(path, st)}, not a regular file")
        if limit is not None and st.st_size > limit:
            raise RefusedFile(path, _over(st.st_size, limit))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _over(size: int, limit: int) -> str:
    """Why a file of ``size`` bytes is refused: over ``limit`` bytes."""
    return f"{size:,} bytes, over the limit of {limit:,} bytes"


def read_json(path: str, limit: int = MAX_RECORD):
    """The JSON document in the regular file ``path`` (:func:`open_regular`) of at most
    ``limit`` bytes (default :data:`MAX_RECORD`; one that grows past it while read is
    refused too). Raises RefusedFile (an OSError naming ``path``: not a regular file,
    or over ``limit``), OSError when it cannot be read, ValueError when it is not JSON
    (UnicodeDecodeError: not UTF-8)."""
    chunks, total = [], 0
    with open_regular(path, limit) as f:
        # 1 MiB at a time: read(limit + 1) would allocate all of the limit (256 MiB)
        # for a record of a few hundred bytes, and fail under an address-space limit
        while chunk := f.read(min(READ_CHUNK, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise RefusedFile(path, _over(total, limit))
    return loads(b"".join(chunks))


def job_world(run_dir: str, notes: list[str] | None = None) -> int | None:
    """The ranks of the job that last started in ``run_dir``: one more than the highest
    sidecar rank in its ``pids.json`` (dgt.launch.Job.start). None when there is none,
    or it cannot be read (a sidecar started by hand; a run dir of an older dgt). A
    ``pids.json`` that is not a regular file or too large (:func:`read_json`) is not
    read, and said in ``notes`` when given (``<path>: a FIFO, not a regular file;
    skipped``)."""
    try:
        procs = read_json(os.path.join(run_dir, "pids.json"))
        ranks = [p["rank"] for p in procs if p["kind"] == "sidecar"]
    except RefusedFile as e:
        if notes is not None:
            notes.append(f"{e}; skipped")
        return None
    except (OSError, ValueError, TypeError, KeyError):
        return None
    ok = ranks and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                       for r in ranks)
    return max(ranks) + 1 if ok else None


def in_job(rank: int, world: int | None) -> bool:
    """Whether ``rank`` is one of the job's ranks ``0..world-1`` (every rank is when
    ``world`` is None: not known)."""
    return world is None or 0 <= rank < world


def of_job(pattern: str, world: int | None) -> list[str]:
    """The paths the glob ``pattern`` (e.g. ``<run-dir>/trace-*.jsonl``) matches, sorted;
    with ``world``, only per-rank names (RANK_FILES) of ranks 0..world-1."""
    paths = sorted(glob.glob(pattern))
    if world is None:
        return paths
    return [p for p in paths
            if (r := rank_of(os.path.basename(p))) is not None and in_job(r, world)]


def clear_previous(run_dir: str, keep: tuple[str, ...] = ()) -> int:
    """Remove what a previous job left in ``run_dir``: its RANK_FILES and JOB_FILES, and
    the same names in its ``attempt-<i>`` folders, each folder then removed when empty.
    Nothing else is touched: not ``lock``, a report, a checkpoint (``trainer-<r>.pt``,
    step folders), a user's file, nor an attempt folder that holds a path of ``keep``
    (the checkpoint dir, the --resume folder). Call it holding the run dir's lock.
    Returns the files removed. Raises OSError when one cannot be removed."""
    removed = _remove_own_files(run_dir)
    keep = tuple(os.path.abspath(k) for k in keep if k)
    for name in sorted(os.listdir(run_dir)):
        folder = os.path.join(run_dir, name)
        if not ATTEMPT.fullmatch(name) or os.path.islink(folder) or \
                not os.path.isdir(folder) or \
                any(_within(k, os.path.abspath(folder)) for k in keep):
            continue
        removed += _remove_own_files(folder)
        if not os.listdir(folder):
            os.rmdir(folder)
    return removed


def _remove_own_files(folder: str) -> int:
    """Unlink every RANK_FILES or JOB_FILES name in ``folder`` that is not a folder (a
    symbolic link goes, never its target). Returns how many."""
    n = 0
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        ours = rank_of(name) is not None or name in JOB_FILES
        if ours and (os.path.islink(path) or not os.path.isdir(path)):
            os.unlink(path)
            n += 1
    return n


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (absolute paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def is_own(name: str, folder: str) -> bool:
    """Whether the entry ``name`` of the run dir ``folder`` is one dgt puts in a run dir:
    a file of RANK_FILES, JOB_FILES or KEPT_FILES (or its leftover temporary file), a
    Unix socket (a sidecar's --socket), the ``checkpoints`` folder, an ``attempt-<i>``
    folder or a ``restart-<i>`` folder."""
    import stat
    path = os.path.join(folder, name)
    try:
        st = os.lstat(path)
    except OSError:   # gone meanwhile
        return True
    if stat.S_ISSOCK(st.st_mode):
        return True
    if stat.S_ISDIR(st.st_mode):
        return name == CHECKPOINTS or any(r.fullmatch(name) for r in (ATTEMPT, RESTART))
    m = _ATOMIC_TMP.fullmatch(name)
    base = m.group(1) if m else name
    return rank_of(base) is not None or base in JOB_FILES or base in KEPT_FILES


def has_own_files(run_dir: str) -> bool:
    """Whether ``run_dir`` is the run dir of an earlier dgt job: it holds at least one
    of dgt's own run files (a name of RANK_FILES or JOB_FILES, e.g. ``sidecar-0.log``,
    ``endpoints-0.json``, ``pids.json``) as a regular file (not a symbolic link, not a
    folder). False for a folder that cannot be read."""
    import stat
    try:
        names = os.listdir(run_dir)
    except OSError:
        return False
    for name in names:
        if rank_of(name) is None and name not in JOB_FILES:
            continue
        try:
            if stat.S_ISREG(os.lstat(os.path.join(run_dir, name)).st_mode):
                return True
        except OSError:   # gone meanwhile
            continue
    return False


def foreign(run_dir: str, keep: tuple[str, ...] = ()) -> list[str]:
    """The names in ``run_dir`` that are not dgt's (:func:`is_own`), sorted (hidden
    ones last); [] for a folder that is new, empty, holds dgt's files alone, or is the
    run dir of an earlier dgt job (:func:`has_own_files`: one of its RANK_FILES or
    JOB_FILES as a regular file), whose other files are the user's (the report, the
    checkpoints, a DDP script's outputs that an earlier job wrote there) and are left
    alone. ``keep``: paths this job itself names there (its --report,
    --checkpoint-dir, --resume, --socket): the run dir's entry that holds one is the
    job's, so a new folder may hold them. The rule a run dir must pass before a job
    writes there (:func:`check_run_dir`), with the same lists that
    :func:`clear_previous` removes from."""
    try:
        names = sorted(os.listdir(run_dir), key=lambda n: (n.startswith("."), n))
    except OSError:   # not there yet (or not a folder, not ours: other checks say so)
        return []
    if has_own_files(run_dir):
        return []
    top = os.path.abspath(run_dir)
    mine, steps = set(), False
    for k in keep:
        k = os.path.abspath(k) if k else ""
        if k == top:
            steps = True   # --checkpoint-dir is the run dir: its step-<t> folders
        elif k and _within(k, top):
            mine.add(os.path.relpath(k, top).split(os.sep)[0])
    return [n for n in names if n not in mine and not is_own(n, run_dir) and
            not (steps and _STEP.fullmatch(n))]


def check_run_dir(run_dir: str, flag: str = "--run-dir",
                  keep: tuple[str, ...] = ()) -> None:
    """Refuse a run dir that a job must not write in: a dangling symbolic link (there
    is no folder to make), or a folder that holds files that are not dgt's
    (:func:`foreign`) and none of dgt's own run files, as /etc, a home folder or a
    project folder do: a job would litter it with its logs and records, and truncate
    files of those names (``--run-dir /etc``, ``--run-dir ~``). A new or empty folder,
    or the run dir of an earlier dgt job (one of its RANK_FILES or JOB_FILES, e.g.
    ``pids.json``, there as a regular file), passes. Raises ValueError, one line naming
    ``flag``."""
    if os.path.islink(run_dir) and not os.path.exists(run_dir):
        try:
            os.stat(run_dir)
        except OSError as e:   # breaker round 11: a link loop read as dangling
            if e.errno == errno.ELOOP:
                from .outpath import folder_problem
                raise ValueError(f"{flag} {folder_problem(run_dir)}; remove the link, or "
                                 f"give another folder") from None
        try:
            target = os.readlink(run_dir)
        except OSError:
            target = "?"
        raise ValueError(f"{flag} {run_dir} is a dangling symbolic link to {target}; "
                         f"remove it, or create the folder it names")
    names = foreign(run_dir, keep)
    if not names:
        return
    shown = ", ".join(n if n.isprintable() else ascii(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    raise ValueError(f"{flag} {run_dir} holds files that are not dgt's ({shown}{more}); "
                     f"give a new or empty folder, or the run dir of an earlier dgt job "
                     f"(one that holds a file it wrote, e.g. pids.json or sidecar-0.log)")


def open_lock(run_dir: str, flag: str = "--run-dir") -> int:
    """Open (or create, mode 0666 less the umask) ``<run_dir>/lock`` for a lock of the
    run dir: dgt train's whole-file flock (dgt.launch.Job.lock), a DDP trainer's byte
    of its rank (dgt.ddp.node.take_rank). Never through a symbolic link (O_NOFOLLOW: a
    link would have us write through it, truncating its target) and never blocking on a
    FIFO (O_NONBLOCK). Returns the descriptor (O_CLOEXEC). Raises ValueError naming
    ``flag`` when ``lock`` is a symbolic link or not a regular file (nothing touched),
    OSError naming the path for any other failure."""
    import errno
    import stat
    path = os.path.join(run_dir, "lock")
    bad = f"{flag} {run_dir}: its lock ({path}) is "
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK |
                     os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(bad + "a symbolic link; remove it") from None
        if e.errno == errno.EISDIR:
            raise ValueError(bad + "not a regular file; remove it") from None
        raise OSError(e.errno, e.strerror, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):   # a FIFO, a device
        os.close(fd)
        raise ValueError(bad + "not a regular file; remove it")
    return fd


def lock_holder(fd: int, start: int = 0, length: int = 0) -> int | None:
    """The pid of a process holding a fcntl(2) lock on bytes ``start`` .. ``start +
    length`` of ``fd`` (``length`` 0: to the end), as F_GETLK reports it, or None."""
    import fcntl
    import struct
    fmt = "hhqqi4x"   # struct flock on Linux's 64-bit ABIs
    got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(fmt, fcntl.F_WRLCK, os.SEEK_SET, start,
                                                     length, 0))
    kind, _, _, _, pid = struct.unpack(fmt, got)
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None


def share_lock(fd: int, run_dir: str, flag: str) -> None:
    """Take a shared flock(2) on the run dir's lock ``fd`` (:func:`open_lock`) for a
    torchrun job's trainer: many trainers share it, and it keeps ``dgt train``, which
    takes it exclusively (dgt.launch.Job.lock), off a run dir a torchrun job is using.
    Raises RuntimeError naming that ``dgt train`` (the pid it wrote into the lock) when
    it holds the run dir."""
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        raise RuntimeError(f"{flag} {run_dir} is in use by a dgt train job (pid {pid}); "
                           f"give another {flag}") from None

"""Checkpoint and resume: everything a run needs to continue bitwise, on disk.

A checkpoint of ``dgt train`` is one folder per iteration, ``<dir>/step-<t>/``, that
holds two files per rank, both written with ``torch.save`` (a temporary file, then
rename(2), so a file that exists is complete):

- ``trainer-<r>.pt`` (:func:`dgt.job.train`): the model's and the optimiser's
  ``state_dict()``, the loop's position (epoch, batches of it done and its iterations,
  step, round), torch's RNG and the augmentation generator, and the history so far;
- ``sidecar-<r>.pt`` (:func:`sidecar_state_dict`): the worker agent's error-feedback
  residual, contribution scores (EMA), adaptive-k state, exploration/ranking generator
  and iteration counter, the shard's adaptive-deadline state and its residual
  (``--pull-codec``, dgt.pull_codec). The trainer asks its
  sidecar to write it (``{"op": "save", "path": ...}`` over the Unix socket, before it
  writes its own file): the residual is model-sized, so it goes from the sidecar's
  memory to the file, never through the trainer's control channel.

A folder is complete when every rank's ``trainer-<r>.pt`` is there (each trainer writes
its file after its sidecar's, and neither stays when one of them cannot be written:
:func:`discard`). Every rank saves after the same iteration (BSP), and rank 0 keeps
the newest ``KEEP`` complete folders. A file that cannot be written (a full disk, EIO,
a folder in its place) costs that step only: the trainer warns, naming the file, and
trains on. ``--resume`` takes a step folder, or the checkpoint folder itself: its
newest complete step whose files all load and belong there (every rank's
``trainer-<r>.pt`` and ``sidecar-<r>.pt``; each records its rank and workers, the
trainer file its step, the sidecar file its pushes: :func:`misplaced`). A step with a
damaged or missing file, e.g. truncated by a full disk, with a file of another step
or rank, e.g. copied in by hand, or without a rank's files (:func:`cut_short`: a
process killed while it was written) is skipped with a warning naming the file; when no
step loads, ValueError names the newest one's file. A folder, step or file that cannot
be read (EACCES: another user's) is an error saying so, never "no checkpoint"
(:func:`resolve`). A step folder given by name is used as it is: such a file in it is an
error naming it, before anything starts. So is a step, found or given, that leaves
nothing to train under ``--iterations`` or ``--epochs`` (:func:`check_left`).

Each rank's trainer then writes ``sha256-<r>.txt`` (:func:`seal`): the SHA-256 of its
two files, as ``sha256sum`` prints them (``sha256sum -c`` checks them by hand). A step
whose file no longer matches (a bit flipped on disk, a file edited) is damaged
(:func:`tampered`): skipped, or refused when given by name, like a file that does not
load. A step without that file (written by a version before it, or a rank killed
between its trainer file and its digests) is not checked. A file whose state holds a
NaN or inf in a floating tensor (a residual, scores, the model, the optimiser's moments)
is refused at :func:`load`, naming the field: resumed, it trained on silently with a
rank's blocks all dropped, or with replicas that were no longer identical.

A DDP training script (dgt.ddp, examples/ddp_train.py) keeps the same layout with its
own ``trainer-<r>.pt``; each trainer file says who wrote it (``writer``), and each tool
refuses the other's (:func:`check_writer`).

The pickled state holds tensors and plain Python values only: no socket, no mapping.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import stat

from .config import given_flag
from .errors import PeerFailure
from .failure import FailureReason
from .run_files import RefusedFile, open_regular

#: complete step folders kept by rank 0 (the newest; an older one is a fallback while
#: the newest is being written)
KEEP = 2
FORMAT = 1
_STEP = re.compile(r"^step-([0-9]+)$")   # ASCII: \d also takes '５'
log = logging.getLogger("dgt.checkpoint")


def step_dir(root: str, step: int) -> str:
    """The folder of the checkpoint taken after ``step`` iterations."""
    return os.path.join(root, f"step-{step:08d}")


def trainer_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"trainer-{rank}.pt")


def sidecar_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"sidecar-{rank}.pt")


def digest_file(folder: str, rank: int) -> str:
    """``rank``'s ``sha256-<r>.txt`` in step ``folder`` (:func:`seal`)."""
    return os.path.join(folder, f"sha256-{rank}.txt")


def complete_steps(root: str, world: int) -> list[tuple[int, str]]:
    """(step, folder) of every complete checkpoint under ``root`` (every rank's
    ``trainer-<r>.pt`` there, a regular file), oldest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        m = _STEP.match(name)
        folder = os.path.join(root, name)
        if m and all(os.path.isfile(trainer_file(folder, r)) for r in range(world)):
            found.append((int(m.group(1)), folder))
    return sorted(found)


def _exists(path: str) -> bool:
    """Whether anything is at ``path``: False for ENOENT and ENOTDIR; any other OSError
    (EACCES: another user's folder, EIO, ELOOP) is raised, not taken for absence."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def missing(folder: str, world: int) -> list[str]:
    """The names of step ``folder``'s files that are not there: each rank's
    ``trainer-<r>.pt``, and its ``sidecar-<r>.pt`` when any rank's sidecar file is there
    (a DDP script without dgt writes none), in rank order. Raises OSError when a file
    cannot be looked at for another reason than its absence (EACCES, EIO)."""
    sides = any(_exists(sidecar_file(folder, r)) for r in range(world))
    return [os.path.basename(path) for r in range(world)
            for path in (trainer_file(folder, r), sidecar_file(folder, r))
            if (sides or path.endswith(f"trainer-{r}.pt")) and not _exists(path)]


def cut_short(folder: str, world: int) -> str | None:
    """Why step ``folder`` is not complete, as one line naming the file: a rank's
    ``trainer-<r>.pt`` is not there (e.g. a process killed while the step was written;
    every file :func:`missing` names, the first four, then how many more) or is not a
    regular file (a write that failed); None when it is complete. Raises OSError as
    :func:`missing` does."""
    names = missing(folder, world)
    if any(n.startswith("trainer-") for n in names):
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return (f"{folder} has no {', '.join(names[:4])}{more} (cut short: a rank's "
                f"files were never written)")
    for r in range(world):
        if not stat.S_ISREG(os.stat(trainer_file(folder, r)).st_mode):
            return (f"{trainer_file(folder, r)} is not a regular file (a write that "
                    f"failed?)")
    return None


def damaged(folder: str, world: int) -> str | None:
    """Why step ``folder`` cannot be resumed from: the first of its files that
    :func:`load` refuses (missing included, or NaN/inf in its state), that
    :func:`misplaced` finds to be of another step or rank, or whose SHA-256 differs
    from what :func:`seal` recorded (:func:`tampered`), as its one-line message; None
    when every file loads, belongs there and matches (tensors stay on disk: mmap; the
    step and rank are read from the files as loaded, nothing twice). Each rank's
    ``trainer-<r>.pt``, then its ``sidecar-<r>.pt``, which is needed when that trainer
    file is dgt train's or any rank's sidecar file is there (a DDP script without dgt
    writes none)."""
    sides = any(os.path.exists(sidecar_file(folder, r)) for r in range(world))
    workers = None   # the step's, as its trainer-0.pt (else sidecar-0.pt) records it
    for r in range(world):
        try:
            state = load(trainer_file(folder, r), mmap=True)
            side = load(sidecar_file(folder, r), mmap=True) \
                if sides or writer_of(state) == "dgt train" else None
        except ValueError as e:
            return str(e)
        if r == 0:
            workers = recorded_world(state, side)
        why = misplaced(folder, r, workers, state, side) or tampered(folder, r)
        if why is not None:
            return why
    return None


def recorded_world(trainer: dict, side: dict | None) -> int | None:
    """The number of workers a step was taken with, as rank 0's files record it
    (``trainer``: its trainer file, loaded; ``side``: its sidecar file or None); None
    when neither records it (a DDP script's trainer file without dgt)."""
    w = trainer.get("world")
    return w if w is not None or side is None else side.get("world")


def misplaced(folder: str, rank: int, workers: int | None, trainer: dict,
              side: dict | None) -> str | None:
    """Why ``rank``'s files of step ``folder`` (loaded: ``trainer``, and ``side`` or
    None) are not that step's files of that rank, as one line naming the file; None when
    they are. Each file records its rank and number of workers (``rank``, ``world``:
    ``workers``, the step's, from :func:`recorded_world`); the trainer file its step
    (``step``: the folder's ``step-<t>``); the sidecar file the pushes it has done
    (``iterations``: dgt train's trainer file's ``rounds``, a DDP script's
    ``dgt.iteration``). A field a file does not record is not checked (files of a
    format without it). A file copied in from another step (or rank) is caught here:
    resumed, it made the trainers fail at their first push ("step 6 out of order") or
    blamed a rank whose file was fine."""
    for path, st in ((trainer_file(folder, rank), trainer),
                     (sidecar_file(folder, rank), side)):
        if st is None:
            continue
        want = (rank, workers if workers is not None else st.get("world"))
        got = (st.get("rank", rank), st.get("world", want[1]))
        if got != want:
            of = "" if got[1] == want[1] else f" of {got[1]} workers"
            then = "" if got[1] == want[1] else f" of {want[1]}"
            return (f"{path} is rank {got[0]}'s file{of}, not rank {rank}'s{then} "
                    f"(copied from another rank or run?)")
    m = _STEP.match(os.path.basename(os.path.normpath(folder)))
    step = trainer.get("step")
    if m and isinstance(step, int) and step != int(m.group(1)):
        return (f"{trainer_file(folder, rank)} is of step {step}, not of its folder's "
                f"step {int(m.group(1))} (copied from another step?)")
    hook = trainer.get("dgt")   # a DDP script's DgtState.state_dict(), or None
    pushes = trainer.get("rounds") if writer_of(trainer) == "dgt train" else \
        hook.get("iteration") if isinstance(hook, dict) else None
    done = side.get("iterations") if side is not None else None
    if isinstance(pushes, int) and isinstance(done, int) and done != pushes:
        unit = "round" if step is not None and pushes != step else "step"   # fedavg
        return (f"{sidecar_file(folder, rank)} is of {unit} {done}, its trainer-{rank}.pt "
                f"of {unit} {pushes} (copied from another step?)")
    return None


def seal(folder: str, rank: int, sidecar: bool = True) -> None:
    """Write ``rank``'s ``sha256-<r>.txt`` in step ``folder``, after its files: the
    SHA-256 of its ``sidecar-<r>.pt`` (``sidecar``: this rank wrote one) and
    ``trainer-<r>.pt``, one ``<hex>  <name>`` line each (``sha256sum``'s format),
    atomically (dgt.atomic). :func:`tampered` checks them at resume. Raises OSError
    naming the file that could not be read or written."""
    from .atomic import write_atomic
    names = ([os.path.basename(sidecar_file(folder, rank))] if sidecar else []) + \
        [os.path.basename(trainer_file(folder, rank))]
    text = "".join(f"{_sha256(os.path.join(folder, n))}  {n}\n" for n in names)
    write_atomic(digest_file(folder, rank), lambda f: f.write(text.encode()))


#: the most bytes :func:`tampered` reads of a ``sha256-<r>.txt`` (two lines of 80)
_DIGESTS_MAX = 4096


def _sha256(path: str) -> str:
    """The SHA-256 (hex) of file ``path``. Raises OSError."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tampered(folder: str, rank: int) -> str | None:
    """Why ``rank``'s files of step ``folder`` are not what was written, as one line
    naming the file: one whose SHA-256 differs from the one its ``sha256-<r>.txt``
    recorded (:func:`seal`: a bit flipped on disk, a file edited by hand), a digest file
    that is not such a list, or a file that cannot be read; None when they match, or
    when there is no ``sha256-<r>.txt`` (a step of a version before it: not checked)."""
    path = digest_file(folder, rank)
    try:   # a FIFO there must not block the resume: only a regular file is read
        with open_regular(path, _DIGESTS_MAX) as f:
            raw = f.read(_DIGESTS_MAX + 1)
    except FileNotFoundError:
        return None
    except RefusedFile as e:
        return f"{e} (damaged)"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    mine = {os.path.basename(trainer_file(folder, rank)),
            os.path.basename(sidecar_file(folder, rank))}
    lines = [re.fullmatch(r"([0-9a-f]{64})  (\S+)", ln)
             for ln in raw.decode("ascii", "replace").splitlines()]
    if len(raw) > _DIGESTS_MAX or not lines or \
            not all(m and m.group(2) in mine for m in lines):
        return f"{path} is not a list of this rank's SHA-256 digests (damaged)"
    for m in lines:
        name = os.path.join(folder, m.group(2))
        try:
            got = _sha256(name)
        except OSError as e:
            return f"cannot read {name}: {e.strerror or e}"
        if got != m.group(1):
            return (f"{name} does not match the SHA-256 that {os.path.basename(path)} "
                    f"recorded when it was written (damaged on disk, or changed since)")
    return None


def latest(root: str, world: int, why: list[str] | None = None) -> str | None:
    """The newest complete step folder under ``root`` whose files all load, or None.
    Each newer complete folder skipped for a damaged file is appended to ``why`` (its
    one-line message) when given, else logged as a warning."""
    for _, folder in reversed(complete_steps(root, world)):
        bad = damaged(folder, world)
        if bad is None:
            return folder
        if why is None:
            log.warning("skipping checkpoint %s: %s", folder, bad)
        else:
            why.append(bad)
    return None


def resolve(path: str, world: int) -> str:
    """``--resume PATH``: a step folder with every rank's files, or a checkpoint folder:
    its newest step that is complete and whose files all load and belong there
    (:func:`damaged`); each newer step skipped, for such a file or for files never
    written (:func:`cut_short`), is logged as a warning naming the file. Raises
    ValueError saying what is missing (naming the newest step's file when there is
    one); what ``path`` is when it is not a folder (a file: give its step folder); or,
    for an OSError looking at ``path`` or its steps (EACCES: another user's folder,
    EIO), what could not be read and why."""
    try:
        return _resolve(path, world)
    except OSError as e:
        what = "it" if e.filename is None or os.path.normpath(e.filename) == \
            os.path.normpath(path) else e.filename
        if isinstance(e, PermissionError) and what != "it":   # a folder we cannot enter
            folder = os.path.dirname(e.filename)                # says itself, not a file
            if not os.access(folder, os.X_OK):
                what = "it" if os.path.normpath(folder) == os.path.normpath(path) \
                    else folder
        give = "a checkpoint folder this user can read" if \
            isinstance(e, PermissionError) else "another checkpoint folder"
        raise ValueError(f"--resume {path}: cannot read {what}: {e.strerror or e}; give "
                         f"{give}") from None


def _resolve(path: str, world: int) -> str:
    """:func:`resolve`, its OSErrors raised as they are."""
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = None   # nothing there
    if not is_dir:
        give = "give a checkpoint folder (--checkpoint-dir) or one of its step-<t> folders"
        if is_dir is None:
            raise ValueError(f"--resume {path}: no such folder; {give}")
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isfile(path) and _STEP.match(os.path.basename(parent)):
            give = f"give its step folder, --resume {os.path.dirname(path) or '.'}"
        what = "a file" if os.path.isfile(path) else "not a folder"
        raise ValueError(f"--resume {path}: is {what}, not a checkpoint folder; {give}")
    if _STEP.match(os.path.basename(os.path.normpath(path))):
        names = missing(path, world)
        if names:
            raise ValueError(f"--resume {path}: {_cut_or_fewer(path, world, names)}")
        _readable(path, world)   # another user's files: said here, with --resume
        return path
    steps = []   # (step, folder) of every step folder
    for name in os.listdir(path):
        m = _STEP.match(name)
        if m and stat.S_ISDIR(os.stat(os.path.join(path, name)).st_mode):
            steps.append((int(m.group(1)), os.path.join(path, name)))
    skipped, bad = [], []   # newer steps' one-line reasons: all, and the damaged ones
    for _, folder in sorted(steps, reverse=True):
        why = cut_short(folder, world)
        if why is None:
            _readable(folder, world)   # not damage: this user's access
            why = damaged(folder, world)
            if why is None:
                for w in skipped:
                    log.warning("--resume %s: skipping a newer step: %s", path, w)
                return folder
            bad.append(why)
        skipped.append(why)
    if bad:
        raise ValueError(f"--resume {path}: no step in it can be resumed from: {bad[0]}; "
                         f"remove the damaged step folder or give another checkpoint")
    newest = max(steps)[1] if steps else None
    workers = taken_with(newest) if newest else None
    if workers is not None and workers != world:
        raise ValueError(f"--resume {path}: {_cut_or_fewer(newest, world, [])}")
    seen = f" ({skipped[0]})" if skipped else ""   # the newest step, cut short
    raise ValueError(f"--resume {path}: no complete checkpoint of {world} workers in "
                     f"it{seen}; take one with --checkpoint-every N --checkpoint-dir "
                     f"{path}")


def taken_with(folder: str) -> int | None:
    """How many workers step ``folder`` was taken with, as rank 0's files record it
    (:func:`recorded_world`); None when they do not say (not there, damaged, or a DDP
    script's without dgt)."""
    try:
        side = load(sidecar_file(folder, 0), mmap=True) \
            if _exists(sidecar_file(folder, 0)) else None
        return recorded_world(load(trainer_file(folder, 0), mmap=True), side)
    except (ValueError, OSError):
        return None


def _cut_or_fewer(folder: str, world: int, names: list[str]) -> str:
    """Why step ``folder`` has no checkpoint of ``world`` workers, with what to do: it
    is one of another number of workers (:func:`taken_with`), or it lacks ``names``
    (:func:`missing`: cut short)."""
    n = taken_with(folder)
    if n is not None and n != world:
        return (f"step {os.path.basename(os.path.normpath(folder))} is a checkpoint of {n} "
                f"workers, not {world}; resume with --workers {n}")
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return (f"{folder} has no {', '.join(names[:4])}{more} (cut short); give the "
            f"checkpoint folder to use its newest complete step")


def _readable(folder: str, world: int) -> None:
    """Raises PermissionError (EACCES, EPERM) for a regular file of step ``folder`` that
    this user may not open: another user's checkpoint, to be said as it is, not skipped
    for a damaged step. Anything else (a file not there, not a regular file) is left to
    :func:`damaged`."""
    for r in range(world):
        for path in (trainer_file(folder, r), sidecar_file(folder, r),
                     digest_file(folder, r)):
            try:
                regular = stat.S_ISREG(os.stat(path).st_mode)
            except FileNotFoundError:
                continue
            if regular:
                os.close(os.open(path, os.O_RDONLY))


#: the trainer's flags that a resumed run must share with the checkpoint: they decide
#: the parameters' shapes, the data each rank sees and the order of its batches; and
#: --lr, which the restored optimiser state would override in silence (breaker round 6:
#: --resume with --lr 5 trained on at the step's lr, the report saying 5). A step
#: written before --lr was recorded is not checked for it
RUN_FLAGS = ("model", "hidden", "width", "dataset", "partition", "algo", "local_steps",
             "batch_size", "seed", "lr")


def run_flags(ns) -> dict:
    """:data:`RUN_FLAGS` of a trainer's namespace (or JobConfig), for its file."""
    return {k: getattr(ns, k) for k in RUN_FLAGS if hasattr(ns, k)}


#: who writes a trainer file (its ``writer``): dgt train's trainers (dgt.job), or a
#: DDP training script through dgt.ddp (examples/ddp_train.py); each resumes only its own
WRITERS = {"dgt train": "dgt train --resume",
           "ddp": "the DDP training script that wrote it (e.g. examples/ddp_train.py "
                  "--resume)"}


def writer_of(state: dict) -> str:
    """Which of :data:`WRITERS` wrote trainer file ``state``: its ``writer`` field, or,
    in a file written before that field, by its keys (dgt train's ``rank`` and
    ``optimizer``, a DDP script's ``opt``)."""
    w = state.get("writer")
    if w in WRITERS:
        return w
    return "dgt train" if "rank" in state and "optimizer" in state else "ddp"


def check_writer(state: dict, path: str, want: str) -> None:
    """Raises ValueError, naming what resumes it, when trainer file ``path`` (loaded:
    ``state``) was not written by ``want`` (one of :data:`WRITERS`)."""
    got = writer_of(state)
    if got != want:
        what = "dgt train" if got == "dgt train" else "a DDP training script (dgt.ddp)"
        raise ValueError(f"{path} is a checkpoint of {what}, not of "
                         f"{'dgt train' if want == 'dgt train' else 'a DDP script'}; "
                         f"resume it with {WRITERS[got]}")


def check_resume(folder: str, world: int, job, tx) -> None:
    """Before anything starts: every rank's files in step ``folder`` are dgt train's
    checkpoint files of this rank and ``world``, taken with this run's
    :data:`RUN_FLAGS` (``job``: a JobConfig) and ``--mode``, ``--block-bytes`` and
    ``--error-feedback`` (``tx``: a TransmissionConfig), and the step leaves something
    to train (:func:`check_left`). Raises ValueError naming the flag that differs, or
    the file that is not such a checkpoint, holds NaN or inf (:func:`load`), is of
    another step or rank than its name says (:func:`misplaced`: the files are loaded
    here anyway) or does not match the SHA-256 recorded when it was written
    (:func:`tampered`)."""
    mode, block_bytes = tx.mode, tx.block_bytes
    workers = None   # as rank 0's files record it
    first = None     # rank 0's trainer file, loaded

    def differs(flag: str, then, now) -> ValueError:
        return ValueError(f"--resume {folder}: taken with {given_flag(flag, then)}, this "
                          f"run has {given_flag(flag, now)}; resume with the same flags")

    def elsewhere(why: str, files: str) -> ValueError:
        return ValueError(f"{why}; resume from another step (--resume "
                          f"{os.path.dirname(os.path.normpath(folder)) or '.'} takes the "
                          f"newest whose files {files})")
    for r in range(world):
        try:
            side = load(sidecar_file(folder, r), mmap=True)
            st = load(trainer_file(folder, r), mmap=True, writer="dgt train")
        except NonFinite as e:
            raise elsewhere(str(e), "are intact") from None
        if r == 0:
            workers, first = recorded_world(st, side), st
        why = misplaced(folder, r, workers, st, side)
        if why is not None:
            raise elsewhere(why, "agree")
        why = tampered(folder, r)
        if why is not None:
            raise elsewhere(why, "are intact")
        if side.get("mode", mode) != mode:
            raise differs("mode", side["mode"], mode)
        if side.get("block_elems", block_bytes // 4) != block_bytes // 4:
            raise differs("block-bytes", 4 * side["block_elems"], block_bytes)
        res = side.get("residual")   # Residual.state_dict(): (0,) with error feedback off
        res = res.get("residual") if isinstance(res, dict) else None
        kept = res.numel() > 0 if hasattr(res, "numel") else bool(tx.error_feedback)
        if kept != bool(tx.error_feedback):
            raise differs("error-feedback", kept, bool(tx.error_feedback))
        if (st.get("rank", r), st.get("world", world)) != (r, world):
            raise ValueError(f"--resume {folder}: trainer-{r}.pt is of rank {st['rank']} "
                             f"of {st['world']}; resume with the same --workers")
        for k, then in (st.get("flags") or {}).items():
            now = getattr(job, k, then)
            if then != now:
                raise differs(k.replace("_", "-"), then, now)
    if first is not None:
        check_left(folder, first, job)


def check_left(folder: str, state: dict, job) -> None:
    """Step ``folder`` (rank 0's trainer file, loaded: ``state``) leaves iterations to
    train under ``job``'s ``--iterations`` (0: no limit) and ``--epochs``; resumed from
    a step at or past either, the trainers ran none and the job ended as if it had
    trained. The epoch is done when the file's ``index`` (batches of its ``epoch``
    done) reaches its ``epoch_iterations`` (files without it: only an epoch past
    ``--epochs`` is caught). Raises ValueError naming the flag and the step's
    iteration."""
    step, epoch, index = state.get("step"), state.get("epoch"), state.get("index")
    iterations, epochs = getattr(job, "iterations", 0), getattr(job, "epochs", None)
    if isinstance(step, int) and iterations and step >= iterations:
        raise ValueError(f"--resume {folder}: the checkpoint is at iteration {step}, at "
                         f"or past --iterations {iterations}: nothing is left to train; "
                         f"give a larger --iterations")
    if not (isinstance(epoch, int) and isinstance(index, int) and epochs):
        return
    per = state.get("epoch_iterations")
    ended = isinstance(per, int) and index >= per   # the checkpoint's epoch is done
    if epoch + ended >= epochs:
        where = f"the end of epoch {epoch + 1}" if ended else f"epoch {epoch + 1}"
        raise ValueError(f"--resume {folder}: the checkpoint is at {where} (iteration "
                         f"{step}), at or past --epochs {epochs}: nothing is left to "
                         f"train; give a larger --epochs")


def save(obj, path: str) -> None:
    """``torch.save(obj, path)``, atomically (dgt.atomic): a write that fails leaves
    what was at ``path`` before (or nothing) and no temporary file. Raises OSError
    naming ``path``, also for the RuntimeError torch raises after a write of the archive
    failed (ENOSPC: ``unexpected pos``)."""
    import torch
    from .atomic import write_atomic
    try:
        write_atomic(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as e:   # e.g. rename(2) names the temporary file
        cause = _os_error(e)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, path) from e


def _os_error(e: BaseException) -> OSError | None:
    """The OSError that ``e`` was raised from or while handling, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


#: what :func:`not_written`'s lines hold, by which :func:`none_written` finds them
NOT_WRITTEN = " not written: "


def not_written(path: str, e: OSError) -> str:
    """The one-line warning for checkpoint file ``path`` that could not be written."""
    return f"checkpoint {path}{NOT_WRITTEN}{e.strerror or e}"


def discard(folder: str, rank: int) -> None:
    """Remove ``rank``'s files from step ``folder`` (its trainer file first: the step is
    incomplete from then on) after one of them could not be written, so that no file of
    an older run under the same name makes the step look complete, and the space
    comes back. A file that cannot be removed is left (a file there is whole:
    dgt.atomic)."""
    for path in (trainer_file(folder, rank), sidecar_file(folder, rank),
                 digest_file(folder, rank)):
        _remove(path)
    # the folder stays: another rank may be writing its files there now (CI of
    # c764589: a rank's rmdir made the other's write fail, ENOENT); the launcher
    # removes it once the job has ended (remove_empty_steps)


def remove_empty_steps(root: str) -> list[str]:
    """After the job that wrote under ``root`` has ended: remove its ``step-<t>``
    folders that are empty (failed writes leave them so: :func:`discard`; breaker round
    10 found one on a full disk). Returns the folders removed. Never raises: a folder
    that cannot be listed or removed is left."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in sorted(names):
        folder = os.path.join(root, name)
        if _STEP.match(name) and not os.path.islink(folder):
            try:
                os.rmdir(folder)   # fails, and leaves it, unless it is an empty folder
            except OSError:
                continue
            removed.append(folder)
    return removed


def none_written(root: str, world: int, warnings: list[str]) -> str | None:
    """After a run that saved checkpoints under ``root``: one line when a file failed
    (``warnings``: the report's, :func:`not_written`'s lines among them) and no step is
    complete there, i.e. the run asked for checkpoints and has none; else None."""
    failed = [w for w in warnings if w.startswith("checkpoint ") and NOT_WRITTEN in w]
    if not failed or complete_steps(root, world):
        return None
    return (f"no checkpoint was written to {root}: {len(failed)} file(s) could not be "
            f"written, the first: {failed[0]}")


def _remove(path: str) -> None:
    """unlink(2) ``path``; nothing when it is not there or cannot be removed."""
    try:
        os.unlink(path)
    except OSError:
        pass


def load(path: str, mmap: bool = False, writer: str | None = None) -> dict:
    """``torch.load`` of one of our files (tensors and plain values only:
    ``weights_only``; ``mmap``: tensors stay on disk until read, for a cheap check).
    ``writer``: a trainer file, which must be that tool's (:func:`check_writer`).
    Raises ValueError for a file that is missing or not ours, and :class:`NonFinite`
    (a ValueError naming the file and the field) for one whose state holds a NaN or inf
    in a floating tensor: its residual, scores, model or optimiser state
    (:func:`non_finite`)."""
    import torch
    try:   # a FIFO or a device would block or stream forever in torch.load
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{path} is not a dgt checkpoint file (not a regular file)")
        with open(path, "rb") as f:   # torch.save writes a zip archive; torch's own
            head = f.read(4)          # words for anything else are about mmap
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if head != b"PK\x03\x04":
        raise ValueError(f"{path} is not a dgt checkpoint file ("
                         f"{'empty' if not head else 'not a torch.save zip archive'})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:   # a truncated or foreign file: torch's first sentence
        why = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else \
            type(e).__name__
        raise ValueError(f"{path} is not a dgt checkpoint file ({why})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dgt checkpoint file of format {FORMAT}")
    if writer is not None:
        check_writer(state, path, writer)
    bad = non_finite(state)
    if bad is not None:
        field, n, of = bad
        raise NonFinite(f"{path}: {field} holds {n} NaN or inf value{'s' * (n != 1)} "
                        f"(of {of}): the file is damaged, or was saved from a broken run")
    return state


class NonFinite(ValueError):
    """A checkpoint file whose state holds NaN or inf (:func:`load`)."""


def non_finite(obj, field: str = "") -> tuple[str, int, int] | None:
    """The first floating tensor in ``obj`` (a loaded state: dicts, lists and tuples
    of tensors and plain values) that holds a NaN or inf: (its field, dotted, e.g.
    ``residual.residual`` or ``optimizer.state.3.exp_avg``; how many values are not
    finite; how many it has), or None. Plain Python floats are not looked at (a
    loss of NaN in the history is a record, not state to train on)."""
    import torch
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            n = obj.numel() - int(torch.isfinite(obj).sum())
            if n:
                return field, n, obj.numel()
        return None
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        hit = non_finite(v, f"{field}.{k}" if field else str(k))
        if hit is not None:
            return hit
    return None


def prune(root: str, world: int, keep: int = KEEP, writing: int | None = None) -> None:
    """Remove all but the newest ``keep`` step folders, and incomplete ones older than
    the newest complete one. ``writing``: the step being written now (by the other
    ranks too), counted as one of the ``keep``; the older ones kept are complete, and
    the newest of them is always kept (``keep`` >= 1), so a ``writing`` step that ends
    incomplete (a file not written) never costs the last complete checkpoint."""
    steps = [s for s, _ in complete_steps(root, world) if s != writing]
    kept = set(steps[-(keep - 1):] if writing is not None and keep > 1 else
               steps[-keep:])
    newest = max([*steps, writing if writing is not None else -1])
    if newest < 0:
        return
    for name in os.listdir(root):
        m = _STEP.match(name)
        if m and int(m.group(1)) < newest and int(m.group(1)) not in kept:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# -- the sidecar's part ---------------------------------------------------------------
def sidecar_state_dict(sidecar) -> dict:
    """A registered :class:`dgt.sidecar.Sidecar`'s state between two iterations: the
    worker agent's residual ((padded,) float32), contribution scores ((n_blocks,)
    float32), adaptive-k and generator state, the iterations pushed, the adaptive
    deadline's window, the time budget's measured rates (None when off), the
    shard's residual (dgt.pull_codec; None without --pull-codec), and the model's
    layout (``shapes_sha256``: dgt.client.shapes_sha256, as the register sent it; None
    when it sent none). Tensors are copies on CPU."""
    plan, lay = sidecar.agent.planner, sidecar.layout
    return {"format": FORMAT, "rank": sidecar.rank, "world": sidecar.world,
            "n_params": lay.n_params, "shapes_sha256": sidecar.shapes_sha256,
            "n_blocks": lay.n_blocks, "block_elems": lay.block_elems,
            "mode": sidecar.cfg.mode, "iterations": sidecar.pushes,
            "residual": plan.residual.state_dict(), "scores": plan.scores.state_dict(),
            "adaptive_k": plan.adaptive.state_dict() if plan.adaptive else None,
            "generator": plan.gen.get_state(), "k_history": list(plan.k_history),
            "deadline": sidecar.adaptive.state_dict() if sidecar.adaptive else None,
            "time_budget": plan.budget.state_dict() if plan.budget else None,
            "shard_residual": sidecar.shard.coder.state_dict() if sidecar.shard.coder
            else None}


def load_sidecar_state(sidecar, state: dict) -> None:
    """Put :func:`sidecar_state_dict`'s output back into a sidecar that has registered
    and pushed nothing yet: its next push is iteration ``state["iterations"]``. Raises
    ValueError when the checkpoint is of another rank, world, model size (gradient
    elements, ``n_params``; a checkpoint written before it was recorded is checked by
    its blocks only), parameter shapes (``shapes_sha256``: not checked when the
    checkpoint, written before it was recorded, or the register has none) or block
    layout."""
    agent, plan, lay = sidecar.agent, sidecar.agent.planner, sidecar.layout
    if sidecar.pushes:
        raise ValueError("resume after the first push: load the state before training")
    for key, have in (("rank", sidecar.rank), ("world", sidecar.world),
                      ("n_params", lay.n_params), ("n_blocks", lay.n_blocks),
                      ("block_elems", lay.block_elems)):
        if key == "n_params" and key not in state:
            continue
        if state[key] != have:
            raise ValueError(f"the checkpoint is of {key} {state[key]}, this sidecar's is "
                             f"{have}; resume with the same --workers, model and "
                             f"--block-bytes")
    was, now = state.get("shapes_sha256"), sidecar.shapes_sha256
    if was is not None and now is not None and was != now:
        raise ValueError(f"the checkpoint is of a model of other parameter shapes (as many "
                         f"parameters, {lay.n_params}, laid out otherwise: shapes "
                         f"SHA-256 {str(was)[:12]}, this model's {now[:12]}); resume "
                         f"with the same model")
    plan.residual.load_state_dict(state["residual"])
    plan.scores.load_state_dict(state["scores"])
    if plan.adaptive is not None and state["adaptive_k"] is not None:
        plan.adaptive.load_state_dict(state["adaptive_k"])
    plan.gen.set_state(state["generator"])
    plan.k_history[:] = state["k_history"]
    if sidecar.adaptive is not None and state["deadline"] is not None:
        sidecar.adaptive.load_state_dict(state["deadline"])
    if plan.budget is not None and state.get("time_budget") is not None:
        plan.budget.load_state_dict(state["time_budget"])   # the rates measured
    if sidecar.shard.coder is not None and state.get("shard_residual") is not None:
        sidecar.shard.coder.load_state_dict(state["shard_residual"])
    t = int(state["iterations"])
    sidecar.pushes = t
    agent.iteration = t - 1 if t else 0
    sidecar.shard.session.iteration = t   # the shard's open iteration


# -- the sidecar's ops (dgt.sidecar: register with "resume", "save") -------------------
async def resume_state(path, rank: int) -> dict | None:
    """The state a ``register`` message's ``resume`` path holds (None: no resume).
    Raises PeerFailure naming ``rank`` for a file that cannot be read."""
    if not isinstance(path, str) or not path:
        return None
    try:
        return await asyncio.get_running_loop().run_in_executor(None, load, path)
    except (OSError, ValueError) as e:
        raise PeerFailure(f"rank {rank}: cannot resume from {path}: {e}", rank,
                          FailureReason.MISMATCH) from None


def restore(sidecar, state: dict, path: str) -> None:
    """:func:`load_sidecar_state`, with its ValueError as PeerFailure naming the rank."""
    try:
        load_sidecar_state(sidecar, state)
    except (ValueError, KeyError) as e:
        why = str(e).removeprefix(f"rank {sidecar.rank}: ")   # said once
        raise PeerFailure(f"rank {sidecar.rank}: cannot resume from {path}: {why}",
                          sidecar.rank, FailureReason.MISMATCH) from None


async def save_op(sidecar, msg: dict) -> None:
    """``{"op": "save", "path": P}`` between two iterations: write ``sidecar``'s state
    (:func:`sidecar_state_dict`) to P with torch.save, then answer ``saved``. The agent
    is idle until our trainer's next push, which waits for it. A file that cannot be
    written (a full disk, EIO, a folder at P) fails no one: it is logged, P is removed,
    and ``saved`` carries ``error`` (the errno text) and ``errno`` (an int or null), for
    the trainer to decide (dgt.Client.save_state raises OSError)."""
    path = msg.get("path")
    if sidecar.agent is None or not isinstance(path, str) or not path:
        sidecar.trainer.send({"op": "error", "rank": sidecar.rank,
                              "message": "save needs a registered model and a path"})
        return
    reply = {"op": "saved", "path": path, "iterations": sidecar.pushes}
    if "\0" in path:   # open(2) cannot take it (a ValueError failed the job: round 19)
        sidecar.trainer.send({**reply, "error": "the path has a NUL byte", "errno": None})
        return
    state = sidecar_state_dict(sidecar)
    try:
        await asyncio.get_running_loop().run_in_executor(None, save, state, path)
    except OSError as e:
        _remove(path)   # an older run's file there must not pass for this step's
        log.warning("rank %d: %s", sidecar.rank, not_written(path, e))
        reply.update(error=e.strerror or str(e), errno=e.errno)
    sidecar.trainer.send(reply)

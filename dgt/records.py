"""End-of-run records (``sidecar-<rank>.json``, ``trainer-<rank>.json``) that survive a
full or broken run dir.

A process that finished its part of the run writes its record to the run dir; when that
write fails (ENOSPC, EIO, the folder gone) the record goes to the *spill folder* instead:
``$DGT_RECORD_SPILL`` (``dgt train`` names one per job in /dev/shm; the first record
spilled creates it, mode 0700, and the launcher removes it when it exits), else
``/dev/shm/dgt-records-<uid>`` (a sidecar started by hand). The spilled file has the record's base name and holds ``{"path": the run-dir
path, "error": what failed, "record": the record}``. ``dgt train`` reads records from
both places (``load``) and turns each spilled one into a warning naming the run-dir file
and the errno text; the run and its ``--report`` are kept. No process fails because its
record could not be written to the run dir (it fails only when the spill folder fails
too).
"""
from __future__ import annotations

import glob
import logging
import os
import secrets
import shutil

from .atomic import write_json
from .ipc import shm_dir
from .run_files import of_job, read_json
from .unixsock import private_dir

SPILL_ENV = "DGT_RECORD_SPILL"
log = logging.getLogger("dgt.records")


def spill_dir() -> str:
    """Where a record goes when the run dir refuses it: ``$DGT_RECORD_SPILL``, else this
    user's ``dgt-records-<uid>`` in the shared-memory folder, created 0700 and checked to
    be ours (dgt.unixsock.private_dir raises NotOurs when another user made it)."""
    path = os.environ.get(SPILL_ENV)
    return private_dir(path or os.path.join(shm_dir(), f"dgt-records-{os.getuid()}"))


def make_spill_dir() -> str:
    """A fresh spill folder's path for one ``dgt train`` job, in the shared-memory folder
    dgt.ipc.shm_dir, named after this process and 96 random bits:
    ``dgt-records-<pid>-<hex>``. Nothing is created: the first record spilled makes it
    (spill_dir, 0700 and checked to be ours), so a launcher killed by SIGKILL, which
    cannot remove it, leaves nothing behind unless a record was spilled. Before that,
    the folders of this user's launchers that are gone (their pid not running) are
    removed: such a launcher was killed before it could. Pass the path to the children
    as ``$DGT_RECORD_SPILL``."""
    _remove_orphans()
    return os.path.join(shm_dir(), f"dgt-records-{os.getpid()}-{secrets.token_hex(12)}")


def _remove_orphans() -> None:
    """Remove this user's ``dgt-records-<pid>-*`` folders whose launcher pid runs no
    more. A live pid (the launcher, or a process that reused its number) keeps its
    folder."""
    for path in glob.glob(os.path.join(shm_dir(), "dgt-records-*-*")):
        pid = os.path.basename(path).split("-")[2]
        try:
            if not pid.isdigit() or os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:   # gone meanwhile, or a live process of another user
            continue


def write(path: str, record: dict, indent: int | None = None) -> str | None:
    """Write ``record`` to ``path`` atomically (dgt.atomic). When that fails, write it
    to the spill folder, log a warning naming ``path``, and return the warning's text
    (None when ``path`` was written). Raises OSError only when the spill folder fails
    too (the error names both)."""
    try:
        write_json(path, record, indent=indent)
        return None
    except OSError as e:
        error = f"could not write {path}: {e.strerror or e}"
    try:
        spilled = os.path.join(spill_dir(), os.path.basename(path))
        write_json(spilled, {"path": path, "error": error, "record": record}, indent=indent)
    except OSError as e2:
        raise OSError(e2.errno, f"{error}; nor {e2.filename or spill_dir()}: "
                      f"{e2.strerror or e2}") from None
    log.warning("%s; kept in %s instead", error, spilled)
    return error


def load(run_dir: str, pattern: str, spill: str | None, world: int | None = None
         ) -> tuple[list[dict], list[str]]:
    """The records matching ``pattern`` (e.g. ``"sidecar-*.json"``) from ``run_dir`` and,
    for names not there, from the spill folder ``spill``; sorted by ``rank``. With
    ``world``, only the files of ranks 0..world-1 (dgt.run_files.rank_of): another job's
    ranks are never this one's. Returns (records, warnings: one per spilled record,
    naming the run-dir file and the error). A record that cannot be read or parsed is
    skipped with a warning naming it, as is one that is not a regular file (a FIFO, a
    device, a directory) or is over dgt.run_files.MAX_RECORD bytes
    (dgt.run_files.read_json), which is never read."""
    found: dict[str, dict] = {}
    warnings: list[str] = []
    for path in of_job(os.path.join(run_dir, pattern), world):
        rec = _read(path, warnings)
        if rec is not None:
            found[os.path.basename(path)] = rec
    for path in of_job(os.path.join(spill, pattern), world) if spill else []:
        name = os.path.basename(path)
        wrapped = _read(path, warnings)
        if name in found or not isinstance(wrapped, dict) or "record" not in wrapped:
            continue
        found[name] = wrapped["record"]
        # the writer's error says why (ENOSPC, ENOENT, EACCES...): no guess added
        # (breaker round 10: "Permission denied (the run dir is full or gone)")
        warnings.append(f"{wrapped.get('error', 'could not write ' + name + ' in the run dir')}"
                        f"; its numbers are in this report")
    recs = [r for r in found.values() if isinstance(r, dict) and "rank" in r]
    return sorted(recs, key=lambda d: d["rank"]), warnings


def _read(path: str, warnings: list[str]):
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        warnings.append(f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
        return None

"""Whether a process of ours still runs, read from /proc (proc(5)): one answer for the
trainer's client (its sidecar ended?), the DDP launcher (a previous generation's
sidecar) and ``dgt train``'s lock (the job named in it alive?)."""
from __future__ import annotations

import time


def running(pid: int) -> bool:
    """True while process ``pid`` runs (proc(5); a zombie, dead but not yet reaped,
    counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def ended(pid: int, wait_s: float) -> bool:
    """Whether process ``pid`` has ended (:func:`running`), waiting up to ``wait_s``
    seconds for it."""
    t_end = time.monotonic() + wait_s
    while running(pid):
        if time.monotonic() >= t_end:
            return False
        time.sleep(0.02)
    return True

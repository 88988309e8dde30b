"""Fresh memory without compaction stalls: numpy's huge-page advice, off in the sidecar.

numpy (1.16 and later, on Linux 4.6 and later) calls ``madvise(MADV_HUGEPAGE)`` on every
array of 4 MiB or more. Under the kernel's default transparent-huge-page policy
(``/sys/kernel/mm/transparent_hugepage/defrag`` = ``madvise``) the first write to such
memory may stall in direct compaction while the kernel assembles 2 MiB pages, and
several processes faulting at once (N sidecars on one host at their first push) stall
each other. The sidecar's arrays are written once per push and live for the whole job,
so it gains little from huge pages and loses its first push to the stalls
(docs/bench/README.md, "Later runs": with the MLP of ``dgt bench``, a median first
push_pull of 376 ms without the advice against 796 ms with it, same bits;
``python -m dgt.tools.bench_startup``).

:func:`keep_small_pages` switches the advice off for this process, unless the user set
numpy's own switch, ``NUMPY_MADVISE_HUGEPAGE``, to anything but 0 (then that wins). torch's allocator gives
no such advice unless ``THP_MEM_ALLOC_ENABLE=1``.
"""
from __future__ import annotations

import os

ENV = "NUMPY_MADVISE_HUGEPAGE"


def env_problem() -> str | None:
    """The one-line error for a ``NUMPY_MADVISE_HUGEPAGE`` that numpy cannot read (it
    calls ``int()`` on it at import and stops the process with a traceback: an empty or
    non-numeric value), or None when it is unset or an integer. Imports nothing, so a
    command can check before numpy loads."""
    value = os.environ.get(ENV)
    if value is None:
        return None
    try:
        int(value)
    except ValueError:
        return (f"{ENV}={value!r} is not an integer, and numpy stops at import on it; "
                f"unset it, or set 0 (small pages) or 1 (huge pages)")
    return None


def _switch():
    """numpy's (get, set) pair for the advice, or (None, None) when it has none."""
    try:
        from numpy._core import multiarray
    except ImportError:   # numpy 1.x
        from numpy.core import multiarray
    return (getattr(multiarray, "_get_madvise_hugepage", None),
            getattr(multiarray, "_set_madvise_hugepage", None))


def numpy_huge_page_advice() -> bool | None:
    """Whether numpy advises huge pages for this process's new arrays (None: this
    numpy cannot tell)."""
    getter, _ = _switch()
    return bool(getter()) if getter is not None else None


def keep_small_pages() -> bool:
    """Stop numpy advising huge pages for the arrays this process makes from now on,
    unless ``NUMPY_MADVISE_HUGEPAGE`` is set to something other than 0 (the user's
    choice wins). Returns True when the advice is off after the call. Never raises."""
    getter, setter = _switch()
    if getter is None or setter is None:
        return False
    if os.environ.get(ENV, "").strip() in ("", "0"):
        setter(False)
    return not getter()

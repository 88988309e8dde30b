"""Stop signals as Ctrl-C, in the process that asked for it and nowhere else.

A command that owns cleanup (``dgt train``: the children; ``dgt bench``: every cell's job
and the testbed) turns SIGTERM and SIGHUP into ``KeyboardInterrupt`` so that its
``finally`` blocks run. A Python signal handler is inherited by ``os.fork``, though, and
libraries fork behind our back: pyroute2 forks a child to enter a network namespace and
stops it with SIGTERM; ``multiprocessing``'s fork context does the same. A handler that
raised there unwound the forked copy of the parent's whole stack, so the copy ran the
parent's cleanup: it removed the testbed under the parent (CI saw ``dgt bench`` fail with
``/var/run/netns/...-sw: No such file`` and hang).

:func:`raise_keyboard_interrupt_on` installs a handler that raises only in the process
that installed it; a forked child that receives the signal dies of it, as with the
default action. Forked children also get the default actions back at once
(``os.register_at_fork``), SIGINT included (Python's own SIGINT handler raises
KeyboardInterrupt too, so a Ctrl-C to the process group would unwind the copy as well),
so a later signal does not reach Python code there at all.

A command that builds state (``dgt testbed up``, ``dgt bench``, ``dgt tc apply``, ...)
calls :func:`stop_on_signals` and, when stopped, :func:`interrupted`: one line on stderr
saying what it undid, and 128 + the signal as its exit status, as a shell gives it.
The ``dgt.tc_profiles`` commands may not import this module (the layer rule): they set
``owns_cleanup`` on their parser, and ``dgt.cli`` does both for them.
"""
from __future__ import annotations

import os
import signal
import sys

# what stops a command that owns cleanup as Ctrl-C does: defined beside the tc layer's
# commit point, which may not import this module
from .tc_profiles.stopping import STOP_SIGNALS, deferred  # noqa: F401 (dgt.tools.bench)

_owner_pid: int | None = None
_installed: set[int] = set()
_fork_hook_registered = False
_received: int | None = None   # the signal that raised, for exit_status()


def exit_status() -> int:
    """The exit status of a command stopped by a signal, as a shell gives it: 128 + the
    signal that raised KeyboardInterrupt here (130 for SIGINT and Ctrl-C, 143 for
    SIGTERM, 129 for SIGHUP)."""
    return 128 + (_received or signal.SIGINT)


def received_name() -> str:
    """The name of the stop signal that raised KeyboardInterrupt here ("SIGTERM", ...),
    "SIGINT" for a Ctrl-C that Python's own handler raised."""
    return signal.Signals(_received or signal.SIGINT).name


def raise_keyboard_interrupt_on(*signums: int, ignore_repeats: bool = False) -> None:
    """From now on each of ``signums`` raises KeyboardInterrupt in this process.

    ``ignore_repeats``: the first such signal also sets SIG_IGN for all of ``signums``,
    so a second one cannot cut the cleanup short. In a forked child every one of them
    has its default action (the child dies of it). Main thread only (``signal.signal``
    raises ValueError elsewhere).
    """
    global _owner_pid
    _owner_pid = os.getpid()
    _installed.update(signums)

    def handler(signum, frame):
        if _forked_copy_dies(signum):
            return
        global _received
        _received = signum
        if ignore_repeats:
            for s in signums:
                signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    for s in signums:
        signal.signal(s, handler)
        _deferred.pop(s, None)
    _register_fork_hook()
    global _pending
    if _pending in signums:   # came during start-up (defer_stop_signals): acted on now
        signum, _pending = _pending, None
        handler(signum, None)


def _forked_copy_dies(signum: int) -> bool:
    """In a forked copy of the process that installed a handler: die of ``signum`` as
    its default action would (True, if the action returns at all); False in that
    process itself."""
    if os.getpid() == _owner_pid:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


def _register_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_defaults_in_child)
        _fork_hook_registered = True


#: signum -> its disposition before :func:`defer_stop_signals` (until the command takes
#: it: :func:`raise_keyboard_interrupt_on` or :func:`release_stop_signals`)
_deferred: dict[int, object] = {}
_pending: int | None = None   # the first stop signal that came while deferred


def defer_stop_signals() -> None:
    """From the start of ``dgt`` until the command says how it takes them: a stop
    signal (:data:`STOP_SIGNALS`) is recorded, not acted on, whatever the process
    inherited, and acted on when the command does (:func:`raise_keyboard_interrupt_on`
    raises it; :func:`release_stop_signals` gives it the inherited disposition).

    Before, a command that turns them into KeyboardInterrupt only did so once its
    imports were done: a SIGINT in that window went to what the process inherited, and a
    job started in the background by a script (``dgt capture ... &``: a shell without
    job control sets SIGINT to SIG_IGN there) lost it and ran on (breaker round 14:
    ``dgt capture`` went on capturing after 39 of 42 early SIGINTs). Idempotent. Main
    thread only."""
    global _owner_pid
    if _deferred:
        return
    _owner_pid = os.getpid()

    def record(signum, frame):
        if _forked_copy_dies(signum):
            return
        global _pending
        if _pending is None:
            _pending = signum

    for s in STOP_SIGNALS:
        _deferred[s] = signal.getsignal(s)
        signal.signal(s, record)
        _installed.add(s)
    _register_fork_hook()


def release_stop_signals(deliver: bool = True) -> None:
    """Give each signal still deferred (:func:`defer_stop_signals`) the disposition it
    had before and, with ``deliver``, deliver a stop signal that came meanwhile to it
    (SIG_IGN drops it, SIG_DFL ends the process, Python's SIGINT handler raises
    KeyboardInterrupt). Nothing when none is deferred."""
    global _pending
    signum, _pending = _pending, None
    restored = dict(_deferred)
    _deferred.clear()
    for s, disposition in restored.items():
        signal.signal(s, disposition if disposition is not None else signal.SIG_DFL)
    if deliver and signum in restored and restored[signum] is not signal.SIG_IGN:
        os.kill(os.getpid(), signum)


def stop_on_signals() -> None:
    """Each of :data:`STOP_SIGNALS` raises KeyboardInterrupt in this process; the first
    one sets the others to SIG_IGN, so no repeat cuts short the cleanup it started."""
    raise_keyboard_interrupt_on(*STOP_SIGNALS, ignore_repeats=True)


def interrupted(prog: str, undone: str = "") -> int:
    """Print the one line of a command stopped by Ctrl-C or a stop signal,
    ``<prog>: interrupted[; <undone>]`` (``undone``: what its cleanup removed, e.g. "the
    half-built testbed 'brk' was removed"), on stderr; return :func:`exit_status`."""
    print(f"{prog}: interrupted" + (f"; {undone}" if undone else ""), file=sys.stderr)
    return exit_status()


def import_torch() -> None:
    """``import torch`` with the stop signals ``deferred`` (tc_profiles.stopping: a
    KeyboardInterrupt raised inside torch's C++ callbacks aborts the process). An import that
    fails (too little address space under ``ulimit -v``: a SystemError or MemoryError
    from torch's C++ start-up; a broken installation) ends the process with one line on
    stderr and status 2, not a traceback."""
    with deferred():
        try:
            import torch  # noqa: F401
        except Exception as e:   # noqa: BLE001 - said in one line, whatever it is
            if _received:   # a Ctrl-C that came just before the signals were held: its
                # KeyboardInterrupt rose inside torch's import, which turned it into
                # another error (CI, loaded: 'TypeError: expected a message argument')
                raise KeyboardInterrupt from None
            why = (str(e).splitlines() or [""])[0][:200]
            print(f"dgt: error: import torch failed ({type(e).__name__}"
                  f"{': ' + why if why else ''}){_import_hint()}", file=sys.stderr,
                  flush=True)
            raise SystemExit(2) from None


def _import_hint() -> str:
    """Why an import of torch may fail here: the address-space limit, when there is one."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        return (f"; the address-space limit (ulimit -v) is {soft >> 20} MiB and torch "
                f"needs more: raise it")
    return "; check the torch installation (.venv/bin/pip install -e .)"


#: s: how soon a KeyboardInterrupt that Python had to swallow is raised again
RAISE_AGAIN_S = 0.01


def keep_lost_interrupts() -> None:
    """Never lose a Ctrl-C (or a stop signal turned into one) to a callback.

    A KeyboardInterrupt raised while Python runs a callback it cannot unwind from (a
    weakref callback, such as the import system's module-lock ``cb``, a ``__del__``) is
    "unraisable": Python prints ``Exception ignored in: ...`` and a traceback, and goes
    on as if no signal had come (CI saw it with a Ctrl-C 1 s into ``dgt train``). This
    sets ``sys.unraisablehook`` so that such an interrupt prints nothing and is raised
    again RAISE_AGAIN_S later, from a SIGALRM timer, where the program's own handlers
    catch it; every other unraisable exception goes to the previous hook. Main thread
    only (signal(2) handlers)."""
    previous = sys.unraisablehook

    def hook(args) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt) \
                and os.getpid() == _hook_pid:
            signal.signal(signal.SIGALRM, _raise_again)
            signal.setitimer(signal.ITIMER_REAL, RAISE_AGAIN_S)
            return
        previous(args)

    global _hook_pid
    _hook_pid = os.getpid()   # a forked child keeps the hook, not the timer's meaning
    sys.unraisablehook = hook


_hook_pid: int | None = None


def _raise_again(signum, frame) -> None:
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    raise KeyboardInterrupt


def _defaults_in_child() -> None:
    if os.getpid() == _owner_pid:
        return
    for s in _installed | {signal.SIGINT}:
        try:   # SIGINT too: Python's default raises there, and would unwind the copy
            signal.signal(s, signal.SIG_DFL)
        except ValueError:   # forked from a thread other than the main one
            pass

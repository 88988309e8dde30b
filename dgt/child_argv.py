"""How dgt starts a Python child: the command line that runs one of our modules (or
torch's) with this interpreter, never importing from the folder it was started in."""
from __future__ import annotations

import sys

#: Python 3.10 has no ``-P``: this ``-c`` program drops the entry ``-c`` put first on
#: ``sys.path`` (``''``, the current folder), then runs the module the way ``-m`` does
#: (as ``__main__``, ``sys.argv[0]`` its file, the arguments after it)
_RUN_WITHOUT_CWD = ("import runpy, sys\n"
                    "if sys.path and sys.path[0] == '':\n"
                    "    del sys.path[0]\n"
                    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n")


def module_argv(module: str, version: tuple[int, ...] = sys.version_info[:2]) -> list[str]:
    """The argv that runs ``python -m module`` (append the module's arguments) with
    ``sys.executable``, without the current folder on the child's ``sys.path``.

    Why: ``python -m`` puts the current folder first on ``sys.path``, so a folder
    started in that holds a ``dgt/`` folder (the one holding a clone named dgt) makes it
    a namespace package that shadows the installed dgt, and every child fails with
    ``cannot import name '__version__' from 'dgt' (unknown location)``.

    On Python >= 3.11 (``version``, the running one unless given): ``[python, "-P",
    "-m", module]``; ``-P`` does not prepend that "potentially unsafe path" (the Python
    docs, "Command line and environment", option -P:
    https://docs.python.org/3/using/cmdline.html#cmdoption-P). Before 3.11: ``[python,
    "-c", PROGRAM, module]``, a short program that removes it and runs the module with
    ``runpy.run_module``. Either way the module name is element 3, an argv element of
    its own (a check on ``/proc/PID/cmdline`` finds it)."""
    if tuple(version) >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _RUN_WITHOUT_CWD, module]


def typed_command(argv: list[str]) -> list[str]:
    """``argv`` (:func:`module_argv` then the module's arguments) as a user would type
    it: ``dgt ARGS`` for dgt.cli, else ``python -m MODULE ARGS``. Raises ValueError for
    an argv that :func:`module_argv` did not start."""
    n = len(module_argv(""))
    module = argv[n - 1] if len(argv) >= n else ""
    if not module or argv[:n] != module_argv(module):
        raise ValueError(f"not a command from module_argv: {argv[:n]}")
    return (["dgt"] if module == "dgt.cli" else ["python", "-m", module]) + argv[n:]

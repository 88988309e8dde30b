"""The layer rule as a test: walk every import of every module (AST, no import runs)
and fail on any edge the layer table in docs/architecture.md forbids.

Layers (folder -> package): ``dgt/`` -> ``dgt``, ``scheduler/`` -> ``dgt.scheduler``,
``transport/`` -> ``dgt.transport``, ``tc_profiles/`` -> ``dgt.tc_profiles``,
``tools/`` -> ``dgt.tools``. ``tools`` may use everything; ``dgt`` may use scheduler,
transport and tc_profiles but never tools; scheduler, transport and tc_profiles stand
alone. Beyond our own layers: transport imports no torch, the scheduler no sockets.
String imports count as edges: ``__import__("x")``, ``importlib.import_module("x")``,
and any string literal that is exactly a dotted ``dgt.*`` module name (the way a loop
over names feeds ``__import__``).

One more rule of the layout: every Python child is started by
``dgt.child_argv.module_argv``, never by a plain ``[sys.executable, "-m", ...]``.
"""
from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE_LITERAL = re.compile(r"dgt(\.[A-Za-z_][A-Za-z0-9_]*)+")

#: layer -> the layers it may import (its own layer is always allowed)
ALLOWED = {
    "dgt": {"scheduler", "transport", "tc_profiles"},
    "scheduler": set(),
    "transport": set(),
    "tc_profiles": set(),
    "tools": {"dgt", "scheduler", "transport", "tc_profiles"},
}
#: layer -> third-party/stdlib top-level modules it must not import
FORBIDDEN_EXTERNAL = {
    "transport": {"torch"},
    "scheduler": {"socket", "asyncio", "uvloop"},
}


def package_dirs() -> dict[str, str]:
    """package name -> folder, from setup.cfg's ``package_dir`` (the one source)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        pkg, folder = (x.strip() for x in line.split("="))
        out[pkg] = folder
    return out


def layer_of(module: str) -> str | None:
    """Layer of a dotted module name, or None if it is not ours."""
    parts = module.split(".")
    if parts[0] != "dgt":
        return None
    if len(parts) > 1 and parts[1] in ("scheduler", "transport", "tc_profiles", "tools"):
        return parts[1]
    return "dgt"


def module_name(path: Path, dirs: dict[str, str]) -> str:
    """Dotted name of the file ``path`` inside the installed namespace."""
    rel = path.relative_to(ROOT)
    folder = rel.parts[0]
    pkg = next(p for p, f in dirs.items() if f == folder)
    rest = [x for x in rel.with_suffix("").parts[1:] if x != "__init__"]
    return ".".join([pkg, *rest])


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``source``, relative ones
    resolved against ``module``; string imports included."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names
                    if layer_of(f"{target}.{a.name}") != layer_of(target)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                MODULE_LITERAL.fullmatch(node.value):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else ""
            if name in ("__import__", "import_module") and node.args and isinstance(
                    node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                target = node.args[0].value
                if target.startswith(".") and len(node.args) > 1:
                    continue   # relative to a runtime package: resolved below
                out.append((node.lineno, target))
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every forbidden edge of one module, as 'module:line -> target (rule)'."""
    me = layer_of(module)
    bad = []
    for line, target in imported_modules(source, module, is_package):
        theirs = layer_of(target)
        top = target.split(".")[0]
        if theirs is not None and theirs != me and theirs not in ALLOWED[me]:
            bad.append(f"{module}:{line} -> {target} (layer {me} must not import {theirs})")
        if theirs is None and top in FORBIDDEN_EXTERNAL.get(me, ()):
            bad.append(f"{module}:{line} -> {target} (layer {me} must not import {top})")
    return bad


def test_no_module_imports_across_a_forbidden_edge():
    dirs = package_dirs()
    assert set(dirs) == {"dgt", "dgt.transport", "dgt.scheduler", "dgt.tc_profiles",
                         "dgt.tools"}
    bad, seen = [], 0
    for folder in dirs.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            mod = module_name(path, dirs)
            bad += violations(path.read_text(), mod, path.name == "__init__.py")
            seen += 1
    assert seen > 40, f"walked only {seen} modules: is the layout still the one in setup.cfg?"
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,source", [
    ("dgt.cli", "from dgt.tools import cli\n"),
    ("dgt.cli", "from .tools import capture\n"),
    ("dgt.cli", "from . import tools\n"),
    ("dgt.cli", "m = __import__('dgt.tools.cli', fromlist=['register'])\n"),
    ("dgt.cli", "import importlib\nimportlib.import_module('dgt.tools.cli')\n"),
    ("dgt.cli", "for m in ('dgt.tc_profiles.cli', 'dgt.tools.cli'):\n    __import__(m)\n"),
    ("dgt.transport.wire", "import torch\n"),
    ("dgt.transport.wire", "from ..agent import WorkerAgent\n"),
    ("dgt.transport.wire", "from .. import agent\n"),
    ("dgt.scheduler.assign", "import socket\n"),
    ("dgt.scheduler.assign", "from ..transport import wire\n"),
    ("dgt.tc_profiles.applier", "from dgt.config import JobConfig\n"),
])
def test_an_upward_import_is_caught(module, source):
    """The checker is not vacuous: each of these edges breaks the layer rule."""
    assert violations(source, module), f"{source!r} in {module} was not flagged"


@pytest.mark.parametrize("module,source", [
    ("dgt.tools.bench", "from dgt.sidecar import Sidecar\nfrom ..transport import wire\n"),
    ("dgt.sidecar", "from .transport import wire\nfrom .scheduler.pacing import x\n"),
    ("dgt.launch", "from .tc_profiles import testbed\n"),
    ("dgt.transport.session", "from . import wire\nimport numpy as np\n"),
])
def test_allowed_imports_pass(module, source):
    assert violations(source, module) == []


#: how a Python child used to be started: ``python -m`` puts the current folder first on
#: the child's sys.path, and a ``dgt/`` folder there shadows the installed dgt
PLAIN_PYTHON_M = re.compile(r"""sys\.executable\s*,\s*["']-m["']|["']-m["']\s*,\s*["']dgt\.""")
#: the one module that writes a child's ``-m`` (see its module_argv)
CHILD_ARGV = "dgt/child_argv.py"


def plain_python_m(source: str) -> list[int]:
    """Lines of ``source`` that start a Python child with a plain ``-m``."""
    return sorted({source.count("\n", 0, m.start()) + 1
                   for m in PLAIN_PYTHON_M.finditer(source)})


def test_every_python_child_is_started_by_module_argv():
    """A spawn site that builds ``[sys.executable, "-m", "dgt.…"]`` itself brings back
    the fault of a ``dgt/`` folder in the current folder (every child failing with
    ``cannot import name '__version__' from 'dgt'``): dgt.child_argv.module_argv is the
    only way to start one."""
    bad, seen = [], 0
    for folder in package_dirs().values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            seen += 1
            if rel != CHILD_ARGV:
                bad += [f"{rel}:{n}" for n in plain_python_m(path.read_text())]
    assert seen > 40 and (ROOT / CHILD_ARGV).is_file()
    assert not bad, ("Python children started with a plain -m (use "
                     "dgt.child_argv.module_argv):\n" + "\n".join(bad))


@pytest.mark.parametrize("source", [
    'argv = [sys.executable, "-m", "dgt.sidecar", "--rank", "0"]\n',
    "cmd = [sys.executable,\n       '-m', 'dgt.tools.gloo_train']\n",
    'py = sys.executable\nargv = prefix + [py, "-m", "dgt.job"]\n',
    'tool = [sys.executable, "-m", "torch.distributed.run"]\n',
])
def test_a_plain_python_m_is_caught(source):
    """The guard is not vacuous: each of these starts a child with a plain -m."""
    assert plain_python_m(source), f"{source!r} was not flagged"


def test_validating_a_job_config_imports_no_netlink_library():
    """``JobConfig.validate`` checks --testbed-prefix with the pure string rule: flag
    validation must not pay for pyroute2 (the fast-CLI rule)."""
    import subprocess
    import sys
    code = ("import sys\nfrom dgt.config import JobConfig\nJobConfig().validate()\n"
            "print('pyroute2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"

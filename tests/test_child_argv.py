"""dgt's Python children never import from the folder they were started in
(dgt/child_argv.py): run from a folder that holds a ``dgt/`` folder (the folder holding
a clone named dgt), ``python -m dgt.x`` imports that folder as the dgt package and
fails. Real processes, started from such a folder."""
import importlib.machinery
import json
import os
import subprocess
import sys

import pytest

from dgt import __version__
from dgt.child_argv import module_argv, typed_command

#: the ``dgt`` command of this environment (a console script: its own folder, not the
#: current one, is first on its sys.path, so only its children meet the shadow)
DGT = os.path.join(os.path.dirname(sys.executable), "dgt")
#: an empty ``dgt/`` folder shadows dgt only where no sys.path entry holds a regular
#: package dgt (an editable install, as the README installs it, is found by its own
#: finder after every path entry); a ``dgt/__init__.py`` shadows any install
EMPTY_SHADOWS = importlib.machinery.PathFinder.find_spec(
    "dgt", [p for p in sys.path if p and os.path.abspath(p) != os.getcwd()]) is None
FORMS = [pytest.param((3, 11), id="-P", marks=pytest.mark.skipif(
             sys.version_info < (3, 11), reason="-P is Python 3.11's")),
         pytest.param((3, 10), id="python-3.10-program")]


def _shadow(folder, kind: str):
    (folder / "dgt").mkdir()
    if kind == "package":
        (folder / "dgt" / "__init__.py").write_text("")
    return folder


@pytest.fixture
def shadowed(tmp_path):
    """A folder holding an empty ``dgt/`` folder (the case reported)."""
    return _shadow(tmp_path, "empty")


@pytest.mark.parametrize("kind", ["empty", "package"])
def test_plain_python_m_imports_the_current_folder(tmp_path, kind):
    """The condition exists: ``[python, "-m", "dgt.cli"]`` from such a folder fails."""
    if kind == "empty" and not EMPTY_SHADOWS:
        pytest.skip(reason="dgt is installed as a regular package on sys.path: an "
                    "empty dgt/ folder does not shadow it")
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "--version"],
                       cwd=_shadow(tmp_path, kind), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "cannot import name '__version__'" in p.stderr, \
        p.stdout + p.stderr


@pytest.mark.parametrize("kind", ["empty", "package"])
@pytest.mark.parametrize("version", FORMS)
def test_module_argv_runs_the_installed_dgt_from_such_a_folder(tmp_path, kind, version):
    argv = module_argv("dgt.cli", version)
    assert argv[0] == sys.executable and argv[3] == "dgt.cli"
    p = subprocess.run(argv + ["--version"], cwd=_shadow(tmp_path, kind),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == f"dgt {__version__}"


@pytest.mark.parametrize("version", FORMS)
def test_the_module_gets_its_arguments_and_its_file_as_with_python_m(tmp_path, version):
    """sys.argv in the child is what ``python -m`` gives: the module's file, then the
    arguments, one of them the module's own name-like string left alone."""
    mod = tmp_path / "lib" / "dgt_argv_probe.py"
    mod.parent.mkdir()
    mod.write_text("import json, sys\nprint(json.dumps([__name__, sys.argv]))\n")
    p = subprocess.run(module_argv("dgt_argv_probe", version) + ["a b", "dgt.cli", "-m"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(mod.parent)))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["__main__", [str(mod), "a b", "dgt.cli", "-m"]]


@pytest.mark.parametrize("version", FORMS)
def test_a_module_in_the_current_folder_is_not_found(tmp_path, version):
    """Not only dgt: nothing in the current folder is importable by the child."""
    (tmp_path / "dgt_cwd_probe.py").write_text("print('imported from the current folder')")
    p = subprocess.run(module_argv("dgt_cwd_probe", version), cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "No module named dgt_cwd_probe" in p.stderr, \
        p.stdout + p.stderr
    assert "imported from the current folder" not in p.stdout


def test_typed_command_is_what_a_user_would_type():
    assert typed_command(module_argv("dgt.cli") + ["train", "--workers", "2"]) == \
        ["dgt", "train", "--workers", "2"]
    assert typed_command(module_argv("dgt.tools.gloo_train") + ["--hidden", "32"]) == \
        ["python", "-m", "dgt.tools.gloo_train", "--hidden", "32"]
    with pytest.raises(ValueError, match="not a command from module_argv"):
        typed_command([sys.executable, "-m", "dgt.cli", "train"])
    with pytest.raises(ValueError, match="not a command from module_argv"):
        typed_command(["dgt"])


@pytest.mark.slow
def test_dgt_train_runs_from_a_folder_holding_dgt(shadowed):
    """``dgt train``'s sidecars and trainers (dgt/launch.py) start from the user's
    folder. An empty ``dgt/`` there breaks only a child that reads the dgt package's
    own names (dgt.cli's ``__version__``): an editable install still finds dgt.sidecar
    and dgt.job. A ``dgt/`` that holds modules of those names (another dgt tree) is
    searched first, so here it holds a sidecar.py and a job.py that fail at once."""
    for name in ("sidecar", "job"):
        (shadowed / "dgt" / f"{name}.py").write_text(
            f"raise SystemExit('dgt.{name} imported from the current folder')\n")
    report = shadowed / "report.json"
    p = subprocess.run([DGT, "train", "--workers", "2", "--epochs", "1", "--iterations",
                        "3", "--hidden", "32", "--report", str(report), "--run-dir",
                        str(shadowed / "run")], cwd=shadowed, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "imported from the current folder" not in p.stdout + p.stderr
    r = json.loads(report.read_text())
    assert r["workers"] == 2 and r["iterations"] == 3 and r["replicas_identical"]


@pytest.mark.slow
def test_dgt_bench_runs_from_a_folder_holding_dgt(shadowed):
    """``dgt bench`` (tools/bench.py) starts each cell's job, and gloo_train its ranks,
    from the user's folder; each cell's command stays the one a user would type."""
    out = shadowed / "out"
    p = subprocess.run([DGT, "bench", "--loopback", "--iterations", "2", "--workers", "2",
                        "--hidden", "32", "--systems", "gloo,dgt", "--out", str(out)],
                       cwd=shadowed, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cells = json.loads((out / "loopback.json").read_text())["cells"]
    assert [c["system"] for c in cells] == ["gloo", "dgt"]
    for c in cells:
        assert c["error"] is None and c["iterations"] == 2, c
    assert cells[0]["command"].startswith("python -m dgt.tools.gloo_train --workers 2 ")
    assert cells[1]["command"].startswith("dgt train --mode dgt ")

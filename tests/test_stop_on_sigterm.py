"""tests/stop_on_sigterm.py: a pytest session stopped by SIGTERM (CI's `timeout`) still
runs its fixtures' teardown, so what a test built (a testbed) is removed."""
import os
import signal
import subprocess
import sys
import time

TEST = '''
import time
import pytest

@pytest.fixture
def built(tmp_path_factory):
    yield
    open(os.environ["TORN_DOWN"], "w").write("torn down")

def test_slow(built):
    open(os.environ["STARTED"], "w").write("started")
    time.sleep(120)
'''


def _session(tmp_path, plugin: bool):
    (tmp_path / "test_slow.py").write_text("import os\n" + TEST)
    env = dict(os.environ, TORN_DOWN=str(tmp_path / "torn"), STARTED=str(tmp_path / "go"),
               PYTHONPATH=os.path.dirname(__file__))
    args = ["-p", "stop_on_sigterm"] if plugin else []
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), *args, str(tmp_path / "test_slow.py")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        t_end = time.monotonic() + 120
        while not (tmp_path / "go").exists():
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < t_end, "the inner test never started"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, (tmp_path / "torn").exists(), out


def test_sigterm_to_a_session_runs_the_teardown(tmp_path):
    code, torn, out = _session(tmp_path, plugin=True)
    assert torn, out
    assert code == 2, out   # pytest's "interrupted"


def test_without_the_plugin_sigterm_skips_the_teardown(tmp_path):
    """The guard: what the plugin is for (pytest dies on SIGTERM, no teardown)."""
    code, torn, out = _session(tmp_path, plugin=False)
    assert not torn and code == -signal.SIGTERM, (code, out)


def test_a_forked_child_of_the_session_dies_of_sigterm_as_before(tmp_path):
    """A test that forks (tests/test_bench.py, test_testbed.py) and stops its child with
    SIGTERM: the child dies of the signal, it does not raise into pytest's code."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1")
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)   # the child runs (a signal before fork's end in the child is lost)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status

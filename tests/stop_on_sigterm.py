"""A pytest plugin (loaded by conftest.py): SIGTERM ends the session as Ctrl-C does, so
the fixtures' teardown runs. Without it pytest dies at once on SIGTERM, as `timeout`
sends it to CI's run at its limit (and as a developer's `kill` does), and a test that
was building a testbed leaves its namespaces, veths and qdiscs behind (seen when a CI
run was stopped by hand: dgtdd-h0, -h1 and -sw stayed). A copy of the session made by
os.fork (a test's child) dies of SIGTERM as before: it must not run the session's
teardown (dgt/interrupt.py says why)."""
import os
import signal


def pytest_configure(config):
    owner = os.getpid()

    def stop(signum, frame):
        if os.getpid() != owner:   # a forked child: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    # a forked child has the default action from the start, not once it runs Python
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM,
                                                             signal.SIG_DFL))

"""dgt.hugepages: numpy's huge-page advice is off in a process that asks, unless the
user's NUMPY_MADVISE_HUGEPAGE says otherwise. Each case runs in a fresh interpreter:
the switch is process-wide."""
import json
import os
import subprocess
import sys

import pytest

PROBE = ("import json; from dgt import hugepages as h; before = h.numpy_huge_page_advice(); "
         "off = h.keep_small_pages(); "
         "print(json.dumps([before, off, h.numpy_huge_page_advice()]))")


def probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env_value is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out)


def test_the_advice_goes_off_by_default():
    before, off, after = probe(None)
    assert before is not None, "numpy >= 1.26 (setup.cfg) has the advice switch"
    assert (off, after) == (True, False)


def test_numpy_own_switch_wins():
    before, off, after = probe("1")
    assert before is True and (off, after) == (False, True)   # the user asked for it
    assert probe("0") == [False, True, False]   # numpy read 0 at import: off already


@pytest.mark.parametrize("value", ["", "abc", " x "])
def test_a_value_numpy_cannot_read_is_one_line_from_dgt(value):
    """numpy calls int() on NUMPY_MADVISE_HUGEPAGE at import: dgt says so in one line
    (exit 2) before numpy loads, for every command, instead of numpy's traceback."""
    env = dict(os.environ, NUMPY_MADVISE_HUGEPAGE=value)
    for args in (["--help"], ["train", "--workers", "2"]):
        p = subprocess.run([sys.executable, "-m", "dgt.cli", *args], env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (value, args, p.stderr)
        assert "Traceback" not in p.stderr
        assert p.stderr.strip() == (f"dgt: error: NUMPY_MADVISE_HUGEPAGE={value!r} is not "
                                    f"an integer, and numpy stops at import on it; unset "
                                    f"it, or set 0 (small pages) or 1 (huge pages)")

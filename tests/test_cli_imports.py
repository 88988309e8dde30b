"""'dgt --help' and the tc, testbed and pcap subcommands import no torch (a cold torch
import costs seconds: those commands must answer at once)."""
import subprocess
import sys

import pytest

PROBE = """
import sys
from dgt.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
"""


@pytest.mark.parametrize("argv", [["--help"], ["tc", "--help"], ["tc", "list"],
                                  ["testbed", "--help"], ["testbed", "status", "--help"],
                                  ["pcap", "--help"], ["pcap", "summary", "--help"]])
def test_these_commands_import_no_torch(argv):
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True,
                       text=True, timeout=120)
    assert p.stdout.strip().splitlines()[-1] == "NO-TORCH", (argv, p.stdout, p.stderr)


def test_the_probe_sees_torch_when_a_command_imports_it():
    """The probe can fail: with torch imported before the command, it says TORCH."""
    p = subprocess.run([sys.executable, "-c", "import torch\n" + PROBE, "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip().splitlines()[-1] == "TORCH", p.stdout

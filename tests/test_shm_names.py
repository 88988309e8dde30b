"""The sidecar's shared buffer lives in /dev/shm, which every user may write. An outside
tester (breaker round 5) predicted a root job's buffer name (pid, session, rank), planted
a link there to a root-owned file, which the sidecar truncated and wrote gradients
through, and its own mode-0666 file for another rank, which it then mapped and scribbled
on: the replicas ended different. Now the name has 64 random bits, the creator refuses a
name that exists or is a link, and the attaching side maps only its own user's private
regular file."""
import os
import stat

import numpy as np
import pytest

from dgt import ipc


def test_a_buffer_name_cannot_be_known_in_advance():
    a = ipc.buffer_name(1234, 0xdeadbeef, 1)
    b = ipc.buffer_name(1234, 0xdeadbeef, 1)
    assert a != b
    for name in (a, b):
        base = os.path.basename(name)
        assert os.path.dirname(name) == ipc.shm_dir()
        assert base.startswith("dgt-1234-deadbeef-r1-") and base.endswith("-grad"), base
        assert len(base.split("-")[4]) == 16, base   # the random part: 8 bytes, hex


def test_a_link_planted_at_the_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"IMPORTANT CONTENT")
    name = tmp_path / "dgt-1-00000000-r0-grad"
    os.symlink(victim, name)
    with pytest.raises(OSError):
        ipc.ShmBuffer(str(name), 1000, create=True)
    assert victim.read_bytes() == b"IMPORTANT CONTENT"
    assert os.path.islink(name)   # not ours: left as it is


def test_a_file_planted_at_the_name_is_not_used(tmp_path):
    name = tmp_path / "dgt-1-00000000-r1-grad"
    name.write_bytes(b"\0" * 4000)
    os.chmod(name, 0o666)
    with pytest.raises(FileExistsError):
        ipc.ShmBuffer(str(name), 1000, create=True)
    assert name.read_bytes() == b"\0" * 4000


def test_the_creator_makes_a_private_file_and_the_peer_maps_it(tmp_path):
    name = str(tmp_path / "dgt-1-00000000-r2-grad")
    mine = ipc.ShmBuffer(name, 10, create=True)
    st = os.stat(name)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    peer = ipc.ShmBuffer(name, 10)
    mine.array[:] = np.arange(10, dtype=np.float32)
    assert peer.array.tolist() == list(range(10))
    peer.close()
    mine.close()
    assert not os.path.exists(name)


@pytest.mark.parametrize("case", ["mode 0666", "mode 0640", "a link", "a fifo",
                                  "another size"])
def test_the_attaching_side_maps_only_its_users_private_file(tmp_path, case):
    name = str(tmp_path / "dgt-1-00000000-r3-grad")
    if case == "a link":
        target = tmp_path / "target"
        target.write_bytes(b"\0" * 40)
        os.chmod(target, 0o600)
        os.symlink(target, name)
    elif case == "a fifo":
        os.mkfifo(name, 0o600)
    else:
        with open(name, "wb") as f:
            f.write(b"\0" * (80 if case == "another size" else 40))
        os.chmod(name, {"mode 0666": 0o666, "mode 0640": 0o640}.get(case, 0o600))
    with pytest.raises((OSError, ValueError)) as e:
        ipc.ShmBuffer(name, 10)
    if case.startswith("mode"):
        assert "another user made it" in str(e.value) and "\n" not in str(e.value)
    if case == "another size":
        assert "size 80 B, expected 40 B" in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a file of another user")
def test_another_users_file_is_not_mapped(tmp_path):
    name = str(tmp_path / "dgt-1-00000000-r4-grad")
    with open(name, "wb") as f:
        f.write(b"\0" * 40)
    os.chmod(name, 0o600)
    os.chown(name, 65534, 65534)
    with pytest.raises(ValueError) as e:
        ipc.ShmBuffer(name, 10)
    assert "owned by uid 65534" in str(e.value)


def test_a_data_path_that_cannot_be_built_leaves_no_buffer_name():
    # breaker round 21: a seed the planner's generator could not take made
    # datapath.build raise after it had made the buffer, and its name stayed in
    # /dev/shm (one per rank) after the sidecar's "internal error"
    from dgt.config import TransmissionConfig
    from dgt.datapath import build
    from dgt.layout import BlockLayout
    from dgt.peer_links import PeerLinks
    from dgt.transport.channels import channel_dscp
    from dgt.transport.counters import Counters
    cfg = TransmissionConfig()
    lay = BlockLayout.from_bytes(352 * 4 * 8, 1408, 2)
    links = PeerLinks(cfg, 0, 2, list(channel_dscp(3)), None)
    mine = f"dgt-{os.getpid()}-"
    before = {n for n in os.listdir(ipc.shm_dir()) if n.startswith(mine)}
    with pytest.raises((ValueError, OverflowError, RuntimeError)):
        build(cfg, lay, 0, 0x5eed, None, Counters(), links, 2**70, lambda *a: None,
              lambda r: None)
    after = {n for n in os.listdir(ipc.shm_dir()) if n.startswith(mine)}
    assert after == before, sorted(after - before)

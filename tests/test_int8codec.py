"""The int8 block codec's C helper (dgt/_int8codec.c) against dgt.codec's torch path:
the same payload bytes and the same decoded bits for every block, ties, signed zeros,
tiny and huge values, strided rows and an encoder that writes its decoded copy over
its input; a non-finite block decodes non-finite on both paths."""
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from dgt import codec
from dgt.transport.wire import Coding

E = 352


def _both(monkeypatch, fn):
    """``fn()`` on the C helper, then on the torch path."""
    if not codec.native():
        pytest.skip(reason="the C helper is not built (see "
                           "test_the_native_helper_is_built)")
    native = fn()
    monkeypatch.setattr(codec, "_native", None)
    assert not codec.native()
    return native, fn()


def _blocks(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, E)).astype(np.float32)
    x[1] *= 1e-40                      # subnormal block
    x[2] *= 1e30                       # huge values
    x[3] = 0.0                         # all zero: scale 0, q 0
    x[4] = -0.0
    x[5, :] = np.arange(E, dtype=np.float32) % 7 - 3.5   # halves once scaled
    x[5, 0] = 127.0                    # max 127: r = 1, so x r = x: ties at .5
    x[6] = rng.integers(-127, 128, E).astype(np.float32) / 2   # ties at every scale
    x[6, 0] = 63.5
    x[7] = np.float32(3e-45)           # near the smallest subnormal
    return x


def test_the_native_helper_is_built():
    """pip install builds it where a C compiler is (this machine, CI). A build that
    broke silently (the extension is optional) fails here."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if shutil.which(cc) is None or not headers.exists():
        pytest.skip(reason="no C compiler or no Python headers: install Debian's gcc and "
                           "python3-dev, then pip install -e . again (int8 runs on "
                           "torch's kernels meanwhile)")
    assert codec.native(), "dgt/_int8codec.c was not built though a compiler is here"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encode_gives_the_torch_paths_bytes_and_decoded_bits(monkeypatch, seed):
    x = _blocks(seed)

    def run():
        dec = torch.empty(x.shape)
        rows = codec.encode(Coding.INT8, torch.from_numpy(x.copy()), dec)
        return rows, dec.numpy().view(np.uint32).copy()

    (rows_c, dec_c), (rows_t, dec_t) = _both(monkeypatch, run)
    assert rows_c.shape == (64, 4 + E)
    assert np.array_equal(rows_c, rows_t)
    assert np.array_equal(dec_c, dec_t)
    # and decode on either path gives the decoded copy's bits
    for rows in (rows_c, rows_t):
        assert np.array_equal(codec.decode(Coding.INT8, rows, E).view(np.uint32), dec_t)


def test_decode_reads_strided_rows_inside_datagrams(monkeypatch):
    x = _blocks(3)
    rows = codec.encode(Coding.INT8, torch.from_numpy(x))
    # each payload sits inside a 34-byte header and a 16-byte tag, as in a GRO run
    grams = np.zeros((64, 34 + rows.shape[1] + 16), np.uint8)
    grams[:, 34:34 + rows.shape[1]] = rows
    view = grams[:, 34:34 + rows.shape[1]]
    assert view.strides[0] != rows.shape[1]
    c, t = _both(monkeypatch, lambda: codec.decode(Coding.INT8, view, E).view(np.uint32))
    assert np.array_equal(c, t)
    assert np.array_equal(c, codec.decode(Coding.INT8, rows, E).view(np.uint32))


def test_the_decoded_copy_may_overwrite_the_blocks(monkeypatch):
    x = _blocks(4)

    def run():
        y = torch.from_numpy(x.copy())
        rows = codec.encode(Coding.INT8, y, y)   # decoded written over its input
        return rows, y.numpy().view(np.uint32).copy()

    (rows_c, dec_c), (rows_t, dec_t) = _both(monkeypatch, run)
    assert np.array_equal(rows_c, rows_t) and np.array_equal(dec_c, dec_t)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_block_decodes_non_finite_on_both_paths(monkeypatch, bad):
    x = _blocks(5)
    x[9, 17] = bad

    def run():
        rows = codec.encode(Coding.INT8, torch.from_numpy(x))
        return rows, codec.decode(Coding.INT8, rows, E)

    for rows, dec in _both(monkeypatch, run):
        assert not np.isfinite(dec[9]).all()
        ok = np.arange(64) != 9
        assert np.isfinite(dec[ok]).all()
        assert not np.isfinite(rows[9, :4].view("<f4")).all()   # its scale


def test_shapes_that_do_not_fit_are_refused():
    if not codec.native():
        pytest.skip(reason="the C helper is not built")
    from dgt import _int8codec
    x = np.zeros((4, E), np.float32)
    with pytest.raises(ValueError, match="out must be"):
        _int8codec.encode(x, np.zeros((4, E), np.uint8), None, None)
    with pytest.raises(ValueError, match="rows must be"):
        _int8codec.decode(np.zeros((4, E), np.uint8), np.zeros((4, E), np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        _int8codec.encode(x[:, ::2], np.zeros((4, 4 + E // 2), np.uint8), None, None)
    with pytest.raises(ValueError):   # read-only output
        out = np.zeros((4, 4 + E), np.uint8)
        out.setflags(write=False)
        _int8codec.encode(x, out, None, None)


@pytest.mark.parametrize("over_blocks", [False, True])
def test_the_coding_error_is_the_blocks_less_their_decoded_values(monkeypatch, over_blocks):
    """encode(..., error=): what error feedback keeps, bitwise blocks - decoded on both
    paths, also written over the blocks themselves (the planner's gathered copy)."""
    x = _blocks(6)

    def run():
        y = torch.from_numpy(x.copy())
        err = y if over_blocks else torch.empty_like(y)
        dec = torch.empty_like(y)
        rows = codec.encode(Coding.INT8, y, dec, error=err)
        return rows, dec.numpy().copy(), err.numpy().copy()

    (rows_c, dec_c, err_c), (rows_t, dec_t, err_t) = _both(monkeypatch, run)
    assert np.array_equal(rows_c, rows_t)
    assert np.array_equal(err_c.view(np.uint32), err_t.view(np.uint32))
    fin = np.isfinite(dec_t).all(axis=1)
    want = np.subtract(x, dec_t)
    assert np.array_equal(err_c[fin].view(np.uint32), want[fin].view(np.uint32))
    assert np.abs(err_c[fin]).max() > 0   # int8 rounds: the error is not all zero


def test_decoded_and_error_in_one_array_are_refused():
    y = torch.from_numpy(_blocks(7))
    with pytest.raises(ValueError, match="two arrays"):
        codec.encode(Coding.INT8, y, y, error=y)
    d = torch.empty_like(y)
    with pytest.raises(ValueError, match="two arrays"):
        codec.encode(Coding.INT8, y, d, error=d)


@pytest.mark.slow
def test_a_job_trains_to_the_same_bits_on_either_path(tmp_path, monkeypatch):
    """Two dgt train runs of one seed, every int8 form on (bands, reliable channel,
    PULLs), the sidecars coding with the C helper in one and with torch's kernels in
    the other (DGT_INT8_CODEC=torch; each report says which): the same parameters."""
    if not codec.native():
        pytest.skip(reason="the C helper is not built")
    from conftest import run_train
    got = {}
    for path in ("C", "torch"):
        if path == "torch":
            monkeypatch.setenv("DGT_INT8_CODEC", "torch")
        _, r = run_train(tmp_path / path, "--workers", 3, "--iterations", 8, "--epochs", 1,
                         "--eval-every", 0, "--band-codec", "int8", "--pull-codec", "int8",
                         "--reliable-codec", "int8", "--seed", 5, "--deadline-ms", 3000)
        assert {s["int8_codec"] for s in r["sidecars"]} == {path}
        assert sum(ch["blocks_lost"] for ch in r["channels"].values()) == 0, \
            "precondition: a run without loss"
        assert r["replicas_identical"]
        got[path] = r["param_sha256"][0]
    assert got["C"] == got["torch"]


@pytest.mark.parametrize("coding", [Coding.INT8, Coding.FP16, Coding.INT4])
def test_decode_into_a_given_array_writes_the_same_bits(coding):
    """decode(..., out=): a shard decodes a worker's whole coded shard straight into its
    receive rows; the bits are those of a decode into a new array."""
    rows = codec.encode(coding, torch.from_numpy(_blocks(8)))
    recv = np.full((3, 64, E), np.nan, np.float32)
    got = codec.decode(coding, rows, E, out=recv[1])
    assert got is recv[1] or np.shares_memory(got, recv)
    assert np.array_equal(recv[1].view(np.uint32),
                          codec.decode(coding, rows, E).view(np.uint32))
    assert np.isnan(recv[0]).all() and np.isnan(recv[2]).all()   # nothing else written
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(coding, rows, E, out=recv[1, :, ::2])
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(coding, rows, E, out=np.empty((64, E), np.float64))

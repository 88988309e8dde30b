"""The library API's arguments outside what it documents, as an outside tester gave them:
dgt.Client's timeouts and rank, dgt.codec's inputs, scheduler.deadline.AdaptiveDeadline's
configuration and the loss that scheduler.assign.AdaptiveK and Client.push_pull take.
Each is refused at once with a TypeError or ValueError naming the argument and what it
must be, or taken the way the documentation says; none hangs or fails deep inside."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import dgt
from dgt import codec
from dgt.scheduler.assign import AdaptiveK
from dgt.scheduler.deadline import AdaptiveDeadline
from dgt.transport.wire import Coding

CODINGS = [Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4]
NAN, INF = float("nan"), float("inf")


# -- dgt.Client: timeouts and rank ---------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_connect_timeout_that_is_not_finite_is_refused_not_waited_out(tmp_path, value):
    # it waited for ever for a sidecar at a path where none is: the bound of the wait
    # is checked in a child that may take 60 s at most
    code = ("import dgt\n"
            "try:\n"
            f"    dgt.Client({str(tmp_path / 'none.sock')!r}, "
            f"connect_timeout_s=float({value!r}))\n"
            "except ValueError as e:\n"
            "    print(type(e).__name__, e)\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"Client(connect_timeout_s={value}) still waited after 60 s")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (f"ValueError Client(connect_timeout_s={value}): give the "
                                f"seconds to wait for the sidecar's socket, a number > "
                                f"0 and <= 1e+09"), p.stdout


@pytest.mark.parametrize("name,value", [
    ("timeout_s", NAN), ("timeout_s", -1), ("timeout_s", 0), ("timeout_s", INF),
    ("timeout_s", "5"), ("timeout_s", True),
    ("connect_timeout_s", -1), ("connect_timeout_s", 0), ("connect_timeout_s", None)])
def test_a_client_timeout_that_is_not_a_finite_number_above_0_is_refused(tmp_path, name,
                                                                         value):
    # they passed until socket.settimeout said "Invalid value NaN" or "Timeout value out
    # of range" (after the connection, here after waiting for a sidecar that is not
    # there), or waited without a bound
    kw = {"connect_timeout_s": 0.01, name: value}
    with pytest.raises(ValueError) as e:
        dgt.Client(str(tmp_path / "none.sock"), **kw)
    assert str(e.value).startswith(f"Client({name}={value!r}): give the seconds ")
    assert str(e.value).endswith(", a number > 0 and <= 1e+09")


@pytest.mark.parametrize("rank", [-1, 1.5, "0", True, None, 64, 10**30])
def test_a_rank_that_is_not_an_int_of_0_or_more_is_refused(tmp_path, rank):
    # rank -1 looked for sidecar--1.sock
    with pytest.raises(ValueError) as e:
        dgt.Client(str(tmp_path / "none.sock"), connect_timeout_s=0.01, rank=rank)
    assert str(e.value) == f"Client(rank={rank!r}): give this trainer's rank, an int in 0..63"


def test_good_client_arguments_still_reach_the_wait_for_the_sidecar(tmp_path):
    path = str(tmp_path / "none.sock")
    for kw in ({"timeout_s": 5, "rank": 3}, {"timeout_s": np.float32(0.5)},
               {"rank": np.int64(2)}):
        with pytest.raises(dgt.PeerFailure, match="no sidecar at"):
            dgt.Client(path, connect_timeout_s=0.01, **kw)


def test_a_client_default_timeout_allows_its_sidecars_start_up_grace(sidecar, monkeypatch):
    """A hand-started sidecar's start-up grace is DGT_STARTUP_GRACE_S, else grown with the
    load (dgt.config.hand_started_grace); the Client's default timeout took a fixed 10 s
    for it, so past a grace of 40 s the trainer gave up before its sidecar could name a
    peer that never came."""
    from dgt.config import START_SKEW_S, trainer_timeout_s
    path, _ = sidecar
    monkeypatch.setenv("DGT_STARTUP_GRACE_S", "300")
    c = dgt.Client(path, connect_timeout_s=60)
    try:
        assert c.timeout_s == trainer_timeout_s(20.0, 300.0) == 60.0 + 300.0
        assert c.timeout_s > 20.0 + max(START_SKEW_S, 300.0)   # the sidecar's own wait
    finally:
        c.close()


# -- dgt.codec -----------------------------------------------------------------------------

def _x(m=6, e=8, seed=0):
    return torch.randn(m, e, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_codes_a_non_contiguous_input_as_its_contiguous_copy(coding):
    # fp16 and bf16 failed ("self.stride(-1) must be 1 to view Half as Byte"); int8 and
    # int4 coded it
    x = _x(8, 6).t()
    assert not x.is_contiguous()
    want = codec.encode(coding, x.contiguous())
    assert np.array_equal(codec.encode(coding, x), want)
    dec, err = torch.empty(6, 8), torch.empty(6, 8)
    assert np.array_equal(codec.encode(coding, x, dec, err), want)
    assert torch.equal(dec, torch.from_numpy(codec.decode(coding, want, 8)))
    assert torch.equal(err, x - dec)
    # the coding error written over a non-contiguous input itself (as the planner does)
    y = x.clone().t().contiguous().t()   # x's values in x's layout, its own memory
    assert np.array_equal(codec.encode(coding, y, error=y), want)
    assert torch.equal(y, x - dec)


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_codes_an_input_that_requires_grad_from_its_values(coding):
    # int8 and int4 failed: "abs(): functions with out=... arguments don't support
    # automatic differentiation"
    x = _x().requires_grad_()
    want = codec.encode(coding, x.detach())
    assert np.array_equal(codec.encode(coding, x), want)
    dec = torch.empty(6, 8)
    assert np.array_equal(codec.encode(coding, x, dec), want)
    assert torch.equal(dec, torch.from_numpy(codec.decode(coding, want, 8)))


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32])
def test_every_coding_refuses_an_input_that_is_not_float32(coding, dtype):
    # float64: int8 and int4 said "Found dtype Float but expected Double", fp16 and bf16
    # coded it without a word
    with pytest.raises(TypeError) as e:
        codec.encode(coding, _x().to(dtype))
    assert str(e.value) == (f"blocks must be a float32 tensor of shape (m, E), got "
                            f"{dtype}")


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("shape", [(8,), (2, 3, 4), ()])
def test_every_coding_refuses_an_input_that_is_not_m_by_e(coding, shape):
    # "not enough values to unpack (expected 2, got 1)"
    with pytest.raises(ValueError) as e:
        codec.encode(coding, torch.zeros(shape))
    assert str(e.value) == (f"blocks must have shape (m, E) with E > 0, got "
                            f"{tuple(shape)}")


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_refuses_blocks_of_no_element(coding):
    # int4: ZeroDivisionError; the others gave payloads of a scale and no value
    with pytest.raises(ValueError, match=r"shape \(m, E\) with E > 0, got \(6, 0\)"):
        codec.encode(coding, torch.empty(6, 0))


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_refuses_what_is_not_a_cpu_tensor(coding):
    with pytest.raises(TypeError, match=r"blocks must be a float32 tensor of shape "
                                        r"\(m, E\), got ndarray"):
        codec.encode(coding, _x().numpy())
    with pytest.raises(ValueError, match="blocks must be on the CPU, got meta"):
        codec.encode(coding, torch.empty(6, 8, device="meta"))


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_refuses_decoded_and_error_arrays_that_do_not_fit(coding):
    x = _x()
    for name in ("decoded", "error"):
        with pytest.raises(ValueError, match=f"{name} must be a float32 tensor of "
                                             r"blocks' shape \(6, 8\), on the CPU, got "):
            codec.encode(coding, x, **{name: torch.empty(6, 9)})
        with pytest.raises(ValueError, match=f"{name} must be a float32 tensor of "
                                             r"blocks' shape \(6, 8\), on the CPU, got "):
            codec.encode(coding, x, **{name: torch.empty(6, 8, dtype=torch.float64)})


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_still_codes_no_block(coding):
    rows = codec.encode(coding, torch.empty(0, 8))
    assert rows.shape == (0, codec.coded_payload_bytes(coding, 8))
    assert codec.decode(coding, rows, 8).shape == (0, 8)


@pytest.mark.parametrize("coding", CODINGS)
def test_decode_refuses_rows_that_are_not_a_uint8_array(coding):
    rows = codec.encode(coding, _x())
    # a tensor: AttributeError 'Tensor' object has no attribute 'flags' (or 'strides')
    with pytest.raises(TypeError) as e:
        codec.decode(coding, torch.from_numpy(rows), 8)
    assert str(e.value) == ("rows must be a numpy uint8 array of shape (m, payload "
                            "bytes), got Tensor")
    # int8 bytes were decoded as if they were uint8
    with pytest.raises(TypeError) as e:
        codec.decode(coding, rows.view(np.int8), 8)
    assert str(e.value) == ("rows must be a numpy uint8 array of shape (m, payload "
                            "bytes), got int8")
    with pytest.raises(ValueError, match=r"rows must have shape \(m, payload bytes\), "
                                         r"got \(\d+,\)"):
        codec.decode(coding, rows[0], 8)


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("e", [0, -1, 2.0, True])
def test_decode_refuses_a_block_size_that_is_not_an_int_above_0(coding, e):
    # int4 with 0: ZeroDivisionError, int8 with 0 gave (m, 0)
    with pytest.raises(ValueError) as ex:
        codec.decode(coding, np.zeros((2, 4), np.uint8), e)
    assert str(ex.value) == f"block_elems must be an int > 0, got {e!r}"


# -- scheduler.deadline.AdaptiveDeadline ---------------------------------------------------

@pytest.mark.parametrize("args,kw,name", [
    ((NAN, 1.0), {}, "floor_s"), ((INF, 1.0), {}, "floor_s"), ((-0.1, 1.0), {}, "floor_s"),
    ((0.05, NAN), {}, "ceiling_s"), ((0.05, INF), {}, "ceiling_s"),
    ((0.05, -1.0), {}, "ceiling_s"),
    ((0.05, 1.0), {"margin": NAN}, "margin"), ((0.05, 1.0), {"margin": INF}, "margin"),
    ((0.05, 1.0), {"margin": 0.5}, "margin"),
    ((0.05, 1.0), {"window": 0}, "window"), ((0.05, 1.0), {"window": 2.5}, "window"),
    ((0.05, 1.0), {"window": True}, "window"), (("0.05", 1.0), {}, "floor_s")])
def test_adaptive_deadline_refuses_a_bad_configuration_naming_it(args, kw, name):
    # floor nan gave the deadline nan; ceiling nan never adapted; margin nan and a
    # negative ceiling were taken
    with pytest.raises(ValueError) as e:
        AdaptiveDeadline(*args, **kw)
    value = dict(zip(("floor_s", "ceiling_s"), args), **kw)[name]
    assert str(e.value).startswith(f"AdaptiveDeadline({name}={value!r}): ")


def test_adaptive_deadline_with_a_good_configuration_adapts_as_before():
    d = AdaptiveDeadline(0.05, 1.0)
    d.observe(0.1)
    assert d.deadline_s() == pytest.approx(0.15)
    assert AdaptiveDeadline(0.05, 0.0).deadline_s() == 0.05   # ceiling <= floor: fixed
    assert AdaptiveDeadline(0, 0, margin=1, window=1).deadline_s() == 0


# -- the loss: scheduler.assign.AdaptiveK and Client.push_pull --------------------------

@pytest.mark.parametrize("loss0,loss1", [
    (torch.tensor(2.0), torch.tensor([1.0])), (np.float32(2), np.float64(1)),
    (2, 1), (np.array(2.0), torch.tensor(1, dtype=torch.int64)),
    (torch.tensor(2.0, requires_grad=True) * 1, np.array([1.0], np.float32))])
def test_adaptive_k_takes_a_loss_that_is_one_real_number_as_a_float(loss0, loss1):
    # a tensor loss gave k tensor(0.5) and a state_dict of {'loss0': tensor(2.)}
    a = AdaptiveK(0.5, 0.2)
    k0, k1 = a.update(loss0), a.update(loss1)
    assert (type(k0), type(k1)) == (float, float)
    assert (k0, k1) == (0.5, 0.25)
    state = a.state_dict()
    assert state == {"loss0": 2.0} and type(state["loss0"]) is float


@pytest.mark.parametrize("loss", [torch.ones(2), np.ones(3), "2", True, np.bool_(True),
                                  torch.tensor(True), 1 + 2j, torch.tensor(1 + 2j), [2.0]])
def test_adaptive_k_refuses_a_loss_that_is_not_one_real_number(loss):
    with pytest.raises(TypeError) as e:
        AdaptiveK(0.5, 0.2).update(loss)
    assert str(e.value).startswith("loss must be one real number (a Python number, a "
                                   "numpy scalar, a one-element tensor or array) or None, "
                                   "got ")


def test_adaptive_k_keeps_ignoring_a_loss_that_is_not_finite_or_above_0():
    a = AdaptiveK(0.5, 0.2)
    assert [a.update(x) for x in (NAN, torch.tensor(INF), None)] == [0.5] * 3
    assert a.state_dict() == {"loss0": None}
    assert a.update(np.float32(2)) == 0.5
    assert [a.update(x) for x in (NAN, -1.0, 0, None)] == [0.2] * 4


@pytest.mark.timeout(120)
def test_push_pull_takes_a_tensor_or_numpy_loss_and_refuses_others_before_sending(sidecar):
    # loss=torch.tensor(2.) and loss=np.float32(2) raised "Object of type Tensor (float32)
    # is not JSON serializable"
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    c.register(m)
    step = 0
    for loss in (torch.tensor(2.0, requires_grad=True) * 1, np.float32(2), np.array([1.5]),
                 NAN, INF, 3):
        m.zero_grad()
        m(torch.ones(1, 4)).sum().backward()
        c.push_pull(step, loss=loss)
        step += 1
    for bad in (torch.ones(2), "2", True):
        with pytest.raises(TypeError, match="^loss must be one real number"):
            c.push_pull(step, loss=bad)
        with pytest.raises(TypeError, match="^loss must be one real number"):
            c.push_buffer(step, loss=bad)
    c.push_pull(step, loss=torch.tensor(1.0))   # nothing was sent: the step is still due
    c.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()


# -- round 18: AdaptiveK's configuration and state, AdaptiveDeadline.observe, decode ------

@pytest.mark.parametrize("k0,k_min,name", [
    (True, 0.2, "k0"), ("0.5", 0.2, "k0"), (None, 0.2, "k0"), (NAN, 0.2, "k0"),
    (INF, 0.2, "k0"), (1.5, 0.2, "k0"), (0.5, False, "k_min"), (0.5, "0.2", "k_min"),
    (0.5, None, "k_min"), (0.5, NAN, "k_min"), (0.5, -0.1, "k_min"), (0.5, 0.6, "k_min"),
    (np.bool_(True), 0.2, "k0")])
def test_adaptive_k_refuses_a_configuration_that_is_not_two_fractions_naming_it(k0, k_min,
                                                                                name):
    # True was taken as k0 = 1; "0.5" and None: "'<=' not supported between instances
    # of 'float' and 'str'", naming no argument
    with pytest.raises(ValueError) as e:
        AdaptiveK(k0, k_min)
    value = {"k0": k0, "k_min": k_min}[name]
    assert str(e.value).startswith(f"AdaptiveK({name}={value!r}): give ")
    assert "0 <= k_min <= k0 <= 1" in str(e.value)


def test_adaptive_k_takes_a_good_configuration_as_floats():
    for k0, k_min in ((1, 0), (np.float32(0.5), np.float64(0.25)), (0.3, 0.3)):
        a = AdaptiveK(k0, k_min)
        assert (a.k0, a.k_min) == (float(k0), float(k_min))
        assert type(a.update(None)) is float


@pytest.mark.parametrize("loss", [10 ** 400, -(10 ** 400), 2 ** 1024])
def test_adaptive_k_refuses_an_int_loss_too_large_for_a_float(loss):
    # OverflowError: int too large to convert to float
    with pytest.raises(TypeError) as e:
        AdaptiveK(0.5, 0.2).update(loss)
    assert str(e.value).startswith("loss must be one real number")
    assert "too large for a float" in str(e.value)


@pytest.mark.parametrize("loss0", [0.0, -1.0, NAN, INF, 0, "2", True])
def test_adaptive_k_load_state_dict_refuses_a_loss0_update_never_stores(loss0):
    # 0.0: update(1.0) raised ZeroDivisionError; nan: update(1.0) gave 1.0
    a = AdaptiveK(0.5, 0.2)
    with pytest.raises(ValueError) as e:
        a.load_state_dict({"loss0": loss0})
    assert str(e.value).startswith(f"AdaptiveK.load_state_dict: loss0={loss0!r} ")
    assert a.state_dict() == {"loss0": None}   # left as it was
    assert a.update(1.0) == 0.5


def test_adaptive_k_load_state_dict_takes_what_state_dict_gives():
    a = AdaptiveK(0.5, 0.2)
    a.update(2.0)
    b = AdaptiveK(0.5, 0.2)
    b.load_state_dict(a.state_dict())
    assert b.update(1.0) == a.update(1.0) == 0.25
    b.load_state_dict({"loss0": None})
    assert b.update(4.0) == 0.5
    b.load_state_dict({"loss0": torch.tensor(8.0)})   # what an older version kept
    assert b.state_dict() == {"loss0": 8.0} and b.update(4.0) == 0.25


@pytest.mark.parametrize("spread", ["0.1", None, True, torch.tensor([0.1, 0.2]),
                                    np.ones(2), [0.1], 1 + 0j, 10 ** 400])
def test_adaptive_deadline_observe_refuses_what_is_not_one_real_number(spread):
    # "'>=' not supported", "Boolean value of Tensor with more than one value is
    # ambiguous"; True was a spread of 1 s
    d = AdaptiveDeadline(0.05, 1.0)
    with pytest.raises(TypeError) as e:
        d.observe(spread)
    assert str(e.value).startswith("spread_s must be one real number (a Python number, "
                                   "a numpy scalar, a one-element tensor or array), got ")
    assert d.state_dict()["spreads"] == [] and d.deadline_s() == 0.05


def test_adaptive_deadline_observe_keeps_a_tensor_or_numpy_spread_as_a_float():
    # a tensor in the state made a later numpy spread fail: "result type Float can't
    # be cast to the desired output type"
    d = AdaptiveDeadline(0.05, 1.0)
    d.observe(torch.tensor(0.3))
    d.observe(np.float64(0.2))
    d.observe(np.array([0.1], np.float32), late=True)
    d.observe(INF)   # longer than any ceiling: the ceiling
    spreads = d.state_dict()["spreads"]
    assert [type(s) for s in spreads] == [float] * 4
    assert spreads[:2] == [pytest.approx(0.3), 0.2] and spreads[3] == 1.0
    assert type(d.deadline_s()) is float and d.deadline_s() == 1.0


def test_adaptive_deadline_observe_still_ignores_nan_and_negative_spreads():
    d = AdaptiveDeadline(0.05, 1.0)
    for s in (NAN, -0.1, np.float32("nan"), torch.tensor(-1.0)):
        d.observe(s)
    assert d.state_dict() == {"spreads": [], "highest_s": 0.05, "beyond_floor": 0}


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_decodes_rows_whose_last_axis_is_not_contiguous(coding):
    # int8 and int4: numpy's "To change to a dtype of a different size, the last axis
    # must be contiguous"; fp16 and bf16 decoded them
    rows = codec.encode(coding, _x(5, 352))
    want = codec.decode(coding, rows, 352)
    f = np.asfortranarray(rows)
    assert not f.flags.c_contiguous
    assert np.array_equal(codec.decode(coding, f, 352), want, equal_nan=True)
    f.flags.writeable = False
    assert np.array_equal(codec.decode(coding, f, 352), want, equal_nan=True)
    wide = np.zeros((5, 2 * rows.shape[1]), np.uint8)
    wide[:, ::2] = rows   # every other byte
    assert np.array_equal(codec.decode(coding, wide[:, ::2], 352), want, equal_nan=True)


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_decodes_rows_of_a_negative_stride(coding):
    # fp16, bf16 and int4: torch's "At least one stride in the given numpy array is
    # negative"; int8 decoded them
    rows = codec.encode(coding, _x(5, 352))
    want = codec.decode(coding, np.ascontiguousarray(rows[::-1]), 352)
    assert rows[::-1].strides[0] < 0
    assert np.array_equal(codec.decode(coding, rows[::-1], 352), want, equal_nan=True)
    assert np.array_equal(codec.decode(coding, rows[::-2], 352),
                          codec.decode(coding, np.ascontiguousarray(rows[::-2]), 352),
                          equal_nan=True)
    back = np.ascontiguousarray(rows[:, ::-1])[:, ::-1]   # a negative byte stride
    assert np.array_equal(codec.decode(coding, back, 352), want[::-1], equal_nan=True)
    ro = rows[::-1]
    ro.flags.writeable = False
    assert np.array_equal(codec.decode(coding, ro, 352), want, equal_nan=True)


# -- load_state_dict: a state that is not what state_dict() gives ------------------------

@pytest.mark.parametrize("state,phrase", [
    (None, "state must be a dict with the keys loss0 (what state_dict() gives), got "
     "NoneType"),
    ([2.0], "got list"),
    ({}, "state has no 'loss0'"),
    ({"spreads": []}, "state has no 'loss0'")])
def test_adaptive_k_load_state_dict_refuses_a_state_that_is_no_state_dict(state, phrase):
    # None: "'NoneType' object is not subscriptable"; {}: KeyError 'loss0'
    a = AdaptiveK(0.5, 0.2)
    with pytest.raises(ValueError) as e:
        a.load_state_dict(state)
    assert str(e.value).startswith("AdaptiveK.load_state_dict: ") and phrase in str(e.value)
    assert "\n" not in str(e.value) and a.state_dict() == {"loss0": None}


_DL_STATE = {"spreads": [0.2, 0.1], "highest_s": 0.3, "beyond_floor": 2}


@pytest.mark.parametrize("change,phrase", [
    (("whole", None), "state must be a dict with the keys spreads, highest_s, "
     "beyond_floor"),
    (("whole", {}), "state has no 'spreads'"),
    (("whole", {"spreads": [0.1], "highest_s": 0.1}), "state has no 'beyond_floor'"),
    ({"spreads": ["x"]}, "spreads[0]='x'"),
    ({"spreads": [0.1, None]}, "spreads[1]=None"),
    ({"spreads": [True]}, "spreads[0]=True"),
    ({"spreads": [torch.ones(2)]}, "spreads[0]=tensor"),
    ({"spreads": [-0.1]}, "spreads[0]=-0.1"),
    ({"spreads": [NAN]}, "spreads[0]=nan"),
    ({"spreads": "0.1"}, "spreads='0.1'"),
    ({"spreads": 0.1}, "spreads=0.1"),
    ({"highest_s": "0.1"}, "highest_s='0.1'"),
    ({"highest_s": INF}, "highest_s=inf"),
    ({"highest_s": -1.0}, "highest_s=-1.0"),
    ({"highest_s": None}, "highest_s=None"),
    ({"beyond_floor": "a"}, "beyond_floor='a'"),
    ({"beyond_floor": 1.5}, "beyond_floor=1.5"),
    ({"beyond_floor": -1}, "beyond_floor=-1"),
    ({"beyond_floor": True}, "beyond_floor=True"),
    ({"beyond_floor": torch.tensor(1.0)}, "beyond_floor=tensor(1.)")])
def test_adaptive_deadline_load_state_dict_refuses_values_observe_would_not_keep(
        change, phrase):
    # spreads ["x"] failed only in deadline_s() ("'>' not supported"), beyond_floor "a"
    # was taken
    state = change[1] if isinstance(change, tuple) else dict(_DL_STATE, **change)
    d = AdaptiveDeadline(0.05, 1.0)
    d.observe(0.4)
    before = d.state_dict()
    with pytest.raises(ValueError) as e:
        d.load_state_dict(state)
    assert str(e.value).startswith("AdaptiveDeadline.load_state_dict: ")
    assert phrase in str(e.value) and "\n" not in str(e.value)
    assert d.state_dict() == before   # left as it was


def test_adaptive_deadline_load_state_dict_keeps_real_numbers_as_floats_and_an_int():
    # a tensor spread was loaded as it was: deadline_s() then returned a tensor
    d = AdaptiveDeadline(0.05, 1.0)
    d.load_state_dict({"spreads": [torch.tensor(0.3), np.float64(0.2), np.array([0.1]),
                                   5.0],
                       "highest_s": np.float32(0.5), "beyond_floor": np.int64(3)})
    state = d.state_dict()
    assert [type(s) for s in state["spreads"]] == [float] * 4
    assert state["spreads"][1:] == [0.2, 0.1, 1.0]   # above the ceiling: the ceiling
    assert type(state["highest_s"]) is float and state["highest_s"] == pytest.approx(0.5)
    assert type(state["beyond_floor"]) is int and state["beyond_floor"] == 3
    assert type(d.deadline_s()) is float and d.deadline_s() == 1.0
    d.load_state_dict(dict(_DL_STATE, beyond_floor=torch.tensor(4)))
    assert d.state_dict()["beyond_floor"] == 4


def test_adaptive_deadline_load_state_dict_takes_what_state_dict_gives():
    a = AdaptiveDeadline(0.05, 1.0, window=3)
    for s in (0.1, 0.4, 0.2, 0.3):
        a.observe(s)
    a.deadline_s()
    b = AdaptiveDeadline(0.05, 1.0, window=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.deadline_s() == a.deadline_s()
    b.observe(0.9)
    a.observe(0.9)
    assert b.state_dict() == a.state_dict() and b.deadline_s() == a.deadline_s()
    fresh = AdaptiveDeadline(0.05, 1.0)
    b.load_state_dict(fresh.state_dict())
    assert b.state_dict() == fresh.state_dict()


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_refuses_a_read_only_out_and_a_bool_coding(coding):
    """Breaker round 20: decode wrote fp16, bf16 and int4 values into a read-only out
    (an immutable bytes object changed; int8 refused it), and encode and decode took
    True as FP16."""
    x = _x(4, 352)
    rows = codec.encode(coding, x)
    buf = bytes(4 * 352 * 4)
    out = np.frombuffer(buf, np.float32).reshape(4, 352)
    with pytest.raises(ValueError, match=r"out must be a writable C-contiguous float32 "
                                         r"array of \(4, 352\), got read-only float32"):
        codec.decode(coding, rows, 352, out=out)
    assert not any(buf)
    for bad in (True, 1.0):
        with pytest.raises(TypeError, match="coding must be a Coding"):
            codec.encode(bad, x)
        with pytest.raises(TypeError, match="coding must be a Coding"):
            codec.decode(bad, rows, 352)


def test_wire_decode_refuses_a_key_that_is_not_bytes_in_one_line():
    # round 20: a bytearray key gave "unhashable type: 'bytearray'" from the MAC cache
    from dgt.transport import wire
    msg = wire.encode(wire.MsgType.HELLO, session=1, sender=0, key=b"kk")
    with pytest.raises(TypeError, match="key must be bytes or None, got bytearray"):
        wire.decode(msg, key=bytearray(b"kk"))
    assert wire.decode(msg, key=b"kk")[0].type == wire.MsgType.HELLO

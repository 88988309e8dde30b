"""The sidecars' Prometheus endpoints and per-iteration traces on a real 4-worker job:
real HTTP scrapes, parsed with prometheus_client's own parser."""
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import doc_names, doc_table_keys
from prometheus_client.parser import text_string_to_metric_families

from dgt.metrics import CHANNEL_METRICS
from dgt.rendezvous import connected_to_itself
from dgt.trace import channel_totals, comm_times_ms, iterations, read_run

pytestmark = pytest.mark.slow

WORKERS = 4


def _own_shm() -> set[str]:
    """This user's dgt shared-memory names (another user's job on the host is not ours)."""
    out = set()
    for f in os.listdir("/dev/shm"):
        try:
            if f.startswith("dgt-") and os.stat(f"/dev/shm/{f}").st_uid == os.getuid():
                out.add(f)
        except OSError:   # gone between listdir and stat
            pass
    return out


def free_port_run(n: int) -> int:
    """A base port with n free consecutive ports on 127.0.0.1 (synth's finder checks
    10 per rank, TCP and UDP: a superset)."""
    from dgt.tools.synth import free_base_port
    return free_base_port(n)


def scrape(port: int) -> dict | None:
    """{(name, labels tuple): value} of one scrape, None when nothing answers. A connect
    to a port with no listener (the endpoint not up yet, or gone) can connect to itself
    when the kernel picks that port as the source (TCP simultaneous open; the suite saw
    its own request come back as the status line): that is nothing answering too."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.connect()
        if connected_to_itself(conn.sock):
            return None
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        if r.status != 200:
            return None
        text = r.read().decode()
    except OSError:
        return None
    finally:
        conn.close()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counters_of(sample: dict) -> dict:
    """{channel: {field: value}} from a scrape."""
    out: dict = {}
    for fld, name, _ in CHANNEL_METRICS:
        for (n, labels), v in sample.items():
            if n == name:
                out.setdefault(dict(labels)["channel"], {})[fld] = v
    return out


def start_job(tmp_path, *extra):
    cmd = [sys.executable, "-m", "dgt.cli", "train", "--workers", str(WORKERS),
           "--hidden", "64", "--iterations", "60", "--report", str(tmp_path / "report.json"),
           "--run-dir", str(tmp_path / "run"), *map(str, extra)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_endpoints_rise_and_final_scrape_equals_report(tmp_path):
    base = free_port_run(WORKERS)
    p = start_job(tmp_path, "--metrics-port", base, "--metrics-linger-s", 4,
                  "--pull-codec", "int8", "--band-codec", "int8")
    run = tmp_path / "run"
    try:
        first: dict[int, dict] = {}
        second: dict[int, dict] = {}
        final: dict[int, dict] = {}
        deadline = time.monotonic() + 200
        while len(final) < WORKERS and time.monotonic() < deadline and p.poll() is None:
            for r in range(WORKERS):
                if r in final:
                    continue
                report_written = (run / f"sidecar-{r}.json").exists()
                s = scrape(base + r)
                if s is None:
                    continue
                pushes = s[("dgt_pushes_total", ())]
                if report_written:   # counters frozen: the endpoint lingers
                    final[r] = s
                elif r not in first and pushes >= 1:
                    first[r] = s
                elif r in first and r not in second and \
                        pushes > first[r][("dgt_pushes_total", ())]:
                    second[r] = s
            time.sleep(0.1)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out[-3000:]
    assert sorted(final) == list(range(WORKERS)), out[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for r in range(WORKERS):
        later = second.get(r, final[r])
        assert r in first, f"rank {r} never scraped while training"
        a, b = counters_of(first[r]), counters_of(later)
        assert b["tcp"]["blocks_sent"] > a["tcp"]["blocks_sent"]
        assert b["tcp"]["bytes_sent"] > a["tcp"]["bytes_sent"]
        assert later[("dgt_comm_seconds_count", ())] > first[r][("dgt_comm_seconds_count", ())]
        assert ("process_resident_memory_bytes", ()) in later
        # the final scrape equals this sidecar's report counters exactly
        side = json.loads((run / f"sidecar-{r}.json").read_text())
        # the endpoint names the job by a digest, never by the session id a HELLO needs
        prom = (run / f"metrics-{r}.prom").read_text()
        assert side["session"] not in prom and str(int(side["session"], 16)) not in prom
        assert 'session_digest="' in prom
        got = counters_of(final[r])
        assert got == {name: {k: float(v) for k, v in ch.items()}
                       for name, ch in side["channels"].items()}
        assert final[r][("dgt_pushes_total", ())] == side["pushes"]
        assert final[r][("dgt_blocks_local_total", ())] == side["blocks_local"]
        assert final[r][("dgt_pull_bytes_sent_total", ())] == side["pull_bytes_sent"] > 0
        assert final[r][("dgt_pull_blocks_coded_total", ())] == side["pull_blocks_coded"] > 0
        assert final[r][("dgt_blocks_cut_by_budget_total", ())] == \
            side["blocks_cut_by_budget"]
        assert final[r][("dgt_iteration", ())] == report["iterations"] - 1
        # coded bands leave their coding error: the residual gauge (kept by the update,
        # never read from the buffer by the scrape) is not zero
        assert final[r][("dgt_residual_norm", ())] > 0
        # the file beside the report holds the same exposition's counters
        text = (run / f"metrics-{r}.prom").read_text()
        filed = {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert counters_of(filed) == got
    # summed over ranks, the final scrapes are the report's channels
    total: dict = {}
    for r in range(WORKERS):
        for name, ch in counters_of(final[r]).items():
            acc = total.setdefault(name, {})
            for k, v in ch.items():
                acc[k] = acc.get(k, 0) + v
    assert total == {name: {k: float(v) for k, v in ch.items()}
                     for name, ch in report["channels"].items()}


def test_traces_recompute_the_report(tmp_path):
    p = start_job(tmp_path, "--drop-udp", 0.05)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    traces = read_run(str(tmp_path / "run"))
    assert sorted(traces) == list(range(WORKERS))
    import numpy as np
    comm = comm_times_ms(traces[0])
    assert len(comm) == report["iterations"]
    assert float(np.median(comm)) == report["comm_ms_median"]
    assert float(np.percentile(comm, 95)) == report["comm_ms_p95"]
    total: dict = {}
    for lines in traces.values():
        assert [ln["t"] for ln in iterations(lines)] == list(range(report["iterations"]))
        for name, ch in channel_totals(lines).items():
            acc = total.setdefault(name, {})
            for k, v in ch.items():
                acc[k] = acc.get(k, 0) + v
    assert total == report["channels"]
    lost = sum(ch["blocks_lost"] for ch in report["channels"].values())
    assert lost > 0, "precondition: --drop-udp lost blocks"
    assert sum(ln["lost"] for lines in traces.values() for ln in iterations(lines)) == lost
    for lines in traces.values():
        for ln in iterations(lines):
            assert ln["push_start_s"] <= ln["reliable_sent_s"] <= ln["end_s"] <= ln["apply_s"]
            assert len(ln["pull_s"]) == WORKERS and 0 <= ln["k"] <= 1
    # every key a trace line holds is named in docs/metrics.md's section on the trace
    # (breaker round 14: first_sent_s and the final line's time_s were not)
    documented = doc_names("docs/metrics.md", "## The per-iteration trace")
    keys = {k for lines in traces.values() for ln in lines for k in ln}
    assert {ln["kind"] for lines in traces.values() for ln in lines} == {"iteration", "final"}
    assert keys - documented == set()
    check_records_match_the_docs(report, tmp_path / "run")


def check_records_match_the_docs(report: dict, run) -> None:
    """Every key of the report, of each sidecar-<rank>.json and of each
    trainer-<rank>.json of a real run is in a table row of docs/reports.md, and every
    row there is a key the run wrote (breaker round 17 found keys no doc named)."""
    page = "docs/reports.md"

    def rows(heading):
        keys = doc_table_keys(page, heading)
        assert len(keys) == len(set(keys)), f"a key twice under {heading}"
        return set(keys)

    assert set(report) == rows("## `report.json`")
    assert set(report["workload"]) == rows("### `workload`")
    assert {k for h in report["history"] for k in h} == rows("### `history`")
    assert {k for s in report["sidecars"] for k in s} == \
        doc_names(page, "### `sidecars`")
    named = doc_names(page, "## `report.json`")
    assert set(report["cpu_per_iteration"]) - named == set()
    assert {k for ch in report["channels"].values() for k in ch} - named == set()
    for r in range(WORKERS):
        sidecar = json.loads((run / f"sidecar-{r}.json").read_text())
        assert set(sidecar) == rows("## `sidecar-<rank>.json`")
        assert set(sidecar["config"]) == set(report["config"]["transmission"])
        trainer = json.loads((run / f"trainer-{r}.json").read_text())
        assert set(trainer) == rows("## `trainer-<rank>.json`")
    # config: one key per dgt train option (--no-<key> for a switch that is on by
    # default), as the page says
    options = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--help"],
                             capture_output=True, text=True, check=True).stdout
    for part in ("job", "transmission"):
        for key in report["config"][part]:
            flag = key.replace("_", "-")
            assert f"--{flag}" in options or f"--no-{flag}" in options, key


@pytest.mark.parametrize("case", ["in_use", "bad_host", "not_local"])
def test_bad_metrics_endpoint_is_one_line_and_nothing_starts(tmp_path, case):
    base = free_port_run(WORKERS)
    holder = socket.socket()
    args = ["--metrics-port", base]
    if case == "in_use":   # rank 2's port is taken
        holder.bind(("127.0.0.1", base + 2))
        holder.listen()
    elif case == "bad_host":
        args += ["--metrics-host", "not-an-address"]
    else:
        args += ["--metrics-host", "192.0.2.1"]   # TEST-NET-1: not on this host
    shm_before = _own_shm()
    try:
        p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "train", "--workers",
                              str(WORKERS), "--hidden", "32", "--iterations", "2",
                              "--run-dir", str(tmp_path / "run"), *map(str, args)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdout, p.stderr = p.communicate(timeout=60)
    finally:
        holder.close()
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--metrics-" in lines[0], p.stderr
    assert p.stdout == ""
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run"), \
        os.listdir(tmp_path / "run")
    # nothing of this job is left in shared memory: its spill folder is named after
    # its launcher (another job of this user may come and go meanwhile); no sidecar
    # started (below), so none left a buffer
    assert not [n for n in _own_shm() - shm_before if n.startswith(f"dgt-records-{p.pid}-")]
    assert not processes_naming(str(tmp_path))


def processes_naming(text: str) -> list[str]:
    """Command lines of running processes that contain ``text``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            out.append(cmd)
    return out


def test_sidecar_alone_refuses_a_port_in_use(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        p = subprocess.run([sys.executable, "-m", "dgt.sidecar", "--rank", "0", "--world",
                            "1", "--run-dir", str(tmp_path), "--socket",
                            str(tmp_path / "s.sock"), "--metrics-port", str(port)],
                           capture_output=True, text=True, timeout=60)
    finally:
        holder.close()
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and f"port {port}" in p.stderr
    assert not (tmp_path / "s.sock").exists()


def _endpoint(tmp_path):
    """A one-rank sidecar's metrics endpoint, started on a free port: (endpoint, port)."""
    from dgt.config import TransmissionConfig
    from dgt.metrics import Endpoint
    from dgt.sidecar import NodeConfig, Sidecar
    sc = Sidecar(TransmissionConfig(), NodeConfig(rank=0, world=1, run_dir=str(tmp_path)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = Endpoint(sc, "127.0.0.1", port)
    ep.start()
    return ep, port


def test_silent_and_dripping_metrics_connections_are_cut_without_a_traceback(
        tmp_path, monkeypatch, capfd):
    """Breaker round 11: each connection silent past the read timeout printed
    socketserver's 17-line traceback into the sidecar's log, and 16 connections that
    each sent a byte every 4 s held every slot for as long as they went on (the
    timeout was per read). Now such connections are counted (``dropped``) in one
    warning line, and each has one deadline from accept to answer."""
    import select
    import urllib.request

    from dgt import metrics_server
    monkeypatch.setattr(metrics_server._Handler, "timeout", 1.0)
    monkeypatch.setattr(metrics_server, "REQUEST_DEADLINE_S", 3.0)
    ep, port = _endpoint(tmp_path)
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10)
                  for _ in range(3)]
        for c in silent:   # closed after the read timeout (a bounded wait)
            assert select.select([c], [], [], 60)[0] and c.recv(1) == b""
            c.close()
        drip = socket.create_connection(("127.0.0.1", port), timeout=10)
        closed, t_end = False, time.monotonic() + 60
        while not closed and time.monotonic() < t_end:   # a byte every 0.5 s
            try:
                drip.sendall(b"G")
                closed = bool(select.select([drip], [], [], 0.5)[0]) and \
                    drip.recv(1) == b""
            except OSError:   # reset: closed as well
                closed = True
        drip.close()
        assert closed, "a connection sending a byte every 0.5 s was never closed"
        t_end = time.monotonic() + 10
        while ep.server.dropped < 3 and time.monotonic() < t_end:
            time.sleep(0.05)
        assert ep.server.dropped >= 3, ep.server.dropped
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        assert b"dgt_" in body   # scrapes are still answered
    finally:
        ep.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err[-3000:]


def test_a_connection_flood_on_the_metrics_port_is_bounded(tmp_path):
    """Breaker round 8: 1,500 connections that each sent a request line and then
    nothing grew sidecar 0 from 8 threads to 511 (prometheus_client's server: a thread
    per connection, no cap, no read timeout). Now at most MAX_CONNECTIONS are served at
    once, the rest closed unanswered at accept; a held one is closed after its read
    timeout; once the flood is gone a scrape is answered."""
    import select
    import threading
    import urllib.request

    from dgt.metrics_server import MAX_CONNECTIONS
    ep, port = _endpoint(tmp_path)
    base = threading.active_count()
    held = []
    try:
        for _ in range(MAX_CONNECTIONS * 3):
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.sendall(b"GET /metrics HTTP/1.1\r\n")   # and never the rest
            held.append(c)
        # the server takes them in: those beyond the cap are closed at accept (a few
        # more may be served, where a first one's read timeout ran out meanwhile)
        t_end = time.monotonic() + 60
        while getattr(ep.server, "refused", 0) < MAX_CONNECTIONS and \
                time.monotonic() < t_end:
            time.sleep(0.05)
        assert getattr(ep.server, "refused", 0) >= MAX_CONNECTIONS, \
            threading.active_count() - base
        assert threading.active_count() <= base + MAX_CONNECTIONS, \
            threading.active_count() - base
        # the served ones are closed once silent for the read timeout (bounded wait)
        assert all(select.select([c], [], [], 60)[0] and c.recv(1) == b"" for c in held)
        for c in held:
            c.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        assert b"dgt_" in body
    finally:
        for c in held:
            c.close()
        ep.stop()

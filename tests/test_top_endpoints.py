"""'dgt top --once --endpoints' against real local HTTP servers: what is not a dgt
sidecar's metrics page is named in one line, never a traceback (breaker: a web page
gave 'ValueError: invalid metric name', forged labels an OverflowError)."""
import http.server
import re
import socket
import subprocess
import sys
import threading

import pytest

#: a dgt sidecar's page, the metrics dgt top reads (dgt.metrics.SidecarCollector)
PAGE = ('dgt_sidecar_info{rank="1",world="2",mode="dgt",session_digest="0123456789ab"} 1.0\n'
        'dgt_iteration 41.0\n'
        'dgt_comm_seconds_count 42.0\n'
        'dgt_comm_seconds_sum 0.42\n'
        'dgt_reliable_fraction 0.5\n'
        'dgt_blocks_lost_own_total 7.0\n'
        'dgt_channel_blocks_sent_total{channel="tcp"} 100.0\n'
        'dgt_channel_blocks_sent_total{channel="udp1"} 50.0\n')
ROW = re.compile(r"^\s*(\d+)\s+(-?\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+([0-9.]+)\s+(\d+)", re.M)


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.server.body.encode()
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """``serve(body, status=200)`` -> the port of an HTTP server answering every GET
    with ``body``; ``serve(raw=b'...')``: a TCP server that sends those bytes, no HTTP."""
    servers = []

    def start(body: str = "", status: int = 200, raw: bytes | None = None) -> int:
        if raw is not None:
            lsock = socket.create_server(("127.0.0.1", 0))
            servers.append(lsock)
            threading.Thread(target=_banner, args=(lsock, raw), daemon=True).start()
            return lsock.getsockname()[1]
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
        srv.body, srv.status = body, status
        servers.append(srv)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv.server_address[1]
    yield start
    for s in servers:
        if isinstance(s, socket.socket):
            s.close()
        else:
            s.shutdown()
            s.server_close()


def _banner(lsock: socket.socket, raw: bytes) -> None:
    """Answer each connection with ``raw`` (e.g. an SSH server's banner), then close."""
    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        with conn:
            conn.sendall(raw)


def top(*endpoints: int):
    return subprocess.run([sys.executable, "-m", "dgt.cli", "top", "--once", "--endpoints",
                           ",".join(f"127.0.0.1:{p}" for p in endpoints)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("page, status, why", [
    ("<html><body>Not Found</body></html>", 200,
     "not Prometheus text: 'invalid metric name:<html>"),
    ('dgt_sidecar_info{rank="-5",world="99999999"} 1\ndgt_iteration{rank="x"} 1e400\n',
     200, "dgt_sidecar_info has rank '-5', world '99999999'"),
    ('dgt_sidecar_info{rank="x",world="2"} 1\n', 200,
     "dgt_sidecar_info has rank 'x', world '2'"),
    ('dgt_sidecar_info{rank="2",world="2"} 1\n', 200,
     "dgt_sidecar_info has rank '2', world '2'"),
    ('node_load1 0.5\n', 200, "no dgt_sidecar_info metric"),
    ("gone", 404, "HTTP 404 'Not Found'"),
], ids=["html", "forged-labels", "rank-not-a-number", "rank-past-world", "other-exporter",
        "http-404"])
def test_an_endpoint_that_is_not_a_dgt_sidecar_is_one_line(serve, page, status, why):
    port = serve(page, status)
    p = top(port)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert (f"dgt top: error: 127.0.0.1:{port} is not a dgt metrics endpoint ({why}"
            in p.stderr), p.stderr


def test_a_server_that_does_not_speak_http_is_one_line(serve):
    port = serve(raw=b"SSH-2.0-OpenSSH_9.2\r\n")
    p = top(port)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stdout + p.stderr
    assert f"127.0.0.1:{port} is not a dgt metrics endpoint (not an HTTP answer" \
        in p.stderr, p.stderr


def test_the_good_endpoints_are_shown_and_the_bad_ones_named(serve):
    good, html = serve(PAGE), serve("<html><body>Not Found</body></html>")
    closed = socket.create_server(("127.0.0.1", 0))   # bound, never listening
    dead = closed.getsockname()[1]
    closed.close()
    p = top(good, html, dead)
    assert p.returncode == 0, p.stdout + p.stderr
    # dgt_iteration 41 (the last applied, from 0): 42 iterations done
    assert [m[:2] for m in ROW.findall(p.stdout)] == [("1", "42")], p.stdout
    text = " ".join(p.stdout.split())   # the caption wraps
    assert f"127.0.0.1:{html} is not a dgt metrics endpoint (" in text, p.stdout
    assert f"127.0.0.1:{dead} does not answer (" in text, p.stdout


def test_one_scrape_shows_no_rate_and_no_quit_hint(serve):
    """--once scrapes once: a rate needs two samples, so it/s, comm ms and the
    channels' blk/s and loss are '-', not 0.0; and there is no live view to quit."""
    p = top(serve(PAGE))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln.split() for ln in p.stdout.splitlines()]
    at = lines.index(["1", "42", "-", "-", "-", "0.50", "7", "-", "-"])   # tcp, udp1 blk/s
    assert lines[at + 1] == ["-", "-"], p.stdout                          # and their loss
    assert "q quits" not in p.stdout, p.stdout


def test_values_that_are_not_finite_are_left_out(serve):
    page = PAGE.replace("dgt_iteration 41.0", "dgt_iteration +Inf").replace(
        "dgt_blocks_lost_own_total 7.0", "dgt_blocks_lost_own_total NaN") + \
        'dgt_reliable_fraction{rank="x"} 1e400\n'
    p = top(serve(page))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    # each value left out is '-', not 0 (breaker round 25: a NaN iteration and an
    # infinite k showed as iter 0 and k 0.00); the finite k of the same name stays
    assert ["1", "-", "-", "-", "-", "0.50", "-", "-", "-"] in \
        [ln.split() for ln in p.stdout.splitlines()], p.stdout
    p = top(serve(PAGE.replace("dgt_reliable_fraction 0.5", "dgt_reliable_fraction +Inf")
                  .replace("dgt_iteration 41.0", "dgt_iteration NaN")))
    assert ["1", "-", "-", "-", "-", "-", "7", "-", "-"] in \
        [ln.split() for ln in p.stdout.splitlines()], p.stdout
    # breaker round 26: values out of their range were shown (k 7.00, -0.00, iter 1e23)
    for it, k, lost, row in (("1e23", "7", "-3", ["-", "-", "-"]),
                             ("41.0", "-0.0", "7.0", ["42", "0.00", "7"])):
        page = PAGE.replace("dgt_iteration 41.0", f"dgt_iteration {it}").replace(
            "dgt_reliable_fraction 0.5", f"dgt_reliable_fraction {k}").replace(
            "dgt_blocks_lost_own_total 7.0", f"dgt_blocks_lost_own_total {lost}")
        p = top(serve(page))
        assert ["1", row[0], "-", "-", "-", row[1], row[2], "-", "-"] in \
            [ln.split() for ln in p.stdout.splitlines()], p.stdout


def test_an_endpoint_given_twice_is_one_line():
    """Breaker round 26: it was taken, and shown as one rank."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", "--once", "--endpoints",
                        "127.0.0.1:9100, 127.0.0.1:9100"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--endpoints names 127.0.0.1:9100 twice; give each sidecar's once" in p.stderr


def _trickle(lsock: socket.socket, head: bytes, drip: bytes, stop: threading.Event) -> None:
    """Answer each connection with ``head`` at once, then ``drip`` every 0.2 s until
    ``stop``: each read gets something well within any per-read timeout, the page never
    ends."""
    def one(conn):
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(head)
                while not stop.wait(0.2):
                    conn.sendall(drip)
            except OSError:
                pass
    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


@pytest.mark.parametrize("head, drip", [
    (b"HTTP/1.0 200 OK\r\n\r\n", b"# x\n"),     # the tester's: a slow body
    (b"HTTP/1.0 200 OK\r\n", b"X-Slow: 1\r\n"),  # headers that never end
    (b"", b"H"),                                 # a status line, a byte at a time
], ids=["body", "headers", "status-line"])
def test_an_endpoint_that_sends_slowly_forever_times_out_in_one_line(head, drip):
    """The outside tester's endpoint (200 OK, then '# x' now and then, forever) kept
    'dgt top --once' waiting forever: the timeout was per read. One deadline per scrape
    (dgt.top.SCRAPE_S, 2 s) now ends it with the same line as a silent endpoint."""
    lsock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    threading.Thread(target=_trickle, args=(lsock, head, drip, stop), daemon=True).start()
    port = lsock.getsockname()[1]
    try:
        p = top(port)   # 60 s: far past the 2 s deadline, and it hung forever before
    finally:
        stop.set()
        lsock.close()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert (f"dgt top: error: no metrics endpoint answered (127.0.0.1:{port}: timed out: "
            f"no whole page within 2 s)") in p.stderr, p.stderr


def test_a_silent_endpoint_gives_the_same_timed_out_line():
    lsock = socket.create_server(("127.0.0.1", 0))   # accepts (backlog), never answers
    port = lsock.getsockname()[1]
    try:
        p = top(port)
    finally:
        lsock.close()
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stdout + p.stderr
    assert f"(127.0.0.1:{port}: timed out: no whole page within 2 s)" in p.stderr, p.stderr

"""The HTTP server behind ``--metrics-port``: ``prometheus_client``'s WSGI app, served
with bounds that its ``start_http_server`` lacks.

``start_http_server`` gives every connection a thread of its own, with no cap and no
read timeout: an outside tester held 1,500 connections that each sent one request line
and then nothing, and sidecar 0 grew from 8 threads to 511, with as many descriptors
(breaker round 8). Here a connection gets at most :data:`READ_TIMEOUT_S` of silence
per read, and :data:`REQUEST_DEADLINE_S` in all, before it is closed (breaker round 11:
connections that sent a byte every 4 s held every slot for as long as they went on),
and at most :data:`MAX_CONNECTIONS` are served at once; one more is closed at accept,
unanswered, and counted (``refused``). A connection closed for its silence or its
deadline, or reset by its peer, is counted (``dropped``) without the traceback that
``socketserver`` prints for it (breaker round 11: 17 lines of log per silent
connection, about 3 KB/s for as long as a stranger kept at it). A flood can keep
scrapes out while it lasts, never the job: the sidecar's threads, descriptors and log
stay bounded.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, make_server

log = logging.getLogger(__name__)

#: connections served at once (a Prometheus server scrapes with one)
MAX_CONNECTIONS = 16
#: s: the longest a served connection may stay silent while its request is read
READ_TIMEOUT_S = 5.0
#: s: the longest a served connection may take in all, from accept to its answer sent
REQUEST_DEADLINE_S = 10.0
#: s: how often the connections' deadlines are looked at
DEADLINE_TICK_S = 0.5


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S   # socketserver.StreamRequestHandler: per read and write

    def log_message(self, format, *args):   # no line per scrape
        pass


def serve(registry, host: str, port: int):
    """Serve ``registry``'s exposition on ``host:port`` from a daemon thread; returns
    the server (``shutdown()``, ``server_close()``; ``refused``: connections closed at
    accept because :data:`MAX_CONNECTIONS` were being served). Raises OSError when the
    address cannot be bound."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        refused = 0
        dropped = 0
        live: dict = {}   # served connection -> its deadline (time.monotonic())
        lock = threading.Lock()
        stopped = threading.Event()

        def handle_error(self, request, client_address):
            # a read timed out, the deadline cut it, the peer reset it: the connection
            # is closed, counted, and the first one named in one line
            Server.dropped += 1
            if Server.dropped == 1:
                log.warning("the metrics endpoint closed a connection from %s that did "
                            "not send a whole request in time, or broke off (further "
                            "ones are counted only)", client_address[0])

        def server_close(self):
            Server.stopped.set()
            super().server_close()

        def process_request(self, request, client_address):
            if not self.slots.acquire(blocking=False):
                if Server.refused == 0:
                    log.warning("the metrics endpoint serves %d connections at once; "
                                "closing further ones unanswered (a connection flood?)",
                                MAX_CONNECTIONS)
                Server.refused += 1
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address):
            with Server.lock:
                Server.live[request] = time.monotonic() + REQUEST_DEADLINE_S
            try:
                super().process_request_thread(request, client_address)
            finally:
                with Server.lock:
                    Server.live.pop(request, None)
                self.slots.release()

    httpd = make_server(host, port, make_wsgi_app(registry), Server,
                        handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    threading.Thread(target=_cut_past_deadline, args=(Server,), name="metrics-deadline",
                     daemon=True).start()
    return httpd


def _cut_past_deadline(server) -> None:
    """Every :data:`DEADLINE_TICK_S`, shut down (both ways) each served connection of
    ``server`` past its deadline: its handler's read or write then ends, and the
    connection is closed as any other. Ends when the server is closed."""
    while not server.stopped.wait(DEADLINE_TICK_S):
        now = time.monotonic()
        with server.lock:
            late = [r for r, deadline in server.live.items() if now > deadline]
        for request in late:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:   # closed meanwhile
                pass

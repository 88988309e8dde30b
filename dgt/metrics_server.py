"""The HTTP server behind ``--metrics-port``: ``prometheus_client``'s WSGI app, served
with bounds that its ``start_http_server`` lacks.

``start_http_server`` gives every connection a thread of its own, with no cap and no
read timeout: an outside tester held 1,500 connections that each sent one request line
and then nothing, and sidecar 0 grew from 8 threads to 511, with as many descriptors
(breaker round 8). Here a connection gets at most :data:`READ_TIMEOUT_S` of silence
per read before it is closed, and at most :data:`MAX_CONNECTIONS` are served at once;
one more is closed at accept, unanswered, and counted (``refused``). A flood can keep
scrapes out while it lasts, never the job: the sidecar's threads and descriptors stay
bounded.
"""
from __future__ import annotations

import logging
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

log = logging.getLogger(__name__)

#: connections served at once (a Prometheus server scrapes with one)
MAX_CONNECTIONS = 16
#: s: the longest a served connection may stay silent while its request is read
READ_TIMEOUT_S = 5.0


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
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    httpd = make_server(host, port, make_wsgi_app(registry), Server,
                        handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd

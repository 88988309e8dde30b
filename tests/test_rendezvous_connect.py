"""dgt.rendezvous.wait_for_listener: a store is up only when something listens. A TCP
socket that connects to its own port (simultaneous open, what a connect to an unused
ephemeral port can do on one host) is not a listener. Real sockets on loopback."""
import socket

import pytest

from dgt.errors import PeerFailure
from dgt.rendezvous import connected_to_itself, wait_for_listener


def test_a_socket_connected_to_itself_is_told_from_a_listener():
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())   # no listener: TCP simultaneous open with itself
        assert connected_to_itself(s)
    finally:
        s.close()
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.create_connection(srv.getsockname()) as c:
        assert not connected_to_itself(c)


def test_the_wait_ends_at_a_listener_and_names_rank_0_without_one():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        wait_for_listener("127.0.0.1", srv.getsockname()[1], 5.0)
        port = srv.getsockname()[1]
    with pytest.raises(PeerFailure, match="did not come up") as e:
        wait_for_listener("127.0.0.1", port, 0.3)
    assert e.value.rank == 0

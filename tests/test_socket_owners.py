"""Which process holds a listening socket (workloads/client/socket_owners.py): the client sends the
Ray token only to a port a process it started listens on."""

from __future__ import annotations

import os
import socket

import pytest
from fake_cluster_tools import ForeignListener

from workloads.client.cluster import free_port
from workloads.client.socket_owners import holds_listener, peer_held_by


def _listen(host: str, port: int, *, v6only: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if ":" in host:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    sock.bind((host, port))
    sock.listen()
    return sock


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::"])
def test_a_listener_of_the_process_on_the_address_or_a_wildcard_is_its(host):
    port = free_port()
    with _listen(host, port):
        assert holds_listener([os.getpid()], port=port)
        assert not holds_listener([os.getppid()], port=port)
    assert not holds_listener([os.getpid()], port=port)


def test_an_ipv6_only_wildcard_does_not_count_where_another_process_listens_on_the_ipv4_address(tmp_path):
    """An IPv6-only listener on `::` leaves 127.0.0.1 of its port to anyone: whoever binds it there
    takes the IPv4 connections."""
    port = free_port()
    with _listen("::", port, v6only=True):
        other = ForeignListener(port, record=tmp_path / "received")
        try:
            assert not holds_listener([os.getpid()], port=port)
            assert holds_listener([other.proc.pid], port=port)
        finally:
            other.stop()


def test_the_other_end_of_a_connection_is_the_process_that_accepted_it(tmp_path):
    port = free_port()
    other = ForeignListener(port, record=tmp_path / "received")
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            assert peer_held_by(sock, pid=other.proc.pid, timeout_s=5)
            assert not peer_held_by(sock, pid=os.getpid(), timeout_s=0.1)
    finally:
        other.stop()

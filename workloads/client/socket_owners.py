"""Which process holds a TCP socket of this machine.

Any account of the machine may listen on a free port of 127.0.0.1, so a port alone does not say
who answers there. The client sends the Ray token only where a process it started (its `kubectl
port-forward`, its local Ray head) holds the socket. psutil reads a process's sockets from the
kernel (on Linux, the inodes of /proc/PID/fd matched in /proc/net/tcp); another account's are not
readable, so they never count.
"""

from __future__ import annotations

import socket
import time
from typing import Iterable

import psutil

ACCEPT_POLL_S = 0.005


def _tcp_sockets(pid: int, *, kind: str = "tcp4") -> list:
    try:
        return psutil.Process(pid).net_connections(kind=kind)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def holds_listener(pids: Iterable[int], *, port: int, host: str = "127.0.0.1") -> bool:
    """Whether one of `pids` holds the socket that takes connections to host:port, an IPv4 address.

    A listener bound to that address or to every IPv4 address counts: no other account can listen
    there beside it (a second listener on a port needs SO_REUSEPORT on both sockets and the same
    user). One bound to every IPv6 address (`::`, what gRPC binds: Ray's GCS) takes IPv4 connections
    too unless it is IPv6-only, which only its owner can tell: it counts where no IPv4 socket of any
    process listens on the port (the machine's whole table, which every account may read)."""
    listening = [conn for pid in pids for conn in _tcp_sockets(pid, kind="tcp")
                 if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port]
    if any(conn.laddr.ip in (host, "0.0.0.0") for conn in listening):
        return True
    if not any(conn.laddr.ip == "::" for conn in listening):
        return False
    try:
        machine = psutil.net_connections(kind="tcp4")
    except psutil.AccessDenied:  # macOS reads the whole table for root only
        return False
    return not any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port for conn in machine)


def peer_held_by(sock: socket.socket, *, pid: int, timeout_s: float) -> bool:
    """Whether the other end of `sock`, a TCP connection within this machine, is a socket of process
    `pid`, which must accept it within `timeout_s`. The two ends of an open connection are unique on
    the machine, so whoever listened on the port when it was made, only that process's socket
    matches."""
    here, there = sock.getsockname()[:2], sock.getpeername()[:2]
    deadline = time.monotonic() + timeout_s
    while True:
        if any(conn.laddr == there and conn.raddr == here for conn in _tcp_sockets(pid)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(ACCEPT_POLL_S)

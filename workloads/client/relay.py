"""A listener of this process on 127.0.0.1 that relays each connection it accepts into one that
`open_upstream` opens, or closes it unanswered when that gives none.

The Jobs SDK opens a connection per request to whatever URL it was given. A `kubectl port-forward`
can exit while a client still holds its URL (kubectl ends when its connection to the pod breaks),
and its port is then free for any account to listen on: the next request would carry the Ray token
there. Given this relay's URL instead, the SDK only ever connects to a socket of this process, which
stays ours while the relay runs, and `open_upstream` decides per connection where the bytes may go.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Callable, Optional

CHUNK = 65536


class Relay:
    def __init__(self, *, open_upstream: Callable[[], Optional[socket.socket]]) -> None:
        self._open_upstream = open_upstream
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        threading.Thread(target=self._serve, name=f"relay-{self.port}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(client,), name=f"relay-{self.port}-conn", daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client:
            try:
                upstream = self._open_upstream()
            except OSError:
                upstream = None
            if upstream is None:
                return
            with upstream:
                sending = threading.Thread(target=_pipe, args=(client, upstream), daemon=True)
                sending.start()
                _pipe(upstream, client)
                sending.join()

    def close(self) -> None:
        # A thread blocked in accept() wakes on shutdown, not on close.
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy `source` into `sink` until it ends, then end `sink`'s sending side; on an error (a reset,
    an end that has gone) end both connections, so the other direction stops too."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

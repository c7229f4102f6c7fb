"""A stand-in for the Hugging Face hub's API on 127.0.0.1: what `HF_ENDPOINT` points the clients at
(huggingface_hub's and the project's own), so that no test reaches the network."""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager
from typing import Iterator

THERE_MAIN = "a1" * 20
"""The commit the model org/there's default branch (main) names."""
THERE_V1 = "b2" * 20
"""The commit of its tag v1."""
CHATS_MAIN = "c3" * 20
"""The commit the dataset org/chats's default branch names."""

REPOSITORIES = {
    "/api/models/org/there": ("org/there", {"": THERE_MAIN, "main": THERE_MAIN, "v1": THERE_V1}),
    "/api/datasets/org/chats": ("org/chats", {"": CHATS_MAIN, "main": CHATS_MAIN}),
}
"""Each repository's API path, id and revisions. Anything else is 401, as the hub answers for a
repository it does not show the caller; an unknown revision of a known one is 404."""


class _Hub(http.server.BaseHTTPRequestHandler):
    asked: list[str]

    def do_GET(self):  # noqa: N802
        self.asked.append(self.path)
        path = self.path.split("?", 1)[0]
        base, _, revision = path.partition("/revision/")
        status, body = 401, {"error": "Repository not found"}
        if base in REPOSITORIES:
            repo_id, revisions = REPOSITORIES[base]
            if revision in revisions:
                status, body = 200, {"id": repo_id, "sha": revisions[revision], "siblings": []}
            else:
                status, body = 404, {"error": f"Invalid rev id: {revision}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        if status != 200:
            self.send_header("X-Error-Code", "RevisionNotFound" if status == 404 else "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextmanager
def fake_hub(monkeypatch) -> Iterator[list[str]]:
    """The stand-in, running, with HF_ENDPOINT pointing at it; yields the paths it was asked for."""
    asked: list[str] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Hub", (_Hub,), {"asked": asked}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield asked
    finally:
        server.shutdown()
        server.server_close()

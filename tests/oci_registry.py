"""An OCI distribution registry on 127.0.0.1, for `python -m infra lock-images` to resolve tags against
without a network: the protocol public.ecr.aws speaks to an anonymous client.

- Every request to /v2/ without a token this registry issued for the repository is answered 401 with a
  `WWW-Authenticate: Bearer realm=...,service=...,scope="aws"` challenge, as public.ecr.aws answers.
- GET <realm>?service=...&scope=repository:<name>:pull issues an anonymous token for that repository
  ({"token": ...}); a scope it does not know is refused with 401.
- HEAD and GET /v2/<name>/manifests/<tag or digest> answer with the manifest (GET only), its media type
  and `Docker-Content-Digest` (the sha256 of the manifest's bytes); a manifest whose media type the
  Accept header leaves out is 404, as the distribution registry answers an OCI index asked for without
  the index types. An unknown tag is 404 MANIFEST_UNKNOWN, an unknown repository 404 NAME_UNKNOWN.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"


def manifest(media_type: str, *, seed: str) -> bytes:
    """A manifest of `media_type` as a registry stores it: the exact bytes whose sha256 is its digest."""
    def descriptor(kind: str, text: str, **extra: Any) -> dict[str, Any]:
        return {"mediaType": kind, "digest": "sha256:" + hashlib.sha256(text.encode()).hexdigest(),
                "size": len(text), **extra}

    if media_type in (OCI_INDEX, DOCKER_MANIFEST_LIST):
        single = OCI_MANIFEST if media_type == OCI_INDEX else DOCKER_MANIFEST
        body = {"schemaVersion": 2, "mediaType": media_type, "manifests": [
            descriptor(single, f"{seed}-{arch}", platform={"architecture": arch, "os": "linux"})
            for arch in ("amd64", "arm64")]}
    else:
        config = ("application/vnd.oci.image.config.v1+json" if media_type == OCI_MANIFEST
                  else "application/vnd.docker.container.image.v1+json")
        layer = ("application/vnd.oci.image.layer.v1.tar+gzip" if media_type == OCI_MANIFEST
                 else "application/vnd.docker.image.rootfs.diff.tar.gzip")
        body = {"schemaVersion": 2, "mediaType": media_type, "config": descriptor(config, f"{seed}-config"),
                "layers": [descriptor(layer, f"{seed}-layer-{i}") for i in range(3)]}
    return json.dumps(body, indent=3).encode()


def digest_of(content: bytes) -> str:
    return "sha256:" + hashlib.sha256(content).hexdigest()


@dataclass
class OciRegistry:
    """The registry's content and behaviour; `start()` serves it on 127.0.0.1."""

    repositories: dict[str, dict[str, tuple[str, bytes]]] = field(default_factory=dict)
    """name -> tag -> (media type, manifest bytes)."""
    digest_on_head: bool = True
    """Whether HEAD answers Docker-Content-Digest (a registry may leave it out; the client then GETs)."""
    refuse_tokens: bool = False
    """Answer every token request 403, as a registry that allows no anonymous pull."""
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    """(method, path, headers) of every request served."""
    _tokens: dict[str, str] = field(default_factory=dict)
    _server: ThreadingHTTPServer | None = None

    def push(self, name: str, tag: str, media_type: str, *, seed: str = "") -> str:
        """Store a manifest under `name:tag` (moving the tag if it exists); its digest."""
        content = manifest(media_type, seed=seed or f"{name}:{tag}:{media_type}")
        self.repositories.setdefault(name, {})[tag] = (media_type, content)
        return digest_of(content)

    @property
    def host(self) -> str:
        assert self._server is not None, "start() first"
        return f"127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> OciRegistry:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: the tests read `requests`
                pass

            def do_HEAD(self) -> None:
                registry._serve(self, body=False)

            def do_GET(self) -> None:
                registry._serve(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _serve(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        parts = urlsplit(handler.path)
        self.requests.append((handler.command, parts.path, dict(handler.headers)))
        if parts.path == "/token/":
            return self._token(handler, parse_qs(parts.query))
        if not parts.path.startswith("/v2/"):
            return _answer(handler, 404, b"", body=body)
        path = parts.path[len("/v2/"):]
        if "/manifests/" not in path:
            return self._challenge(handler, body=body)
        name, reference = path.rsplit("/manifests/", 1)
        if handler.headers.get("Authorization") != f"Bearer {self._tokens.get(name, '-')}":
            return self._challenge(handler, body=body)
        tags = self.repositories.get(name)
        if tags is None:
            return _error(handler, 404, "NAME_UNKNOWN", f"repository {name} not known", body=body)
        by_digest = {digest_of(content): (kind, content) for kind, content in tags.values()}
        found = by_digest.get(reference) if reference.startswith("sha256:") else tags.get(reference)
        if found is None:
            return _error(handler, 404, "MANIFEST_UNKNOWN", f"manifest {reference} not known", body=body)
        kind, content = found
        accepted = [a.split(";")[0].strip() for a in handler.headers.get("Accept", "").split(",")]
        if kind not in accepted:
            return _error(handler, 404, "MANIFEST_UNKNOWN", f"{kind} found, but the Accept header does not "
                          "take it", body=body)
        headers = {"Content-Type": kind}
        if body or self.digest_on_head:
            headers["Docker-Content-Digest"] = digest_of(content)
        _answer(handler, 200, content, body=body, headers=headers)

    def _challenge(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        challenge = f'Bearer realm="{self.url}/token/",service="{self.host}",scope="aws"'
        _error(handler, 401, "DENIED", "Not Authorized", body=body, headers={"WWW-Authenticate": challenge})

    def _token(self, handler: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        scope = (query.get("scope") or [""])[0]
        service = (query.get("service") or [""])[0]
        if self.refuse_tokens:
            return _error(handler, 403, "DENIED", "anonymous pull not allowed", body=True)
        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        if kind != "repository" or "pull" not in actions.split(",") or service != self.host:
            return _error(handler, 401, "DENIED", f"scope {scope!r} for service {service!r} refused", body=True)
        token = self._tokens.setdefault(name, secrets.token_urlsafe(16))
        _answer(handler, 200, json.dumps({"token": token}).encode(), body=True,
                headers={"Content-Type": "application/json"})


def _answer(handler: BaseHTTPRequestHandler, status: int, content: bytes, *, body: bool,
            headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(content)))
    handler.end_headers()
    if body:
        handler.wfile.write(content)


def _error(handler: BaseHTTPRequestHandler, status: int, code: str, message: str, *, body: bool,
           headers: dict[str, str] | None = None) -> None:
    content = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
    _answer(handler, status, content, body=body, headers={"Content-Type": "application/json", **(headers or {})})

"""The digest a registry gives an image tag, read through the OCI distribution API as an anonymous
client, the way public.ecr.aws serves one:

1. `HEAD /v2/<repository>/manifests/<tag>`, accepting an OCI image index, a Docker manifest list and
   both single manifests (MANIFEST_MEDIA_TYPES);
2. answered 401 with `WWW-Authenticate: Bearer realm=...,service=...`, get an anonymous token from the
   realm for `repository:<repository>:pull` and ask again with it;
3. the digest is the `Docker-Content-Digest` header; a registry that leaves it off HEAD is asked with
   GET, and the digest is then the sha256 of the manifest's bytes (checked against the header when
   there is one).

A multi-platform image's digest is its index's, so every node pulls its own platform's manifest
through it. Registries are reached over HTTPS; loopback ones (localhost, 127.0.0.0/8, ::1) over plain
HTTP, as Docker and containerd reach them by default. Credentials are not read: public images only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
import ssl
from dataclasses import dataclass
from typing import Mapping

import requests
from requests.utils import parse_dict_header

MANIFEST_MEDIA_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
"""What a manifest may be, multi-platform indexes first: the digest pinned is the tag's own."""
DOCKER_HUB = "registry-1.docker.io"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_REFERENCE_RE = re.compile(r"^(?P<name>[^@\s]+?)(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


class RegistryError(Exception):
    """The registry could not say which digest a tag names; `fix` says what to do."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")


class RegistryUnreachable(RegistryError):
    """No answer from the registry (connection, DNS, TLS, timeout) or an answer it could not give (5xx)."""


class TagNotFound(RegistryError):
    """The registry answered: no such tag, or no such repository."""


class RegistryDenied(RegistryError):
    """The registry refused an anonymous client."""


@dataclass(frozen=True, kw_only=True)
class ImageReference:
    """`[registry/]repository[:tag][@digest]`, as Kubernetes reads an image."""

    name: str
    """As written: registry and repository (`public.ecr.aws/deep-learning-containers/ray`)."""
    registry: str
    """The registry's host[:port] (Docker Hub's API host for names without one)."""
    repository: str
    """The repository inside the registry (`library/` added for Docker Hub's official images)."""
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> ImageReference:
        m = _REFERENCE_RE.match(text.strip())
        if not m or "/" in (m["tag"] or ""):
            raise ValueError(f"{text!r} is not an image reference")
        name = m["name"]
        first, _, rest = name.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, repository = first, rest
        else:
            registry, repository = DOCKER_HUB, name if rest else f"library/{name}"
        if registry == "docker.io":
            registry = DOCKER_HUB
        return cls(name=name, registry=registry, repository=repository, tag=m["tag"], digest=m["digest"])

    def pinned(self, digest: str) -> str:
        """This image by `digest`, its tag kept for the reader."""
        return f"{self.name}{':' + self.tag if self.tag else ''}@{digest}"


def _is_loopback(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cause(exc: BaseException) -> str:
    """Why a connection failed, in a few words, from the exceptions requests and urllib3 chain."""
    seen: list[BaseException] = []
    stack = [exc]
    while stack:
        e = stack.pop()
        if e in seen:
            continue
        seen.append(e)
        stack += [x for x in (e.__cause__, e.__context__, getattr(e, "reason", None)) if isinstance(x, BaseException)]
        stack += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    for e in seen:
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, socket.gaierror):
            return "its name does not resolve"
        if isinstance(e, ssl.SSLError):
            return f"TLS failed ({e.reason or e})"
        if isinstance(e, (TimeoutError, socket.timeout, requests.Timeout)):
            return "no answer in time"
    return str(exc).split("\n")[0]


class RegistryClient:
    """Reads tag digests from OCI distribution registries as an anonymous client."""

    def __init__(self, *, session: requests.Session | None = None, timeout_s: float = 20.0,
                 endpoints: Mapping[str, str] | None = None):
        self.session = session or requests.Session()
        self.timeout_s = timeout_s
        self.endpoints = dict(endpoints or {})
        """registry -> base URL to reach it at (a mirror); by default https://<registry>."""
        self._tokens: dict[tuple[str, str], str] = {}

    def _base(self, registry: str) -> str:
        if registry in self.endpoints:
            return self.endpoints[registry].rstrip("/")
        return f"{'http' if _is_loopback(registry) else 'https'}://{registry}"

    def digest(self, ref: ImageReference) -> str:
        """The digest the registry gives `ref`'s tag now (RegistryError when it cannot say)."""
        assert ref.tag, "a reference without a tag names its digest already"
        url = f"{self._base(ref.registry)}/v2/{ref.repository}/manifests/{ref.tag}"
        answer = self._get(ref, "HEAD", url)
        if answer.status_code == 404:
            answer = self._get(ref, "GET", url)  # its body says whether the tag or the repository is missing
        self._raise_for(ref, answer)
        digest = answer.headers.get("Docker-Content-Digest", "")
        if not digest:
            answer = self._get(ref, "GET", url)
            self._raise_for(ref, answer)
            digest = answer.headers.get("Docker-Content-Digest", "")
        if answer.request.method == "GET":
            content = "sha256:" + hashlib.sha256(answer.content).hexdigest()
            if digest and digest != content:
                raise RegistryUnreachable(f"the registry {ref.registry} sent a manifest whose sha256 is {content} "
                                          f"under the digest {digest}", "ask again; if it persists, do not trust "
                                          "this registry's answer")
            digest = content
        if not _DIGEST_RE.match(digest):
            raise RegistryUnreachable(f"the registry {ref.registry} gave the digest {digest!r}, not a sha256 one",
                                      "pin the digest by hand")
        return digest

    def _get(self, ref: ImageReference, method: str, url: str) -> requests.Response:
        scope = f"repository:{ref.repository}:pull"
        headers = {"Accept": ", ".join(MANIFEST_MEDIA_TYPES)}
        token = self._tokens.get((ref.registry, scope))
        answer = self._send(ref, method, url, headers, token)
        challenge = answer.headers.get("WWW-Authenticate", "")
        if answer.status_code == 401 and challenge.lower().startswith("bearer ") and token is None:
            token = self._token(ref, parse_dict_header(challenge[len("bearer "):]), scope)
            self._tokens[(ref.registry, scope)] = token
            answer = self._send(ref, method, url, headers, token)
        return answer

    def _send(self, ref: ImageReference, method: str, url: str, headers: dict[str, str],
              token: str | None) -> requests.Response:
        if token:
            headers = {**headers, "Authorization": f"Bearer {token}"}
        try:
            return self.session.request(method, url, headers=headers, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise RegistryUnreachable(f"cannot reach the registry {ref.registry}: {_cause(exc)}",
                                      f"check the network path to {ref.registry} (a proxy, a firewall), or run "
                                      "lock-images from a machine that reaches it") from None

    def _token(self, ref: ImageReference, challenge: Mapping[str, str], scope: str) -> str:
        realm = challenge.get("realm")
        if not realm:
            raise RegistryDenied(f"the registry {ref.registry} asked for a token without saying where to get it",
                                 "pin the digest by hand")
        params = {"scope": scope, **({"service": challenge["service"]} if challenge.get("service") else {})}
        try:
            answer = self.session.get(realm, params=params, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise RegistryUnreachable(f"cannot reach the token service of {ref.registry} ({realm}): {_cause(exc)}",
                                      f"check the network path to {realm}") from None
        if answer.status_code in (401, 403):
            raise RegistryDenied(f"the registry {ref.registry} refused an anonymous token (HTTP "
                                 f"{answer.status_code}: {_error_message(answer)})",
                                 "lock-images reads public images only; pin the digest by hand")
        if answer.status_code >= 300:
            raise RegistryUnreachable(f"the token service of {ref.registry} answered HTTP {answer.status_code}",
                                      "ask again later")
        try:
            body = answer.json()
        except ValueError:
            body = {}
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryUnreachable(f"the token service of {ref.registry} answered without a token",
                                      "ask again later")
        return token

    def _raise_for(self, ref: ImageReference, answer: requests.Response) -> None:
        status = answer.status_code
        if status < 300:
            return
        if status == 404:
            code = _error_code(answer)
            if code == "NAME_UNKNOWN":
                problem = f"the registry has no repository {ref.name}"
            else:
                problem = f"the registry has no tag {ref.tag} in {ref.name}"
            raise TagNotFound(f"{problem} ({code or 'HTTP 404'})", "name a tag the repository has")
        if status in (401, 403):
            raise RegistryDenied(f"the registry {ref.registry} refused to show {ref.name}:{ref.tag} to an "
                                 f"anonymous client (HTTP {status}: {_error_message(answer)})",
                                 "lock-images reads public images only; pin the digest by hand")
        raise RegistryUnreachable(f"the registry {ref.registry} answered HTTP {status} for {ref.name}:{ref.tag}",
                                  "ask again later")


def _errors(answer: requests.Response) -> list[dict]:
    try:
        body = answer.json()
    except ValueError:
        return []
    errors = body.get("errors") if isinstance(body, dict) else None
    return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def _error_code(answer: requests.Response) -> str:
    return next((str(e.get("code")) for e in _errors(answer) if e.get("code")), "")


def _error_message(answer: requests.Response) -> str:
    return next((str(e.get("message")) for e in _errors(answer) if e.get("message")), answer.reason or "")

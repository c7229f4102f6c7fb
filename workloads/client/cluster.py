"""Reaching a RayCluster's Jobs API: from a Pulumi stack's outputs, or from a URL.

With a stack, its kubeconfig goes to a private temporary file, the Ray token is read from its
Kubernetes Secret, and a `kubectl port-forward` to the head's dashboard port is held open while the
connection is in use (the head is never exposed); the token goes only into connections that end in
that kubectl's own socket (PortForward), never to another account's listener on a port of 127.0.0.1.
With an address, the token comes from RAY_AUTH_TOKEN or a file (--token-file), never from the
command line, where every user of the machine sees it (`ps`) and the shell keeps it; and a
plain-http address must be this machine's own (loopback), since the token and every job would cross
the network in the clear.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import logging
import os
import queue
import random
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Iterator, Optional

from workloads.client.relay import Relay
from workloads.client.socket_owners import holds_listener, peer_held_by


class UnreachableError(RuntimeError):
    """The cluster (or a tool needed to reach it) did not answer; exit code 3."""


@dataclass(frozen=True, kw_only=True)
class StackOutputs:
    kubeconfig: str
    """The cluster's kubeconfig (YAML or JSON text)."""
    cluster_name: str
    region: str
    ray_namespace: str
    """Namespace of the RayCluster and its Secret."""
    ray_cluster_name: str
    ray_head_service: str
    """The head's Service, target of the port-forward."""
    ray_dashboard_port: int
    """The head's dashboard (Jobs API) port."""
    ray_auth_secret_name: str
    ray_auth_secret_key: str
    """Secret and key holding the Ray auth token."""
    checkpoint_bucket_uri: str
    """`s3://bucket[/prefix]`: Ray Train's storage_path."""
    gpu_memory_gib: Optional[int] = None
    """Memory of one GPU of the stack's GPU nodes (absent from stacks deployed before it existed)."""
    ray_worker_gpus: Optional[int] = None
    """GPUs of all Ray worker pods together (absent from stacks deployed before it existed)."""
    mlflow_tracking_server_arn: Optional[str] = None
    """The stack's SageMaker managed MLflow tracking server (`ray-eks:mlflow`), the jobs' tracking URI."""
    mlflow_ui_url: Optional[str] = None
    """Its UI (opened through a presigned URL: docs/WORKLOAD.md)."""
    gpu_idle_minutes: int = 0
    """Minutes without a job after which the stack's GPU nodes scale to zero; 0 (and absent from
    stacks deployed before it existed): they stay up."""


STACK_OUTPUT_NAMES = {
    "kubeconfig": "kubeconfig",
    "clusterName": "cluster_name",
    "region": "region",
    "rayNamespace": "ray_namespace",
    "rayClusterName": "ray_cluster_name",
    "rayHeadService": "ray_head_service",
    "rayDashboardPort": "ray_dashboard_port",
    "rayAuthSecretName": "ray_auth_secret_name",
    "rayAuthSecretKey": "ray_auth_secret_key",
    "checkpointBucketUri": "checkpoint_bucket_uri",
}


def stack_outputs_from_json(data: dict, *, stack: str) -> StackOutputs:
    """Map `pulumi stack output --json` to StackOutputs; ValueError names any missing output."""
    missing = [name for name in STACK_OUTPUT_NAMES if data.get(name) in (None, "")]
    if missing:
        raise ValueError(
            f"stack {stack!r} lacks output(s) {', '.join(missing)}: run `pulumi up --stack {stack}` first"
        )
    values = {attr: data[name] for name, attr in STACK_OUTPUT_NAMES.items()}
    if not isinstance(values["kubeconfig"], str):
        values["kubeconfig"] = json.dumps(values["kubeconfig"])
    values["ray_dashboard_port"] = int(values["ray_dashboard_port"])
    for attr in STACK_OUTPUT_NAMES.values():
        if attr not in ("kubeconfig", "ray_dashboard_port"):
            values[attr] = str(values[attr])
    if data.get("gpuMemoryGib") is not None:
        values["gpu_memory_gib"] = int(data["gpuMemoryGib"])
    if data.get("rayWorkerGpus") is not None:
        values["ray_worker_gpus"] = int(data["rayWorkerGpus"])
    if data.get("mlflowTrackingServerArn"):
        values["mlflow_tracking_server_arn"] = str(data["mlflowTrackingServerArn"])
    if data.get("mlflowUiUrl"):
        values["mlflow_ui_url"] = str(data["mlflowUiUrl"])
    if data.get("gpuIdleMinutes") is not None:
        values["gpu_idle_minutes"] = int(data["gpuIdleMinutes"])
    return StackOutputs(**values)


def _tool(argv: list[str], *, what: str) -> str:
    """Run a CLI tool and return its stdout; UnreachableError with its stderr when it fails."""
    if shutil.which(argv[0]) is None:
        raise UnreachableError(f"{argv[0]} is not on PATH; it is needed to {what}")
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UnreachableError(f"could not {what}: `{shlex.join(argv[:3])} ...` exited {proc.returncode}: {detail}")
    return proc.stdout


PROJECT_DIR = Path(__file__).resolve().parents[2]
"""The Pulumi project (Pulumi.yaml) this package belongs to: `pulumi` finds the stack from there,
whatever folder the command runs in."""


def read_stack_outputs(stack: str, *, project_dir: Path = PROJECT_DIR) -> StackOutputs:
    cwd = ["--cwd", str(project_dir)] if (project_dir / "Pulumi.yaml").is_file() else []
    text = _tool(
        ["pulumi", "stack", "output", "--json", "--show-secrets", "--stack", stack, *cwd],
        what=f"read the outputs of stack {stack!r}",
    )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnreachableError(f"`pulumi stack output --json` printed invalid JSON: {exc}") from None
    return stack_outputs_from_json(data, stack=stack)


@contextmanager
def private_kubeconfig(content: str) -> Iterator[Path]:
    """The kubeconfig in a file only this user can read, deleted on exit."""
    fd, name = tempfile.mkstemp(prefix="kubeconfig-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(content)
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def read_ray_token(*, kubeconfig: Path, namespace: str, secret: str, key: str) -> str:
    text = _tool(
        ["kubectl", "--kubeconfig", str(kubeconfig), "--namespace", namespace, "get", "secret", secret, "-o", "json"],
        what=f"read the Ray token from Secret {namespace}/{secret}",
    )
    data = json.loads(text).get("data") or {}
    if key not in data:
        raise UnreachableError(f"Secret {namespace}/{secret} has no key {key!r} (keys: {', '.join(data) or 'none'})")
    return base64.b64decode(data[key]).decode().strip()


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Linux's range of ports it hands out itself: to a socket bound to port 0 and to outgoing connections."""
PORT_FLOOR = 20_000
"""The lowest port chosen: above the range Ray's nodes give their worker processes (10002-19999 by
default, `--min-worker-port`, `--max-worker-port`)."""


def ephemeral_floor() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read,
    which is below macOS's 49152 too)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, *, besides: Collection[int] = ()) -> list[int]:
    """`count` distinct ports free on every interface now, none of them in `besides` (ports chosen
    earlier that nothing listens on yet), at random below the kernel's ephemeral range.

    Whoever asks binds them later, in another process (a `ray start` binds a node's agents seconds
    after): a port of the ephemeral range can be handed out in between to any socket that binds port 0
    or connects out, and then the bind fails (a worker node's runtime-env agent did, "Address already
    in use", in a full test run; its raylet exited with it and the job waited for the node). Below the
    range only a process that names the port itself can take it. The ports are held open together
    while chosen, so none is given twice."""
    floor = ephemeral_floor()
    # A range that starts low leaves no port the kernel never hands out: any then does as well.
    end = floor if floor - PORT_FLOOR >= 1_000 else 65_536
    pool = [port for port in range(PORT_FLOOR, end) if port not in besides]
    random.shuffle(pool)
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in pool:
            if len(ports) == count:
                break
            sock = socket.socket()
            try:
                sock.bind(("", port))
            except OSError:  # in use
                sock.close()
                continue
            held.enter_context(sock)
            ports.append(port)
        if len(ports) < count:
            raise RuntimeError(f"only {len(ports)} of the {count} ports asked for are free in {PORT_FLOOR}-{end - 1}")
        return ports


FORWARDING = re.compile(r"^Forwarding from 127\.0\.0\.1:(\d+) -> \d+")
"""kubectl's line once it listens on the local port (it prints one per address it listens on)."""
ACCEPT_TIMEOUT_S = 10.0
"""How long kubectl may take to accept a connection made to its port."""


class PortForward:
    """`kubectl port-forward svc/<service>` on a local port kubectl picks and binds itself, restarted
    when it has died, and reached only through a Relay of this process (`port`, which stays the same
    across restarts): each connection is passed on to kubectl's port once its other end is seen to be
    kubectl's own socket, so no request reaches another account that listens on that port before
    kubectl binds it or after kubectl has exited."""

    def __init__(self, *, kubeconfig: Path, namespace: str, service: str, remote_port: int,
                 timeout_s: float = 30.0) -> None:
        if shutil.which("kubectl") is None:
            raise UnreachableError("kubectl is not on PATH; it is needed to reach the Ray head")
        # An empty local port: kubectl binds a free one itself and names it, so no port is chosen free
        # here and bound later, when another process may have taken it.
        self._argv = ["kubectl", "--kubeconfig", str(kubeconfig), "--namespace", namespace, "port-forward",
                      "--address", "127.0.0.1", f"svc/{service}", f":{remote_port}"]
        self._target = f"svc/{service}:{remote_port}"
        self._timeout_s = timeout_s
        # Held while kubectl is started, stopped or connected to: only then is its process reaped, so
        # its pid stays its own while its sockets are read.
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._kubectl_port = 0
        self._relay: Optional[Relay] = None
        self.port = 0

    def ensure(self) -> int:
        """The local port of a live port-forward, started anew when there is none."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start_kubectl()
            if self._relay is None:
                self._relay = Relay(open_upstream=self._connect_to_kubectl)
                self.port = self._relay.port
        return self.port

    def _start_kubectl(self) -> None:
        self._stop_kubectl()
        with tempfile.TemporaryFile(mode="w+") as errors:
            proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=errors, text=True)
            said: queue.Queue[Optional[int]] = queue.Queue()
            threading.Thread(target=_read_forwarded_port, args=(proc.stdout, said), daemon=True).start()
            try:
                port = said.get(timeout=self._timeout_s)
            except queue.Empty:
                port = None
            if port is None:
                _terminate(proc)
                errors.seek(0)
                detail = (errors.read().strip().splitlines() or ["no output"])[-1]
                raise UnreachableError(f"kubectl port-forward to {self._target} did not open: {detail}")
        if not holds_listener([proc.pid], port=port):
            _terminate(proc)
            raise UnreachableError(f"kubectl port-forward to {self._target} says it listens on 127.0.0.1:{port}, but "
                                   "no socket of it does: another process holds the port; nothing was sent there")
        self._proc, self._kubectl_port = proc, port

    def _connect_to_kubectl(self) -> Optional[socket.socket]:
        """A connection to kubectl's port whose other end is kubectl's socket; None when kubectl has
        exited or another process answered there (then nothing was sent on it)."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return None
            sock = socket.create_connection(("127.0.0.1", self._kubectl_port), timeout=ACCEPT_TIMEOUT_S)
            if peer_held_by(sock, pid=proc.pid, timeout_s=ACCEPT_TIMEOUT_S) and proc.poll() is None:
                sock.settimeout(None)
                return sock
            sock.close()
            if proc.poll() is None:
                logging.getLogger(__name__).warning(
                    "a connection to 127.0.0.1:%d, kubectl's port-forward, did not reach kubectl: it was closed "
                    "unused", self._kubectl_port)
            return None

    def _stop_kubectl(self) -> None:
        if self._proc is not None:
            _terminate(self._proc)
            self._proc = None

    def stop(self) -> None:
        with self._lock:
            self._stop_kubectl()
            if self._relay is not None:
                self._relay.close()
                self._relay = None


def _read_forwarded_port(stdout, said: queue.Queue) -> None:
    """Put the port of kubectl's first Forwarding line (None when it ends without one), then read on
    until it ends: kubectl prints a line for each connection, and would block on a full pipe."""
    told = False
    for line in stdout:
        if not told and (match := FORWARDING.match(line)):
            said.put(int(match[1]))
            told = True
    if not told:
        said.put(None)


def _terminate(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def port_forward(*, kubeconfig: Path, namespace: str, service: str, remote_port: int,
                 timeout_s: float = 30.0) -> Iterator[PortForward]:
    """A running PortForward, stopped on exit."""
    forward = PortForward(kubeconfig=kubeconfig, namespace=namespace, service=service, remote_port=remote_port,
                          timeout_s=timeout_s)
    try:
        forward.ensure()
        yield forward
    finally:
        forward.stop()


@dataclass(frozen=True, kw_only=True)
class WakeTarget:
    """Where to watch a stack's GPU nodes come back from zero (workloads/client/wakeup.py)."""

    kubeconfig: Path
    """The connection's private kubeconfig file (it exists while the connection is open)."""
    namespace: str
    ray_cluster: str
    cluster_name: str
    """The EKS cluster's name: the GPU Auto Scaling group's discovery tag carries it."""
    region: str
    idle_minutes: int


@dataclass(frozen=True, kw_only=True)
class Connection:
    address: str
    """The Jobs API URL (the local end of the port-forward for a stack)."""
    token: Optional[str]
    """Ray auth token, sent as `Authorization: Bearer`; None for a cluster without token auth."""
    storage_path: Optional[str]
    """Default Ray Train storage (the stack's checkpoint bucket); None with --address."""
    target_args: tuple[str, ...]
    """The options that reach this cluster again, for the reattach/stop hints."""
    gpu_memory_gib: Optional[int] = None
    """Memory of one GPU of the cluster's workers, when the stack says (sizes the default preset)."""
    ray_worker_gpus: Optional[int] = None
    """GPUs the cluster's workers have together, when the stack says (the job waits for them)."""
    tracking_uri: Optional[str] = None
    """The stack's MLflow tracking server (its ARN), when it has one."""
    reconnect: Optional[Callable[[], str]] = field(default=None, compare=False, repr=False)
    """Restores the way to the cluster (a new port-forward) and returns the Jobs API URL; None
    when the address needs nothing restored."""
    wake: Optional[WakeTarget] = None
    """Where to watch the GPU nodes come back, for a stack whose GPU nodes scale to zero; None
    otherwise (and with --address)."""

    def current_address(self) -> str:
        return self.reconnect() if self.reconnect else self.address


@contextmanager
def stack_connection(stack: str) -> Iterator[Connection]:
    outputs = read_stack_outputs(stack)
    with private_kubeconfig(outputs.kubeconfig) as kubeconfig:
        token = read_ray_token(kubeconfig=kubeconfig, namespace=outputs.ray_namespace,
                               secret=outputs.ray_auth_secret_name, key=outputs.ray_auth_secret_key)
        with port_forward(kubeconfig=kubeconfig, namespace=outputs.ray_namespace,
                          service=outputs.ray_head_service, remote_port=outputs.ray_dashboard_port) as forward:
            wake = (WakeTarget(kubeconfig=kubeconfig, namespace=outputs.ray_namespace,
                               ray_cluster=outputs.ray_cluster_name, cluster_name=outputs.cluster_name,
                               region=outputs.region, idle_minutes=outputs.gpu_idle_minutes)
                    if outputs.gpu_idle_minutes else None)
            yield Connection(address=f"http://127.0.0.1:{forward.port}", token=token,
                             storage_path=outputs.checkpoint_bucket_uri, target_args=("--stack", stack),
                             gpu_memory_gib=outputs.gpu_memory_gib, ray_worker_gpus=outputs.ray_worker_gpus,
                             tracking_uri=outputs.mlflow_tracking_server_arn,
                             reconnect=lambda: f"http://127.0.0.1:{forward.ensure()}", wake=wake)


DEFAULT_DASHBOARD_PORT = 8265
CONNECT_TIMEOUT_S = 5.0
"""How long --address may take to accept a connection before the command gives up (exit 3)."""


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's own (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def normalize_address(address: str, *, insecure: bool = False) -> str:
    """The Jobs API URL of an --address: `host:port` gets `http://`. ValueError for anything that
    is not an http(s) URL (a `ray://` client or a bare GCS address would hang in Ray's own lookup),
    and for plain http to another machine unless `insecure` (--insecure) says so."""
    text = address.strip()
    if "://" not in text:
        text = f"http://{text}"
    url = urllib.parse.urlsplit(text)
    try:
        valid = url.scheme in ("http", "https") and bool(url.hostname) and url.port != 0
    except ValueError:  # a port that is not a number
        valid = False
    if not valid:
        raise ValueError(f"--address {address!r} is not a Ray Jobs API URL: use http://HOST:PORT, the "
                         f"Ray head's dashboard port ({DEFAULT_DASHBOARD_PORT} by default)")
    if url.scheme == "http" and not insecure and not is_loopback(url.hostname or ""):
        raise ValueError(f"--address {address!r}: plain http to another machine would send the Ray token, and "
                         "every job, in the clear: use https://, reach the head through a tunnel to 127.0.0.1 "
                         "(ssh -L, kubectl port-forward), or pass --insecure to send them anyway")
    return text.rstrip("/")


def read_token_file(path: Path) -> str:
    """The Ray token in the file at `path` (surrounding whitespace dropped); ValueError when it
    cannot be read or is empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {path}: cannot read it ({exc.strerror or exc})") from None
    if not token:
        raise ValueError(f"--token-file {path}: the file is empty")
    return token


def check_reachable(url: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """UnreachableError unless something accepts a TCP connection at the URL within timeout_s."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise UnreachableError(f"no Ray Jobs API at {url}: nothing answers ({reason}); is the Ray head up, "
                               f"and is this its dashboard port ({DEFAULT_DASHBOARD_PORT} by default)?") from None


@contextmanager
def connect(*, stack: Optional[str], address: Optional[str], token: Optional[str],
            insecure: bool = False) -> Iterator[Connection]:
    if stack and address:
        raise ValueError("--stack and --address both name a cluster: give one of them")
    if address:
        address = normalize_address(address, insecure=insecure)
        token = token or os.environ.get("RAY_AUTH_TOKEN") or None
        yield Connection(address=address, token=token, storage_path=None, target_args=("--address", address))
    elif stack:
        with stack_connection(stack) as conn:
            yield conn
    else:
        raise ValueError("say which cluster: --stack NAME (a Pulumi stack) or --address URL (a Jobs API)")


def job_client(conn: Connection, *, address: Optional[str] = None):
    from ray.job_submission import JobSubmissionClient

    # The SDK logs each package upload and closed log stream at INFO; the console says what matters.
    for name in ("ray.dashboard.modules.job.sdk", "ray.dashboard.modules.dashboard_sdk",
                 "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)

    headers = {"Authorization": f"Bearer {conn.token}"} if conn.token else None
    # The address asked for: after a dropped port-forward, the restored one's new local port.
    address = address or conn.address
    check_reachable(address)
    try:
        return JobSubmissionClient(address, headers=headers)
    except ConnectionError as exc:
        raise UnreachableError(f"no Ray Jobs API at {address}: {first_line(str(exc))}") from None
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        # The SDK's first request is GET /api/version. A server that is not a Ray dashboard answers
        # it with a 404 (which the SDK blames on a Ray older than 1.9), another error status, or a
        # body that is no Ray version: none of that is an old Ray.
        raise UnreachableError(
            f"nothing at {address} answers as a Ray Jobs API (GET /api/version: {_version_answer(exc)}): "
            f"is this the Ray head's dashboard port ({DEFAULT_DASHBOARD_PORT} by default)?") from None


def _version_answer(exc: BaseException) -> str:
    text = first_line(str(exc))
    if text.startswith("Version check returned 404"):
        return "HTTP 404"
    if isinstance(exc, KeyError):
        return "a JSON answer without ray_version"
    if isinstance(exc, ValueError) and not isinstance(exc, UnicodeError):
        return "not JSON"
    return text or type(exc).__name__


def client_factory(conn: Connection) -> Callable[[], object]:
    """New Jobs API clients for `conn`, each over a restored port-forward when it had dropped."""
    return lambda: job_client(conn, address=conn.current_address())


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]

"""`pulumi` and `kubectl` replaced by scripts that answer like them, for the stack path of the client:
the fake port-forward relays to a Jobs API of the test's choosing (a real local Ray head, or a
stand-in). And a listener of another process, which records whatever reaches it: the port-forward
tests assert that the Ray token never does."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

FAKE_PULUMI = """\
#!{python}
import json, os, sys
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps(["pulumi", *sys.argv[1:]]) + "\\n")
print(os.environ["FAKE_OUTPUTS"])
"""

FAKE_KUBECTL = """\
#!{python}
import asyncio, base64, json, os, signal, sys, time
argv = sys.argv[1:]
kubeconfig = argv[argv.index("--kubeconfig") + 1]
with open(os.environ["FAKE_CALLS"], "a") as f:
    mode = oct(os.stat(kubeconfig).st_mode & 0o777)
    f.write(json.dumps(["kubectl", *argv, {{"kubeconfig_mode": mode, "kubeconfig": open(kubeconfig).read()}}]) + "\\n")
if "get" in argv:
    token = base64.b64encode(os.environ["FAKE_TOKEN"].encode()).decode()
    print(json.dumps({{"data": {{"token": token}}}}))
    sys.exit(0)
if os.environ.get("FAKE_FORWARD_FAILS"):
    print('error: services "ray-head-svc" not found', file=sys.stderr)
    sys.exit(1)
with open(os.environ["FAKE_PIDS"], "a") as f:
    f.write(f"{{os.getpid()}}\\n")
# LOCAL:REMOTE as kubectl takes it; an empty LOCAL has it pick a free port itself.
local = int(argv[-1].split(":")[0] or 0)
target = int(os.environ["FAKE_DASHBOARD_PORT"])

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def relay(reader, writer):
    print("Handling connection for 8265", flush=True)
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
    request_line = await reader.readline()  # kept, so a test can tell when the log stream is open
    with open(os.environ["FAKE_REQUESTS"], "a") as f:
        f.write(f"{{os.getpid()}} {{request_line.decode(errors='replace').strip()}}\\n")
    up_writer.write(request_line)
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

async def main():
    time.sleep(float(os.environ.get("FAKE_BIND_DELAY_S") or 0))  # a kubectl slow to bind its port
    try:
        server = await asyncio.start_server(relay, "127.0.0.1", local)
    except OSError as exc:
        print(f"Unable to listen on port {{local}}: {{exc}}", file=sys.stderr)
        print("error: unable to listen on any of the requested ports", file=sys.stderr)
        sys.exit(1)
    port = server.sockets[0].getsockname()[1]
    with open(os.environ["FAKE_PORTS"], "a") as f:
        f.write(f"{{port}}\\n")
    # FAKE_SAYS_PORT: a kubectl whose line names a port that is not the one it listens on.
    print(f"Forwarding from 127.0.0.1:{{os.environ.get('FAKE_SAYS_PORT') or port}} -> 8265", flush=True)
    # SIGUSR1: stop listening and run on (the forwarded connections too).
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, server.close)
    await asyncio.Event().wait()

asyncio.run(main())
"""

STACK_OUTPUTS = {
    "kubeconfig": {"apiVersion": "v1", "kind": "Config", "clusters": [{"name": "ray-eks"}]},
    "clusterName": "ray-eks", "region": "us-west-2", "rayNamespace": "ray", "rayClusterName": "ray",
    "rayHeadService": "ray-head-svc", "rayDashboardPort": 8265, "rayAuthSecretName": "ray-auth",
    "rayAuthSecretKey": "token", "checkpointBucketUri": "s3://ckpt",
}


def install_fake_tools(work: Path, monkeypatch, *, token: str, dashboard_port: int) -> None:
    """`pulumi` and `kubectl` on PATH, with stack us-west-2's outputs, the Secret holding `token` and
    a port-forward to 127.0.0.1:`dashboard_port`. They write into `work`: calls.jsonl (every call),
    pids and ports (each port-forward's pid and the port it listens on), requests (the first line of
    each request through a port-forward). A port-forward stops listening on SIGUSR1 and runs on."""
    bin_dir = work / "bin"
    bin_dir.mkdir()
    for name, source in (("pulumi", FAKE_PULUMI), ("kubectl", FAKE_KUBECTL)):
        path = bin_dir / name
        path.write_text(source.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_OUTPUTS", json.dumps(STACK_OUTPUTS))
    monkeypatch.setenv("FAKE_CALLS", str(work / "calls.jsonl"))
    monkeypatch.setenv("FAKE_PIDS", str(work / "pids"))
    monkeypatch.setenv("FAKE_PORTS", str(work / "ports"))
    monkeypatch.setenv("FAKE_REQUESTS", str(work / "requests"))
    monkeypatch.setenv("FAKE_TOKEN", token)
    monkeypatch.setenv("FAKE_DASHBOARD_PORT", str(dashboard_port))


def calls(work: Path) -> list[list]:
    return [json.loads(line) for line in (work / "calls.jsonl").read_text().splitlines()]


LISTENER = """\
import pathlib, socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
record, answer = pathlib.Path(sys.argv[2]), sys.argv[3].encode()
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(2)
    with conn:
        try:
            while data := conn.recv(65536):
                with record.open("ab") as f:
                    f.write(data)
                if answer:
                    conn.sendall(answer)
                    break
        except OSError:
            pass
"""


HTTP_401 = "HTTP/1.0 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
"""What a Ray head answers a request without its token."""


class ForeignListener:
    """A process other than the client's that listens on 127.0.0.1:`port`, as another account of the
    machine may on any free port, and keeps every byte sent to it. It answers nothing, or `answer` to
    the first bytes of each connection (HTTP_401 looks like a Ray head to a check that any HTTP
    answer satisfies)."""

    def __init__(self, port: int, *, record: Path, answer: str = "") -> None:
        self.port, self.record = port, record
        self.proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port), str(record), answer],
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the other process could not listen on 127.0.0.1:{port}")

    def received(self) -> bytes:
        return self.record.read_bytes() if self.record.exists() else b""

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

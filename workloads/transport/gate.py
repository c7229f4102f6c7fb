"""The in-band transport gate: after the process group exists and before the first training step,
prove that NCCL connected the ranks over the expected transports and that all-reduce is not slow.

Every rank writes its own NCCL log (the launcher sets the variables from `nccl_log_env`), runs an
all-reduce (which makes NCCL open its connections), measures bus bandwidth, parses its own log and
judges the connections it made. The verdicts are all-gathered so that every rank stops together,
with one message naming ranks, hosts, transports and the measured GB/s.

Default bandwidth floors (`min_busbw_gbps=None`) only catch gross degradation, so that they never
stop a healthy run; the transport check is what catches a fallback to TCP sockets (which measured
3.8 GB/s between two H200s of one host, against 330 GB/s over NVLink):
- all ranks on one node: 2 GB/s, under what PCIe-only GPUs (g6's L4s) reach over P2P or SHM;
- ranks on several nodes: a fifth of the nodes' EFA line rate (INTER_NODE_FLOOR_SHARE), which the
  Ray worker pods are told (`node_network_env`, set by infra/raycluster.py): 1 GB/s on g6.12xlarge's
  one 40 Gbps interface, 80 GB/s on p5.48xlarge's 32 x 100 Gbps, so a p5 whose NCCL uses a few of its
  interfaces fails as one that uses none would. The all-reduce is then sized to take a few
  milliseconds at that rate (`message_bytes_for`): a 64 MiB one is over in 0.2 ms at 400 GB/s, too
  short to tell bandwidth from latency. Where the network is not known (a local run, a cluster
  this stack did not build), the floor is a generic 1 GB/s, and the gate's line says so.
For a tight gate, set the floor to about 70% of a healthy run's figure from
`python -m workloads.bench nccl` on the same instance type.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional

from workloads.context import PreflightError
from workloads.transport.verdict import Status, not_nccl_message

if TYPE_CHECKING:
    import torch

    from workloads.context import TrainContext

INTRA_NODE_FLOOR_GBPS = 2.0
INTER_NODE_FLOOR_GBPS = 1.0
"""Between nodes whose network is not known: under what one 40 Gbps EFA interface carries."""
INTER_NODE_FLOOR_SHARE = 0.2
"""The default floor between nodes as a share of their EFA line rate: the share 1 GB/s is of
g6.12xlarge's 40 Gbps, the slowest type the stack deploys."""
DEFAULT_MESSAGE_BYTES = 64 * 2**20
"""The gate's all-reduce without a known node network."""
MESSAGE_SECONDS_AT_LINE_RATE = 0.008
"""How long the gate's all-reduce should take at the nodes' line rate (`message_bytes_for`)."""
MAX_MESSAGE_BYTES = 512 * 2**20
EFA_INTERFACES_ENV = "RAY_EKS_EFA_INTERFACES"
NETWORK_GBPS_ENV = "RAY_EKS_NETWORK_GBPS"
"""The EFA interfaces and the network line rate (Gbps, all interfaces) of a Ray worker's node, set
on the pods by infra/raycluster.py from the instance table (`node_network_env`)."""
NCCL_LOG_NAME = "nccl.%h.%p.log"
POD_INTERFACE = "eth0"
"""The EKS pod's VPC CNI interface."""
NODE_NAME_ENV = "K8S_NODE_NAME"
"""The Kubernetes node a Ray worker pod runs on (the downward API's spec.nodeName, set on the pods by
infra/raycluster.py): the node a failing gate names for draining."""

EFA_TRANSPORT_ENV: dict[str, str] = {
    # libfabric would otherwise take the first provider that answers (tcp works everywhere), and
    # aws-ofi-nccl would then carry NCCL's traffic at TCP speed without an error.
    "FI_PROVIDER": "efa",
    # aws-ofi-nccl installs libnccl-net-ofi.so; NCCL loads libnccl-net-<NCCL_NET_PLUGIN>.so.
    "NCCL_NET_PLUGIN": "ofi",
    # NCCL's bootstrap and its socket fallback use this interface; the EFA device carries the data.
    # Named exactly, so NCCL never picks an interface the other pods cannot reach.
    "NCCL_SOCKET_IFNAME": POD_INTERFACE,
    # Unless fork support is on, libfabric's EFA provider aborts a process that forks after opening
    # the device (kernels without copy-on-fork of DMA pages); Ray and data loaders fork.
    "FI_EFA_FORK_SAFE": "1",
}
"""The network transport of multi-node GPU runs on EKS, declared rather than left to NCCL's silent
fallback to TCP sockets. Set on the Ray worker pods (infra/raycluster.py) and again in the job's
runtime_env (workloads/client/submission.py)."""


class TransportGateError(PreflightError):
    """Raised on every rank when any rank's connections or the measured bandwidth fail the gate."""


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    expect: Literal["efa", "any"] = "efa"
    """Network required between nodes: "efa" (EFA through aws-ofi-nccl) or "any" NCCL network."""
    min_busbw_gbps: Optional[float] = None
    """All-reduce bus-bandwidth floor in GB/s; None picks one by topology and the nodes' EFA network
    (see the module doc)."""
    message_bytes: Optional[int] = None
    """Size of the all-reduce that opens the connections and measures bandwidth; None: sized to the
    nodes' network (`message_bytes_for`; 64 MiB where it is not known)."""
    enabled: bool = True
    """False skips the gate (the loop logs that it was skipped)."""
    log_wait_s: float = 5.0
    """How long a rank waits for its connection lines to reach its NCCL log file."""

    def __post_init__(self) -> None:
        if self.expect not in ("efa", "any"):
            raise ValueError(f"transport gate: expect must be 'efa' or 'any', got {self.expect!r}")
        if self.min_busbw_gbps is not None and self.min_busbw_gbps < 0:
            raise ValueError(f"transport gate: min_busbw_gbps must be >= 0, got {self.min_busbw_gbps}")
        if self.message_bytes is not None and self.message_bytes < 4096:
            raise ValueError(f"transport gate: message_bytes must be >= 4096, got {self.message_bytes}")
        if self.log_wait_s < 0:
            raise ValueError(f"transport gate: log_wait_s must be >= 0, got {self.log_wait_s}")


@dataclass(frozen=True, kw_only=True)
class NodeNetwork:
    """The EFA network of the nodes the ranks run on, as the Ray worker pods are told it."""

    efa_interfaces: int
    line_gbps: float
    """All interfaces together, Gbps."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional["NodeNetwork"]:
        """The network the pod's environment names; None where it names none (or nonsense)."""
        try:
            network = cls(efa_interfaces=int(environ[EFA_INTERFACES_ENV]),
                          line_gbps=float(environ[NETWORK_GBPS_ENV]))
        except (KeyError, ValueError):
            return None
        return network if network.efa_interfaces > 0 and network.line_gbps > 0 else None

    @property
    def floor_gbps(self) -> float:
        """The default bus-bandwidth floor between nodes, GB/s."""
        return INTER_NODE_FLOOR_SHARE * self.line_gbps / 8

    def describe(self) -> str:
        share = f"{INTER_NODE_FLOOR_SHARE:.0%}"
        return (f"{share} of the {self.line_gbps:g} Gbps of {self.efa_interfaces} EFA "
                f"interface{'s' if self.efa_interfaces > 1 else ''}")


def node_network_env(*, efa_interfaces: int, line_gbps: float) -> dict[str, str]:
    """What the Ray worker pods carry so the gate knows their nodes' network."""
    return {EFA_INTERFACES_ENV: str(efa_interfaces), NETWORK_GBPS_ENV: f"{line_gbps:g}"}


def message_bytes_for(cfg: GateConfig, network: Optional[NodeNetwork]) -> int:
    """The gate's all-reduce size: the config's, else what takes MESSAGE_SECONDS_AT_LINE_RATE at
    the nodes' line rate (a power of two from 64 MiB to MAX_MESSAGE_BYTES)."""
    if cfg.message_bytes is not None:
        return cfg.message_bytes
    if network is None:
        return DEFAULT_MESSAGE_BYTES
    wanted = network.line_gbps / 8 * 1e9 * MESSAGE_SECONDS_AT_LINE_RATE
    size = DEFAULT_MESSAGE_BYTES
    while size < wanted and size < MAX_MESSAGE_BYTES:
        size *= 2
    return size


@dataclass(frozen=True, kw_only=True)
class RankVerdict:
    """One rank's judgement of its own connections, as exchanged between ranks."""

    rank: int
    host: str
    ok: bool
    problems: tuple[str, ...] = ()
    """Each names the ranks and hosts it is about."""
    transports: tuple[str, ...] = ()
    """The transports this rank's connections used, e.g. ("P2P/CUMEM", "NET/Libfabric/GDRDMA")."""
    inter_node_links: int = 0
    """Links this rank logged to a rank on another host."""
    log_file: str = ""
    node: str = ""
    """The Kubernetes node of this rank's pod, where known (K8S_NODE_NAME)."""

    @property
    def machine(self) -> str:
        """The machine to act on: the Kubernetes node, else the host label."""
        return self.node or self.host


@dataclass(frozen=True, kw_only=True)
class GateResult:
    applies: bool
    """False when the gate did not run (gloo backend, disabled, single rank); `message` says why."""
    passed: bool
    message: str
    """One line when passed or not applicable; on failure, a header line and one line per problem."""
    busbw_gbps: Optional[float] = None
    floor_gbps: Optional[float] = None
    floor_source: str = ""
    """Where a default floor between nodes came from (the nodes' network, or none known)."""
    nodes: int = 0
    verdicts: tuple[RankVerdict, ...] = field(default=())
    drain: tuple[str, ...] = ()
    """The nodes whose ranks alone failed: the ones to drain and replace. Empty when the failure
    names no node (every node failed alike, one node only, or bandwidth alone)."""


def nccl_log_env(*, log_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Environment a launcher sets on every training process so the gate can read its NCCL log.

    NCCL logs every "Channel ... via <transport>" line under INIT together with the transport's own
    subsystem (INIT|P2P, INIT|SHM, INIT|NET), so INIT alone yields the connections and the pid ->
    rank lines; NET adds the net plugin's choices (aws-ofi-nccl's libfabric provider); ENV shows a
    transport turned off by the environment (NCCL_P2P_DISABLE=1, ...). NCCL
    substitutes %h (hostname up to the first dot) and %p (pid) in NCCL_DEBUG_FILE, so each process
    writes its own file.
    """
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "NCCL_DEBUG_FILE": str(Path(log_dir) / NCCL_LOG_NAME),
    }


def resolve_debug_file(pattern: str, *, hostname: str, pid: int) -> Path:
    """The file NCCL writes for `pattern` (NCCL_DEBUG_FILE) in the process `pid` on `hostname`:
    %h is the hostname up to its first dot, %p the pid, %% a percent sign; other %x stay as they are."""
    values = {"h": hostname.split(".", 1)[0], "p": str(pid), "%": "%"}
    return Path(re.sub(r"%(.)", lambda m: values.get(m[1], m[0]), pattern, flags=re.DOTALL))


def node_label(hostname: str, *, host_id: Optional[str] = None) -> str:
    """This rank's node as NCCL tells nodes apart: by NCCL_HOSTID when it is set (several processes
    of one machine are then several nodes, as in an emulated multi-node run), else by host."""
    host = hostname.split(".", 1)[0]
    return f"{host}/{host_id}" if host_id else host


def default_floor_gbps(*, nodes: int, network: Optional[NodeNetwork] = None) -> tuple[float, str]:
    """The floor without `min_busbw_gbps`, and where it comes from (empty within one node)."""
    if nodes <= 1:
        return INTRA_NODE_FLOOR_GBPS, ""
    if network is None:
        return INTER_NODE_FLOOR_GBPS, (f"generic: the nodes' EFA network is unknown ({NETWORK_GBPS_ENV} "
                                       "is not set)")
    return network.floor_gbps, network.describe()


def judge_rank(
    cfg: GateConfig,
    *,
    rank: int,
    host: str,
    log_text: str,
    rank_hosts: dict[int, str],
    log_file: str = "",
    node: str = "",
) -> RankVerdict:
    """Judge the connections `rank` made, from its own NCCL log and every rank's host.

    The node count is not checked here: a rank sees only its own connections, and in a ring most
    ranks have no peer on another node. `combine_verdicts` checks it over all ranks.
    """
    from workloads.transport import nccl_log, verify

    verdict = verify.decide(nccl_log.parse_nccl_log(log_text), expect=cfg.expect, rank_hosts=rank_hosts)
    transports = tuple(sorted({t for link in verdict.links for t in link.transports}))
    inter = sum(1 for link in verdict.links if link.scope == "inter")
    problems: tuple[str, ...] = ()
    if not log_text.strip():
        problems = (f"rank {rank} on {host}: NCCL log {log_file or '(unnamed)'} is missing or empty "
                    "(is NCCL_DEBUG=INFO set for this process?)",)
    elif verdict.status != Status.PASS:
        # Link problems name their ranks and hosts already; gaps do not.
        problems = verdict.problems + tuple(f"rank {rank} on {host}: {gap}" for gap in verdict.gaps)
    return RankVerdict(
        rank=rank, host=host, ok=not problems, problems=problems, transports=transports,
        inter_node_links=inter, log_file=log_file, node=node,
    )


def nodes_to_drain(verdicts: list[RankVerdict]) -> tuple[tuple[str, ...], str]:
    """Which machines a failed gate points at, and the advice line. A machine stands out when some of
    its ranks failed while every rank of another machine passed; when every machine failed alike, the
    cause is one they share (the image, the job's environment, the security group), and draining one
    would not help."""
    by_machine: dict[str, list[RankVerdict]] = {}
    for verdict in verdicts:
        by_machine.setdefault(verdict.machine, []).append(verdict)
    failing = [m for m, ranks in by_machine.items() if not all(v.ok for v in ranks)]
    if not failing:
        return (), ("drain: no node stands out: every rank's connections are right, and the bus bandwidth is one "
                    "figure for all of them; `kubectl describe node` shows each node's NetworkingReady and "
                    "AcceleratedHardwareReady conditions (EKS node monitoring agent)")
    if len(failing) == len(by_machine):
        where = "the run's only node" if len(by_machine) == 1 else f"all {len(by_machine)} nodes"
        return (), (f"drain: no node stands out: ranks on {where} failed alike ({', '.join(failing)}), a cause "
                    "they share (the image, the job's environment, the security group) rather than one "
                    "machine; `kubectl describe node` shows the monitoring agent's conditions before any drain")
    advice = "; ".join(
        f"{machine} (ranks {', '.join(str(v.rank) for v in by_machine[machine] if not v.ok)} failed, the other "
        f"nodes' passed)" for machine in failing)
    commands = " && ".join(f"kubectl drain {m} --ignore-daemonsets --delete-emptydir-data" for m in failing)
    return tuple(failing), (f"drain: {advice}: `{commands}`, then terminate the instance: the node group "
                            "replaces it and the run resumes from its latest checkpoint")


def combine_verdicts(
    cfg: GateConfig, *, verdicts: list[RankVerdict], busbw_gbps: float, message_bytes: int,
    network: Optional[NodeNetwork] = None,
) -> GateResult:
    """One result for all ranks: every rank computes the same one from the same gathered verdicts."""
    verdicts = sorted(verdicts, key=lambda v: v.rank)
    nodes = len({v.host for v in verdicts})
    floor, source = ((cfg.min_busbw_gbps, "") if cfg.min_busbw_gbps is not None
                     else default_floor_gbps(nodes=nodes, network=network))
    placement = ", ".join(f"{v.rank}@{v.host}" for v in verdicts)
    used = ", ".join(sorted({t for v in verdicts for t in v.transports})) or "none seen"
    bw = (
        f"all-reduce bus bandwidth {busbw_gbps:.2f} GB/s (floor {floor:.2f} GB/s{': ' + source if source else ''}, "
        f"{message_bytes / 2**20:g} MiB, {len(verdicts)} ranks on {nodes} node(s))"
    )
    # Both ends of a link log it, so the same problem can come from two ranks.
    failures = list(dict.fromkeys(p for v in verdicts for p in v.problems))
    if nodes > 1 and all(v.ok for v in verdicts) and not any(v.inter_node_links for v in verdicts):
        failures.append(f"ranks run on {nodes} nodes but no rank logged a connection between nodes")
    if busbw_gbps < floor:
        failures.append(f"bus bandwidth {busbw_gbps:.2f} GB/s is under the floor of {floor:.2f} GB/s")
    common = dict(busbw_gbps=busbw_gbps, floor_gbps=floor, floor_source=source, nodes=nodes,
                  verdicts=tuple(verdicts))
    if failures:
        drain, advice = nodes_to_drain(verdicts)
        message = (
            f"transport gate failed (expect {cfg.expect}; ranks {placement}; transports {used}; {bw}):\n  "
            + "\n  ".join([*failures, advice])
        )
        return GateResult(applies=True, passed=False, message=message, drain=drain, **common)
    message = f"transport gate passed (expect {cfg.expect}; ranks {placement}; transports {used}; {bw})"
    return GateResult(applies=True, passed=True, message=message, **common)


def _read_when_connected(path: Path, *, wait_s: float, sleep: Callable[[float], None] = time.sleep) -> str:
    """The log's text once it holds connection lines, or whatever it holds after `wait_s`."""
    from workloads.transport import nccl_log

    deadline = time.monotonic() + wait_s
    while True:
        text = path.read_text(errors="replace") if path.is_file() else ""
        if nccl_log.parse_nccl_log(text).connections or time.monotonic() >= deadline:
            return text
        sleep(0.1)


def check_transport(
    cfg: GateConfig,
    *,
    ctx: "TrainContext",
    device: "torch.device",
    measure: Callable[..., float],
    log_path: Optional[Path],
    all_gather: Callable[[Any], list[Any]],
    hostname: str,
    host_id: Optional[str] = None,
    node: str = "",
    network: Optional[NodeNetwork] = None,
) -> GateResult:
    """The gate proper, with its collaborators passed in: `measure(device=, message_bytes=)` runs the
    all-reduces and returns bus GB/s (the same figure on every rank), `all_gather(obj)` returns every
    rank's obj in rank order; `network` is the nodes' EFA network where known. Raises
    TransportGateError on every rank when any rank fails."""
    message_bytes = message_bytes_for(cfg, network)
    busbw = measure(device=device, message_bytes=message_bytes)
    rank_hosts = dict(enumerate(all_gather(node_label(hostname, host_id=host_id))))
    host = rank_hosts[ctx.rank]
    if log_path is None:
        own = RankVerdict(
            rank=ctx.rank, host=host, ok=False, node=node,
            problems=(f"rank {ctx.rank} on {host}: NCCL_DEBUG_FILE is not set, so its NCCL log cannot be "
                      "read (the launcher must set workloads.transport.gate.nccl_log_env)",),
        )
    else:
        text = _read_when_connected(log_path, wait_s=cfg.log_wait_s)
        own = judge_rank(cfg, rank=ctx.rank, host=host, log_text=text, rank_hosts=rank_hosts, log_file=str(log_path),
                         node=node)
    result = combine_verdicts(cfg, verdicts=list(all_gather(own)), busbw_gbps=busbw, message_bytes=message_bytes,
                              network=network)
    if not result.passed:
        raise TransportGateError(result.message)
    return result


def run_transport_gate(cfg: GateConfig, *, ctx: "TrainContext", device: "torch.device") -> GateResult:
    """Run the gate on every rank; raises TransportGateError on all ranks together when it fails.

    Call once the default process group exists and before the first training step, with `device`
    this rank's current CUDA device (all_gather_object over NCCL stages objects on it).
    """
    import torch.distributed as dist

    from workloads.transport.bandwidth import measure_busbw

    if not cfg.enabled:
        return GateResult(applies=False, passed=True, message="transport gate disabled by config")
    backend = dist.get_backend()
    if backend != "nccl":
        return GateResult(
            applies=False, passed=True,
            message=not_nccl_message(backend),
        )
    if ctx.world_size < 2:
        return GateResult(applies=False, passed=True,
                          message="transport gate does not apply to a single rank (NCCL makes no connections)")
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    hostname = socket.gethostname()
    log_path = resolve_debug_file(pattern, hostname=hostname, pid=os.getpid()) if pattern else None

    def all_gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return check_transport(
        cfg, ctx=ctx, device=device, measure=measure_busbw, log_path=log_path,
        all_gather=all_gather, hostname=hostname, host_id=os.environ.get("NCCL_HOSTID"),
        node=os.environ.get(NODE_NAME_ENV, ""), network=NodeNetwork.from_env(os.environ),
    )

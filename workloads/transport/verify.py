"""Which transport did NCCL really use between ranks? Parse NCCL debug output, then judge it.

`parse_nccl_log` turns NCCL_DEBUG=INFO output (plain, or as Ray prints worker logs: with a
"(RayTrainWorker pid=..., ip=...)" prefix and "[repeated Nx across cluster]" folding) into the
communicator ranks and the connections NCCL made. It is pure and never raises on any text.

`decide` judges those connections: between nodes the expected network (EFA through aws-ofi-nccl,
which names itself "Libfabric", formerly "AWS Libfabric"), within a node P2P, SHM or NVLS. NCCL
initializes a network plugin even when no traffic uses it, so lines such as "Using network Socket"
prove nothing; only connection lines count.

`python -m workloads verify-transport LOG... [--expect efa|any] [--nodes N] [--json]` exits 0 when
every connection is acceptable, 1 when some is not, 2 on bad input, 3 when the logs cannot tell.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Optional

Expect = Literal["efa", "any"]

# aws-ofi-nccl's plugin name as NCCL prints it in "via NET/<name>/..." across its releases.
EFA_PLUGIN_NAMES = frozenset({"libfabric", "aws libfabric", "ofi"})

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAY_PREFIX = re.compile(r"^\s*\((?P<actor>[^()]*?)\bpid=(?P<pid>\d+)(?:,\s*ip=(?P<ip>[^)\s]+))?\)\s*")
# Ray appends a one-time hint ("(Ray deduplicates logs by default. ...)") after the first fold.
_RAY_FOLD = re.compile(r"\s*\[repeated (?P<count>\d+)x across cluster\]")
_NCCL_PREFIX = re.compile(
    r"(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL (?P<level>INFO|WARN|TRACE) (?P<msg>.*)$"
)
_COMM = re.compile(
    r"\bcomm (?P<ptr>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<dev>\d+)"
    r"(?:.*?\bcommId (?P<comm_id>0x[0-9a-fA-F]+))?"
)
_CHANNEL = re.compile(
    r"^Channel (?P<channel>\d+)(?:/(?P<conn>\d+))? : (?P<src>\d+)\[[0-9a-fA-Fx]+\] -> "
    r"(?P<dst>\d+)\[[0-9a-fA-Fx]+\](?: \[(?P<dir>send|receive)\])? via (?P<via>.+?)\s*$"
)
_COLLNET = re.compile(
    r"^Coll(?:Net)? (?P<channel>\d+)(?:/(?P<conn>\d+))? : (?P<rank>\d+) \[(?P<dir>send|receive)\] via (?P<via>.+?)\s*$"
)
_NVLS = re.compile(r"^NVLS comm 0x[0-9a-fA-F]+ headRank (?P<head>-?\d+)")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (?P<provider>[^\s,(]+)")


class Kind(str, enum.Enum):
    P2P = "P2P"
    SHM = "SHM"
    NVLS = "NVLS"
    NET = "NET"
    COLLNET = "COLLNET"
    OTHER = "OTHER"


@dataclass(frozen=True)
class Transport:
    kind: Kind
    name: str
    """Normalized: device index and proxy rank dropped, e.g. "P2P/CUMEM/read", "NET/Libfabric"."""
    plugin: str = ""
    """For NET/COLLNET: the plugin's name as NCCL printed it ("Socket", "IB", "Libfabric", ...)."""
    gdr: bool = False
    """GPUDirect RDMA (the NIC reads and writes GPU memory directly)."""

    @property
    def is_efa(self) -> bool:
        return self.kind in (Kind.NET, Kind.COLLNET) and self.plugin.strip().lower() in EFA_PLUGIN_NAMES

    @property
    def is_network(self) -> bool:
        return self.kind in (Kind.NET, Kind.COLLNET)

    @property
    def is_intra_node(self) -> bool:
        return self.kind in (Kind.P2P, Kind.SHM, Kind.NVLS)


@dataclass(frozen=True)
class RankInfo:
    """A "comm 0x.. rank R nranks N cudaDev D ..." line: process host:pid is rank R of a communicator."""

    host: str
    pid: int
    rank: int
    nranks: int
    comm: str
    """The commId shared by all ranks of the communicator, or "nranks=N" when NCCL does not print it."""


@dataclass(frozen=True)
class Connection:
    """One "Channel ... via ..." line: NCCL connected `src` to `dst` (ranks of `comm`) over `transport`."""

    src: int
    dst: Optional[int]
    """None for CollNet and NVLS, which connect a rank to the switch rather than to a peer."""
    transport: Transport
    host: str
    """Host of the process that printed the line."""
    pid: int
    channel: int
    direction: str = ""
    """"send", "receive", or "" (P2P/SHM lines name no direction)."""
    comm: Optional[str] = None
    line: int = 0


@dataclass(frozen=True)
class NcclLog:
    ranks: tuple[RankInfo, ...] = ()
    connections: tuple[Connection, ...] = ()
    ofi_providers: tuple[tuple[str, int, str], ...] = ()
    """(host, pid, provider) from aws-ofi-nccl's "Selected provider is ..." lines."""
    folded_connection_lines: int = 0
    """Connection lines Ray's log deduplication hid behind "[repeated Nx across cluster]"."""
    nccl_lines: int = 0

    def merged(self, other: "NcclLog") -> "NcclLog":
        return NcclLog(
            ranks=self.ranks + other.ranks,
            connections=self.connections + other.connections,
            ofi_providers=self.ofi_providers + other.ofi_providers,
            folded_connection_lines=self.folded_connection_lines + other.folded_connection_lines,
            nccl_lines=self.nccl_lines + other.nccl_lines,
        )


def parse_transport(via: str) -> Transport:
    """"NET/AWS Libfabric/0(1)/GDRDMA" -> Transport(NET, "NET/AWS Libfabric", "AWS Libfabric", gdr=True)."""
    parts = [p.strip() for p in via.split("/")]
    head = parts[0].upper()
    if head in ("NET", "COLLNET") and len(parts) >= 2:
        kind = Kind.NET if head == "NET" else Kind.COLLNET
        return Transport(kind, f"{head}/{parts[1]}", plugin=parts[1], gdr="GDRDMA" in parts[2:])
    if head == "P2P":
        # "P2P/indirect/3[3]" names the intermediate GPU; "P2P/direct pointer" has a space.
        kept = [p for p in parts[1:] if p and not re.fullmatch(r"\d+\[[0-9a-fA-Fx]+\]", p)]
        return Transport(Kind.P2P, "/".join(["P2P", *kept]))
    if head == "SHM":
        return Transport(Kind.SHM, "/".join(["SHM", *parts[1:]]))
    if head == "NVLS":
        return Transport(Kind.NVLS, "NVLS")
    return Transport(Kind.OTHER, via.strip())


@dataclass
class _ParseState:
    ranks: list[RankInfo] = field(default_factory=list)
    connections: list[Connection] = field(default_factory=list)
    providers: list[tuple[str, int, str]] = field(default_factory=list)
    current_comm: dict[tuple[str, int], RankInfo] = field(default_factory=dict)
    folded: int = 0
    nccl_lines: int = 0


def parse_nccl_log(text: str) -> NcclLog:
    """Parse NCCL debug output; unrelated lines are ignored and no input makes it raise."""
    state = _ParseState()
    for number, raw in enumerate(text.splitlines(), start=1):
        _parse_line(raw, number, state)
    return NcclLog(
        ranks=tuple(state.ranks),
        connections=tuple(state.connections),
        ofi_providers=tuple(state.providers),
        folded_connection_lines=state.folded,
        nccl_lines=state.nccl_lines,
    )


def _parse_line(raw: str, number: int, state: _ParseState) -> None:
    line = _ANSI.sub("", raw)
    line = _RAY_PREFIX.sub("", line, count=1)
    repeats = 1
    fold = _RAY_FOLD.search(line)
    if fold:
        repeats = int(fold["count"])
        line = line[: fold.start()]
    m = _NCCL_PREFIX.search(line)
    if not m:
        return
    state.nccl_lines += 1
    host, pid, msg = m["host"], int(m["pid"]), m["msg"].strip()
    comm = _COMM.search(msg)
    if comm:
        info = RankInfo(
            host=host, pid=pid, rank=int(comm["rank"]), nranks=int(comm["nranks"]),
            comm=comm["comm_id"] or f"nranks={comm['nranks']}",
        )
        known = state.current_comm.get((host, pid))
        # Init START, Init COMPLETE and Destroy lines repeat the same rank; keep one.
        if known is None or (known.comm, known.rank) != (info.comm, info.rank):
            state.ranks.append(info)
        state.current_comm[(host, pid)] = info
        return
    provider = _OFI_PROVIDER.search(msg)
    if provider:
        state.providers.append((host, pid, provider["provider"]))
        return
    conn = _connection(msg, host=host, pid=pid, number=number, state=state)
    if conn is not None:
        state.connections.append(conn)
        # Ray prints one line for N alike ones; words with digits (ranks, "P2P", "NET/x/0") are
        # ignored when it compares, so the hidden lines may have used other transports.
        state.folded += repeats - 1


def _connection(msg: str, *, host: str, pid: int, number: int, state: _ParseState) -> Optional[Connection]:
    comm = state.current_comm.get((host, pid))
    comm_key = comm.comm if comm else None
    m = _CHANNEL.match(msg)
    if m:
        return Connection(
            src=int(m["src"]), dst=int(m["dst"]), transport=parse_transport(m["via"]), host=host, pid=pid,
            channel=int(m["channel"]), direction=m["dir"] or "", comm=comm_key, line=number,
        )
    m = _COLLNET.match(msg)
    if m:
        return Connection(
            src=int(m["rank"]), dst=None, transport=parse_transport(m["via"]), host=host, pid=pid,
            channel=int(m["channel"]), direction=m["dir"], comm=comm_key, line=number,
        )
    m = _NVLS.match(msg)
    if m and comm is not None:
        return Connection(
            src=comm.rank, dst=None, transport=Transport(Kind.NVLS, "NVLS"), host=host, pid=pid,
            channel=0, comm=comm_key, line=number,
        )
    return None


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"

    @property
    def exit_code(self) -> int:
        return {Status.PASS: 0, Status.FAIL: 1, Status.INCONCLUSIVE: 3}[self]


@dataclass(frozen=True)
class Link:
    """All connections between two ranks of one communicator in one direction (dst None: to a switch)."""

    comm: Optional[str]
    src: int
    dst: Optional[int]
    src_host: Optional[str]
    dst_host: Optional[str]
    scope: Literal["intra", "inter", "unknown"]
    transports: tuple[str, ...]
    channels: int
    ok: bool
    problem: str = ""


@dataclass(frozen=True)
class Verdict:
    status: Status
    summary: str
    problems: tuple[str, ...] = ()
    """Proven wrong connections (status FAIL)."""
    gaps: tuple[str, ...] = ()
    """What the logs do not show that a pass would need (status INCONCLUSIVE unless FAIL)."""
    links: tuple[Link, ...] = ()
    hosts: tuple[str, ...] = ()
    expect: str = "efa"
    nodes: Optional[int] = None

    def to_json(self) -> dict:
        data = asdict(self)
        data["status"] = self.status.value
        data["exit_code"] = self.status.exit_code
        return data


def _rank_hosts(log: NcclLog) -> dict[Optional[str], dict[int, str]]:
    by_comm: dict[Optional[str], dict[int, str]] = defaultdict(dict)
    for info in log.ranks:
        by_comm[info.comm].setdefault(info.rank, info.host)
    for conn in log.connections:
        reporter = conn.dst if conn.direction == "receive" else conn.src
        if reporter is not None:
            by_comm[conn.comm].setdefault(reporter, conn.host)
    return by_comm


def _judge(transport: Transport, scope: str, *, expect: Expect, provider: Optional[str]) -> str:
    """Why `transport` is wrong for a link of `scope`, or "" when it is acceptable."""
    if scope == "unknown":
        # A peer on an unknown host: P2P/SHM/NVLS cannot leave a node, and a network link is
        # judged as the inter-node link NCCL uses a network for.
        scope = "intra" if transport.is_intra_node else "inter"
    if scope == "intra":
        if transport.is_intra_node:
            return ""
        return f"{transport.name} within a node (expected P2P, SHM or NVLS)"
    if not transport.is_network:
        return f"{transport.name} between nodes (expected a network transport)"
    if expect == "any":
        return ""
    if not transport.is_efa:
        return f"{transport.name} between nodes (expected EFA: NET/Libfabric through aws-ofi-nccl)"
    if provider is not None and provider.lower() != "efa":
        return f"{transport.name} with libfabric provider {provider!r} between nodes (expected provider 'efa')"
    return ""


def decide(
    log: NcclLog,
    *,
    expect: Expect = "efa",
    nodes: Optional[int] = None,
    rank_hosts: Optional[dict[int, str]] = None,
) -> Verdict:
    """Judge every connection in `log`.

    `nodes`, when given, is the node count the job ran on: more hosts in the logs fails, and fewer,
    or no connection between nodes when nodes > 1, is inconclusive (logs missing, nothing proven
    wrong). `rank_hosts` supplies hosts for ranks the log does not place (a single rank's own log).
    A link to a rank on an unknown host is judged by its transport: P2P/SHM/NVLS as within a node,
    a network as between nodes.
    """
    hosts_by_comm = _rank_hosts(log)
    if rank_hosts:
        # rank_hosts numbers ranks of the world; a sub-communicator's ranks are numbered apart.
        world_comms = {i.comm for i in log.ranks if i.nranks == len(rank_hosts)} | {None}
        for comm in world_comms:
            hosts_by_comm[comm] = {**rank_hosts, **hosts_by_comm.get(comm, {})}
    providers = {(h, p): prov for h, p, prov in log.ofi_providers}
    grouped: dict[tuple, list[Connection]] = defaultdict(list)
    for conn in log.connections:
        # A rank's NVLS (NVLink switch) and CollNet (network switch) links are distinct links.
        switch = conn.transport.kind.value if conn.dst is None else ""
        grouped[(str(conn.comm), conn.src, -1 if conn.dst is None else conn.dst, switch)].append(conn)

    links: list[Link] = []
    for (_, src, _, _), conns in sorted(grouped.items()):
        comm, dst = conns[0].comm, conns[0].dst
        known = hosts_by_comm.get(comm, {})
        src_host = known.get(src)
        dst_host = None if dst is None else known.get(dst)
        if dst is None:
            scope = "intra" if all(c.transport.is_intra_node for c in conns) else "inter"
        elif src_host and dst_host:
            scope = "intra" if src_host == dst_host else "inter"
        else:
            scope = "unknown"
        reasons = sorted({
            reason
            for c in conns
            if (reason := _judge(c.transport, scope, expect=expect, provider=providers.get((c.host, c.pid))))
        })
        links.append(Link(
            comm=comm, src=src, dst=dst, src_host=src_host, dst_host=dst_host, scope=scope,
            transports=tuple(sorted({c.transport.name + ("/GDRDMA" if c.transport.gdr else "") for c in conns})),
            channels=len({(c.channel, c.direction) for c in conns}), ok=not reasons, problem="; ".join(reasons),
        ))

    hosts = sorted({h for m in hosts_by_comm.values() for h in m.values()})
    problems = [f"{_describe(link)}: {link.problem}" for link in links if not link.ok]
    gaps: list[str] = []
    if not log.connections:
        gaps.append(
            "no NCCL connection lines (\"Channel ... via ...\"): run with NCCL_DEBUG=INFO and "
            "NCCL_DEBUG_SUBSYS including INIT, and keep the output of at least one collective"
        )
    if log.folded_connection_lines:
        gaps.append(
            f"Ray folded {log.folded_connection_lines} connection line(s) into \"[repeated Nx across cluster]\", "
            "hiding their transports: set RAY_DEDUP_LOGS=0 or check the per-rank NCCL_DEBUG_FILE logs"
        )
    inter = [link for link in links if link.scope == "inter"]
    if nodes is not None and log.connections:
        if len(hosts) > nodes:
            problems.append(f"expected {nodes} node(s), ranks ran on {len(hosts)}: {', '.join(hosts)}")
        elif nodes > 1 and not inter:
            gaps.append(
                f"expected {nodes} nodes but no connection between nodes is in the logs "
                f"(hosts seen: {', '.join(hosts) or 'none'}): pass the logs of every node"
            )
        elif len(hosts) < nodes:
            gaps.append(f"expected {nodes} nodes, the logs show {len(hosts)}: {', '.join(hosts)}")

    status = Status.FAIL if problems else Status.INCONCLUSIVE if gaps else Status.PASS
    return Verdict(
        status=status, summary=_summary(links, hosts), problems=tuple(problems), gaps=tuple(gaps),
        links=tuple(links), hosts=tuple(hosts), expect=expect, nodes=nodes,
    )


def _describe(link: Link) -> str:
    src = f"rank {link.src} ({link.src_host or 'host unknown'})"
    if link.dst is None:
        return f"{src} -> switch"
    return f"{src} -> rank {link.dst} ({link.dst_host or 'host unknown'})"


def _summary(links: list[Link], hosts: list[str]) -> str:
    if not links:
        return "no connections"
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for link in links:
        for name in link.transports:
            counts[(link.scope, name)] += 1
    scope_words = {"intra": "within a node", "inter": "between nodes", "unknown": "peer host unknown"}
    parts = [f"{n} link(s) {scope_words[scope]} over {name}" for (scope, name), n in sorted(counts.items())]
    return f"{len(links)} rank-to-rank link(s) on {len(hosts)} host(s): " + "; ".join(parts)


def render(verdict: Verdict) -> str:
    expect = "EFA between nodes" if verdict.expect == "efa" else "any network between nodes"
    lines = [f"{verdict.status.value.upper()}: {verdict.summary} (expected {expect}, P2P/SHM/NVLS within a node)"]
    lines += [f"  wrong transport: {p}" for p in verdict.problems]
    lines += [f"  cannot tell: {g}" for g in verdict.gaps]
    return "\n".join(lines)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _arg_parser(command: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=f"python -m workloads {command}",
        description="Check NCCL debug logs: did every connection between ranks use the expected transport? "
        "Exit 0 yes, 1 no, 2 bad input, 3 the logs cannot tell.",
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="NCCL_DEBUG=INFO output; '-' reads stdin")
    parser.add_argument("--expect", choices=("efa", "any"), default="efa",
                        help="network required between nodes (default: efa)")
    parser.add_argument("--nodes", type=_positive_int, help="node count the job ran on, cross-checked with the logs")
    parser.add_argument("--json", action="store_true", help="print a machine-readable report")
    return parser


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return number


def _read(paths: Iterable[str]) -> str:
    texts = []
    for name in paths:
        if name == "-":
            texts.append(sys.stdin.read())
            continue
        try:
            texts.append(Path(name).read_text(errors="replace"))
        except OSError as err:
            raise _UsageError(f"cannot read {name}: {err.strerror or err}") from None
    return "\n".join(texts)


def verify_transport(text: str, *, expect: Expect = "efa", nodes: Optional[int] = None) -> Verdict:
    """Parse and judge NCCL debug output in one call (what the CLI and the submitter's check run)."""
    return decide(parse_nccl_log(text), expect=expect, nodes=nodes)


def main(command: str, argv: list[str]) -> int:
    try:
        args = _arg_parser(command).parse_args(argv)
        text = _read(args.logs)
    except _UsageError as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
    verdict = verify_transport(text, expect=args.expect, nodes=args.nodes)
    print(json.dumps(verdict.to_json(), indent=2) if args.json else render(verdict))
    return verdict.status.exit_code

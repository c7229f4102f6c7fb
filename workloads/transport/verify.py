"""Which transport did NCCL really use between ranks? Judge the connections of parsed NCCL logs.

`decide` judges the connections that workloads/transport/nccl_log.py parsed: between nodes the
expected network (EFA: aws-ofi-nccl, which names itself "Libfabric", formerly "AWS Libfabric", on
libfabric's `efa` provider), within a node P2P, SHM or NVLS. NCCL initializes a network plugin even
when no traffic uses it, so lines such as "Using network Socket" prove nothing; only connection
lines count. Whether two ranks share a node is read as NCCL reports it (its nNodes/localRanks
lines), and from host names only where the log lacks those.

`python -m workloads verify-transport LOG... [--expect efa|any] [--nodes N] [--json]` exits 0 when
every connection is acceptable, 1 when some is not, 2 on bad input, 3 when the logs cannot tell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Optional

from workloads.transport.nccl_log import Connection, Kind, NcclLog, Transport, parse_nccl_log
from workloads.transport.verdict import NOT_NCCL_RE, Status

Expect = Literal["efa", "any"]


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
    """The node count the caller expected (--nodes)."""
    nodes_seen: Optional[int] = None
    """Nodes in the logs: NCCL's own count (nNodes) where it printed one, else distinct host names."""

    def to_json(self) -> dict:
        data = asdict(self)
        data["status"] = self.status.value
        data["exit_code"] = self.status.exit_code
        return data


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one communicator ran, as far as its logs tell."""

    hosts: dict[int, str]
    """Rank -> the host name its lines carry, or the node label a caller supplied."""
    nnodes: Optional[int] = None
    """Nodes as NCCL counted them; None when the log has no topology line, or when the environment
    turned off P2P/SHM (NCCL's count then splits machines: see workloads/transport/nccl_log.py)."""
    nranks: Optional[int] = None
    local_ranks: dict[int, int] = field(default_factory=dict)
    """Rank -> how many ranks of the communicator NCCL placed on that rank's node."""
    labels_given: bool = False
    """`hosts` came from the caller, who knows each rank's node: they alone decide."""
    host_names_agree: bool = True
    """False when host names contradict NCCL's topology (two nodes under one name, say)."""

    def scope(self, src: int, dst: int) -> Literal["intra", "inter", "unknown"]:
        src_host, dst_host = self.hosts.get(src), self.hosts.get(dst)
        by_name = "intra" if src_host == dst_host else "inter"
        if self.labels_given:
            return by_name if src_host and dst_host else "unknown"
        if self.nnodes == 1:
            return "intra"
        if self.nnodes is not None and (
            self.nnodes == self.nranks or self.local_ranks.get(src) == 1 or self.local_ranks.get(dst) == 1
        ):
            return "inter"  # a rank alone on its node: every peer is on another one
        if src_host and dst_host and self.host_names_agree:
            return by_name
        return "unknown"


def _host_names_agree(hosts: dict[int, str], *, nnodes: Optional[int], nranks: Optional[int],
                      local_ranks: dict[int, int]) -> bool:
    if nnodes is None:
        return True
    per_host: dict[str, int] = defaultdict(int)
    for host in hosts.values():
        per_host[host] += 1
    if any(per_host[hosts[rank]] > count for rank, count in local_ranks.items() if rank in hosts):
        return False  # more ranks under one name than NCCL put on that rank's node
    return not (nranks is not None and len(hosts) == nranks and len(per_host) != nnodes)


def placements(log: NcclLog, *, rank_hosts: Optional[dict[int, str]] = None) -> dict[Optional[str], Placement]:
    """Each communicator's placement. `rank_hosts` (world rank -> node label) decides for the
    communicators as wide as it: a caller that knows each rank's node (the in-band gate gathers
    `NCCL_HOSTID`-aware labels) is more precise than a log line's host name or NCCL's counts."""
    hosts: dict[Optional[str], dict[int, str]] = defaultdict(dict)
    for info in log.ranks:
        hosts[info.comm].setdefault(info.rank, info.host)
    for topo in log.topology:
        hosts[topo.comm].setdefault(topo.rank, topo.host)
    for conn in log.connections:
        reporter = conn.dst if conn.direction == "receive" else conn.src
        if reporter is not None:
            hosts[conn.comm].setdefault(reporter, conn.host)
    labelled: set[Optional[str]] = set()
    if rank_hosts:
        # rank_hosts numbers ranks of the world; a sub-communicator's ranks are numbered apart.
        widths = {i.comm: i.nranks for i in log.ranks} | {t.comm: t.nranks for t in log.topology}
        labelled = {c for c, width in widths.items() if width == len(rank_hosts)} | {None}
        for comm in labelled:
            hosts[comm] = {**hosts.get(comm, {}), **rank_hosts}
    split = {(h, p) for h, p, _ in log.intra_node_disabled}
    result: dict[Optional[str], Placement] = {}
    for comm in set(hosts) | {t.comm for t in log.topology}:
        topo = [t for t in log.topology if t.comm == comm]
        trusted = topo and not any((t.host, t.pid) in split for t in topo)
        nnodes = max(t.nnodes for t in topo) if trusted else None
        nranks = max(t.nranks for t in topo) if topo else None
        local_ranks = {t.rank: t.local_ranks for t in topo} if trusted else {}
        comm_hosts = dict(hosts.get(comm, {}))
        result[comm] = Placement(
            hosts=comm_hosts, nnodes=nnodes, nranks=nranks, local_ranks=local_ranks, labels_given=comm in labelled,
            host_names_agree=_host_names_agree(comm_hosts, nnodes=nnodes, nranks=nranks, local_ranks=local_ranks),
        )
    return result


def _judge(transport: Transport, scope: str, *, expect: Expect, provider: Optional[str]) -> tuple[str, str]:
    """(why `transport` is wrong for a link of `scope`, what the log lacks to judge it); "" for neither."""
    if transport.kind is Kind.OTHER:
        return "", f"transport {transport.name!r} is none NCCL names (a cut or interleaved line?)"
    if scope == "unknown":
        # A peer NCCL's lines do not place: P2P/SHM/NVLS cannot leave a node, and a network link
        # is judged as the inter-node link NCCL uses a network for.
        scope = "intra" if transport.is_intra_node else "inter"
    if scope == "intra":
        if transport.is_intra_node:
            return "", ""
        return f"{transport.name} within a node (expected P2P, SHM or NVLS)", ""
    if not transport.is_network:
        return f"{transport.name} between nodes (expected a network transport)", ""
    if expect == "any":
        return "", ""
    if not transport.is_efa_plugin:
        return f"{transport.name} between nodes (expected EFA: NET/Libfabric through aws-ofi-nccl)", ""
    if provider is None:
        # aws-ofi-nccl runs on other libfabric providers too (cxi on Slingshot, tcp, ...).
        return "", (f"{transport.name} between nodes, but no \"NET/OFI Selected provider is ...\" line says "
                    "which libfabric provider carried it (keep NCCL_DEBUG_SUBSYS=INIT,NET)")
    if provider.lower() != "efa":
        return f"{transport.name} with libfabric provider {provider!r} between nodes (expected provider 'efa')", ""
    return "", ""


def _covered_nodes(log: NcclLog, widest: Optional[str], placement: Optional[Placement]) -> Optional[int]:
    """Nodes whose ranks' own lines are in the log (a node counts when all its ranks printed)."""
    if placement is None or placement.nnodes is None:
        return None
    printed = {t.rank for t in log.topology if t.comm == widest}
    return int(sum(1 / placement.local_ranks[rank] for rank in printed) + 1e-9)


def decide(
    log: NcclLog,
    *,
    expect: Expect = "efa",
    nodes: Optional[int] = None,
    rank_hosts: Optional[dict[int, str]] = None,
) -> Verdict:
    """Judge every connection in `log`.

    A link is within or between nodes as NCCL's topology lines place its ranks, else as their host
    names do. `nodes`, when given, is the node count the job ran on: more nodes in the logs fails,
    and fewer, missing nodes' logs, or no connection between nodes when nodes > 1 is inconclusive
    (nothing proven wrong). `rank_hosts` supplies hosts for ranks the log does not place (a single
    rank's own log). A link NCCL's lines do not place is judged by its transport: P2P/SHM/NVLS as
    within a node, a network as between nodes.
    """
    placed = placements(log, rank_hosts=rank_hosts)
    providers = {(h, p): prov for h, p, prov in log.ofi_providers}
    grouped: dict[tuple, list[Connection]] = defaultdict(list)
    for conn in log.connections:
        # A rank's NVLS (NVLink switch) and CollNet (network switch) links are distinct links.
        switch = conn.transport.kind.value if conn.dst is None else ""
        grouped[(str(conn.comm), conn.src, -1 if conn.dst is None else conn.dst, switch)].append(conn)

    links: list[Link] = []
    gaps: list[str] = []
    for (_, src, _, _), conns in sorted(grouped.items()):
        comm, dst = conns[0].comm, conns[0].dst
        placement = placed.get(comm) or Placement(hosts={})
        src_host = placement.hosts.get(src)
        dst_host = None if dst is None else placement.hosts.get(dst)
        if dst is None:
            scope = "intra" if all(c.transport.is_intra_node for c in conns) else "inter"
        else:
            scope = placement.scope(src, dst)
        judged = [_judge(c.transport, scope, expect=expect, provider=providers.get((c.host, c.pid)))
                  for c in conns]
        reasons = sorted({reason for reason, _ in judged if reason})
        link = Link(
            comm=comm, src=src, dst=dst, src_host=src_host, dst_host=dst_host, scope=scope,
            transports=tuple(sorted({c.transport.name + ("/GDRDMA" if c.transport.gdr else "") for c in conns})),
            channels=len({(c.channel, c.direction) for c in conns}), ok=not reasons, problem="; ".join(reasons),
        )
        links.append(link)
        gaps += [f"{_describe(link)}: {gap}" for gap in sorted({gap for _, gap in judged if gap})]

    hosts = sorted({h for p in placed.values() for h in p.hosts.values()})
    widest = max(placed, key=lambda c: (placed[c].nranks or 0, str(c)), default=None)
    nccl_nodes = max((p.nnodes for p in placed.values() if p.nnodes is not None), default=None)
    nodes_seen = nccl_nodes if nccl_nodes is not None else len(hosts)
    problems = [f"{_describe(link)}: {link.problem}" for link in links if not link.ok]
    general: list[str] = []
    if not log.connections:
        general.append(
            "no NCCL connection lines (\"Channel ... via ...\"): run with NCCL_DEBUG=INFO and "
            "NCCL_DEBUG_SUBSYS including INIT, and keep the output of at least one collective"
        )
    if log.folded_connection_lines:
        general.append(
            f"Ray folded {log.folded_connection_lines} connection line(s) into \"[repeated Nx across cluster]\", "
            "hiding their transports: set RAY_DEDUP_LOGS=0 or check the per-rank NCCL_DEBUG_FILE logs"
        )
    gaps = general + gaps
    inter = [link for link in links if link.scope == "inter"]
    where = _nodes_text(nodes_seen, hosts=hosts, from_nccl=nccl_nodes is not None)
    if nodes is not None and log.connections:
        covered = _covered_nodes(log, widest, placed.get(widest))
        if nodes_seen > nodes:
            problems.append(f"expected {nodes} node(s), ranks ran on {where}")
        elif nodes > 1 and not inter:
            gaps.append(
                f"expected {nodes} nodes but no connection between nodes is in the logs "
                f"(ranks on {where}): pass the logs of every node"
            )
        elif nodes_seen < nodes:
            gaps.append(f"expected {nodes} nodes, the logs show {where}")
        elif covered is not None and covered < nodes:
            gaps.append(f"the logs hold the lines of every rank of {covered} of the {nodes} nodes: "
                        "pass the logs of every node")

    status = Status.FAIL if problems else Status.INCONCLUSIVE if gaps else Status.PASS
    return Verdict(
        status=status, summary=_summary(links, where), problems=tuple(problems), gaps=tuple(gaps),
        links=tuple(links), hosts=tuple(hosts), expect=expect, nodes=nodes, nodes_seen=nodes_seen,
    )


def _nodes_text(nodes: int, *, hosts: list[str], from_nccl: bool) -> str:
    """"2 node(s) (vm)" when NCCL counted them, "2 host(s) (a, b)" when only host names tell."""
    return f"{nodes} {'node' if from_nccl else 'host'}(s) ({', '.join(hosts) or 'no host name'})"


def _describe(link: Link) -> str:
    src = f"rank {link.src} ({link.src_host or 'host unknown'})"
    if link.dst is None:
        return f"{src} -> switch"
    return f"{src} -> rank {link.dst} ({link.dst_host or 'host unknown'})"


def _summary(links: list[Link], where: str) -> str:
    if not links:
        return "no connections"
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for link in links:
        for name in link.transports:
            counts[(link.scope, name)] += 1
    scope_words = {"intra": "within a node", "inter": "between nodes", "unknown": "peer host unknown"}
    parts = [f"{n} link(s) {scope_words[scope]} over {name}" for (scope, name), n in sorted(counts.items())]
    return f"{len(links)} rank-to-rank link(s) on {where}; " + "; ".join(parts)


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
    """Parse and judge NCCL debug output in one call (what the CLI and the submitter's check run).
    The log of a job whose ranks talked over another backend (gloo: `make demo`, CPU workers) has no
    NCCL connection to judge, and the verdict says so rather than asking for NCCL_DEBUG."""
    log = parse_nccl_log(text)
    verdict = decide(log, expect=expect, nodes=nodes)
    other = NOT_NCCL_RE.search(text)
    if log.connections or other is None:
        return verdict
    backend = other.group(1)
    return dataclasses.replace(verdict, summary=f"not an NCCL run: the ranks talked over {backend}", gaps=(
        f"the job's transport gate says its ranks used the {backend} backend (CPU workers), so NCCL made no "
        "connection to check: verify-transport judges the logs of GPU jobs",))


def main(command: str, argv: list[str]) -> int:
    try:
        args = _arg_parser(command).parse_args(argv)
        text = _read(args.logs)
    except _UsageError as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
    verdict = verify_transport(text, expect=args.expect, nodes=args.nodes)
    try:
        print(json.dumps(verdict.to_json(), indent=2) if args.json else render(verdict), flush=True)
    except BrokenPipeError:
        # The reader left early (`| head`), as a pager or head does: the rest is not wanted. Later
        # writes, and the interpreter's own flush at exit, go nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return verdict.status.exit_code

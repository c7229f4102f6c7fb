"""The NCCL log parser and the transport decision, on real captures and on synthetic logs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads.transport.nccl_log import Kind, parse_nccl_log, parse_transport
from workloads.transport.verify import Status, decide

SYNTHETIC = Path(__file__).parent / "fixtures" / "nccl_synthetic"


def real_log(shared_dir: Path, name: str) -> str:
    return (shared_dir / "fixtures" / "nccl" / name).read_text()


def synthetic(name: str) -> str:
    return (SYNTHETIC / name).read_text()


def test_real_p2p_log_maps_pids_to_ranks_and_finds_p2p(shared_dir):
    log = parse_nccl_log(real_log(shared_dir, "h200x2-single-node-p2p.log"))
    assert {(r.host, r.pid, r.rank, r.nranks) for r in log.ranks} == {("vm", 671, 0, 2), ("vm", 672, 1, 2)}
    assert {c.transport.name for c in log.connections} == {"P2P/CUMEM"}
    assert {(c.src, c.dst) for c in log.connections} == {(0, 1), (1, 0)}
    # 24 channels each way, each line printed by the sending rank.
    assert len(log.connections) == 48
    assert all(c.comm == "0x8e03ac664b20d7da" for c in log.connections)


@pytest.mark.parametrize("nodes", [None, 1])
def test_real_p2p_log_passes_under_expect_efa(shared_dir, nodes):
    verdict = decide(parse_nccl_log(real_log(shared_dir, "h200x2-single-node-p2p.log")), expect="efa", nodes=nodes)
    assert verdict.status is Status.PASS
    assert [(link.src, link.dst, link.scope, link.transports) for link in verdict.links] == [
        (0, 1, "intra", ("P2P/CUMEM",)),
        (1, 0, "intra", ("P2P/CUMEM",)),
    ]


def test_real_p2p_log_with_two_nodes_expected_is_inconclusive(shared_dir):
    """Logs of one node cannot prove what crossed between nodes: nothing is wrong, something is missing."""
    verdict = decide(parse_nccl_log(real_log(shared_dir, "h200x2-single-node-p2p.log")), expect="efa", nodes=2)
    assert verdict.status is Status.INCONCLUSIVE
    assert "expected 2 nodes but no connection between nodes" in verdict.gaps[0]


@pytest.mark.parametrize("expect", ["efa", "any"])
def test_real_forced_socket_log_fails_within_a_node(shared_dir, expect):
    log = parse_nccl_log(real_log(shared_dir, "h200x2-forced-socket.log"))
    directions = {(c.src, c.dst, c.direction) for c in log.connections}
    assert directions == {(0, 1, "send"), (0, 1, "receive"), (1, 0, "send"), (1, 0, "receive")}
    verdict = decide(log, expect=expect, nodes=1)
    assert verdict.status is Status.FAIL
    assert verdict.problems == (
        "rank 0 (vm) -> rank 1 (vm): NET/Socket within a node (expected P2P, SHM or NVLS)",
        "rank 1 (vm) -> rank 0 (vm): NET/Socket within a node (expected P2P, SHM or NVLS)",
    )


def test_using_network_socket_alone_proves_nothing(shared_dir):
    text = "\n".join(
        line for line in real_log(shared_dir, "h200x2-forced-socket.log").splitlines() if " via " not in line
    )
    assert "Using network Socket" in text
    assert decide(parse_nccl_log(text)).status is Status.INCONCLUSIVE


@pytest.mark.parametrize(
    ("name", "expect", "status"),
    [
        ("efa-2x4-libfabric.log", "efa", Status.PASS),
        ("efa-2x4-aws-libfabric.log", "efa", Status.PASS),
        ("tcp-fallback-2x4.log", "efa", Status.FAIL),
        ("tcp-fallback-2x4.log", "any", Status.PASS),
        ("efa-2x4-one-socket-link.log", "efa", Status.FAIL),
        ("libfabric-tcp-provider-2x4.log", "efa", Status.FAIL),
        ("libfabric-tcp-provider-2x4.log", "any", Status.PASS),
        ("no-connections-2x4.log", "efa", Status.INCONCLUSIVE),
        ("ray-efa-2x4-nodedup.log", "efa", Status.PASS),
        ("ray-efa-2x4-folded.log", "efa", Status.INCONCLUSIVE),
    ],
)
def test_synthetic_logs(name, expect, status):
    assert decide(parse_nccl_log(synthetic(name)), expect=expect, nodes=2).status is status


def test_two_node_efa_log_places_ranks_on_hosts():
    verdict = decide(parse_nccl_log(synthetic("efa-2x4-libfabric.log")), expect="efa", nodes=2)
    assert verdict.hosts == ("ip-10-0-1-5", "ip-10-0-1-6")
    inter = [(link.src, link.dst, link.src_host, link.dst_host, link.transports) for link in verdict.links
             if link.scope == "inter"]
    assert inter == [
        (3, 4, "ip-10-0-1-5", "ip-10-0-1-6", ("NET/Libfabric/GDRDMA",)),
        (7, 0, "ip-10-0-1-6", "ip-10-0-1-5", ("NET/Libfabric/GDRDMA",)),
    ]
    assert sum(link.scope == "intra" for link in verdict.links) == 6


def test_one_bad_link_is_named_with_ranks_hosts_and_transport():
    verdict = decide(parse_nccl_log(synthetic("efa-2x4-one-socket-link.log")), expect="efa", nodes=2)
    assert verdict.problems == (
        "rank 7 (ip-10-0-1-6) -> rank 0 (ip-10-0-1-5): NET/Socket between nodes "
        "(expected EFA: NET/Libfabric through aws-ofi-nccl)",
    )


def test_libfabric_with_a_non_efa_provider_is_not_efa():
    verdict = decide(parse_nccl_log(synthetic("libfabric-tcp-provider-2x4.log")), expect="efa")
    assert all("provider 'tcp;ofi_rxm'" in p for p in verdict.problems) and len(verdict.problems) == 2


def test_ray_prefix_and_colors_are_stripped():
    log = parse_nccl_log(synthetic("ray-efa-2x4-nodedup.log"))
    assert len(log.ranks) == 8 and {r.host for r in log.ranks} == {"ip-10-0-1-5", "ip-10-0-1-6"}
    assert len(log.connections) == 20


def test_ray_folding_is_counted_and_named():
    log = parse_nccl_log(synthetic("ray-efa-2x4-folded.log"))
    assert log.folded_connection_lines == 2 + 22
    verdict = decide(log, expect="efa", nodes=2)
    assert "RAY_DEDUP_LOGS=0" in verdict.gaps[0]


def test_a_proven_bad_link_fails_even_when_lines_were_folded():
    text = synthetic("ray-efa-2x4-folded.log") + (
        "(RayTrainWorker pid=4110, ip=10.0.1.6) ip-10-0-1-6:4110:4110 [3] NCCL INFO "
        "Channel 01/0 : 7[3] -> 0[0] [send] via NET/Socket/0 [repeated 2x across cluster]\n"
    )
    assert decide(parse_nccl_log(text), expect="efa", nodes=2).status is Status.FAIL


def test_more_hosts_than_nodes_fails():
    verdict = decide(parse_nccl_log(synthetic("efa-2x4-libfabric.log")), expect="efa", nodes=1)
    assert verdict.status is Status.FAIL
    assert verdict.problems[-1] == "expected 1 node(s), ranks ran on 2 node(s) (ip-10-0-1-5, ip-10-0-1-6)"


def test_rank_hosts_place_peers_a_single_ranks_log_cannot():
    own = "\n".join(
        line for line in synthetic("tcp-fallback-2x4.log").splitlines() if line.startswith("ip-10-0-1-6:4107:")
    )
    hosts = {r: "ip-10-0-1-5" if r < 4 else "ip-10-0-1-6" for r in range(8)}
    unplaced = decide(parse_nccl_log(own), expect="efa")
    placed = decide(parse_nccl_log(own), expect="efa", rank_hosts=hosts)
    assert {link.scope for link in unplaced.links} == {"unknown"}
    assert {(link.src, link.dst, link.scope) for link in placed.links} == {(3, 4, "inter"), (4, 5, "intra")}
    assert placed.status is Status.FAIL and placed.problems == (
        "rank 3 (ip-10-0-1-5) -> rank 4 (ip-10-0-1-6): NET/Socket between nodes "
        "(expected EFA: NET/Libfabric through aws-ofi-nccl)",
    )


@pytest.mark.parametrize(
    ("via", "kind", "name", "plugin", "efa", "gdr"),
    [
        ("P2P/CUMEM", Kind.P2P, "P2P/CUMEM", "", False, False),
        ("P2P/CUMEM/read", Kind.P2P, "P2P/CUMEM/read", "", False, False),
        ("P2P/IPC/read", Kind.P2P, "P2P/IPC/read", "", False, False),
        ("P2P/direct pointer", Kind.P2P, "P2P/direct pointer", "", False, False),
        ("P2P/indirect/3[3]", Kind.P2P, "P2P/indirect", "", False, False),
        ("SHM/direct/direct", Kind.SHM, "SHM/direct/direct", "", False, False),
        ("NET/Socket/0", Kind.NET, "NET/Socket", "Socket", False, False),
        ("NET/IB/1/GDRDMA", Kind.NET, "NET/IB", "IB", False, True),
        ("NET/Libfabric/0/GDRDMA", Kind.NET, "NET/Libfabric", "Libfabric", True, True),
        ("NET/Libfabric/2(0)/GDRDMA", Kind.NET, "NET/Libfabric", "Libfabric", True, True),
        ("NET/AWS Libfabric/0/GDRDMA/Shared", Kind.NET, "NET/AWS Libfabric", "AWS Libfabric", True, True),
        ("NET/OFI/0", Kind.NET, "NET/OFI", "OFI", True, False),
        ("COLLNET/SHARP/0/GDRDMA", Kind.COLLNET, "COLLNET/SHARP", "SHARP", False, True),
        ("something new", Kind.OTHER, "something new", "", False, False),
    ],
)
def test_parse_transport(via, kind, name, plugin, efa, gdr):
    t = parse_transport(via)
    assert (t.kind, t.name, t.plugin, t.is_efa_plugin, t.gdr) == (kind, name, plugin, efa, gdr)


def test_collnet_and_nvls_lines():
    text = "\n".join([
        "h1:10:10 [0] NCCL INFO ncclCommInitRank comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 commId 0xab - Init COMPLETE",
        "h1:10:10 [0] NCCL INFO NVLS comm 0x1 headRank 0 nHeads 1 buffSize 1048576 memSize 2097152",
        "h1:10:10 [0] NCCL INFO CollNet 00/0 : 0 [send] via COLLNET/SHARP/0/GDRDMA",
    ])
    conns = parse_nccl_log(text).connections
    assert [(c.src, c.dst, c.transport.kind) for c in conns] == [(0, None, Kind.NVLS), (0, None, Kind.COLLNET)]
    verdict = decide(parse_nccl_log(text), expect="any")
    assert verdict.status is Status.PASS
    assert {(link.scope, link.transports) for link in verdict.links} == {("inter", ("COLLNET/SHARP/GDRDMA",)),
                                                                          ("intra", ("NVLS",))}


def test_connection_lines_follow_the_communicator_their_process_last_created():
    text = "\n".join([
        "h1:10:10 [0] NCCL INFO ncclCommInitRankConfig comm 0x1 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1000 commId 0xaa - Init START",
        "h1:10:10 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM",
        "h1:10:10 [0] NCCL INFO ncclCommInitRankConfig comm 0x2 rank 1 nranks 4 cudaDev 0 nvmlDev 0 busId 1000 commId 0xbb - Init START",
        "h1:10:10 [0] NCCL INFO Channel 00/0 : 1[0] -> 2[1] via P2P/CUMEM",
    ])
    assert [c.comm for c in parse_nccl_log(text).connections] == ["0xaa", "0xbb"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=120),
    st.sampled_from([
        "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via ",
        "h:1:1 [0] NCCL INFO Channel 99999999999999999999/0 : 0[zz] -> 1[1] via NET/",
        "(RayTrainWorker pid=1, ip=1) h:1:1 [0] NCCL INFO CollNet 00/0 : 0 [send] via /// [repeated 0x across cluster]",
        "h:1:1 [0] NCCL INFO comm 0x1 rank 0 nranks 0 cudaDev 0",
        "h:1:1 [0] NCCL INFO NVLS comm 0x1 headRank -1",
        "\x1b[36m(pid=1)\x1b[0m h.x:1:2 [0] NCCL INFO NET/OFI Selected provider is ",
    ]),
), max_size=30))
def test_parser_and_decision_never_raise(lines):
    text = "\n".join(lines)
    log = parse_nccl_log(text)
    verdict = decide(log, expect="efa", nodes=2)
    assert verdict.status in set(Status)

"""Nodes as NCCL sees them, and the verifier on logs from other people's clusters.

NCCL tells nodes apart by a host hash (NCCL_HOSTID when set), not by the host name it prints; the
verifier reads its nNodes/localRanks lines and falls back to host names where a log lacks them. The
real logs and their expert verdicts live in the shared folder (fixtures/nccl-real/expected.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from workloads.context import TrainContext
from workloads.transport.gate import GateConfig, check_transport, judge_rank, node_label
from workloads.transport.nccl_log import Kind, parse_nccl_log, parse_transport
from workloads.transport.verify import Status, decide, placements

SYNTHETIC = Path(__file__).parent / "fixtures" / "nccl_synthetic"
REAL_LOGS = [
    "efa-aws-efa-eks-p4d-2node.log", "efa-aws-do-eks-g4dn-2node.log", "efa-training-on-eks-g6e-rank0-of-4pods.log",
    "socket-training-on-eks-g6e-no-eligible-providers.log", "single-node-training-on-eks-g6e-shm.log",
    "socket-ray-vllm-llm-k8s-no-ib.log", "ib-ray-vllm-llm-k8s.log", "socket-pytorch-tutorial-tesla-2node.log",
    "cxi-gb25-perlmutter.log",
]


def shared_log(shared_dir: Path, name: str) -> str:
    return (shared_dir / "fixtures" / "nccl" / name).read_text()


def test_every_real_log_has_a_verdict(shared_dir):
    expected = json.loads((shared_dir / "fixtures/nccl-real/expected.json").read_text())
    assert sorted(expected) == sorted(REAL_LOGS)


@pytest.mark.parametrize("name", REAL_LOGS)
def test_the_verifier_agrees_with_the_expert_verdict(shared_dir, name):
    verdict_of = json.loads((shared_dir / "fixtures/nccl-real/expected.json").read_text())[name]
    text = (shared_dir / "fixtures/nccl-real" / name).read_text()
    verdict = decide(parse_nccl_log(text), expect=verdict_of["expect"], nodes=verdict_of["nodes"])
    allowed = verdict_of["exit"] if isinstance(verdict_of["exit"], list) else [verdict_of["exit"]]
    assert verdict.status.exit_code in allowed, (verdict_of["why"], verdict.problems, verdict.gaps)


def test_two_ncclhostid_processes_of_one_machine_are_two_nodes(shared_dir):
    log = parse_nccl_log(shared_log(shared_dir, "h200x2-two-hostid-socket.log"))
    assert {(t.rank, t.nnodes, t.local_ranks) for t in log.topology} == {(0, 2, 1), (1, 2, 1)}
    passed = decide(log, expect="any", nodes=2)
    assert passed.status is Status.PASS, (passed.problems, passed.gaps)
    assert passed.nodes_seen == 2 and {link.scope for link in passed.links} == {"inter"}
    failed = decide(log, expect="efa", nodes=2)
    assert failed.status is Status.FAIL
    assert failed.problems[0] == ("rank 0 (vm) -> rank 1 (vm): NET/Socket between nodes "
                                  "(expected EFA: NET/Libfabric through aws-ofi-nccl)")


def test_p2p_and_shm_turned_off_on_one_machine_is_still_one_node(shared_dir):
    """NCCL 2.28 counts two GPUs that cannot reach each other without the network as two nodes
    (nNodes 2) when NCCL_P2P_DISABLE/NCCL_SHM_DISABLE are set: that count is not a machine count."""
    log = parse_nccl_log(shared_log(shared_dir, "h200x2-forced-socket.log"))
    assert {t.nnodes for t in log.topology} == {2}
    assert {setting for _, _, setting in log.intra_node_disabled} == {"NCCL_P2P_DISABLE=1"}
    verdict = decide(log, expect="any")
    assert verdict.status is Status.FAIL and verdict.nodes_seen == 1
    assert all("NET/Socket within a node" in problem for problem in verdict.problems)


def test_host_names_decide_where_the_log_has_no_topology_lines():
    text = (SYNTHETIC / "tcp-fallback-2x4.log").read_text()
    log = parse_nccl_log("\n".join(line for line in text.splitlines() if "nNodes" not in line))  # NCCL < 2.12
    placement = placements(log)[log.ranks[0].comm]
    assert not log.topology
    assert placement.nnodes is None and placement.scope(3, 4) == "inter" and placement.scope(0, 1) == "intra"


def test_topology_places_pairs_whose_host_names_disagree_with_it():
    """Two nodes of four ranks each behind one host name: NCCL's localRanks proves the name wrong,
    so a pair it cannot place stays unknown rather than "within a node"."""
    lines = [f"pod:{100 + r}:{100 + r} [0] NCCL INFO comm 0x{r:x}0 rank {r} nRanks 8 nNodes 2 localRanks 4 "
             f"localRank {r % 4} MNNVL 0" for r in range(8)]
    placement = placements(parse_nccl_log("\n".join(lines)))["nranks=8"]
    assert placement.nnodes == 2 and not placement.host_names_agree
    assert placement.scope(0, 5) == "unknown"


def test_nccl_before_2_9_names_shared_memory_in_words():
    assert parse_transport("direct shared memory") == parse_transport("SHM")
    assert parse_transport("direct shared memory").kind is Kind.SHM


def test_aws_libfabric_without_a_provider_line_proves_no_efa():
    text = (SYNTHETIC / "efa-2x4-aws-libfabric.log").read_text()
    assert decide(parse_nccl_log(text), expect="efa", nodes=2).status is Status.PASS
    without = "\n".join(line for line in text.splitlines() if "Selected Provider" not in line)
    verdict = decide(parse_nccl_log(without), expect="efa", nodes=2)
    assert verdict.status is Status.INCONCLUSIVE
    assert "no \"NET/OFI Selected provider is ...\" line" in verdict.gaps[0]
    # Under --expect any the provider does not matter.
    assert decide(parse_nccl_log(without), expect="any", nodes=2).status is Status.PASS


def test_connection_lines_after_another_communicators_creation_keep_their_own():
    """NCCL connects at a communicator's first collective: a process may create a 2-rank
    communicator and then print connections of its 8-rank one."""
    lines = [
        "h:5:5 [5] NCCL INFO ncclCommInitRankConfig comm 0xa rank 5 nranks 8 cudaDev 5 busId 5 commId 0xwide - Init START",
        "h:5:5 [5] NCCL INFO ncclCommInitRankConfig comm 0xb rank 1 nranks 2 cudaDev 5 busId 5 commId 0xpair - Init START",
        "h:5:9 [5] NCCL INFO Channel 00/0 : 5[5] -> 4[4] via P2P/IPC/read",
        "h:5:9 [5] NCCL INFO Channel 00/0 : 1[5] -> 0[4] [send] via NET/Socket/0",
    ]
    log = parse_nccl_log("\n".join(lines).replace("0xwide", "0x1").replace("0xpair", "0x2"))
    assert [(c.src, c.dst, c.comm) for c in log.connections] == [(5, 4, "0x1"), (1, 0, "0x2")]


def _context(rank: int, tmp_path: Path) -> TrainContext:
    return TrainContext(rank=rank, world_size=2, local_rank=0, local_world_size=1, node_rank=rank,
                        report=lambda metrics, checkpoint_dir=None: None, latest_checkpoint=lambda: None,
                        scratch_dir=tmp_path)


@pytest.mark.parametrize(("host_ids", "passes"), [(("host-a", "host-b"), True), ((None, None), False)])
def test_gate_reads_nodes_as_nccl_does(shared_dir, tmp_path, host_ids, passes):
    """The emulated two-host run (one machine, NCCL_HOSTID per process) passes the gate under
    --expect any; the same log from processes without NCCL_HOSTID is sockets within one node."""
    text = shared_log(shared_dir, "h200x2-two-hostid-socket.log")
    own = "\n".join(line for line in text.splitlines() if line.startswith("vm:1111:"))
    peer = "\n".join(line for line in text.splitlines() if line.startswith("vm:1110:"))
    cfg = GateConfig(expect="any")
    labels = [node_label("vm", host_id=host_id) for host_id in host_ids]
    peer_verdict = judge_rank(cfg, rank=1, host=labels[1], log_text=peer, rank_hosts=dict(enumerate(labels)))
    log_path = tmp_path / "own.log"
    log_path.write_text(own)

    def all_gather(obj: Any) -> list[Any]:
        return [obj, labels[1]] if isinstance(obj, str) else [obj, peer_verdict]

    run = lambda: check_transport(  # noqa: E731
        cfg, ctx=_context(0, tmp_path), device=torch.device("cpu"), measure=lambda **_: 4.1, log_path=log_path,
        all_gather=all_gather, hostname="vm", host_id=host_ids[0])
    if passes:
        result = run()
        assert result.passed and result.nodes == 2
        assert "ranks 0@vm/host-a, 1@vm/host-b" in result.message and "2 ranks on 2 node(s)" in result.message
    else:
        with pytest.raises(RuntimeError, match="NET/Socket within a node"):
            run()

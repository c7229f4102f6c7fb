"""The in-band transport gate: its decision on fake per-rank NCCL logs and a fake bandwidth, and a
real two-process gloo run where it does not apply."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from workloads.context import TrainContext
from workloads.transport.gate import (
    DEFAULT_MESSAGE_BYTES,
    EFA_TRANSPORT_ENV,
    GateConfig,
    NodeNetwork,
    RankVerdict,
    TransportGateError,
    check_transport,
    combine_verdicts,
    judge_rank,
    message_bytes_for,
    nccl_log_env,
    resolve_debug_file,
    run_transport_gate,
)

SYNTHETIC = Path(__file__).parent / "fixtures" / "nccl_synthetic"


def context(rank: int, world_size: int, tmp_path: Path) -> TrainContext:
    return TrainContext(
        rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, node_rank=0,
        report=lambda metrics, checkpoint_dir=None: None, latest_checkpoint=lambda: None, scratch_dir=tmp_path,
    )


def lines_of(text: str, prefix: str) -> str:
    """One process's own NCCL log, as NCCL_DEBUG_FILE holds it: only the lines it printed."""
    return "\n".join(line for line in text.splitlines() if line.startswith(prefix)) + "\n"


def run_gate_as_rank(
    tmp_path: Path, *, own_log: str, peer_log: str, hosts: list[str], busbw: float, cfg: GateConfig = GateConfig()
):
    """Rank 0 of a 2-rank world, the peer's verdict computed from its own log as it would be."""
    log_path = tmp_path / "nccl.own.log"
    log_path.write_text(own_log)
    rank_hosts = dict(enumerate(hosts))
    peer = judge_rank(cfg, rank=1, host=hosts[1], log_text=peer_log, rank_hosts=rank_hosts)

    def all_gather(obj: Any) -> list[Any]:
        return [obj, hosts[1]] if isinstance(obj, str) else [obj, peer]

    measured: list[dict] = []

    def measure(**kwargs: Any) -> float:
        measured.append(kwargs)
        return busbw

    result = check_transport(
        cfg, ctx=context(0, 2, tmp_path), device=torch.device("cpu"), measure=measure, log_path=log_path,
        all_gather=all_gather, hostname=f"{hosts[0]}.ec2.internal",
    )
    assert measured == [{"device": torch.device("cpu"), "message_bytes": cfg.message_bytes or DEFAULT_MESSAGE_BYTES}]
    return result


def test_gate_passes_over_nvlink(shared_dir, tmp_path):
    text = (shared_dir / "fixtures/nccl/h200x2-single-node-p2p.log").read_text()
    result = run_gate_as_rank(tmp_path, own_log=lines_of(text, "vm:671:"), peer_log=lines_of(text, "vm:672:"),
                              hosts=["vm", "vm"], busbw=330.09)
    assert result.applies and result.passed
    assert result.nodes == 1 and result.floor_gbps == 2.0
    assert result.message == (
        "transport gate passed (expect efa; ranks 0@vm, 1@vm; transports P2P/CUMEM; all-reduce bus bandwidth "
        "330.09 GB/s (floor 2.00 GB/s, 64 MiB, 2 ranks on 1 node(s)))"
    )


def test_gate_passes_over_efa_between_nodes(tmp_path):
    text = (SYNTHETIC / "efa-2x4-libfabric.log").read_text()
    # Ranks 3 and 4 of the 8-rank log: the pair that crosses nodes.
    cfg = GateConfig()
    log_path = tmp_path / "rank3.log"
    log_path.write_text(lines_of(text, "ip-10-0-1-5:4103:"))
    hosts = ["ip-10-0-1-5"] * 4 + ["ip-10-0-1-6"] * 4
    others = [
        judge_rank(cfg, rank=r, host=hosts[r], log_text=lines_of(text, f"{hosts[r]}:{pid}:"),
                   rank_hosts=dict(enumerate(hosts)))
        for r, pid in enumerate([4100, 4101, 4102, 4103, 4107, 4108, 4109, 4110])
    ]

    def all_gather(obj: Any) -> list[Any]:
        return hosts if isinstance(obj, str) else [obj if v.rank == 3 else v for v in others]

    result = check_transport(
        cfg, ctx=context(3, 8, tmp_path), device=torch.device("cpu"), measure=lambda **_: 9.5, log_path=log_path,
        all_gather=all_gather, hostname="ip-10-0-1-5",
    )
    assert result.passed and result.nodes == 2 and result.floor_gbps == 1.0
    assert "transports NET/Libfabric/GDRDMA, P2P/CUMEM/read" in result.message


def test_gate_fails_on_sockets_within_a_node_naming_ranks_hosts_transport_and_bandwidth(shared_dir, tmp_path):
    text = (shared_dir / "fixtures/nccl/h200x2-forced-socket.log").read_text()
    with pytest.raises(TransportGateError) as err:
        run_gate_as_rank(tmp_path, own_log=lines_of(text, "vm:734:"), peer_log=lines_of(text, "vm:735:"),
                         hosts=["vm", "vm"], busbw=3.84)
    assert str(err.value) == (
        "transport gate failed (expect efa; ranks 0@vm, 1@vm; transports NET/Socket; all-reduce bus bandwidth "
        "3.84 GB/s (floor 2.00 GB/s, 64 MiB, 2 ranks on 1 node(s))):\n"
        "  rank 0 (vm) -> rank 1 (vm): NET/Socket within a node (expected P2P, SHM or NVLS)\n"
        "  rank 1 (vm) -> rank 0 (vm): NET/Socket within a node (expected P2P, SHM or NVLS)\n"
        "  drain: no node stands out: ranks on the run's only node failed alike (vm), a cause they share (the "
        "image, the job's environment, the security group) rather than one machine; `kubectl describe node` shows "
        "the monitoring agent's conditions before any drain"
    )


def test_gate_fails_on_tcp_between_nodes(tmp_path):
    text = (SYNTHETIC / "tcp-fallback-2x4.log").read_text()
    # Rank 0 of the 8-rank log: it receives from rank 7 over the network; the others' verdicts are
    # what their own logs give.
    cfg = GateConfig()
    hosts = ["ip-10-0-1-5"] * 4 + ["ip-10-0-1-6"] * 4
    verdicts = [
        judge_rank(cfg, rank=r, host=hosts[r], log_text=lines_of(text, f"{hosts[r]}:{pid}:"),
                   rank_hosts=dict(enumerate(hosts)))
        for r, pid in enumerate([4100, 4101, 4102, 4103, 4107, 4108, 4109, 4110])
    ]
    log_path = tmp_path / "rank0.log"
    log_path.write_text(lines_of(text, "ip-10-0-1-5:4100:"))
    with pytest.raises(TransportGateError) as err:
        check_transport(
            cfg, ctx=context(0, 8, tmp_path), device=torch.device("cpu"), measure=lambda **_: 3.1,
            log_path=log_path,
            all_gather=lambda obj: hosts if isinstance(obj, str) else [obj, *verdicts[1:]],
            hostname="ip-10-0-1-5",
        )
    lines = str(err.value).splitlines()
    assert lines[0].startswith("transport gate failed (expect efa; ranks 0@ip-10-0-1-5, 1@ip-10-0-1-5, ")
    assert "transports NET/Socket, P2P/CUMEM/read; all-reduce bus bandwidth 3.10 GB/s (floor 1.00 GB/s" in lines[0]
    assert lines[1:] == [
        "  rank 7 (ip-10-0-1-6) -> rank 0 (ip-10-0-1-5): NET/Socket between nodes "
        "(expected EFA: NET/Libfabric through aws-ofi-nccl)",
        "  rank 3 (ip-10-0-1-5) -> rank 4 (ip-10-0-1-6): NET/Socket between nodes "
        "(expected EFA: NET/Libfabric through aws-ofi-nccl)",
        "  drain: no node stands out: ranks on all 2 nodes failed alike (ip-10-0-1-5, ip-10-0-1-6), a cause they "
        "share (the image, the job's environment, the security group) rather than one machine; `kubectl describe "
        "node` shows the monitoring agent's conditions before any drain",
    ]


def test_gate_fails_under_the_floor_with_the_right_transport(shared_dir, tmp_path):
    text = (shared_dir / "fixtures/nccl/h200x2-single-node-p2p.log").read_text()
    with pytest.raises(TransportGateError) as err:
        run_gate_as_rank(tmp_path, own_log=lines_of(text, "vm:671:"), peer_log=lines_of(text, "vm:672:"),
                         hosts=["vm", "vm"], busbw=120.0, cfg=GateConfig(min_busbw_gbps=250))
    assert str(err.value) == (
        "transport gate failed (expect efa; ranks 0@vm, 1@vm; transports P2P/CUMEM; all-reduce bus bandwidth "
        "120.00 GB/s (floor 250.00 GB/s, 64 MiB, 2 ranks on 1 node(s))):\n"
        "  bus bandwidth 120.00 GB/s is under the floor of 250.00 GB/s\n"
        "  drain: no node stands out: every rank's connections are right, and the bus bandwidth is one figure for "
        "all of them; `kubectl describe node` shows each node's NetworkingReady and AcceleratedHardwareReady "
        "conditions (EKS node monitoring agent)"
    )


def test_default_floor_for_one_node_applies(shared_dir, tmp_path):
    text = (shared_dir / "fixtures/nccl/h200x2-single-node-p2p.log").read_text()
    with pytest.raises(TransportGateError, match=r"\n  bus bandwidth 1.50 GB/s is under the floor of 2.00 GB/s\n"):
        run_gate_as_rank(tmp_path, own_log=lines_of(text, "vm:671:"), peer_log=lines_of(text, "vm:672:"),
                         hosts=["vm", "vm"], busbw=1.5)


def test_gate_fails_when_its_log_shows_no_connections(tmp_path):
    text = (SYNTHETIC / "no-connections-2x4.log").read_text()
    with pytest.raises(TransportGateError, match=r"rank 0 on ip-10-0-1-5: no NCCL connection lines"):
        run_gate_as_rank(tmp_path, own_log=lines_of(text, "ip-10-0-1-5:4100:"), peer_log="",
                         hosts=["ip-10-0-1-5", "ip-10-0-1-5"], busbw=50.0, cfg=GateConfig(log_wait_s=0))


def test_gate_fails_when_a_peer_has_no_log(shared_dir, tmp_path):
    text = (shared_dir / "fixtures/nccl/h200x2-single-node-p2p.log").read_text()
    with pytest.raises(TransportGateError, match=r"rank 1 on vm: NCCL log \(unnamed\) is missing or empty"):
        run_gate_as_rank(tmp_path, own_log=lines_of(text, "vm:671:"), peer_log="", hosts=["vm", "vm"], busbw=300.0)


def test_gate_across_nodes_needs_some_rank_to_see_an_inter_node_link(tmp_path):
    text = (SYNTHETIC / "efa-2x4-libfabric.log").read_text()
    with pytest.raises(TransportGateError, match="ranks run on 2 nodes but no rank logged a connection between"):
        # Two ranks whose own logs hold only intra-node links, yet placed on different hosts.
        run_gate_as_rank(tmp_path, own_log=lines_of(text, "ip-10-0-1-5:4101:"),
                         peer_log=lines_of(text, "ip-10-0-1-6:4108:"), hosts=["ip-10-0-1-5", "ip-10-0-1-6"],
                         busbw=9.0)


def test_gate_without_nccl_debug_file_fails_with_the_fix(tmp_path):
    cfg = GateConfig()
    peer = RankVerdict(rank=1, host="vm", ok=True, transports=("P2P/CUMEM",))
    with pytest.raises(TransportGateError, match="NCCL_DEBUG_FILE is not set.*nccl_log_env"):
        check_transport(
            cfg, ctx=context(0, 2, tmp_path), device=torch.device("cpu"), measure=lambda **_: 300.0, log_path=None,
            all_gather=lambda obj: ["vm", "vm"] if isinstance(obj, str) else [obj, peer], hostname="vm",
        )


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("/tmp/ray/nccl/nccl.%h.%p.log", "/tmp/ray/nccl/nccl.ip-10-0-1-5.4242.log"),
        ("/logs/%%h-%p", "/logs/%h-4242"),
        ("/logs/%x%h", "/logs/%xip-10-0-1-5"),
        ("/logs/plain.log", "/logs/plain.log"),
        ("/logs/trailing%", "/logs/trailing%"),
    ],
)
def test_resolve_debug_file_as_nccl_does(pattern, expected):
    assert resolve_debug_file(pattern, hostname="ip-10-0-1-5.us-west-2.compute.internal", pid=4242) == Path(expected)


def test_nccl_log_env_is_what_the_gate_reads(tmp_path):
    env = nccl_log_env(log_dir=tmp_path)
    assert env == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "NCCL_DEBUG_FILE": f"{tmp_path}/nccl.%h.%p.log",
    }


def test_the_efa_transport_is_declared_apart_from_the_log_settings(tmp_path):
    assert EFA_TRANSPORT_ENV == {
        "FI_PROVIDER": "efa",
        "NCCL_NET_PLUGIN": "ofi",
        "NCCL_SOCKET_IFNAME": "eth0",
        "FI_EFA_FORK_SAFE": "1",
    }
    assert not EFA_TRANSPORT_ENV.keys() & nccl_log_env(log_dir=tmp_path).keys()  # merging overrides nothing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expect": "ib"}, "expect must be 'efa' or 'any', got 'ib'"),
        ({"min_busbw_gbps": -1.0}, "min_busbw_gbps must be >= 0"),
        ({"message_bytes": 16}, "message_bytes must be >= 4096"),
        ({"log_wait_s": -1.0}, "log_wait_s must be >= 0"),
    ],
)
def test_gate_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GateConfig(**kwargs)


def _gloo_worker(rank: int, init_file: str, out_dir: str, forced_socket_log: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out = Path(out_dir)
        ctx = context(rank, 2, out)
        result = run_transport_gate(GateConfig(), ctx=ctx, device=torch.device("cpu"))
        # The gate proper over a real all-gather: each rank reads only its own log.
        text = Path(forced_socket_log).read_text()
        own = out / f"rank{rank}.log"
        own.write_text(lines_of(text, f"vm:{734 + rank}:"))
        try:
            check_transport(
                GateConfig(log_wait_s=0), ctx=ctx, device=torch.device("cpu"), measure=lambda **_: 3.84,
                log_path=own, all_gather=_all_gather, hostname="vm",
            )
            error = ""
        except TransportGateError as err:
            error = str(err)
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"applies": result.applies, "passed": result.passed, "message": result.message, "error": error}
        ))
    finally:
        dist.destroy_process_group()


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, obj)
    return gathered


@pytest.mark.slow
def test_gloo_run_says_the_gate_does_not_apply_and_ranks_stop_together(shared_dir, tmp_path):
    run_ranks(_gloo_worker, nprocs=2,
              args=(str(tmp_path / "pg"), str(tmp_path), str(shared_dir / "fixtures/nccl/h200x2-forced-socket.log")))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert (r["applies"], r["passed"]) == (False, True)
        assert r["message"] == "transport gate does not apply to the gloo backend (it checks NCCL transports)"
    assert results[0]["error"] == results[1]["error"]
    assert "rank 0 (vm) -> rank 1 (vm): NET/Socket within a node" in results[0]["error"]


def _efa_verdicts(*, failing_node: str | None) -> list[RankVerdict]:
    """8 ranks on two g6.12xlarge pods; the ranks on `failing_node` found no NCCL connection in their logs
    (the EFA device of that instance did not come up, say)."""
    nodes = ["ip-10-0-1-5.us-west-2.compute.internal"] * 4 + ["ip-10-0-1-6.us-west-2.compute.internal"] * 4
    pods = ["ray-train-gpu-worker-a"] * 4 + ["ray-train-gpu-worker-b"] * 4
    verdicts = []
    for rank, (node, pod) in enumerate(zip(nodes, pods)):
        ok = node != failing_node
        verdicts.append(RankVerdict(
            rank=rank, host=pod, node=node, ok=ok, transports=("NET/Libfabric/GDRDMA",) if ok else (),
            inter_node_links=1 if ok and rank in (3, 4) else 0,
            problems=() if ok else (f"rank {rank} on {pod}: no NCCL connection lines in its log",)))
    return verdicts


def test_a_failing_gate_names_the_node_whose_ranks_alone_failed():
    from workloads.transport.gate import combine_verdicts

    bad = "ip-10-0-1-6.us-west-2.compute.internal"
    result = combine_verdicts(GateConfig(), verdicts=_efa_verdicts(failing_node=bad), busbw_gbps=4.2,
                              message_bytes=64 * 2**20)
    assert not result.passed and result.drain == (bad,)
    assert result.message.splitlines()[-1] == (
        f"  drain: {bad} (ranks 4, 5, 6, 7 failed, the other nodes' passed): `kubectl drain {bad} "
        "--ignore-daemonsets --delete-emptydir-data`, then terminate the instance: the node group replaces it and "
        "the run resumes from its latest checkpoint")
    # Without the Kubernetes node name (a local run), the host label names the machine.
    local = [dataclasses.replace(v, node="") for v in _efa_verdicts(failing_node=bad)]
    assert combine_verdicts(GateConfig(), verdicts=local, busbw_gbps=4.2, message_bytes=4096).drain == (
        "ray-train-gpu-worker-b",)
    healthy = combine_verdicts(GateConfig(), verdicts=_efa_verdicts(failing_node=None), busbw_gbps=4.2,
                               message_bytes=4096)
    assert healthy.passed and healthy.drain == () and "drain" not in healthy.message


def test_the_gate_reads_the_pods_node_name(monkeypatch, tmp_path):
    """run_transport_gate passes K8S_NODE_NAME (the downward API's spec.nodeName) into the rank's verdict."""
    from workloads.transport import gate

    seen = {}
    monkeypatch.setenv(gate.NODE_NAME_ENV, "ip-10-0-1-5.us-west-2.compute.internal")
    monkeypatch.setattr(gate, "check_transport", lambda cfg, **kwargs: seen.update(kwargs))
    monkeypatch.setattr("torch.distributed.get_backend", lambda: "nccl")
    gate.run_transport_gate(GateConfig(), ctx=context(0, 2, tmp_path), device=torch.device("cpu"))
    assert seen["node"] == "ip-10-0-1-5.us-west-2.compute.internal"
    assert seen["network"] is None  # no network on this machine's environment: the generic floor
    monkeypatch.setenv(gate.EFA_INTERFACES_ENV, "32")
    monkeypatch.setenv(gate.NETWORK_GBPS_ENV, "3200")
    gate.run_transport_gate(GateConfig(), ctx=context(0, 2, tmp_path), device=torch.device("cpu"))
    assert seen["network"] == gate.NodeNetwork(efa_interfaces=32, line_gbps=3200)


P5 = NodeNetwork(efa_interfaces=32, line_gbps=3200)
G6 = NodeNetwork(efa_interfaces=1, line_gbps=40)


def test_the_floor_between_nodes_follows_the_nodes_efa_network():
    """A p5 whose NCCL reaches what 4 of its 32 interfaces carry fails; g6.12xlarge keeps its 1 GB/s."""
    healthy = _efa_verdicts(failing_node=None)
    few_interfaces = combine_verdicts(GateConfig(), verdicts=healthy, busbw_gbps=45.0, message_bytes=512 * 2**20,
                                      network=P5)
    assert not few_interfaces.passed and few_interfaces.floor_gbps == 80.0
    assert ("all-reduce bus bandwidth 45.00 GB/s (floor 80.00 GB/s: 20% of the 3200 Gbps of 32 EFA interfaces, "
            "512 MiB, 8 ranks on 2 node(s))") in few_interfaces.message
    assert "bus bandwidth 45.00 GB/s is under the floor of 80.00 GB/s" in few_interfaces.message
    assert combine_verdicts(GateConfig(), verdicts=healthy, busbw_gbps=310.0, message_bytes=512 * 2**20,
                            network=P5).passed
    g6 = combine_verdicts(GateConfig(), verdicts=healthy, busbw_gbps=4.2, message_bytes=64 * 2**20, network=G6)
    assert g6.passed and g6.floor_gbps == 1.0 and g6.floor_source == "20% of the 40 Gbps of 1 EFA interface"
    unknown = combine_verdicts(GateConfig(), verdicts=healthy, busbw_gbps=4.2, message_bytes=64 * 2**20)
    assert unknown.floor_gbps == 1.0 and unknown.floor_source.startswith("generic: the nodes' EFA network is unknown")
    # An explicit floor is the user's; one node keeps the floor under PCIe GPUs' P2P.
    assert combine_verdicts(GateConfig(min_busbw_gbps=30), verdicts=healthy, busbw_gbps=45.0,
                            message_bytes=4096, network=P5).passed
    one_node = [dataclasses.replace(v, host="pod", node="n", inter_node_links=0) for v in healthy]
    assert combine_verdicts(GateConfig(), verdicts=one_node, busbw_gbps=45.0, message_bytes=4096,
                            network=P5).floor_gbps == 2.0


def test_the_all_reduce_is_sized_to_take_milliseconds_at_the_line_rate():
    assert message_bytes_for(GateConfig(), None) == 64 * 2**20
    assert message_bytes_for(GateConfig(), G6) == 64 * 2**20  # 5 GB/s: 13 ms already
    assert message_bytes_for(GateConfig(), NodeNetwork(efa_interfaces=1, line_gbps=100)) == 128 * 2**20
    assert message_bytes_for(GateConfig(), P5) == 512 * 2**20  # the most: 1.3 ms at 400 GB/s
    assert message_bytes_for(GateConfig(message_bytes=8 * 2**20), P5) == 8 * 2**20
    assert NodeNetwork.from_env({"RAY_EKS_EFA_INTERFACES": "x", "RAY_EKS_NETWORK_GBPS": "40"}) is None

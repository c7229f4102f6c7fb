"""The step-time model: arithmetic checked by hand on small cases, then the properties that make
its comparisons between strategies meaningful."""

from __future__ import annotations

import pytest

from workloads.sizing.step_time import (
    BF16_BYTES,
    FSDP,
    HSDP,
    Hardware,
    Link,
    ModelShape,
    Strategy,
    cluster_strategies,
    collective_s,
    g6_12xlarge_pair,
    main,
    predict_step,
    model_shape,
)

GB = 1e9


def toy_model() -> ModelShape:
    # 10 layers of 1e8 parameters, a root of 1e8: 1.1e9 parameters; 1e10 FLOPs per token.
    return ModelShape(layers=10, params_per_layer=100_000_000, root_params=100_000_000, flops_per_token=1e10)


def test_link_interpolates_in_log_size_and_is_flat_beyond_its_points():
    link = Link(points=((2**20, 1.0), (2**30, 4.0)))
    assert link.gbps(2**10) == 1.0 and link.gbps(2**40) == 4.0
    assert link.gbps(2**25) == pytest.approx(2.5)  # halfway in log size
    with pytest.raises(ValueError, match="increasing"):
        Link(points=((2**30, 4.0), (2**20, 1.0)))


def test_collectives_follow_nccl_tests_bus_bandwidth():
    link = Link.constant(4.0)
    # Two ranks: an all-gather moves half the buffer, an all-reduce all of it, over each rank's link.
    assert collective_s("all_gather", size_bytes=8 * GB, ranks=2, link=link) == pytest.approx(1.0)
    assert collective_s("all_reduce", size_bytes=8 * GB, ranks=2, link=link) == pytest.approx(2.0)
    assert collective_s("reduce_scatter", size_bytes=8 * GB, ranks=4, link=link) == pytest.approx(1.5)
    assert collective_s("all_reduce", size_bytes=8 * GB, ranks=1, link=None) == 0.0


def test_one_gpu_is_pure_compute_at_the_given_mfu():
    hw = Hardware(nodes=1, gpus_per_node=1, peak_flops=1e15, mfu=0.5)
    p = predict_step(hw, toy_model(), Strategy(label="one", kind=FSDP, micro_batch=4, seq_len=1000, grad_accum_steps=3))
    assert p.compute_s == pytest.approx(3 * 4000 * 1e10 / 5e14)
    assert p.step_s == p.compute_s and p.exposed_comm_s == 0.0
    assert p.tokens_per_s_per_gpu == pytest.approx(5e14 / 1e10)


def test_flat_fsdp_over_two_hosts_by_hand():
    # bf16 gathers of 1.1e9 parameters and fp32 reduce-scatters, half of each buffer over a 1 GB/s link.
    hw = Hardware(nodes=2, gpus_per_node=1, peak_flops=1e15, mfu=0.5, inter=Link.constant(1.0))
    p = predict_step(hw, toy_model(), Strategy(label="flat", kind=FSDP, micro_batch=1, seq_len=1000))
    layer_gather, layer_reduce = 0.1, 0.2  # 2e8 and 4e8 bytes, half of each, at 1 GB/s
    compute = 1000 * 1e10 / 5e14  # 0.02 s: the collectives are exposed almost whole
    expected_exposed = (
        layer_gather + (10 * layer_gather - compute / 3)  # root gather, then layers beyond forward
        + (10 * layer_reduce - 2 * compute / 3) + layer_reduce  # layers beyond backward, then root
    )
    assert p.exposed_comm_s == pytest.approx(expected_exposed)
    assert p.comm_s == pytest.approx(11 * (layer_gather + layer_reduce))
    assert p.step_s == pytest.approx(compute + expected_exposed)


def test_hsdp_all_reduces_across_nodes_once_per_optimizer_step():
    # In-node links fast enough not to matter: what is left is the traffic between nodes.
    hw = Hardware(nodes=2, gpus_per_node=4, peak_flops=1e15, mfu=0.5, intra=Link.constant(1e9),
                  inter=Link.constant(1.0))
    steps = {
        k: predict_step(hw, toy_model(), Strategy(label="h", kind=HSDP, micro_batch=8, seq_len=1000,
                                                   grad_accum_steps=k))
        for k in (1, 2, 8)
    }
    # The cross-node cost does not grow with the micro-steps; flat FSDP's does.
    exposed = {k: p.step_s - p.compute_s for k, p in steps.items()}
    assert exposed[8] == pytest.approx(exposed[1], rel=1e-6) and exposed[2] == pytest.approx(exposed[1], rel=1e-6)
    flat = {k: predict_step(hw, toy_model(), Strategy(label="f", kind=FSDP, micro_batch=8, seq_len=1000,
                                                       grad_accum_steps=k)) for k in (1, 8)}
    assert flat[8].step_s - flat[8].compute_s == pytest.approx(8 * (flat[1].step_s - flat[1].compute_s))
    # Each GPU's 1/4 shard crosses in fp32, the node's four GPUs together: 2(n-1)/n x 4.4 GB at 1 GB/s.
    assert steps[1].comm_s == pytest.approx(2 * (2 - 1) / 2 * 1.1e9 * 4 / GB, rel=1e-6)
    compute_bwd = 2 / 3 * 8000 * 1e10 / 5e14
    assert exposed[1] == pytest.approx(10 * 0.4 - compute_bwd + 0.4, rel=1e-6)  # layers beyond backward, root


def test_bf16_between_nodes_halves_the_all_reduce():
    hw = Hardware(nodes=2, gpus_per_node=1, peak_flops=1e15, mfu=0.5, inter=Link.constant(1.0))
    fp32, bf16 = (
        predict_step(hw, toy_model(), Strategy(label=str(b), kind=HSDP, micro_batch=1, seq_len=1000,
                                                cross_node_bytes=b))
        for b in (4, BF16_BYTES)
    )
    assert bf16.comm_s == pytest.approx(fp32.comm_s / 2)
    assert bf16.step_s < fp32.step_s


def test_ranks_sharing_a_gpu_compute_at_their_share():
    alone = Hardware(nodes=1, gpus_per_node=1, peak_flops=1e15, mfu=0.5)
    shared = Hardware(nodes=1, gpus_per_node=1, peak_flops=1e15, mfu=0.5, ranks_per_gpu=2)
    s = Strategy(label="s", kind=FSDP, micro_batch=1, seq_len=1000)
    alone_s = predict_step(alone, toy_model(), s).compute_s
    assert predict_step(shared, toy_model(), s).compute_s == pytest.approx(2 * alone_s)


def test_cost_per_billion_tokens():
    # 8 GPUs each at 32,768 tokens/s cost 2 nodes x $4.6016/h: $9.2032/h for 262,144 tokens/s.
    hw = Hardware(nodes=2, gpus_per_node=4, peak_flops=1e15, mfu=1.0, intra=Link.constant(1e6),
                  inter=Link.constant(1e6), usd_per_node_hour=4.6016)
    model = ModelShape(layers=1, params_per_layer=1, root_params=1, flops_per_token=1e15 / 32768)
    p = predict_step(hw, model, Strategy(label="c", kind=HSDP, micro_batch=1, seq_len=32768))
    assert p.tokens_per_s_per_gpu == pytest.approx(32768, rel=1e-6)
    assert p.usd_per_billion_tokens == pytest.approx(9.2032 / 3600 / (8 * 32768) * 1e9, rel=1e-6)


def test_the_model_shape_counts_each_decoder_layer_and_the_root():
    shape = model_shape("qwen2.5-1.5b", seq_len=2048)
    # 1,543,714,304 parameters, the tied embedding once; 10.32 GFLOP per token at 2,048 (DESIGN.md).
    assert shape.params == 1_543_714_304 and shape.layers == 28
    assert shape.root_params == 151936 * 1536 + 1536  # embedding (= lm_head) and the final norm
    assert shape.flops_per_token == pytest.approx(10.32e9, rel=1e-3)


def test_on_g6_hsdp_with_bf16_between_nodes_is_the_fastest_and_cheapest():
    hw = g6_12xlarge_pair(mfu=0.55)
    assert hw.usd_per_node_hour == 4.6016 and hw.ranks == 8
    flat, hsdp32, auto = (predict_step(hw, model_shape("qwen2.5-1.5b", seq_len=2048), s) for s in cluster_strategies())
    assert auto.tokens_per_s_per_gpu > hsdp32.tokens_per_s_per_gpu > flat.tokens_per_s_per_gpu
    assert auto.usd_per_billion_tokens < hsdp32.usd_per_billion_tokens < flat.usd_per_billion_tokens
    # Never faster than the compute alone.
    assert auto.step_s >= auto.compute_s


def test_bad_input_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="inter-node link"):
        Hardware(nodes=2, gpus_per_node=1, peak_flops=1e15, mfu=0.5)
    with pytest.raises(ValueError, match="kind"):
        Strategy(label="x", kind="ddp", micro_batch=1, seq_len=1)
    assert main(["--mfu", "1.5"]) == 2
    assert "mfu must be in (0, 1]" in capsys.readouterr().err


def test_the_cli_prints_the_g6_table(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "2x g6.12xlarge" in out and "HSDP, bf16 between nodes (auto)" in out and "$/1e9 tok" in out

"""The profile's categories (workloads/bench/profile_categories.py): kernels as torch.profiler names
them on an H100/H200 run of the loop, attributed by the operator that launched them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workloads.bench.profile_categories import Launch, breakdown, categorize, is_lora_gemm, launches


@pytest.mark.parametrize("kernel, op, shapes, category", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", "aten::mm", [[8192, 3584], [3584, 18944]], "gemm"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_TNT", "aten::mm", [[8192, 3584], [3584, 16]], "lora-gemm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "aten::mm", [[16, 8192], [8192, 3584]], "lora-gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", None, [], "gemm"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "aten::_flash_attention_forward", [], "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", None, [], "attention"),
    ("_cross_entropy_kernel", None, [], "loss"),
    ("_liger_fused_linear_cross_entropy_grad", None, [], "loss"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "aten::copy_", [], "cast-copy"),
    ("Memcpy HtoD (Pinned -> Device)", None, [], "cast-copy"),
    ("triton_poi_fused_add_mul_silu_0", None, [], "compiled-pointwise"),
    ("_rms_norm_forward_kernel", None, [], "norm-activation"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "aten::_fused_adamw_", [], "optimizer"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", None, [], "nccl"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "record_param_comms", [], "nccl"),
    ("void at::native::reduce_kernel<512, 1>", "aten::sum", [], "other"),
])
def test_each_kernel_falls_in_its_category(kernel, op, shapes, category):
    assert categorize(kernel=kernel, op=op, shapes=shapes) == category


def test_a_rank_sized_operand_makes_a_lora_gemm():
    assert is_lora_gemm([[4096, 16], [16, 3584]]) and is_lora_gemm([[16, 4096], [4096, 1536]])
    assert not is_lora_gemm([[4096, 1536], [1536, 8960]]) and not is_lora_gemm([])


def fake_event(name, *, kernels=(), shapes=(), children=(), cuda_span=None):
    kernel_objs = [SimpleNamespace(name=k, duration=us) for k, us in kernels]
    if cuda_span is not None:
        return SimpleNamespace(name=name, device_type="DeviceType.CUDA", kernels=[],
                               time_range=SimpleNamespace(start=cuda_span[0], end=cuda_span[1]))
    return SimpleNamespace(name=name, device_type="DeviceType.CPU", kernels=kernel_objs, input_shapes=list(shapes),
                           cpu_children=list(children))


def test_kernels_go_to_their_innermost_operator_and_the_unlaunched_ones_count_by_name():
    mm = fake_event("aten::mm", kernels=[("nvjet_a", 3000.0)], shapes=[[8192, 3584], [3584, 16]])
    linear = fake_event("aten::linear", kernels=[("nvjet_a", 3000.0)], children=[mm])  # the same kernel, seen twice
    events = [linear, mm,
              fake_event("nvjet_a", cuda_span=(0, 3000)),
              fake_event("triton_poi_fused_mul_0", cuda_span=(3000, 4000)),
              fake_event("ncclDevKernel_AllGather", cuda_span=(4000, 6000))]
    found = launches(events)
    assert Launch(kernel="nvjet_a", seconds=0.003, op="aten::mm", shapes=((8192, 3584), (3584, 16))) in found
    assert sum(1 for item in found if item.kernel == "nvjet_a") == 1
    result = breakdown(found, steps=2)
    assert result.seconds == pytest.approx({"lora-gemm": 0.0015, "compiled-pointwise": 0.0005, "nccl": 0.001})
    table = result.as_dict()
    assert table["categories"]["lora-gemm"]["share"] == pytest.approx(0.5)
    assert [k["kernel"] for k in table["top_kernels"]] == [
        "nvjet_a", "ncclDevKernel_AllGather", "triton_poi_fused_mul_0"]
    assert "lora-gemm" in result.table()


def test_a_named_range_on_the_device_timeline_is_not_counted_beside_the_kernels_inside_it():
    """torch.compile marks each compiled graph's span on the GPU's timeline (`## Call CompiledFxGraph
    ... ##`, a user annotation); counted as a kernel it doubled a profiled 7B LoRA step's device time
    (1,002 ms for a 530 ms step, half of it "other")."""
    annotation = fake_event("## Call CompiledFxGraph fxtgv7 ##", cuda_span=(0, 4000))
    marked = fake_event("train-step", cuda_span=(0, 4000))
    marked.is_user_annotation = True
    events = [annotation, marked, fake_event("nvjet_a", cuda_span=(0, 3000)),
              fake_event("triton_poi_fused_mul_0", cuda_span=(3000, 4000))]
    result = breakdown(launches(events), steps=1)
    assert result.seconds == pytest.approx({"gemm": 0.003, "compiled-pointwise": 0.001})

"""The cost model against measured figures: effective throughput per device and dtype, the message-size curve
of a link, and all-reduces that grow with the group."""

from __future__ import annotations

import pytest

from atoll.coordinator.planner import PlannerOptions, TrainSpec, parse_cluster
from atoll.coordinator.planner.catalog import device
from atoll.coordinator.planner.cluster import GBPS, Island
from atoll.coordinator.planner.composer import Composer, _Setup
from atoll.coordinator.planner.costmodel import CostModel, loss_bytes_per_logit
from atoll.coordinator.planner.profiles import ProfileSet
from atoll.models import preset_spec

MODEL = preset_spec("1.3b")  # d_model 2048, seq 2048: one sequence's activation is 8.4 MB in bf16


def _island(name: str, gpus: int = 8, gpn: int = 8, intra: float = 600, inter: float = 100) -> Island:
    return Island(id=name, group=name, device=device(name), gpus=gpus, gpus_per_node=gpn,
                  intra_node_bandwidth=intra * GBPS, inter_node_bandwidth=inter * GBPS)


def _speed_ratio(dtype: str, fast: str = "A100-80GB", slow: str = "V100-32GB") -> float:
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048, dtype=dtype))
    t = {name: cm.table(_island(name), 4) for name in (fast, slow)}
    return (t[slow].pf[-1] + t[slow].pb[-1]) / (t[fast].pf[-1] + t[fast].pb[-1])


def test_fp32_runs_on_tf32_tensor_cores_where_the_device_has_them() -> None:
    assert device("A100").math_path("fp32") == "tf32" and device("H100").math_path("fp32") == "tf32"
    assert device("RTX4090").math_path("fp32") == "tf32" and device("L4").math_path("fp32") == "tf32"
    assert device("V100").math_path("fp32") == "fp32" and device("T4").math_path("fp32") == "fp32"
    assert device("V100").math_path("bf16") == "tensor16"
    # measured fp32 training: an A100 (TF32) is about 3.1x a V100; the datasheets' non-tensor fp32 would say 1.24x
    assert 2.5 <= _speed_ratio("fp32") <= 4.0
    assert device("A100").tflops_32 / device("V100").tflops_32 == pytest.approx(1.24, abs=0.01)
    # 16-bit: Lambda's 1.95x-2.5x for language models on fp16 tensor cores
    assert 1.95 <= _speed_ratio("bf16") <= 2.5


def test_efficiency_grows_with_tokens_per_kernel() -> None:
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048))
    isl = _island("A100-80GB")
    per_seq = [(cm.table(isl, b).pf[-1] + cm.table(isl, b).pb[-1]) / b for b in (1, 2, 4, 8)]
    assert per_seq == sorted(per_seq, reverse=True) and per_seq[0] > per_seq[-1]


def test_a_large_activation_over_a_per_gpu_link_costs_what_the_curve_says() -> None:
    # two 4-GPU-per-node islands joined at 100 Gbit/s per GPU flow: the 8.4 MB activation of one sequence
    cluster = parse_cluster("""
[[group]]
name = "a"
device = "A100-80GB"
count = 4
gpus_per_node = 4
inter_node_gbps = 100
[[group]]
name = "b"
device = "A100-80GB"
count = 4
gpus_per_node = 4
inter_node_gbps = 100
""")
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048), options=PlannerOptions(activation_codecs=("identity",)))
    comp = Composer(cost_model=cm, cluster=cluster)
    s = _Setup(order=cluster.islands, widths=(4, 4), batch=4, m=16, caps=(1, 1), bound=0.0)
    raw, bw, lat = comp._link(s, 0, 1, MODEL.num_layers // 2)
    assert raw == 2048 * 2048 * 2 == 8_388_608
    # every GPU streams at the link's figure: the four GPUs of a node do not split it
    assert bw == pytest.approx(0.96 * 100 * GBPS)
    want = lat + raw / (0.96 * 100 * GBPS)  # the curve: latency + size / achievable rate, 0.72 ms
    assert cm.transfer_seconds(raw, 100 * GBPS, lat) == pytest.approx(want)
    assert want == pytest.approx(0.72e-3, rel=0.02)
    assert cm.codecs.choose(raw, 2, bw, lat, 1.0)[1] == pytest.approx(want, rel=0.02)
    # the curve: a small message is dominated by the latency, a large one reaches the achievable rate
    small, large = (cm.effective_bandwidth(n, 100 * GBPS, 20e-6) for n in (64 << 10, 256 << 20))
    assert small < 0.25 * large and large == pytest.approx(0.96 * 100 * GBPS, rel=0.01)


def test_allreduce_grows_with_dp_and_pays_a_latency_per_hop() -> None:
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048))
    isl = _island("A100-80GB", gpus=512)
    big = [cm.allreduce_seconds(1e9, n, isl) for n in (2, 4, 8, 16, 64, 512)]
    assert big == sorted(big) and len(set(big)) == len(big)
    tiny = [cm.allreduce_seconds(8, n, isl) for n in (16, 64, 512)]
    assert tiny == sorted(tiny) and tiny[-1] > 10 * tiny[0]  # 2 (k-1) inter-node hops of 20 us each
    # hierarchical when the intra-node links are faster: beats a flat ring over the slow links
    flat = 2 * 511 / 512 * 1e9 / (0.96 * isl.inter_node_bandwidth)
    assert big[-1] < 0.5 * flat
    # without faster intra-node links it is a flat ring: 2 (n-1)/n x bytes / bandwidth + 2 (n-1) latencies
    same = _island("A100-80GB", gpus=64, intra=100, inter=100)
    assert cm.allreduce_seconds(1e9, 64, same) == pytest.approx(
        2 * 63 / 64 * 1e9 / (0.96 * 100 * GBPS) + 2 * 63 * same.latency_s)


def test_tensor_parallel_costs_compute_collectives_and_memory() -> None:
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048))
    isl = _island("V100-32GB", intra=300)
    one, four = cm.table(isl, 4), cm.table(isl, 4, tp=4)
    block = 1
    ar = cm.tp_allreduce_seconds(4 * 2048 * 2048 * 2, 4, isl)
    assert ar > 0
    assert four.fwd[block] == pytest.approx(one.fwd[block] / (4 * cm.tp_efficiency(4)) + 2 * ar)
    assert four.bwd[block] == pytest.approx(one.bwd[block] / (4 * cm.tp_efficiency(4)) + 2 * ar)
    assert 0.8 < cm.tp_efficiency(4) < 1 and cm.tp_efficiency(8) < cm.tp_efficiency(4)
    assert four.params[block] == -(-one.params[block] // 4)
    assert one.act[block] / 4 < four.act[block] < one.act[block]  # the norm inputs stay whole on every rank


def test_measured_profiles_override_the_catalog_also_under_tp() -> None:
    doc = {"devices": {"V100-32GB": {"layers": {k: [{"micro_batch": 1, "seq_len": 2048, "forward_s": 0.01,
                                                     "backward_s": 0.02}] for k in ("embedding", "block", "head")}}}}
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048), ProfileSet.from_dict(doc))
    isl = _island("V100-32GB", intra=300)
    assert cm.table(isl, 2).fwd[1] == pytest.approx(0.02)
    two = cm.table(isl, 2, tp=2)
    ar = cm.tp_allreduce_seconds(2 * 2048 * 2048 * 2, 2, isl)
    assert two.fwd[1] == pytest.approx(0.02 / (2 * cm.tp_efficiency(2)) + 2 * ar)


def test_a_measured_split_of_the_backward_overrides_the_flops_share_of_the_weight_gradients() -> None:
    """A profile that split a block's backward (`LayerTiming.weight_fraction`) sets what a zero-bubble stage
    defers; without it the weight-gradient products take their FLOPs share of the measured backward."""
    def doc(fraction: float | None) -> dict:
        pt = {"micro_batch": 1, "seq_len": 2048, "forward_s": 0.01, "backward_s": 0.02}
        if fraction is not None:
            pt["weight_fraction"] = fraction
        return {"devices": {"V100-32GB": {"layers": {k: [pt] for k in ("embedding", "block", "head")}}}}

    isl = _island("V100-32GB", intra=300)
    block = next(i for i, layer in enumerate(MODEL.layers) if layer.kind == "block")
    flops = MODEL.layers[block].flops_wgrad_per_token / MODEL.layers[block].flops_bwd_per_token
    plain = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048), ProfileSet.from_dict(doc(None)))
    assert plain.table(isl, 1).weight(block, block + 1) == pytest.approx(0.02 * flops)
    split = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048), ProfileSet.from_dict(doc(0.25)))
    t = split.table(isl, 1)
    assert t.weight(block, block + 1) == pytest.approx(0.02 * 0.25) and t.bwd[block] == pytest.approx(0.02)
    assert split.table(isl, 1, tp=2).weight(block, block + 1) == pytest.approx(
        0.02 * 0.25 / (2 * split.tp_efficiency(2)))
    with pytest.raises(ValueError, match="weight_fraction"):
        ProfileSet.from_dict(doc(1.2))
    assert t.split(block, block + 1) == 0  # not measured: two passes cost what one does


def test_a_measured_cost_of_splitting_the_backward_goes_to_the_deferring_stage() -> None:
    """`LayerTiming.split_overhead`: B + W run 10% above the fused backward, the products 25% of that; the table
    holds the extra beside the fused backward (plain 1F1B keeps paying only the fused one), also under tp."""
    pt = {"micro_batch": 1, "seq_len": 2048, "forward_s": 0.01, "backward_s": 0.02, "weight_fraction": 0.25,
          "split_overhead": 0.1}
    doc = {"devices": {"V100-32GB": {"layers": {k: [pt] for k in ("embedding", "block", "head")}}}}
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048), ProfileSet.from_dict(doc))
    isl = _island("V100-32GB", intra=300)
    block = next(i for i, layer in enumerate(MODEL.layers) if layer.kind == "block")
    t = cm.table(isl, 1)
    assert t.bwd[block] == pytest.approx(0.02) and t.split(block, block + 1) == pytest.approx(0.002)
    assert t.weight(block, block + 1) == pytest.approx(0.022 * 0.25)
    speed = 2 * cm.tp_efficiency(2)
    assert cm.table(isl, 1, tp=2).split(block, block + 1) == pytest.approx(0.002 / speed)
    with pytest.raises(ValueError, match="split_overhead"):
        ProfileSet.from_dict({"devices": {"V100-32GB": {"layers": {"block": [{**pt, "split_overhead": -0.1}]}}}})


def test_the_heads_loss_is_priced_at_the_devices_memory_bandwidth() -> None:
    """The loss over the logits is memory-bound: the catalog prices its passes (`loss_bytes_per_logit`) at the
    device's bandwidth, beside the head's FLOPs; its share is larger on a device whose FLOPs outrun its memory,
    the weight-gradient products stay their FLOPs' share of the matmul part, and every tp rank pays it whole."""
    model = preset_spec("llama-3.2-1b")  # a 128k-token vocabulary
    train = TrainSpec(global_batch=64, seq_len=2048)
    cm = CostModel(model, train)
    head = model.num_layers - 1
    layer = model.layers[head]
    assert layer.kind == "head"
    tokens = 2 * 2048
    for name in ("H100", "T4"):
        isl = _island(name, intra=300)
        t = cm.table(isl, 2)
        bw = device(name).memory_gbps * 1e9 * cm.options.memory_fraction
        fb, bb = loss_bytes_per_logit(2)
        assert t.loss == pytest.approx((fb * tokens * model.config.vocab_size / bw,
                                        bb * tokens * model.config.vocab_size / bw))
        matmul = t.bwd[head] - t.loss[1]
        assert matmul == pytest.approx(layer.flops_bwd_per_token * tokens
                                       / (isl.device.effective_flops("bf16", cm.fractions) * tokens
                                          / (tokens + cm.options.half_efficiency_tokens)))
        assert t.weight(head, head + 1) == pytest.approx(matmul * layer.flops_wgrad_per_token
                                                         / layer.flops_bwd_per_token)
        assert t.fwd[1] == pytest.approx(cm.table(isl, 2).fwd[1])  # blocks: unchanged
    # an H100's FLOPs outrun its memory more than a T4's: the loss is a larger share of its head
    share = {n: cm.table(_island(n), 2).loss[0] / cm.table(_island(n), 2).fwd[head] for n in ("H100", "T4")}
    assert share["H100"] > share["T4"] > 0.05
    # tp: the gathered logits' loss runs whole on every rank
    isl = _island("H100")
    one, two = cm.table(isl, 2), cm.table(isl, 2, tp=2)
    gather = cm.tp_allreduce_seconds(tokens * model.config.vocab_size * 2, 2, isl) / 2
    assert two.fwd[head] == pytest.approx((one.fwd[head] - one.loss[0]) / (2 * cm.tp_efficiency(2))
                                          + one.loss[0] + gather)
    # fp32: no casts
    assert loss_bytes_per_logit(4) == (8, 16)


def test_a_measured_head_keeps_its_own_time_and_an_unknown_bandwidth_prices_no_loss() -> None:
    doc = {"devices": {"V100-32GB": {"layers": {k: [{"micro_batch": 1, "seq_len": 2048, "forward_s": 0.01,
                                                     "backward_s": 0.02}] for k in ("embedding", "block", "head")}}}}
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048), ProfileSet.from_dict(doc))
    t = cm.table(_island("V100-32GB", intra=300), 1)
    assert t.loss == (0.0, 0.0) and t.fwd[-1] == pytest.approx(0.01)
    custom = parse_cluster('[[group]]\nname = "x"\ntflops = 100\nmemory_gb = 40\ncount = 4\n')
    assert custom.islands[0].device.memory_gbps == 0
    assert CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048)).table(custom.islands[0], 1).loss == (0.0, 0.0)
    given = parse_cluster('[[group]]\nname = "x"\ntflops = 100\nmemory_gb = 40\nmemory_gbps = 1200\ncount = 4\n')
    assert given.islands[0].device.memory_gbps == 1200
    assert CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048)).table(given.islands[0], 1).loss[0] > 0
    with pytest.raises(ValueError, match="memory_gbps"):
        parse_cluster('[[group]]\nname = "x"\ndevice = "A100"\nmemory_gbps = -1\ncount = 4\n')


def test_the_optimizer_step_runs_at_the_devices_memory_bandwidth() -> None:
    """AdamW's state updates are memory-bound: a T4 (320 GB/s) takes about 10x an H100 (3,350 GB/s) for the same
    parameters, not one figure for every device; a measured profile still overrides it."""
    cm = CostModel(MODEL, TrainSpec(global_batch=64, seq_len=2048))
    h100, t4 = (cm.optimizer_seconds(_island(n), 10**9, zero=0, group=1) for n in ("H100", "T4"))
    assert t4 / h100 == pytest.approx(3350 / 320)
    per_param = 2 * (cm.weight_bytes_per_param + cm.grad_bytes_per_param + cm.opt_bytes_per_param)
    assert h100 == pytest.approx(1e9 * per_param / (3350e9 * cm.options.memory_fraction))
    assert cm.optimizer_seconds(_island("H100"), 10**9, zero=1, group=4) == pytest.approx(h100 / 4)
    with pytest.raises(ValueError, match="memory_fraction"):
        PlannerOptions(memory_fraction=0)

"""`ulysses-trainer rehearse`: one rank of an N-rank job in one process on the fake process group, and the
model of the job's collectives that it adds (plan/collectives.py, plan/comm_model.py), checked against hand counts."""

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, free_port, train_env
from ulysses_trainer.plan.collectives import EVERY_LAYER, Collective, Job, step_collectives
from ulysses_trainer.plan.comm_model import A2A_STALL_S_PER_GB, Overlap, estimate, load_bandwidth, wire_bytes
from ulysses_trainer.plan.counts import param_numels
from ulysses_trainer.plan.inputs import ModelShape, Settings
from ulysses_trainer.vocabulary.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "launch/recipes/cpu_default.yaml")
MiB = 2**20


def _ops(shape, job, op):
    return [c for c in step_collectives(shape, job) if c.op == op]


def _by_name(rows, prefix):
    (row,) = [c for c in rows if c.name.startswith(prefix)]
    return row


# ------------------------------------------------------------------ the collective model, by hand


def test_all_to_alls_qwen3_8b_sp2_by_hand():
    # Qwen3-8B: 32 q heads, 8 KV heads, head_dim 128, 36 layers; sp = 2 over 2 GPUs, 262,144 tokens
    # in bf16: each rank holds t = 131,072 tokens.
    s = ModelShape.preset("qwen3-8b")
    job = Job(world_size=2, sp_size=2, local_tokens=131072, bytes_per_el=2)
    q_bytes = 131072 * 32 * 128 * 2  # q (and the attention output): t x 32 heads x 128 x 2 B = 1 GiB
    kv_bytes = 131072 * 8 * 128 * 2  # k, v: 8 KV heads, no copies (sp 2 divides 8) = 256 MiB
    assert (q_bytes, kv_bytes) == (1024 * MiB, 256 * MiB)
    a2a = _ops(s, job, "all_to_all")
    # per layer: forward 4 (q, k, v, out), checkpoint recompute 4, backward 4 = 12; 36 layers = 432
    assert sum(c.count for c in a2a) == 36 * 12 == 432
    fwd_q = _by_name(a2a, "ulysses forward q")
    assert (fwd_q.bytes, fwd_q.count) == (q_bytes, 2 * 36 * 2)  # q + out, forward + recompute
    fwd_kv = _by_name(a2a, "ulysses forward k")
    assert (fwd_kv.bytes, fwd_kv.count) == (kv_bytes, 2 * 36 * 2)
    bwd_q = _by_name(a2a, "ulysses backward q")
    assert (bwd_q.bytes, bwd_q.count) == (q_bytes, 2 * 36)
    # bytes through the all-to-alls per step and rank: 36 x 3 passes x (2 x 1 GiB + 2 x 256 MiB) = 270 GiB
    assert sum(c.total_bytes for c in a2a) == 36 * 3 * (2 * q_bytes + 2 * kv_bytes) == 270 * 1024 * MiB
    assert all(c.group_size == 2 and not c.crosses_nodes for c in a2a)


def test_all_to_alls_tiny_sp4_replicate_kv_heads_by_hand():
    # tiny: 8 q heads, 2 KV heads, head_dim 16, 2 layers; sp 4 > 2 KV heads: each KV head is copied twice
    # before the all-to-all, so k and v go out with 4 heads. fp32, t = 1024 tokens per rank.
    s = ModelShape.preset("tiny")
    job = Job(world_size=4, sp_size=4, local_tokens=1024, bytes_per_el=4)
    a2a = _ops(s, job, "all_to_all")
    assert _by_name(a2a, "ulysses forward q").bytes == 1024 * 8 * 16 * 4 == 512 * 1024
    assert _by_name(a2a, "ulysses forward k").bytes == 1024 * (2 * 2) * 16 * 4 == 256 * 1024
    assert sum(c.count for c in a2a) == 2 * 12 == 24
    # checkpoint_every 2: layer 1 keeps no input and its forward runs once more in backward: +4 all-to-alls
    thinned = Job(4, 4, 1024, bytes_per_el=4, levers=replace(EVERY_LAYER, checkpoint_every=2))
    assert sum(c.count for c in _ops(s, thinned, "all_to_all")) == 28
    # no checkpointing: forward and backward only, 8 per layer; gradient accumulation 3 triples it
    plain = Job(4, 4, 1024, grad_accum=3, bytes_per_el=4,
                levers=replace(EVERY_LAYER, gradient_checkpointing=False))
    assert sum(c.count for c in _ops(s, plain, "all_to_all")) == 3 * 2 * 8
    assert _ops(s, Job(4, 1, 4096, bytes_per_el=4), "all_to_all") == []  # sp 1 (dp 4): no all-to-all


def test_all_to_alls_qwen3_8b_sp16_two_nodes_replicate_and_cross_nodes():
    # sp 16 over two 8-GPU nodes: 16 > 8 KV heads -> 2 copies each, k/v go out with 16 heads = q's half
    s = ModelShape.preset("qwen3-8b")
    job = Job(world_size=16, sp_size=16, local_tokens=65536, gpus_per_node=8)
    a2a = _ops(s, job, "all_to_all")
    assert _by_name(a2a, "ulysses forward k").bytes == 65536 * 16 * 128 * 2
    assert all(c.crosses_nodes for c in a2a)
    assert all(not c.crosses_nodes for c in _ops(s, Job(16, 8, 131072, gpus_per_node=8), "all_to_all"))


def test_zero3_collectives_qwen3_8b_w4_by_hand():
    # ZeRO-3 over W = 4 ranks, bf16. Persistence threshold 10 x 4096 = 40,960 elements: the norms
    # (4096, and q_norm/k_norm 128) stay gathered; every projection is gathered where it is used.
    s = ModelShape.preset("qwen3-8b")
    job = Job(world_size=4, sp_size=4, local_tokens=65536)
    rows = [c for c in step_collectives(s, job) if c.op in ("all_gather", "reduce_scatter")]
    q = 4096 * 4096  # q_proj and o_proj
    kv = 4096 * 1024  # k_proj and v_proj (8 KV heads x 128)
    mlp = 4096 * 12288  # gate, up, down
    layer = 2 * q + 2 * kv + 3 * mlp + 2 * 4096 + 2 * 128  # 193M elements
    # a layer is gathered for its forward, released (its recompute comes after ~36 other layers and the
    # 622M-element lm_head: far beyond stage3_max_reuse_distance 1e9), gathered again for the checkpoint's
    # recompute and kept through its backward (within one layer's 193M elements): 2 per layer, 36 layers
    assert layer < 1e9 < 2 * 4096 * 151936
    assert _by_name(rows, "zero3 gather: q/o").bytes == q // 4 * 2 == 8 * MiB
    assert _by_name(rows, "zero3 gather: q/o").count == 2 * 2 * 36
    assert _by_name(rows, "zero3 gather: k/v").bytes == kv // 4 * 2 == 2 * MiB
    assert _by_name(rows, "zero3 gather: k/v").count == 2 * 2 * 36
    assert _by_name(rows, "zero3 gather: gate/up/down").bytes == mlp // 4 * 2 == 24 * MiB
    assert _by_name(rows, "zero3 gather: gate/up/down").count == 3 * 2 * 36
    emb = 151936 * 4096
    # embedding: forward and (after the whole backward) its backward; lm_head (untied): its backward follows
    # its forward at once, so 1
    head = _by_name(rows, "zero3 gather: embed + lm_head")
    assert (head.bytes, head.count) == (emb // 4 * 2, 2 + 1)
    # persistent tensors: gathered once each after the optimizer step; 2 x 36 + 1 of 4096, 2 x 36 of 128
    assert _by_name(rows, "zero3 gather: persistent 4096").count == 73
    assert _by_name(rows, "zero3 gather: persistent 128").count == 72
    # reduce-scatter, buckets of 4096**2 = q elements, filled in backward order: lm_head alone, then per
    # layer down | up | gate (each alone: 3 x mlp), post_attention_norm (4096, sent when o arrives),
    # o alone, v + k_norm + k + q_norm (8.39M, sent when q arrives), q alone (sent at input_norm); the
    # 4096 held at a layer's start (final norm or the input_norm above) is sent when down arrives; the
    # last input_norm when the embedding arrives; the embedding alone at the end.
    buckets = {c.bytes // 2: c.count for c in rows if c.op == "reduce_scatter"}
    assert buckets == {emb: 2, mlp: 3 * 36, q: 2 * 36, 2 * kv + 2 * 128: 36, 4096: 2 * 36 + 1}
    n = 2 * emb + 36 * layer + 4096
    assert n == sum(param_numels(s)) == 8_190_735_360
    assert sum(c.total_bytes for c in rows if c.op == "reduce_scatter") == 2 * n  # every gradient once, bf16
    # a tiled MLP (12 tiles: what auto picks at 131,072 tokens per rank) runs gate/up/down 12 x 2 times
    # between a layer's recompute and its attention's backward (12 x 6 x 50M elements > 1e9): q, k, v, o
    # are gathered a third time there; the MLP weights stay gathered across the tiles (2 per layer)
    tiled = step_collectives(s, Job(world_size=4, sp_size=4, local_tokens=65536,
                                        levers=replace(EVERY_LAYER, tiled_mlp=12)))
    assert 12 * 6 * mlp > 1e9
    assert _by_name(tiled, "zero3 gather: q/o").count == 2 * 3 * 36
    assert _by_name(tiled, "zero3 gather: k/v").count == 2 * 3 * 36
    assert _by_name(tiled, "zero3 gather: gate/up/down").count == 3 * 2 * 36
    # a reuse distance smaller than a layer: the backward gathers the layer a third time
    short = Job(world_size=4, sp_size=4, local_tokens=65536, max_reuse_distance=10_000_000)
    assert _by_name(step_collectives(s, short), "zero3 gather: q/o").count == 2 * 3 * 36


def test_zero3_tied_embedding_is_gathered_three_times():
    s = ModelShape.preset("qwen3-4b")  # tied: the lm_head is the embedding, gathered for it once more
    rows = step_collectives(s, Job(world_size=2, sp_size=2, local_tokens=65536))
    assert _by_name(rows, "zero3 gather: embed").count == 3


# ------------------------------------------------------------------ bandwidth and time


def test_a_plans_job_counts_with_the_plans_own_lever_record():
    # Job.of reads the settings' lever record (Settings.levers, what Plan.levers is made of), not copies of it:
    # thinning and tiles chosen by the plan reach the counts, and a record with an auto lever left is refused
    s = ModelShape.preset("qwen3-8b")
    run = Settings(max_length=262_144, layout=Layout(4, 4)).with_levers(checkpoint_every=2, tiled_mlp=12,
                                                                        activation_offload=3)
    job = Job.of(run)
    assert job.levers == run.levers
    assert (job.levers.checkpoint_every, job.levers.tiled_mlp, job.levers.activation_offload) == (2, 12, 3)
    by_hand = Job(world_size=4, sp_size=4, local_tokens=65536, gpus_per_node=4,
                  levers=replace(EVERY_LAYER, checkpoint_every=2, tiled_mlp=12))
    assert step_collectives(s, job) == step_collectives(s, by_hand)
    assert step_collectives(s, job) != step_collectives(s, Job(world_size=4, sp_size=4, local_tokens=65536,
                                                               gpus_per_node=4))
    with pytest.raises(ValueError, match="every one decided"):
        Job(4, 4, 1024, levers=replace(EVERY_LAYER, tiled_mlp="rule"))
    with pytest.raises(ValueError, match="every one decided"):
        Job(4, 4, 1024, levers=replace(EVERY_LAYER, checkpoint_every=None))


def test_wire_bytes_ring_factors():
    assert wire_bytes("all_gather", 100, 4) == 300  # every rank receives the 3 other shards
    assert wire_bytes("reduce_scatter", 400, 4) == 300
    assert wire_bytes("all_to_all", 400, 4) == 300
    assert wire_bytes("all_reduce", 400, 4) == 600
    assert wire_bytes("all_to_all", 400, 1) == 0


def test_default_bandwidth_is_named_and_assumed(tmp_path):
    bw = load_bandwidth(None)
    assert bw.source.startswith("assumed") and bw.busbw_gbps("all_to_all", 2**30) == 350.0
    assert load_bandwidth(str(tmp_path / "absent.json")).source.startswith("assumed")
    c = Collective("x", "all_to_all", "sp", 8, 2**30, 1)
    assert bw.seconds(c, 8) == pytest.approx(20e-6 + 2**30 * 7 / 8 / 350e9)


def test_measured_bandwidth_interpolates_and_floors_at_latency(tmp_path):
    path = tmp_path / "bw.json"
    pts = [{"op": "all_gather", "bytes": 2**20, "seconds": 1e-4, "busbw_gbps": 100.0},
           {"op": "all_gather", "bytes": 2**30, "seconds": 4e-3, "busbw_gbps": 300.0}]
    path.write_text(json.dumps({"device": "NVIDIA H200", "world_size": 2, "backend": "nccl", "points": pts}))
    bw = load_bandwidth(str(path), internode_gbps=40.0)
    assert bw.source.startswith("measured") and "all_to_all" in bw.source  # the op it lacks is named
    assert bw.busbw_gbps("all_gather", 2**25) == pytest.approx(200.0)  # halfway in log(bytes)
    assert bw.busbw_gbps("all_gather", 2**40) == 300.0
    big = Collective("g", "all_gather", "world", 8, 2**30, 1)
    assert bw.seconds(big, 8) == pytest.approx(7 * 2**30 / 300e9)
    assert bw.seconds(Collective("g", "all_gather", "world", 8, 16, 1), 8) == 1e-4  # latency floor
    cross = Collective("g", "all_gather", "world", 16, 2**30, 1, crosses_nodes=True)
    assert bw.seconds(cross, 8) == pytest.approx(15 * 2**30 / 40e9)  # the network is the bottleneck


def test_estimate_overlap_parameters():
    s = ModelShape.preset("qwen3-8b")
    job = Job(world_size=8, sp_size=8, local_tokens=131072)
    bw = load_bandwidth(None)
    e = estimate(s, job, bw, compute_s=100.0)
    assert e["zero3_exposed_s"] == 0.0  # 100 s of compute hides ZeRO-3's fraction of a second
    # exposed: every all-to-all, the small all-reduces, and the calibrated stall per all-to-all GB
    stall = A2A_STALL_S_PER_GB * e["by_op"]["all_to_all"]["bytes"] / 1e9
    assert e["a2a_stall_s"] == pytest.approx(stall) and stall > 0
    assert e["comm_s_estimate"] == pytest.approx(e["all_to_all_s"] + e["all_reduce_s"] + stall)
    none = estimate(s, job, bw, compute_s=100.0, overlap=Overlap(a2a_stall_s_per_gb=0.0))
    assert none["comm_s_estimate"] == pytest.approx(e["comm_s_estimate"] - stall)
    tight = estimate(s, job, bw, compute_s=0.01, overlap=Overlap(a2a_hidden=0.5, zero3_hidden=1.0))
    assert tight["zero3_exposed_s"] == pytest.approx(tight["zero3_s"] - 0.01)
    assert tight["all_to_all_exposed_s"] == pytest.approx(0.5 * tight["all_to_all_s"])
    unknown = estimate(s, job, bw, compute_s=None)
    assert unknown["zero3_hidden_assumed"] and unknown["zero3_exposed_s"] is None
    assert sum(r["seconds"] for r in e["ops"]) == pytest.approx(e["comm_s_total"])


# ------------------------------------------------------------------ the command


def _main(argv):
    from ulysses_trainer.cli.rehearse import main

    return main(argv)


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "4", "--rank", "4"], "--rank 4 is outside the job's ranks 0..3"),
    (["--gpus", "four"], "argument --gpus: invalid int value"),
    ([], "the following arguments are required: --gpus"),
    (["--gpus", "4", "--sp_size", "3"], "sp_size=3 does not divide the world size 4"),
    (["--gpus", "4", "--steps", "1"], "--steps must be >= 2"),
    (["--gpus", "4", "--gpus_per_node", "0"], "--gpus_per_node must be >= 1, got 0"),
    (["--gpus", "4", "--gpus_per_host", "0"], "--gpus_per_node must be >= 1, got 0"),  # plan's earlier spelling
    (["--gpus", "4", "--comm", "/nonexistent/bw.json"], "no such file"),
    (["--gpus", "4", "--no_such_field", "1"], "no_such_field"),
    (["--gpus", "4", "--max_length", "512", "--warmup_length", "1024"], "--warmup_length must be between 2"),
    (["--gpus", "4", "--host_cores", "0"], "--host_cores must be >= 1, got 0"),
    (["--gpus", "4", "--layer_times", "--gradient_accumulation_steps", "2"], "add --gradient_accumulation_steps 1"),
])
def test_bad_input_exits_2_with_one_message(argv, needle, capsys):
    assert _main(["--config", RECIPE, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_help_names_gpus_per_node_only():
    from ulysses_trainer.cli.rehearse import _parser

    text = _parser().format_help()
    assert "--gpus_per_node" in text and "--gpus_per_host" not in text


@pytest.mark.parametrize("rank", [0, 3])
def test_rehearse_rank_of_4_in_this_process(rank, tmp_path, monkeypatch, capsys):
    """Rank 0 or rank 3 of a 4-rank tiny job in this process: ZeRO-3 holds 1/4 of every parameter, the
    all-to-alls the run makes are the ones the model counts, and the JSON says what is measured and what
    is not. Rank 3 warms up on 64-token sequences; rank 0 tiles the MLP."""
    from ulysses_trainer.parallel import comm

    calls = []
    for name in ("_seq_to_heads", "_heads_to_seq"):
        real = getattr(comm, name)

        def counted(x, sp_size, group, _real=real):
            calls.append(x.numel() * x.element_size())
            return _real(x, sp_size, group)

        monkeypatch.setattr(comm, name, counted)
    shape = ModelShape.preset("tiny")
    out = tmp_path / f"rank{rank}.json"
    warmup = 64 if rank == 3 else 256
    tiles = ["--tiled_mlp", "2"] if rank == 0 else []  # the tiled MLP's module order, counted too
    assert _main(["--config", RECIPE, "--gpus", "4", "--rank", str(rank), "--max_length", "256", *tiles,
                  "--warmup_length", str(warmup), "--count_collectives", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["world_size"], r["rank"], r["sp_size"], r["dp_size"]) == (4, rank, 4, 1)
    assert r["losses_meaningful"] is False and r["standin"] is False and r["compute_time_real"] is True
    # every collective left this rank's own values: finite losses, every update ran (and was timed)
    assert r["collective_fill"] == "local"
    assert all(math.isfinite(x) for x in r["losses"]) and r["optimizer_update_skipped"] == [False, False]
    assert r["optimizer_step_s_added"] is None
    assert r["peak_host_mem_gb"] > 0 and r["compute_s"] > 0 and r["predicted_step_s"] >= r["compute_s"]
    assert r["tokens_per_s_predicted"] == pytest.approx(256 / r["predicted_step_s"])
    # ZeRO-3 partitions every tensor over 4 ranks: ceil(numel / 4) elements each, nothing more
    assert r["param_numel"] == sum(param_numels(shape))
    assert r["param_partition_numel"] == sum(-(-n // 4) for n in param_numels(shape))
    assert r["param_partition_max_excess"] == 0
    assert r["adam_state_bytes"] == 8 * r["param_partition_numel"]  # m and v, fp32, this rank's share
    # the all-to-alls the run made (2 steps) = the model's count and bytes per step, twice
    job = Job(world_size=4, sp_size=4, local_tokens=256 // 4, bytes_per_el=4)
    a2a = _ops(shape, job, "all_to_all")
    a2a_warmup = _ops(shape, Job(world_size=4, sp_size=4, local_tokens=warmup // 4, bytes_per_el=4), "all_to_all")
    assert len(calls) == 3 * sum(c.count for c in a2a)  # warm-up, timed step and the counted one
    assert sum(calls) == sum(c.total_bytes for c in a2a_warmup) + 2 * sum(c.total_bytes for c in a2a)
    # the counted step (steady state: DeepSpeed's trace exists) against the model, op by op
    counted, modelled = r["collectives_counted"], r["comm"]["by_op"]
    assert counted["all_to_all"] == modelled["all_to_all"]
    assert counted["reduce_scatter"] == modelled["reduce_scatter"]  # calls (bucketing) and bytes
    assert counted["all_gather"]["bytes"] == modelled["all_gather"]["bytes"]  # (k, v go in one call)
    assert counted["all_reduce"]["calls"] == modelled["all_reduce"]["calls"] - 1  # the stop flag is the loop's
    assert r["comm"]["all_to_all_s"] > 0 and r["comm"]["bandwidth_source"]
    printed = capsys.readouterr().out
    assert "losses meaningless" in printed and f"rehearsal rank {rank}/4" in printed


# one run per family, each at another sp (2 and 4): the counts are per layer, so the other pairs add time, not cover
@pytest.mark.parametrize("model, gpus", [("tiny-qwen3.5", 4), ("tiny-qwen3.5-moe", 2)])
def test_rehearse_counts_the_qwen3_5_layers_as_modelled(model, gpus, tmp_path):
    """Qwen3.5 (3 Gated DeltaNet layers, then one gated full-attention layer) as rank 1 of an sp=2 or sp=4 job: the
    DeltaNet layers' all-to-alls (channels before the conv, output after the rule; forward, recompute, backward)
    and their parameters' ZeRO-3 gathers and gradient buckets are the ones the comm model counts."""
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--model_name_or_path", model, "--gpus", str(gpus), "--rank", "1",
                  "--max_length", "256", "--warmup_length", "64", "--count_collectives", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["world_size"], r["sp_size"]) == (gpus, gpus)
    counted, modelled = r["collectives_counted"], r["comm"]["by_op"]
    shape = ModelShape.preset(model)
    # 3 DeltaNet layers x 2 a pass (forward, recompute, backward) + 1 attention layer x 4 a pass
    assert counted["all_to_all"]["calls"] == 3 * 3 * 2 + 3 * 4
    assert counted["all_to_all"] == modelled["all_to_all"]
    assert counted["reduce_scatter"] == modelled["reduce_scatter"]  # calls (bucketing) and bytes
    assert counted["all_gather"]["bytes"] == modelled["all_gather"]["bytes"]
    assert counted["all_reduce"]["calls"] == modelled["all_reduce"]["calls"] - 1  # the stop flag is the loop's
    rows = {o["name"]: o for o in r["comm"]["ops"]}
    assert rows["ulysses forward DeltaNet rule output"]["count"] == 2 * len(shape.mixer_layers)  # fwd, recompute
    gathered = {n for name in rows if name.startswith("zero3 gather: ") for n in name[14:].split("/")}
    assert {"qkv", "conv", "z", "out", "q", "o"} <= gathered  # the DeltaNet layers' and the attention layer's


def _row(docs: list[int], pads: int = 0) -> dict:
    """A row of documents of `docs` tokens each (positions restart at each), then `pads` pads."""
    import torch

    pos = torch.cat([torch.arange(n) for n in docs] + ([torch.arange(pads)] if pads else []))
    row = {"input_ids": torch.arange(len(pos)) % 97, "position_ids": pos, "labels": torch.arange(len(pos)) % 97}
    if pads:
        row["real_tokens"] = sum(docs)
    return row


@pytest.mark.parametrize("docs, pads, length", [
    ([1024], 0, 64),                 # one document: the dense path
    ([700, 200, 124], 0, 64),        # packed: varlen
    ([900], 124, 64),                # one document and pads
    ([500, 300], 224, 64),           # packed and pads
    ([3] * 300 + [124], 0, 8),       # more documents than warm-up tokens: still packed
    ([1000, 24], 0, 2),              # the shortest warm-up keeps two documents
    ([1023], 1, 16),                 # one pad stays a pad
])
def test_the_warm_up_row_keeps_the_rows_layout(docs, pads, length):
    """The warm-up step's row (rehearsal.warmup_row) is the row's layout scaled to the warm-up length: packed
    iff the row is, pads iff the row has them, positions restarting at each scaled document start, so the
    warm-up compiles the kernels the timed step runs (varlen kernels compile apart from dense ones)."""
    from ulysses_trainer.parallel.sharding import document_layout
    from ulysses_trainer.train.rehearsal import warmup_row

    row = _row(docs, pads)
    w = warmup_row(row, length)
    assert all(len(w[k]) == length for k in ("input_ids", "position_ids", "labels"))
    assert w["position_ids"].dtype == row["position_ids"].dtype

    def layout(r):
        real = int(r.get("real_tokens", len(r["input_ids"])))
        cu, _, packed, pad_spans = document_layout(r["position_ids"][None], [real])
        return packed, bool(pad_spans), cu

    packed, padded, cu = layout(w)
    assert (packed, padded) == layout(row)[:2]
    real = int(w.get("real_tokens", length))
    assert 1 <= real <= length and (real < length) == (pads > 0)
    starts = cu[:-1].tolist()
    docs_w = [b - a for a, b in zip(starts, starts[1:] + [length]) if a < real]
    assert all(n >= 1 for n in docs_w) and sum(docs_w) == real
    if len(docs) * 4 <= length:  # room for every document: they all stay
        assert len(docs_w) == len(docs)
    # positions restart at every kept start and count up inside each document
    for a in starts:
        if a < real:
            assert int(w["position_ids"][a]) == 0
    assert warmup_row(row, len(row["input_ids"])) is row  # the full length: the row itself


def test_the_warm_up_cuts_the_timed_steps_rows(monkeypatch):
    """The warm-up runs the timed step's rows cut short, not step 0's: a step 0 of one document and a timed step of
    packed ones would otherwise leave the varlen kernels' compile and autotune in the timed step."""
    from types import SimpleNamespace

    from ulysses_trainer.parallel.sharding import document_layout
    from ulysses_trainer.train import data_order, rehearsal

    rows = {0: [[_row([1024])]], 1: [[_row([600, 424])]]}  # per step: micro-batches of rows
    monkeypatch.setattr(data_order, "micro_batch_rows", lambda plan, dp_rank, step: rows[step])
    trainer = SimpleNamespace(prepared=None, state=SimpleNamespace(dp_rank=0), shard_rows=lambda micro: micro)
    (micro,) = rehearsal._warmup_batches(trainer, 64, timed_step=1)
    (row,) = micro
    assert len(row["input_ids"]) == 64
    assert document_layout(row["position_ids"][None], [64])[2]  # packed, as the timed step's row


def test_the_rehearsed_compute_is_the_median_of_the_steps_after_the_warm_up(tmp_path, monkeypatch):
    """compute_s as the trainer's end-of-run line measures a step (train/metrics.steady_step_s): with four steps,
    the median of the three after the warm-up, not their mean. After a shorter warm-up, the kernels whose tuning is
    keyed by the token count (attention/length_tuned.py: fla's q/k L2 norm) are tuned for the timed step's tokens,
    once, outside the timed steps."""
    from ulysses_trainer.attention import length_tuned

    monkeypatch.setattr(length_tuned, "_TUNERS", {})
    asked = []
    length_tuned.register(("a length-keyed kernel", 2, 64), asked.append)
    length_tuned.register(("a length-keyed kernel", 2, 64), asked.append)  # the same shape again: one tuner
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "2", "--max_length", "256", "--steps", "4", "--host_cores", "2",
                  "--warmup_length", "64", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["step_s"]) == 4 and r["optimizer_step_s_added"] is None
    assert r["compute_s"] == statistics.median(r["step_s"][1:])
    assert (r["host_cores"], r["cores_per_rank"]) == (2, 1)  # the node's 2 cores over its 2 ranks
    assert asked == [256] and r["length_tuning_s"] >= 0  # one micro-batch row of 256 tokens, tuned once


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and 2 cores")
def test_a_rank_runs_on_its_share_of_the_cores_and_gets_them_back():
    """rehearsal.cores_share: every thread of the process (a worker started before it too) on the first n cores
    while the step runs, as a rank of the node; the affinity restored after."""
    import threading

    from ulysses_trainer.train.rehearsal import cores_share

    before = os.sched_getaffinity(0)
    seen, go, done = {}, threading.Event(), threading.Event()

    def worker():
        go.wait()
        seen["inside"] = os.sched_getaffinity(0)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    with cores_share(1):
        assert os.sched_getaffinity(0) == {min(before)}
        go.set()
        done.wait(10)
    t.join()
    assert seen["inside"] == {min(before)}
    assert os.sched_getaffinity(0) == before


def test_a_skipped_update_under_local_fill_is_an_error(tmp_path, monkeypatch, capsys):
    """With real-looking collective outputs the gradients are finite; a step whose update DeepSpeed still skips
    would leave the optimizer untimed, so the rehearsal fails (exit 1) naming the step instead of reporting."""
    from ulysses_trainer.train.trainer import Trainer

    real = Trainer.train_step

    def skipping(self, batches):
        out = real(self, batches)
        self.engine.skipped_steps += 1  # as DeepSpeed counts an update it skipped on a non-finite norm
        return out

    monkeypatch.setattr(Trainer, "train_step", skipping)
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "2", "--max_length", "128", "--out", str(out)]) == 1
    assert "rehearsal update skipped (non-finite gradient norm) in step(s) [1, 2]" in capsys.readouterr().err
    assert not out.exists()


def test_out_of_memory_is_a_result_too(tmp_path, monkeypatch, capsys):
    """A length that does not fit: exit 1, and --out still says so (the memory search reads it)."""
    import torch

    from ulysses_trainer.cli import rehearse

    def oom(plan, opts):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(rehearse, "run_rehearsal", oom)
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "4", "--max_length", "512", "--out", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["status"] == "oom" and "Tried to allocate 2.00 GiB" in r["error"] and r["predicted_step_s"] is None
    assert (r["world_size"], r["max_length"]) == (4, 512)
    assert "out of GPU memory at 512 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["out of memory building the engine", "plan mismatch"])
def test_the_trainers_own_errors_are_one_line_and_their_exit_code(kind, tmp_path, monkeypatch, capsys):
    """Out of GPU memory while the trainer builds the engine is a result as a step's is; any other of the
    package's errors is its one line and exit code, no traceback."""
    from ulysses_trainer.cli import rehearse
    from ulysses_trainer.errors import PlanMismatchError
    from ulysses_trainer.train.out_of_memory import OutOfGpuMemory

    def fail(plan, opts):
        if kind == "plan mismatch":
            raise PlanMismatchError("the ranks resolved different plans")
        raise OutOfGpuMemory("out of GPU memory while building the engine", ())

    monkeypatch.setattr(rehearse, "run_rehearsal", fail)
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "4", "--max_length", "512", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if kind == "plan mismatch":
        assert err.strip().endswith("error: the ranks resolved different plans") and not out.exists()
    else:
        assert json.loads(out.read_text())["status"] == "oom" and "out of GPU memory at 512 tokens" in err


def test_host_standin_holds_two_slots_and_counts_the_rest(tmp_path, capsys):
    """--host_standin: the offloaded layer inputs share two host slots; the result counts what the job's host
    holds (every offloaded layer's slot) and adds the slots not held to the measured peak."""
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "4", "--max_length", "256", "--standin", "--host_standin",
                  "--steps", "1", "--model_init_kwargs", '{"num_hidden_layers": 4}', "--activation_offload", "3",
                  "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["host_standin"] is True and r["offloaded_layers"] == 3
    slot = r["host_offload_counted_gb"] / 3  # one layer's input, page-aligned: [1, 256 / 4, hidden] fp32
    assert slot * 2**30 == -(-64 * ModelShape.preset("tiny").hidden * 4 // 4096) * 4096
    assert r["host_offload_held_gb"] == pytest.approx(2 * slot)
    assert r["peak_host_job_gb"] == pytest.approx(r["peak_host_mem_gb"] + slot)
    assert "GiB of offloaded inputs counted" in capsys.readouterr().out


def test_host_standin_times_the_step_on_a_smaller_host(tmp_path):
    """--host_standin without --standin: a timed rehearsal (the real kernels) whose offloaded inputs share two host
    slots; every step computes finite values from real activations, so the update runs and the time is the job's."""
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "2", "--max_length", "128", "--host_standin",
                  "--model_init_kwargs", '{"num_hidden_layers": 4}', "--activation_offload", "3",
                  "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["host_standin"] is True and r["standin"] is False and r["compute_time_real"] is True
    assert r["offloaded_layers"] == 3 and not any(r["optimizer_update_skipped"])
    assert r["host_offload_held_gb"] == pytest.approx(r["host_offload_counted_gb"] * 2 / 3)
    assert all(math.isfinite(x) for x in r["losses"]) and r["compute_s"] > 0


def test_layer_times_of_the_last_step(tmp_path, capsys):
    """--layer_times: the last timed step layer by layer in the JSON (every layer's forward and recompute, every
    backward but the bottom layer's, which runs to the step's end), inside the step, and a summary line."""
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "2", "--max_length", "128", "--layer_times",
                  "--model_init_kwargs", '{"num_hidden_layers": 3}', "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    t = r["layer_times"]
    assert len(t["forward_s"]) == len(t["recompute_s"]) == len(t["backward_s"]) == 3
    assert None not in t["forward_s"] + t["recompute_s"] + t["backward_s"][1:] and t["backward_s"][0] is None
    parts = [t["before_layers_s"], *t["forward_s"], t["loss_s"], *t["recompute_s"], *t["backward_s"][1:],
             t["last_backward_and_update_s"]]
    assert min(parts) >= 0 and sum(parts) <= t["step_s"] <= r["step_s"][-1]
    assert t["unaccounted_s"] == pytest.approx(t["step_s"] - sum(parts))
    assert "layer times of the last step" in capsys.readouterr().out
    # the plan's step and floor beside the measurement, and the card whose rates they read (none on CPU)
    assert r["plan_step_s"] == r["predicted_by_plan_step_s"] and "plan_floor_s" in r
    assert r["plan_rates_card"] == "h200"


@pytest.mark.slow
def test_rehearse_command_standin_with_dp(tmp_path):
    """The real command: rank 5 of 8 as sp 4 x dp 2 with the memory-only stand-in prints the summary and
    JSON; compute time and prediction are withheld (the stand-in does no attention math)."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "ulysses_trainer", "rehearse", "--config", RECIPE, "--gpus", "8", "--rank", "5",
           "--sp_size", "4", "--max_length", "512", "--standin", "--steps", "1", "--json", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert json.loads(res.stdout[res.stdout.index("{\n"):]) == r
    assert (r["sp_size"], r["dp_size"], r["rank"]) == (4, 2, 5)
    assert r["standin"] is True and r["attention_kernel"] == "standin_memory_only"
    assert r["compute_s"] is None and r["predicted_step_s"] is None and r["compute_time_real"] is False
    assert r["comm"]["zero3_hidden_assumed"] is True
    assert "rehearsal rank 5/8" in res.stdout and "losses meaningless" in res.stdout


@pytest.mark.slow
def test_rehearse_standin_takes_flash_attn_4s_path_when_the_run_names_it(tmp_path):
    """`--standin --attn_implementation flash_attention_4` (flash-attn-4 need not be installed: nothing of it
    runs): the stand-in on its path, every layer group by group; the JSON names it."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "ulysses_trainer", "rehearse", "--config", RECIPE, "--gpus", "4", "--rank", "1",
           "--sp_size", "4", "--max_length", "512", "--standin", "--steps", "1", "--attn_implementation",
           "flash_attention_4", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["standin"] is True and r["attention_kernel"] == "standin_memory_only_fa4"


def test_the_fa4_stand_in_runs_group_by_group_with_one_kv_head(monkeypatch):
    """Where ours' rule runs all heads at once (one KV head per rank, nothing kept), flash-attn-4's stand-in
    still goes through the groups, as flash-attn-4 does."""
    import torch

    from ulysses_trainer.attention import standin

    calls = []
    real = standin.grouped_attention
    monkeypatch.setattr(standin, "grouped_attention", lambda *a, **k: calls.append(a[4].name) or real(*a, **k))
    q, k, v = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8)
    standin.standin_attention(q, k, v, scale=0.35)
    assert calls == []  # ours' rule: one group and nothing kept -> all heads at once
    out = standin.standin_attention_fa4(q, k, v, scale=0.35)
    assert calls == ["standin"] and out.shape == q.shape


@pytest.mark.slow
def test_comm_bandwidth_benchmark_writes_what_the_rehearsal_reads(tmp_path):
    """benchmarks/comm_bandwidth.py under torchrun (2 ranks, gloo, tiny sizes): every op at every size, in
    the format load_bandwidth reads back as measured."""
    out = tmp_path / "bw.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "benchmarks/comm_bandwidth.py", "--backend", "gloo", "--sizes", "4096,65536", "--dtype", "float32",
           "--warmup", "1", "--iters", "2", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["world_size"], data["backend"]) == (2, "gloo")
    assert sorted((p["op"], p["bytes"]) for p in data["points"]) == sorted(
        (op, b) for op in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce") for b in (4096, 65536))
    for p in data["points"]:  # busbw is the ring-factor wire bytes over the time
        assert p["busbw_gbps"] == pytest.approx(wire_bytes(p["op"], p["bytes"], 2) / p["seconds"] / 1e9)
    bw = load_bandwidth(str(out))
    assert bw.source.startswith("measured") and "assumed" not in bw.source
    assert bw.busbw_gbps("all_gather", 65536) == pytest.approx(
        next(p["busbw_gbps"] for p in data["points"] if (p["op"], p["bytes"]) == ("all_gather", 65536)))


@pytest.mark.gpu
def test_rehearse_on_a_gpu_measures_gpu_memory(tmp_path):
    out = tmp_path / "r.json"
    assert _main(["--config", RECIPE, "--gpus", "2", "--max_length", "4096", "--attn_implementation", "sdpa",
                  "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["peak_gpu_mem_gb"] > 0 and r["peak_gpu_reserved_gb"] >= r["peak_gpu_mem_gb"]
    assert r["device"] != "cpu" and r["compute_s"] > 0


# ------------------------------------------------------------------ the committed rehearsals

RESULTS = ROOT / "benchmarks" / "results"
TIMED = ("sp2_4b_131k", "sp2_8b_262k", "reference_8gpu_1m", "two_nodes_sp16")
REAL_SP2 = {"sp2_4b_131k": "metrics_sp2_4b_131k.jsonl", "sp2_8b_262k": "metrics_sp2_8b_262k.jsonl"}


def _rehearsed(name):
    return json.loads((RESULTS / "rehearsal" / f"rehearse_{name}.json").read_text())


def _real_step_s(name):
    """The real 2-GPU run's second (warm) step: its tokens over its tokens per second."""
    rows = [json.loads(line) for line in (RESULTS / "sp2" / REAL_SP2[name]).read_text().splitlines()]
    return (rows[1]["num_tokens"] - rows[0]["num_tokens"]) / rows[1]["tokens_per_s"]


def _stall_free(r):
    c = r["comm"]
    return r["compute_s"] + c["all_to_all_exposed_s"] + c["all_reduce_s"] + c["zero3_exposed_s"]


@pytest.mark.parametrize("name", TIMED)
def test_committed_rehearsals_ran_on_local_fill_and_add_up(name):
    r = _rehearsed(name)
    assert r["collective_fill"] == "local" and not any(r["optimizer_update_skipped"])
    assert all(math.isfinite(x) for x in r["losses"]) and r["optimizer_step_s_added"] is None
    assert r["compute_s"] == r["step_s"][-1]  # the timed step, the optimizer inside it
    c = r["comm"]
    assert c["overlap"]["a2a_stall_s_per_gb"] == A2A_STALL_S_PER_GB
    assert c["a2a_stall_s"] == pytest.approx(A2A_STALL_S_PER_GB * c["by_op"]["all_to_all"]["bytes"] / 1e9)
    assert r["predicted_step_s"] == pytest.approx(_stall_free(r) + c["a2a_stall_s"])
    assert r["tokens_per_s_predicted"] == pytest.approx(r["tokens_per_step"] / r["predicted_step_s"])


def test_stall_term_is_the_real_sp2_runs_left_over():
    """A2A_STALL_S_PER_GB = mean over the two real sp=2 runs of (real step - rehearsed compute - wire time) per
    GB of all-to-all input; each rehearsal then lands within 5% of its real run (within 1% measured)."""
    per_gb = []
    for name in REAL_SP2:
        r = _rehearsed(name)
        per_gb.append((_real_step_s(name) - _stall_free(r)) / (r["comm"]["by_op"]["all_to_all"]["bytes"] / 1e9))
    assert A2A_STALL_S_PER_GB == round(sum(per_gb) / len(per_gb), 4)
    for name in REAL_SP2:
        assert abs(_rehearsed(name)["predicted_step_s"] / _real_step_s(name) - 1) <= 0.05


def test_the_27b_longest_rehearsal_is_what_docs_qwen3_5_states():
    """The committed memory rehearsal of Qwen3.5-27B at the plan's longest (host stand-in): it ran, the job's host
    is the measured peak plus the slots counted and not held, and docs/qwen3_5.md's table carries its numbers."""
    r = _rehearsed("qwen3_5_27b_2777088_standin")
    assert r["status"] == "ok" and r["standin"] is True and r["host_standin"] is True
    assert (r["max_length"], r["world_size"], r["offloaded_layers"]) == (2777088, 8, 64)
    assert r["peak_host_job_gb"] == pytest.approx(r["peak_host_mem_gb"] + r["host_offload_counted_gb"]
                                                  - r["host_offload_held_gb"])
    row = {line.split("|")[1].strip(): line for line in (ROOT / "docs" / "qwen3_5.md").read_text().splitlines()
           if line.startswith("| GPU ") or line.startswith("| host |")}
    assert f"**{r['peak_gpu_mem_gb']:.2f} GiB**" in row["GPU allocated at the peak"]
    assert f"{r['predicted_by_plan_peak_gpu_gb']:.2f} GiB" in row["GPU allocated at the peak"]
    assert f"**{r['peak_gpu_reserved_gb']:.2f} GiB**" in row["GPU reserved by the allocator"]
    assert f"**{r['peak_host_job_gb']:.2f} GiB** ({r['peak_host_mem_gb']:.2f} measured" in row["host"]

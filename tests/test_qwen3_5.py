"""Qwen3.5 (Gated DeltaNet + gated full attention, dense and MoE) under Ulysses SP equals stock transformers.

Ranks are threads (tests/threaded_ranks.py: the all-to-alls move the data for real). The reference shares no code
with the SP path: the stock Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM with SDPA, one forward per packed document
(so "a packed row equals its documents run one by one"), F.cross_entropy over the trained targets. fp32 on the CPU:
loss rel <= 1e-5, every gradient ||g - g_ref|| / ||g_ref|| <= 1e-5.

The models are the tiny presets with a 503-token vocabulary (the preset's 248,320 only makes the embedding big).
A_log is drawn from [-3, 0] (decay rates 0.05..1 per unit softplus) rather than transformers' init (rates up to
16, whose decays underflow to 0 and leave A_log / dt_bias gradients made of rounding alone).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.sp_rank import sp_steps, summed_grads
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.vocabulary.layout import Layout

VOCAB = 503
IGNORE = -100


def build(preset: str, seed: int = 0, vocab: int = VOCAB, **overrides):
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config

    config = preset_config(preset)
    config.vocab_size = vocab
    config.output_router_logits = False  # the CE alone: the aux loss is RouterStats' (tests/test_moe.py)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-3.0, 0.0)
    return model



def lora_model(preset: str, build=build):
    """The preset (`build`: this file's, or a family test's own) with LoRA on every Linear the family adapts (the
    trainer's add_lora, all-linear, r 4), B drawn so the adapters act."""
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.lora import add_lora

    cfg = TrainConfig(model_name_or_path=preset, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                      lora_target_modules="all-linear")
    model, _ = add_lora(build(preset), cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model

def batch(length: int, docs: list[int] | None, seed: int = 0, masked: bool = False, vocab: int = VOCAB):
    """ids [1, L], positions restarting per document, labels (masked: the first third of each document is a
    prompt, not trained on)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, length), generator=g)
    docs = docs or [length]
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    labels = ids.clone()
    if masked:
        labels[0, pos[0] < torch.cat([torch.full((n,), n // 3) for n in docs])] = IGNORE
    return ids, pos, labels


def reference(model, ids, pos, labels):
    """Stock transformers, one forward per document: (loss, grads)."""
    total, count = 0.0, 0
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    for a, e in zip(starts[:-1], starts[1:]):
        logits = model(input_ids=ids[:, a:e]).logits.float()
        target = labels[0, a + 1:e]
        total = total + F.cross_entropy(logits[0, :-1], target, reduction="sum", ignore_index=IGNORE)
        count += int((target != IGNORE).sum())
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None}  # frozen weights (LoRA) have none


def sp_run(models, ids, pos, labels, **levers):
    """Each thread a rank with its own copy of the model: (global loss, summed grads)."""
    out = sp_steps(models, ids, pos, labels, **{"loss_chunk_size": 7, **levers})
    return out[0].loss, summed_grads(out)


def assert_equal(got, ref):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-5, (loss, ref_loss)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, g_ref in ref_grads.items():
        rel = float(torch.linalg.norm(grads[name] - g_ref) / torch.linalg.norm(g_ref))
        assert rel <= 1e-5, f"{name}: relative gradient error {rel:.2e}"


# sp 1, 2, 4 (4 > the 2 KV heads: replicated; the 4 key / 8 value DeltaNet heads split); packed documents (two
# cross a rank boundary, one a 64-token chunk boundary); assistant-only style masks; the MoE model
CASES = [
    ("tiny-qwen3.5", 1, None, False),
    ("tiny-qwen3.5", 2, [30, 41], True),
    ("tiny-qwen3.5", 4, [9, 66, 12, 3], False),
    ("tiny-qwen3.5-moe", 2, None, True),
    ("tiny-qwen3.5-moe", 4, [20, 51, 19], False),
]


@pytest.mark.parametrize("preset, sp_size, docs, masked", CASES)
def test_sp_equals_stock_transformers(preset, sp_size, docs, masked):
    length = sum(docs) if docs else 67  # 67: padded to 68 (sp 2, 4)
    ids, pos, labels = batch(length, docs, seed=sp_size, masked=masked)
    ref = reference(build(preset), ids, pos, labels)
    assert_equal(sp_run([build(preset) for _ in range(sp_size)], ids, pos, labels), ref)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_levers_change_memory_not_results(preset):
    # checkpointing with every input offloaded to the host pool, checkpoint_every 2, MLP / experts in 3 tiles
    ids, pos, labels = batch(70, [33, 37], seed=5, masked=True)
    ref = reference(build(preset), ids, pos, labels)
    levers = dict(gradient_checkpointing=True, activation_offload=True, checkpoint_every=2, tiled_mlp=3)
    assert_equal(sp_run([build(preset) for _ in range(2)], ids, pos, labels, **levers), ref)


def test_chunked_loss_at_the_real_vocabulary():
    # the preset's 248,320-token vocabulary (tied): the loss head's 7-row chunks against full logits
    ids, pos, labels = batch(41, [19, 22], seed=8, vocab=248320)
    ref = reference(build("tiny-qwen3.5", vocab=248320), ids, pos, labels)
    assert_equal(sp_run([build("tiny-qwen3.5", vocab=248320) for _ in range(2)], ids, pos, labels), ref)


def test_yarn_reaches_the_full_attention_layers_only():
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import resolve_rope_parameters

    yarn = preset_config("tiny-qwen3.5")
    resolve_rope_parameters(yarn, {"rope_type": "yarn", "factor": "auto",
                                   "original_max_position_embeddings": 32}, 128)
    assert yarn.rope_parameters["rope_type"] == "yarn" and yarn.rope_parameters["factor"] == 4.0
    assert yarn.rope_parameters["partial_rotary_factor"] == 0.25  # still the first 8 of 32 dimensions rotate
    rotary = build("tiny-qwen3.5", rope_parameters=yarn.rope_parameters).model.rotary_emb
    assert rotary.inv_freq.shape == (4,)
    over = dict(rope_parameters=yarn.rope_parameters, max_position_embeddings=yarn.max_position_embeddings)
    ids, pos, labels = batch(70, [70], seed=6)
    ref = reference(build("tiny-qwen3.5", **over), ids, pos, labels)
    plain = reference(build("tiny-qwen3.5"), ids, pos, labels)
    assert abs(ref[0] - plain[0]) > 1e-6  # the lever changes the model (positions past 32 rotate differently)
    assert_equal(sp_run([build("tiny-qwen3.5", **over) for _ in range(2)], ids, pos, labels), ref)


def test_sp_sizes_the_deltanet_heads_refuse():
    from ulysses_trainer.plan.inputs import ModelShape, Settings, check_settings

    shape = ModelShape.preset("qwen3.5-27b")  # 24 q / 4 kv heads; DeltaNet 16 key / 48 value heads
    check_settings(shape, Settings(max_length=1024, layout=Layout(8, 8)))  # 8 > 4 KV heads: replicated
    with pytest.raises(ConfigError, match=r"sp_size=3 does not divide the model's 16 linear-attention .*"
                                          r"sp_size values that work for this model: \[1, 2, 4, 8\]"):
        check_settings(shape, Settings(max_length=1024, layout=Layout(3, 3)))


def test_presets_count_the_published_sizes():
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape

    for name in ("tiny-qwen3.5", "tiny-qwen3.5-moe"):  # the plan's count is the built model's
        model = AutoModelForCausalLM.from_config(preset_config(name))
        assert ModelShape.preset(name).num_params == sum(p.numel() for p in model.parameters())
    billions = {n: (ModelShape.preset(n).num_params / 1e9, ModelShape.preset(n).num_active_params / 1e9)
                for n in ("qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b")}
    assert 26.5 < billions["qwen3.5-27b"][0] < 27.5
    assert 34 < billions["qwen3.5-35b-a3b"][0] < 36 and 3 < billions["qwen3.5-35b-a3b"][1] < 3.6
    assert 390 < billions["qwen3.5-397b-a17b"][0] < 400 and 16.5 < billions["qwen3.5-397b-a17b"][1] < 18


def test_deltanet_kernel_auto_takes_fla_where_installed_and_the_plan_names_it():
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.plan.inputs import ModelShape
    from ulysses_trainer.plan.resolve import resolve_plan
    from ulysses_trainer.plan.types import Machine, ZeroSettings

    def plan(model, installed, **cfg):
        machine = Machine(gpus=1, gpu_memory_gb=139.8, host_memory_gb=125.9, gpu_name="NVIDIA H200",
                          deltanet_kernels=installed)
        config = TrainConfig(model_name_or_path=model, max_length=32768, sp_size=1, **cfg)
        return resolve_plan(config, ModelShape.preset(model), machine, ZeroSettings())

    fla = plan("qwen3.5-9b", ("fla", "torch"))
    assert fla.run.deltanet_kernel == "fla" and ", fla deltanet," in fla.summary()
    assert "deltanet_kernel fla" in fla.decided and fla.model_setup(None, 1).deltanet_kernel == "fla"
    assert plan("qwen3.5-9b", ("torch",)).run.deltanet_kernel == "torch"
    assert plan("qwen3.5-9b", ("fla", "torch"), deltanet_kernel="torch").run.deltanet_kernel == "torch"
    with pytest.raises(ConfigError, match="deltanet_kernel='fla' is not installed here .*flash-linear-attention"):
        plan("qwen3.5-9b", ("torch",), deltanet_kernel="fla")
    qwen3 = plan("qwen3-4b", ("fla", "torch"))  # no DeltaNet layer: no kernel named
    assert qwen3.run.deltanet_kernel == "" and "deltanet" not in qwen3.summary()


def _zero3_rank(rank, world_size, preset, ids, pos, labels):
    from tests.dist_utils import sp_zero3_step
    from ulysses_trainer import ParallelizeConfig, make_parallel_state, parallelize

    state = make_parallel_state(world_size)
    model = parallelize(build(preset), state, ParallelizeConfig(attn_implementation="sdpa", loss_chunk_size=7,
                                                                  tiled_mlp=2, gradient_checkpointing=True))
    step = sp_zero3_step(model, state, ids, position_ids=pos, labels=labels,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return step["loss"], step["grads"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_sp2_under_zero3_equals_stock_transformers(preset):
    # a real DeepSpeed ZeRO-3 engine: the DeltaNet conv rows, A_log and dt_bias slices come from gathered
    # parameters and their gradients reduce into the partitions; packed, masked, checkpointed, tiled
    from tests.dist_utils import run_ranks

    ids, pos, labels = batch(61, [25, 36], seed=7, masked=True)
    ref = reference(build(preset), ids, pos, labels)
    for got in run_ranks(2, _zero3_rank, preset, ids, pos, labels):
        assert_equal(got, ref)


def _fla_conv_as_documented(x, weight, bias=None, activation=None, cu_seqlens=None, **_):
    """fla's causal_conv1d as its docstring defines it (x [B, T, D], weight [D, W], cu_seqlens over a B = 1 batch),
    written with torch's conv1d: what the trainer's call into it must match."""
    assert bias is None and x.is_contiguous()
    w = weight.shape[1]

    def one(seg):  # [T', D] -> [T', D]
        y = F.conv1d(F.pad(seg.t()[None], (w - 1, 0)), weight[:, None], groups=seg.shape[1])[0].t()
        return F.silu(y) if activation == "silu" else y

    if cu_seqlens is None:
        return torch.stack([one(row) for row in x]), None
    assert x.shape[0] == 1 and cu_seqlens.dtype == torch.long
    bounds = cu_seqlens.tolist()
    return torch.cat([one(x[0, a:e]) for a, e in zip(bounds[:-1], bounds[1:])])[None], None


@pytest.mark.parametrize("packed", [False, True])
def test_fla_conv_call_matches_the_torch_conv(packed, monkeypatch):
    """The mixer's conv through fla (families/qwen3_5/deltanet_kernels.fla_conv_tokens) hands fla's causal_conv1d
    the layout, weight and documents it documents: against fla's definition written in torch, the output and both
    gradients equal the torch conv's, on the mixer's own strided view of its packed channels."""
    from ulysses_trainer.families.qwen3_5 import deltanet_kernels as deltanet

    monkeypatch.setattr(deltanet, "_fla_conv_function", lambda: _fla_conv_as_documented)
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 50, 12 + 3, generator=g)  # [b, s, C + 3]: the conv's channels and two more fields
    w = torch.randn(12, 4, generator=g)
    cu = torch.tensor([0, 20, 50, 100], dtype=torch.int32) if packed else None
    outs = []
    for fn in (deltanet.fla_conv_tokens, deltanet.torch_conv_tokens):
        x, wt = wide.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(x[..., :12], wt, cu)  # a [b, s, 12] view with a token stride of 15
        y.backward(torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).sin())
        outs.append((y.detach(), x.grad, wt.grad))
    for a, b in zip(*outs):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    assert deltanet.CONV_FUNCTIONS["fla"] is deltanet.fla_conv_tokens  # the kernel's name picks both parts


def test_conv_and_rule_keep_packed_documents_apart():
    from ulysses_trainer.families.qwen3_5.deltanet_kernels import causal_conv, torch_rule

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 12, 50, generator=g), torch.randn(12, 4, generator=g)  # rows of 50: docs 20+30 | 50
    cu = torch.tensor([0, 20, 50, 100])

    def conv(xd):  # one document alone, torch's own causal conv
        return F.silu(F.conv1d(xd, w.unsqueeze(1), padding=3, groups=12)[..., :xd.shape[-1]])

    alone = torch.cat([torch.cat([conv(x[:1, :, :20]), conv(x[:1, :, 20:])], -1), conv(x[1:])])
    assert torch.allclose(causal_conv(x, w, cu), alone, atol=1e-5)
    assert torch.allclose(causal_conv(x, w, None), torch.cat([conv(x[:1]), conv(x[1:])]), atol=1e-5)
    assert not torch.allclose(causal_conv(x, w, None), alone, atol=1e-3)  # the boundary matters
    q, k = torch.randn(1, 100, 2, 8, generator=g), torch.randn(1, 100, 2, 8, generator=g)
    v, gate = torch.randn(1, 100, 4, 8, generator=g), -torch.rand(1, 100, 4, generator=g)
    beta = torch.rand(1, 100, 4, generator=g)
    docs = torch.tensor([0, 70, 100])  # 70 crosses the 64-token chunk
    packed = torch_rule(q, k, v, gate, beta, docs)
    one = [torch_rule(*(t[:, a:e] for t in (q, k, v, gate, beta)), None) for a, e in ((0, 70), (70, 100))]
    assert torch.allclose(packed, torch.cat(one, dim=1), atol=1e-6)
    assert not torch.allclose(torch_rule(q, k, v, gate, beta, None), packed, atol=1e-3)


def test_full_attention_at_head_dim_256_is_timed_at_its_measured_rate():
    """Qwen3.5's full layers (head_dim 256) run the kernels at ~60-78% of their head-dim-128 rates on the H200:
    the step model scales the 128 points by the measured ratio, so a layer's fwd+bwd time is the 256 rate's."""
    from pathlib import Path

    from ulysses_trainer.plan import rates
    from ulysses_trainer.plan.attention_time import attention_flops_forward, attention_seconds, head_dim_scale
    from ulysses_trainer.plan.inputs import ModelShape, Settings

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    assert rates.hd256_rates_from_results(results) == rates.HD256_RATES  # the table is the file's
    shape = ModelShape.preset("qwen3.5-27b")
    for kernel, pts in rates.HD256_RATES.items():
        for length, tflops in pts:
            s = Settings(max_length=length, layout=Layout(8, 8), attn_implementation=kernel,
                         deltanet_kernel="fla").with_levers(tiled_mlp=16)
            fwd, bwd = attention_seconds(shape, s)[:2]
            assert 3.5 * attention_flops_forward(shape, s) / (fwd + bwd) / 1e12 == pytest.approx(tflops, rel=1e-6)
    assert head_dim_scale("sdpa", 128, 1048576) == 1.0  # Qwen3's head dim: the points as measured
    assert head_dim_scale("sdpa", 256, 4 * 1048576) == head_dim_scale("sdpa", 256, 1048576)  # held past the last


def test_the_plan_times_and_sizes_deltanet_layers_by_their_own_terms():
    from pathlib import Path

    from ulysses_trainer.plan import rates
    from ulysses_trainer.plan.inputs import ModelShape, Settings
    from ulysses_trainer.plan.layer_terms import layer_working_set
    from ulysses_trainer.plan.step_time import step_time

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    assert rates.deltanet_rates_from_results(results) == (rates.DELTANET_RULE_S, rates.DELTANET_RULE_PEAK_BYTES,
                                                          rates.DELTANET_CONV_S)  # the table is the file's
    shape = ModelShape.preset("qwen3.5-27b")  # 48 DeltaNet + 16 full-attention layers
    s = Settings(max_length=1048576, layout=Layout(8, 8), attn_implementation="sdpa",
                 deltanet_kernel="fla").with_levers(tiled_mlp=16)
    st = step_time(shape, s, shape.num_params)
    every = step_time(shape.__class__(**{**_fields(shape), "mixer_layers": ()}), s, shape.num_params)
    assert st.parts["attention backward"] * 4 == pytest.approx(every.parts["attention backward"])  # 16 of 64 attend
    assert 0 < st.parts["linear_attention kernels"] < st.parts["attention backward"] / 10
    size, phase, terms = layer_working_set(shape, s)
    assert phase.startswith("linear_attention") and "DeltaNet backward: the rule's measured fwd+bwd peak" in terms
    # the rule's measured peak at this shape: 1M tokens x 6 value heads a rank, 24.4 GiB in the benchmark
    assert terms["DeltaNet backward: the rule's measured fwd+bwd peak"] / 2**30 == pytest.approx(24.4, rel=0.01)
    from ulysses_trainer.plan.memory import kept_attention_at

    # keep_attention_outputs 16: of the first 16 layers, layers 3, 7, 11, 15 attend and keep an output
    assert kept_attention_at(shape, s.with_levers(keep_attention_outputs=16), 64) == 4
    assert st.parts["attention forward"] > step_time(shape, s.with_levers(keep_attention_outputs=16),
                                                     shape.num_params).parts["attention forward"]


def test_the_floor_and_the_all_to_alls_count_the_deltanet_layers():
    """Qwen3.5-27B at 1M tokens, sp=8: the step's floor holds the DeltaNet kernels besides the attention kernels
    and the matmuls, and the comm model's all-to-alls are 16 attention layers' 4 a pass and 48 DeltaNet layers' 2
    (their bytes by hand: 131,072 tokens x (2 x 16 x 128 + 48 x 128 + 2 x 48) channels before the conv, x 48 x 128
    after the rule, bf16)."""
    from ulysses_trainer.plan.collectives import Job, ulysses_all_to_alls
    from ulysses_trainer.plan.inputs import ModelShape, Settings
    from ulysses_trainer.plan.step_time import step_floor, step_time

    shape = ModelShape.preset("qwen3.5-27b")
    s = Settings(max_length=1048576, layout=Layout(8, 8), attn_implementation="sdpa",
                 deltanet_kernel="fla").with_levers(tiled_mlp=16)
    st = step_time(shape, s, shape.num_params)
    floor = step_floor(shape, s, st.parts)
    kernels = st.parts["attention forward"] + st.parts["attention backward"] + st.parts["linear_attention kernels"]
    assert floor["linear_attention kernels s"] == st.parts["linear_attention kernels"] > 0
    assert floor["floor s"] == pytest.approx(kernels + floor["matmuls s"]) and floor["floor s"] < st.total_s
    t = 131072
    rows = {c.name: c for c in ulysses_all_to_alls(shape, Job(world_size=8, sp_size=8, local_tokens=t))}
    assert rows["ulysses forward q + attention output"].count == 2 * 16 * 2  # forward + recompute, q and output
    assert rows["ulysses backward k + v"].count == 2 * 16
    before, after = rows["ulysses forward DeltaNet q, k, v, b, a (before the conv)"], \
        rows["ulysses backward DeltaNet rule output"]
    assert (before.bytes, before.count) == (t * (2 * 16 * 128 + 48 * 128 + 2 * 48) * 2, 2 * 48)
    assert (after.bytes, after.count) == (t * 48 * 128 * 2, 48)


def _fields(shape):
    import dataclasses

    return {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape) if f.init}


def test_lora_adapters_counted_where_peft_puts_them():
    from peft import LoraConfig, get_peft_model

    from ulysses_trainer.plan.inputs import ModelShape
    from ulysses_trainer.plan.partitions import lora_numels

    shape = ModelShape.from_config(build("tiny-qwen3.5").config)
    for targets in (["q_proj", "v_proj", "up_proj"], ["in_proj_qkv", "out_proj"], "all-linear"):
        # 3 DeltaNet layers (in_proj_*, out_proj; no q/k/v/o_proj), 1 gated full-attention layer
        names = list(shape.family.lora_targets(targets))
        peft = get_peft_model(build("tiny-qwen3.5"), LoraConfig(r=4, target_modules=names))
        trained = sorted(p.numel() for p in peft.parameters() if p.requires_grad)
        assert trained == sorted(lora_numels(shape, targets, 4)), targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_gated_norm_equals_transformers_and_keeps_less(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    from tests.saved_tensors import saved_bytes
    from ulysses_trainer.families.qwen3_5.lean_gated_norm import LeanGatedRMSNorm

    g = torch.Generator().manual_seed(3)
    hf = Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(16, generator=g))
    lean = LeanGatedRMSNorm(hf)
    x, z = (torch.randn(50, 16, generator=g).to(dtype) for _ in range(2))
    grad = torch.randn(50, 16, generator=g).to(dtype)
    runs = []
    for module in (hf, lean):
        xi, zi = x.clone().requires_grad_(), z.clone().requires_grad_()
        hf.weight.grad = None
        out, kept = saved_bytes(module, lambda m=module, a=xi, b=zi: m(a, b))
        out.backward(grad)
        runs.append((out, xi.grad, zi.grad, hf.weight.grad.clone(), kept))
    (o1, x1, z1, w1, k1), (o2, x2, z2, w2, k2) = runs
    assert torch.equal(o1, o2)  # the same forward ops
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in ((x1, x2), (z1, z2), (w1, w2)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) <= tol
    assert k2 < k1 and k2 <= 2 * x.numel() * x.element_size() + 50 * 4  # x, gate, one fp32 scale per row


@pytest.mark.slow
@pytest.mark.parametrize("preset, sp_size", [("tiny-qwen3.5", 4), ("tiny-qwen3.5-moe", 2)])
def test_the_trainer_sp_runs_log_the_one_process_losses(tmp_path, preset, sp_size):
    # the whole trainer (preset, tokenizer, packed synthetic documents, plan, ZeRO-3, chunked loss, checkpoints)
    # through the rank entry of `deepspeed --num_gpus N launch/train.py`: two steps, sp ranks vs one
    import json

    from tests.dist_utils import JOB_TIMEOUT_S, job_failure
    from tests.warm_ranks import run_trainer

    args = ["--model_name_or_path", preset, "--max_length", "192", "--max_steps", "2", "--learning_rate", "1e-3",
            "--bf16", "false", "--seed", "3", "--logging_steps", "1", "--packing", "true", "--save_strategy", "no"]
    rows = {}
    for ranks in (1, sp_size):
        out = tmp_path / f"sp{ranks}"
        proc = run_trainer(ranks, [*args, "--sp_size", str(ranks), "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, job_failure(proc)
        assert "deltanet" in proc.stdout  # the plan line names the DeltaNet kernel
        rows[ranks] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows[1]) == len(rows[sp_size]) == 2
    for a, b in zip(rows[sp_size], rows[1]):
        assert abs(a["loss"] - b["loss"]) / b["loss"] <= 1e-5 and a["num_tokens"] == b["num_tokens"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] <= 1e-5, (a, b)


def test_zero3_gathered_layer_params_are_the_binding_layer_kinds():
    """The ZeRO-3 gathered-parameter term counts the layer whose working set binds, of its own kind, and the
    prefetch of the next layer the backward reaches, of its kind (not the larger kind twice): Qwen3.5-27B's shape
    with 16 DeltaNet value heads, whose full-attention layers hold more parameters than its DeltaNet layers; the
    first step (no trace: stage3_max_live_parameters does not cover them)."""
    from dataclasses import replace

    from ulysses_trainer.plan.inputs import ModelShape, Settings, Zero3Knobs, mlp_run
    from ulysses_trainer.plan.memory import backward_peak_layer, estimate

    shape = ModelShape(**{**_fields(ModelShape.preset("qwen3.5-27b")), "linear_v_heads": 16})
    fam, d = shape.family, shape.dims
    mlp = sum(n for _, n in fam.mlp_params(d)) + 2 * shape.hidden
    deltanet, attention = (sum(n for _, n in fam.mixer.params(d)) + mlp,
                           sum(n for _, n in fam.attention_params(d)) + mlp)
    assert attention > deltanet
    term = "ZeRO-3 gathered layer params + grads"
    for sp_size, binds, own, below in ((1, "linear_attention backward", deltanet, deltanet),
                                  (8, "attention backward", attention, deltanet)):
        s = Settings(max_length=131072, layout=Layout(sp_size, sp_size), zero3_trace=False,
                     deltanet_kernel="fla").with_levers(tiled_mlp=16)
        est = estimate(shape, s)
        assert backward_peak_layer(shape, s) == 63  # the top layer, a full-attention one
        assert est.term(f"layer working set ({binds})").gpu > 0
        grads = fam.mlp.weight_grad_numel(d, mlp_run(shape, s))
        assert est.term(term).gpu == (own + min(int(0.9 * shape.hidden ** 2), below) + grads) * 2, sp_size
        # a prefetch bucket larger than a layer: the layer below gathered whole beside the binding one
        big = replace(s, zero3=Zero3Knobs(prefetch_bucket_size=10 ** 10))
        assert estimate(shape, big).term(term).gpu == (own + below + grads) * 2, sp_size

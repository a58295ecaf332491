"""The sparse-MoE families beyond Qwen3-MoE (Mixtral, Qwen2-MoE) under Ulysses SP equal stock transformers, the
load-balancing loss included, and what the trainer cannot run of them is refused in one line.

The harness is tests/test_qwen3_5.py's (threads as ranks, the all-to-alls and the router statistics' all-reduces
moving the data; fp32 on the CPU: loss rel <= 1e-5, every gradient ||g - g_ref|| / ||g_ref|| <= 1e-5). The reference
is the stock model with SDPA, one forward per packed document: the token loss is F.cross_entropy over the trained
targets, the aux loss transformers' own load_balancing_loss_func over every document's router logits together (the
statistics are means over the whole row, as the SP ranks' sums over the group make them), router_aux_loss_coef
times. Each SP rank adds coef x aux / sp to its share (the all-reduce's backward sums the router grads over the
group; DeepSpeed's average over the world is the same factor, parallel/loss.aux_for_backward). The models are the
tiny presets with a 503-token vocabulary and routers drawn N(0, 0.5) so routing differs per token: tiny-mixtral's
16-token window is shorter than the documents.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.test_qwen3_5 import IGNORE, VOCAB, assert_equal, batch, lora_model
from tests.test_qwen3_5 import build as build_tiny


def build(preset: str, aux: bool = True, seed: int = 0, **overrides):
    """The tiny preset (503-token vocabulary), the load-balancing loss on or off, routers drawn N(0, 0.5);
    gpt-oss (no SDPA in transformers: its sinks) built eager, its sinks drawn N(0, 1)."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config

    if preset != "tiny-gpt-oss":
        model = build_tiny(preset, seed=seed, **overrides)
    else:
        config = preset_config(preset)
        config.vocab_size = VOCAB
        for key, value in overrides.items():
            setattr(config, key, value)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    model.config.output_router_logits = aux
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for layer in model.model.layers:
            router = getattr(layer.mlp, "gate", None) or layer.mlp.router
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.5)
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model


def reference(model, ids, pos, labels):
    """Stock transformers, one forward per document: (CE mean + coef x aux over all documents' router logits,
    grads, aux)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    c = model.config
    aux_on = bool(c.output_router_logits)
    total, count, router_logits = 0.0, 0, []
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    for a, e in zip(starts[:-1], starts[1:]):
        out = model(input_ids=ids[:, a:e], output_router_logits=aux_on)
        target = labels[0, a + 1:e]
        total = total + F.cross_entropy(out.logits[0, :-1].float(), target, reduction="sum", ignore_index=IGNORE)
        count += int((target != IGNORE).sum())
        if aux_on:
            router_logits.append(out.router_logits)  # per layer [doc tokens, E]
    loss = total / count
    aux = torch.zeros(())
    if aux_on:
        per_layer = tuple(torch.cat(docs) for docs in zip(*router_logits))  # [all tokens, E] per layer
        aux = load_balancing_loss_func(per_layer, c.num_experts, c.num_experts_per_tok)
        loss = loss + c.router_aux_loss_coef * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, float(aux.detach())


def sp_run(models, ids, pos, labels, **levers):
    """Each thread a rank with its own copy of the model, the objective as the trainer forms it: (global loss incl.
    coef x aux, summed grads, aux)."""
    from tests.sp_rank import parallelize_rank
    from tests.threaded_ranks import run_threads
    from ulysses_trainer import global_loss, shard_batch, step_token_count

    def one(rank: int, world_size: int):
        model, state = parallelize_rank(models[rank], world_size, **{"loss_chunk_size": 7, **levers})
        shard = shard_batch(ids, position_ids=pos, labels=labels, sp_size=world_size, sp_rank=rank)
        count = step_token_count(shard.num_valid, state)
        local = model(**shard.model_inputs())
        objective = local / count
        aux = 0.0
        if model.aux_loss is not None:
            objective = objective + model.aux_loss_coef * model.aux_loss / world_size
            aux = float(model.aux_loss.detach())
        objective.backward()
        grads = {n.removeprefix("causal_lm."): p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        return float(global_loss(local.detach(), count, state)) + model.aux_loss_coef * aux, grads, aux

    out = run_threads(len(models), one)
    assert len({round(a, 12) for _, _, a in out}) == 1  # every SP rank holds the whole row's aux loss
    return out[0][0], {n: sum(o[1][n] for o in out) for n in out[0][1]}, out[0][2]


def check(got, ref, aux_expected: bool = True):
    """Loss (incl. coef x aux) and every gradient as assert_equal, the aux loss within 1e-6 relative."""
    assert_equal(got[:2], ref[:2])
    if aux_expected:
        assert ref[2] > 1.0  # E x sum f P is 1 when balanced: something to get right
        assert abs(got[2] - ref[2]) <= 1e-6 * ref[2], (got[2], ref[2])


# sp 1, 2, 4 (4 > the 2 KV heads: replicated); packed documents (one shorter than the window after one longer, one
# crossing a rank boundary); assistant-only style masks (the first third of each document not trained on)
# crossing a rank boundary); assistant-only style masks; once with the aux loss off (the CE alone)
CASES = [
    ("tiny-mixtral", 1, [40, 31], False, True),
    ("tiny-mixtral", 2, [9, 50, 12], True, True),
    ("tiny-mixtral", 4, None, False, True),  # one 67-token document and a pad: windows across rank boundaries
    ("tiny-qwen2-moe", 1, None, True, True),
    ("tiny-qwen2-moe", 2, [30, 41], False, False),
    ("tiny-qwen2-moe", 4, [9, 50, 12], True, True),
    ("tiny-gpt-oss", 1, [40, 31], True, True),
    ("tiny-gpt-oss", 2, [9, 50, 12], False, True),  # sinks and a window inside short and long documents
    ("tiny-gpt-oss", 4, None, True, True),
]
PRESETS = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-gpt-oss"]


@pytest.mark.parametrize("preset, sp_size, docs, masked, aux", CASES)
def test_sp_equals_stock_transformers_with_the_aux_loss(preset, sp_size, docs, masked, aux):
    length = sum(docs) if docs else 67  # 67: padded to 68 (sp 2, 4)
    ids, pos, labels = batch(length, docs, seed=sp_size, masked=masked)
    ref = reference(build(preset, aux), ids, pos, labels)
    check(sp_run([build(preset, aux) for _ in range(sp_size)], ids, pos, labels), ref, aux)


@pytest.mark.parametrize("preset", PRESETS)
def test_levers_change_memory_not_results(preset):
    # checkpointing with every input offloaded to the host pool, checkpoint_every 2, the experts in 3 tiles
    ids, pos, labels = batch(70, [33, 37], seed=5, masked=True)
    ref = reference(build(preset), ids, pos, labels)
    levers = dict(gradient_checkpointing=True, activation_offload=True, checkpoint_every=2, tiled_mlp=3)
    check(sp_run([build(preset) for _ in range(2)], ids, pos, labels, **levers), ref)


def test_what_the_cases_prove_differs_between_the_families():
    """Mixtral's router renormalises its top-2 weights, Qwen2-MoE's (norm_topk_prob false) does not; Qwen2-MoE's
    shared expert acts (its gate is not 0); Mixtral's window changes the loss; gpt-oss's sinks and its window each
    change the loss (so the gpt-oss cases prove both)."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    mixtral, qwen2_moe = build("tiny-mixtral").model.layers[0].mlp, build("tiny-qwen2-moe").model.layers[0].mlp
    assert torch.allclose(mixtral.gate(x)[1].sum(-1), torch.ones(5))
    assert (qwen2_moe.gate(x)[1].sum(-1) < 1 - 1e-3).all()
    assert (torch.sigmoid(qwen2_moe.shared_expert_gate(x)) * qwen2_moe.shared_expert(x)).abs().max() > 1e-3
    ids = batch(40, None, seed=2)[0]  # one 40-token document: 16-token windows cut it

    def loss(model) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:]))

    windowed, unwindowed = loss(build("tiny-mixtral")), loss(build("tiny-mixtral", sliding_window=None))
    assert abs(windowed - unwindowed) / windowed > 1e-4, (windowed, unwindowed)
    gpt_oss, zero_sinks = build("tiny-gpt-oss"), build("tiny-gpt-oss")
    with torch.no_grad():
        for layer in zero_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(sink) = 0: a plain softmax
    with_sinks, full = loss(gpt_oss), loss(build("tiny-gpt-oss", layer_types=["full_attention"] * 2))
    no_sinks = loss(zero_sinks)
    assert abs(with_sinks - no_sinks) / with_sinks > 1e-4 and abs(with_sinks - full) / with_sinks > 1e-4


@pytest.mark.parametrize("preset", PRESETS)
def test_lora_under_sp_equals_stock_peft(preset):
    """LoRA on all-linear at sp 2, packed masked rows, the aux loss on (the frozen routers still route): the
    adapters' loss and gradients (the only ones) equal the stock PEFT model's."""
    ids, pos, labels = batch(71, [9, 50, 12], seed=2, masked=True)
    ref = reference(lora_model(preset, build), ids, pos, labels)
    assert len(ref[1]) == 2 * 4 * 2 and all("lora_" in n for n in ref[1])  # 2 layers x q, k, v, o x (A, B)
    check(sp_run([lora_model(preset, build) for _ in range(2)], ids, pos, labels), ref)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_trainers_model_path_matches_transformers(preset):
    """The trainer's own path (model_config_for, which turns the aux loss on -> plan_for -> build_model ->
    parallelize with the plan's levers) on a 48-token row: one forward/backward, loss + coef x aux, = the stock
    model's own loss (transformers adds router_aux_loss_coef x its aux loss when given labels); the 503-token
    vocabulary through model_init_kwargs, as a user's overrides reach the config (cheap on the CPU)."""
    from tests.sp_rank import trainer_path_matches

    sp_model = trainer_path_matches(preset, 48, {"vocab_size": VOCAB})
    assert sp_model.config.vocab_size == VOCAB and sp_model.config.output_router_logits is True
    assert sp_model.aux_loss > 1.0 and sp_model.aux_loss_coef == sp_model.config.router_aux_loss_coef


@pytest.mark.parametrize("preset", PRESETS)
def test_the_plan_counts_the_built_model(preset):
    """The planner's parameter list, in module order, is the built model's: tensor by tensor."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape

    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert list(ModelShape.from_config(config).param_numels) == [p.numel() for p in model.parameters()]


# published totals (the model cards round them): Mixtral-8x7B 46.7B (12.9B active), Qwen1.5-MoE-A2.7B 14.3B
# (2.7B active), gpt-oss-20b 20.9B (3.6B active), gpt-oss-120b 116.8B (5.1B active; gpt-oss's active counts leave
# the embedding table out, the last element says so)
PUBLISHED = {"mixtral-8x7b": (46_702_792_704, 12.9e9, False), "qwen1.5-moe-a2.7b": (14_315_784_192, 2.7e9, False),
             "gpt-oss-20b": (20_914_757_184, 3.6e9, True), "gpt-oss-120b": (116_829_156_672, 5.1e9, True)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_count_the_published_sizes_and_plan_at_1m_on_8_gpus(name, capsys):
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.__main__ import main as cli_main
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.plan.inputs import ModelShape

    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    total, active, without_embedding = PUBLISHED[name]
    assert sum(p.numel() for p in model.parameters()) == total == shape.num_params
    counted = shape.num_active_params - (shape.vocab * shape.hidden if without_embedding else 0)
    assert abs(counted - active) <= 0.01 * active, counted
    # 1M tokens is past its positions: stretched with YaRN, as the refusal says
    # host memory for gpt-oss-120b's Adam states on the host (16 bytes a parameter)
    code = cli_main(["plan", "--model", name, "--max_length", "1048576", "--gpus", "8", "--gpu_memory_gb", "139.8",
                     "--host_memory_gb", "2500", "--model_init_kwargs",
                     '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}', "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["estimate"]["parameters"] == total and data["plan"]["sp_size"] == 8
    assert data["plan"]["step_parts_s"]["experts (grouped_mm)"] > 0  # the experts at their measured rate
    if name.startswith("gpt-oss"):  # the sinks' path keeps no attention output for the recompute
        assert data["plan"]["keep_attention_outputs"] == 0, data["plan"]["keep_attention_outputs"]


def _save(tmp_path, config) -> str:
    from transformers import AutoModelForCausalLM

    path = tmp_path / config.model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _plan_exit(capsys, model: str) -> tuple[int, str]:
    from ulysses_trainer.__main__ import main as cli_main

    capsys.readouterr()
    code = cli_main(["plan", "--model", model, "--max_length", "4096", "--gpus", "2", "--gpu_memory_gb", "80",
                     "--host_memory_gb", "64"])
    return code, capsys.readouterr().err


def test_router_jitter_is_refused_in_one_line(tmp_path, capsys):
    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config

    config = preset_config("tiny-mixtral")
    assert family("mixtral").check_config(config) is None
    config.router_jitter_noise = 0.01
    code, err = _plan_exit(capsys, _save(tmp_path, config))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "router_jitter_noise" in err, err


@pytest.mark.parametrize("change, named", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(qkv_bias=False), "qkv_bias"),
    (dict(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
     "use_sliding_window"),
])
def test_what_qwen2_moe_does_not_run_is_refused_in_one_line(change, named, tmp_path, capsys):
    """Dense layers among the sparse ones, q/k/v without biases, windowed layers: exit 2, one line naming it."""
    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config

    config = preset_config("tiny-qwen2-moe")
    assert family("qwen2_moe").check_config(config) is None
    for key, value in change.items():
        setattr(config, key, value)
    code, err = _plan_exit(capsys, _save(tmp_path, config))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and named in err, err



def test_a_gpt_oss_without_its_biases_is_refused_in_one_line(tmp_path, capsys):
    from ulysses_trainer.families import family
    from ulysses_trainer.families.presets import preset_config

    config = preset_config("tiny-gpt-oss")
    assert family("gpt_oss").check_config(config) is None
    config.attention_bias = False
    code, err = _plan_exit(capsys, _save(tmp_path, config))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "attention_bias" in err, err


@pytest.mark.parametrize("call_queries", [1 << 16, 10])
def test_sink_attention_equals_gpt_oss_eager_attention(call_queries, monkeypatch):
    """attention/kernels.sink_attention (the sink as a key of its own; windowed: block masks) against transformers'
    own eager_attention_forward of gpt-oss (the sinks concatenated to the scores), GQA, one document per row, with and
    without a window: outputs and the gradients of q, k, v and the sinks; the windowed blocks all in one call, and
    two a call (8 blocks in 4 calls)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from ulysses_trainer.attention import windowed
    from ulysses_trainer.attention.kernels import sdpa_attention, sink_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 37, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    monkeypatch.setattr(windowed, "CALL_QUERIES", call_queries)
    for window in (None, 5):
        out = sink_attention(q, k, v, sinks, scale=0.3, attend=sdpa_attention, window=window)
        i, j = torch.arange(37)[:, None], torch.arange(37)[None, :]
        allowed = (j <= i) & ((j > i - window) if window else True)
        mask = torch.zeros(37, 37).masked_fill(~allowed, float("-inf"))
        module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
        ref = eager_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                      scaling=0.3)[0]  # [b, s, h, d]
        assert torch.allclose(out, ref, atol=1e-6)
        got = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
        want = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)

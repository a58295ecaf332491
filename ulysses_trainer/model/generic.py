"""The generic path: a Family made on the fly for a model_type no family folder covers, or one line saying why not.

What it accepts is decided from the config and the causal LM built on the meta device (no weights, no memory): every
decoder layer holds `self_attn` (q/k/v/o Linear projections, q/k/v biases all or none, optional per-head or
whole-width q/k RMSNorms) whose forward goes through transformers' attention interface (ALL_ATTENTION_FUNCTIONS, so
the trainer's Ulysses attention is what runs, with no keyword it would drop), `mlp` (bias-free Linear gate/up/down,
or up/down, and an act_fn, computing down(act(gate(x)) * up(x)) or down(act(up(x))) as a small CPU copy of its class
shows: it acts per token, so tiling it is exact), and the two pre-norm RMSNorms input_layernorm /
post_attention_layernorm; no other module. Every RMSNorm's arithmetic is run once on a few CPU numbers against the
lean norm the trainer swaps in (one of its two castings), and every layer's parameters counted from the meta model
must equal what the Family counts. A layer_types entry other than full or sliding attention, a decoder layer
module it cannot classify (a recurrent or convolutional mixer), or a head that transforms the logits is refused
in one line naming it: the trainer would split it by sequence without an all-to-all and train it wrong.

Not proven by these checks: that the decoder layer's forward wires the blocks as a pre-norm residual layer (the
plan's terms assume it; the forward that runs is transformers' own, and the checkpoint's recompute never skips the
tiled MLP's forward for a generic family).
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import textwrap
from typing import Any

import torch
from torch import nn

from ..families import FAMILIES, register, unregister
from ..families.base import ATTENTION_LAYER_TYPES, Family, MlpBlock
from ..families.dense import PlainMlp
from ..families.qwen3 import GatedMlp
from ..levers.lean_norm import is_rms_norm, rms_norm_forward

GENERIC_NOTE = ("generic decoder: parameters counted from the built model on the meta device; time at the dense "
                "rate; memory with its MLP's (gated or plain) and pre-norm RMSNorm layers' terms (as for Llama); the "
                "recompute reruns a tiled MLP's forward")
_LAYER_PARTS = {"self_attn", "input_layernorm", "mlp", "post_attention_layernorm"}
_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# what Ulysses attention takes of the keywords a layer passes its attention function (parallel/ulysses.py)
_ATTENTION_KEYWORDS = {"dropout", "scaling", "sliding_window", "position_ids"}
# a causal-LM head that changes the logits after lm_head (Cohere's logit_scale): the trainer's loss head would not
# (an assignment to logits other than lm_head's output; not a call's logits=logits, keyword)
_LOGITS_CHANGED = re.compile(r"^\s*logits\s*[*/+-]?=(?!\s*self\.lm_head\().*[^,\s]\s*$", re.M)


class Refused(Exception):
    """Why the generic path cannot run a model (one line)."""


def _param_free(module: nn.Module) -> bool:
    return next(module.parameters(), None) is None


def _norm_casting(norm: nn.Module, width: int, where: str) -> bool:
    """fp32_weight of the lean norm that reproduces `norm` exactly (checked on CPU numbers in bf16); Refused for a
    norm that neither casting reproduces, or one that is not a weight-only RMSNorm of `width`."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not is_rms_norm(norm) or not isinstance(weight, nn.Parameter) or eps is None \
            or [n for n, _ in norm.named_parameters()] != ["weight"] or tuple(weight.shape) != (width,):
        raise Refused(f"{where} is a {type(norm).__name__}, not an RMSNorm of width {width} with a weight alone")
    cpu = copy.deepcopy(norm).to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cpu.weight.copy_(1 + torch.randn(width, generator=g) / 3)
        x = (torch.randn(3, width, generator=g) * 4).to(torch.bfloat16)
        got = cpu(x)
        for fp32_weight in (False, True):
            if torch.equal(got, rms_norm_forward(x, cpu.weight, float(eps), 0.0, fp32_weight)[0]):
                return fp32_weight
    raise Refused(f"{where} ({type(norm).__name__}) computes its RMSNorm in a way the trainer's lean norm does not "
                  f"reproduce")


def _attention(attn: nn.Module, config: Any, where: str) -> dict[str, Any]:
    """The attention's Family fields; Refused for one the trainer cannot split by head."""
    linears = {n: getattr(attn, n, None) for n in _ATTENTION_LINEARS}
    missing = [n for n, m in linears.items() if not isinstance(m, nn.Linear)]
    if missing:
        raise Refused(f"{where} ({type(attn).__name__}) has no Linear {', '.join(missing)}")
    source = textwrap.dedent(inspect.getsource(type(attn).forward))
    calls = [c for c in ast.walk(ast.parse(source)) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Name) and c.func.id == "attention_interface"]
    if "ALL_ATTENTION_FUNCTIONS" not in source or not calls:
        raise Refused(f"{where} ({type(attn).__name__}) does not go through transformers' attention interface "
                      f"(ALL_ATTENTION_FUNCTIONS), so Ulysses attention would not be what runs")
    unheard = sorted({k.arg for c in calls for k in c.keywords if k.arg is not None} - _ATTENTION_KEYWORDS)
    if unheard:  # e.g. Gemma 2's softcap: Ulysses attention would drop it
        raise Refused(f"{where} ({type(attn).__name__}) passes {unheard[0]} to the attention function, which "
                      f"Ulysses attention does not apply")
    if getattr(attn, "is_causal", True) is not True:
        raise Refused(f"{where} ({type(attn).__name__}) is not causal; Ulysses attention is")
    biases = [n for n in _ATTENTION_LINEARS[:3] if linears[n].bias is not None]
    if biases not in ([], list(_ATTENTION_LINEARS[:3])) or linears["o_proj"].bias is not None:
        raise Refused(f"{where}: biases on {', '.join(n for n, m in linears.items() if m.bias is not None)} (the "
                      f"trainer counts biases on q, k and v together or none)")
    other = [n for n, m in attn.named_children() if n not in (*_ATTENTION_LINEARS, "q_norm", "k_norm")
             and not _param_free(m)]
    if other:
        raise Refused(f"{where} ({type(attn).__name__}) has a module {other[0]!r} the generic path cannot "
                      f"classify")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields: dict[str, Any] = {"qkv_bias": bool(biases)}
    norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    if any(n is not None for n in norms):
        widths = (linears["q_proj"].out_features, linears["k_proj"].out_features)
        whole = all(n is not None and tuple(n.weight.shape) == (w,) for n, w in zip(norms, widths))
        fp32 = {_norm_casting(n, w if whole else head_dim, f"{where}.{name}")
                for n, w, name in zip(norms, widths, ("q_norm", "k_norm")) if n is not None}
        if None in norms:
            raise Refused(f"{where} has one of q_norm / k_norm without the other")
        fields.update(qk_norm=True, qk_norm_whole=whole and head_dim not in widths, norm_fp32=fp32)
    return fields


def _mlp(mlp: nn.Module, config: Any, where: str) -> MlpBlock:
    """The block of a bias-free gated gate/up/down MLP or plain up/down MLP with a parameter-free act_fn whose forward
    is down(act(gate(x)) * up(x)) or down(act(up(x))), what the tiled MLP runs (checked on a small one of its class,
    built on the CPU); Refused otherwise."""
    parts = dict(mlp.named_children())
    names = _MLP_LINEARS if "gate_proj" in parts else _MLP_LINEARS[1:]
    linear = all(isinstance(parts.get(n), nn.Linear) and parts[n].bias is None for n in names)
    rest = [n for n, m in parts.items() if n not in names and not _param_free(m)]
    formula = "down(act(gate(x)) * up(x))" if "gate_proj" in parts else "down(act(up(x)))"
    if not linear or rest or not hasattr(mlp, "act_fn"):
        raise Refused(f"{where} ({type(mlp).__name__}: {', '.join(parts)}) is not a gated or plain MLP of bias-free "
                      f"gate_proj / up_proj / down_proj Linears and an act_fn")
    small = copy.deepcopy(config)
    small.hidden_size, small.intermediate_size = 8, 16  # its arithmetic, not its size
    g = torch.Generator().manual_seed(0)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            cpu = type(mlp)(small).float()
        with torch.no_grad():
            for p in cpu.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 3)
            x = torch.randn(5, 8, generator=g)
            up = cpu.up_proj(x)
            inner = cpu.act_fn(cpu.gate_proj(x)) * up if "gate_proj" in parts else cpu.act_fn(up)
            same = torch.equal(cpu(x), cpu.down_proj(inner))
    except Exception as exc:  # a class that needs more than the config, or another layout
        raise Refused(f"{where} ({type(mlp).__name__}) cannot be checked on a small copy ({type(exc).__name__}); "
                      f"the generic path tiles only an MLP it has checked") from None
    if not same:
        raise Refused(f"{where} ({type(mlp).__name__}) does not compute {formula}, what the trainer's tiled MLP runs")
    return GatedMlp() if "gate_proj" in parts else PlainMlp()


def _family(config: Any) -> Family:
    """The generic Family of `config`, or Refused naming what it cannot run."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    types = list(getattr(config, "layer_types", None) or ())[:config.num_hidden_layers]
    unknown = [t for t in types if t not in ATTENTION_LAYER_TYPES]
    if unknown:
        raise Refused(f"its layer type {unknown[0]!r} mixes along the sequence in a way this trainer has no Ulysses "
                      f"path for (only full_attention and sliding_attention layers are split by head)")
    dropout = [(k, v) for k, v in sorted(config.to_dict().items()) if "dropout" in k and isinstance(v, (int, float))
               and not isinstance(v, bool) and v]
    if dropout:  # Ulysses attention runs none; a dropout elsewhere would differ per rank from one process
        raise Refused(f"{dropout[0][0]} is {dropout[0][1]}; set it to 0 (model_init_kwargs: {{{dropout[0][0]}: 0.0}})")
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise Refused(f"transformers has no causal LM for {type(config).__name__}")
    if _LOGITS_CHANGED.search(inspect.getsource(cls.forward)):
        raise Refused(f"{cls.__name__} changes the logits after lm_head, which the trainer's loss head does not")
    try:
        with torch.device("meta"):  # no memory, no weights: the modules and their shapes
            model = cls(copy.deepcopy(config))
    except Exception as exc:  # the config the model class rejects
        raise Refused(f"{cls.__name__} cannot be built from this config ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None
    body, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise Refused(f"{cls.__name__} is not a decoder with .model.layers and a bias-free Linear lm_head")
    h = config.hidden_size
    extra = [n for n, m in body.named_children() if n not in ("embed_tokens", "layers", "norm") and not _param_free(m)]
    if extra:
        raise Refused(f"{type(body).__name__} has a module {extra[0]!r} the generic path cannot classify")
    fp32 = {_norm_casting(body.norm, h, "the final norm")}
    fields: dict[str, Any] = {}
    checked: dict[type, MlpBlock] = {}
    for i, layer in enumerate(layers):
        where = f"layer {i}"
        kinds = {n: type(m).__name__ for n, m in layer.named_children() if n not in _LAYER_PARTS and
                 not _param_free(m)}
        if kinds:
            name, kind = next(iter(kinds.items()))
            raise Refused(f"{where} ({type(layer).__name__}) holds {name!r} ({kind}), a module the generic path "
                          f"cannot classify (it takes attention, an MLP and two pre-norms; a recurrent or "
                          f"convolutional mixer has no Ulysses path)")
        absent = sorted(_LAYER_PARTS - {n for n, _ in layer.named_children()})
        if absent:
            raise Refused(f"{where} ({type(layer).__name__}) has no {', '.join(absent)} (the generic path takes "
                          f"self_attn, mlp and the pre-norms input_layernorm, post_attention_layernorm)")
        fields = _attention(layer.self_attn, config, f"{where}.self_attn")
        fp32 |= fields.pop("norm_fp32", set())
        if type(layer.mlp) not in checked:  # one check per class: its arithmetic, not its weights
            checked[type(layer.mlp)] = _mlp(layer.mlp, config, f"{where}.mlp")
        fp32 |= {_norm_casting(getattr(layer, n), h, f"{where}.{n}") for n in ("input_layernorm",
                                                                             "post_attention_layernorm")}
    blocks = {type(b) for b in checked.values()}
    if len(blocks) != 1:
        raise Refused("its layers mix gated and plain MLPs; the generic family takes one kind")
    if len(fp32) > 1:
        raise Refused("its RMSNorms cast in two ways, the trainer's lean norms take one per model")
    fam = Family(model_type=config.model_type, config_class=type(config).__name__, causal_lm_class=cls.__name__,
                 mlp=next(iter(checked.values())), norm_fp32_weight=fp32.pop(),
                 modules="ulysses_trainer.families.dense.modules",
                 qk_norm=fields.get("qk_norm", False), qk_norm_whole=fields.get("qk_norm_whole", False),
                 qkv_bias=fields["qkv_bias"], plan_note=GENERIC_NOTE, mlp_output_unread=False)
    _check_counts(fam, config, model)
    return fam


def _check_counts(fam: Family, config: Any, model: nn.Module) -> None:
    """What the Family counts equals the meta model's parameters, layer by layer and for the embedding and head."""
    d = fam.layer_dims(config)
    counted = fam.attention_params(d) + fam.mlp_params(d) + [(n, d.hidden) for n in fam.layer_norms()]
    per_layer = sum(n for _, n in counted)
    for i, layer in enumerate(model.model.layers):
        built = sum(p.numel() for p in layer.parameters())
        if built != per_layer:
            raise Refused(f"layer {i} has {built:,} parameters where the generic family counts {per_layer:,} "
                          f"({', '.join(f'{n} {k:,}' for n, k in counted)})")
    vocab, embed = config.vocab_size, model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    if tuple(embed.shape) != (vocab, d.hidden) or tuple(model.lm_head.weight.shape) != (vocab, d.hidden) \
            or tied != bool(getattr(config, "tie_word_embeddings", False)):
        raise Refused(f"its embedding {tuple(embed.shape)} / lm_head {tuple(model.lm_head.weight.shape)} (tied "
                      f"{tied}) is not the vocab x hidden pair the config gives")


def generic_family(config: Any) -> Family | str:
    """The generic Family of a transformers config whose model_type no family covers, or why not (one line)."""
    try:
        return _family(config)
    except Refused as why:
        return str(why)


def is_generic(fam: Family) -> bool:
    """Whether `fam` was made by the generic path (checked again for every config loaded)."""
    return fam.plan_note == GENERIC_NOTE


def register_generic(config: Any) -> str | None:
    """Register the generic family of `config` under its model_type (replacing one the generic path made for an
    earlier config, so the planner and the trainer see this config's); None, or why the generic path refuses it
    (then no generic family of that model_type stays registered)."""
    old = FAMILIES.get(config.model_type)
    if old is not None and not is_generic(old):
        return None
    fam = generic_family(config)
    if old is not None:
        unregister(config.model_type)
    if isinstance(fam, str):
        return fam
    register(fam)
    return None

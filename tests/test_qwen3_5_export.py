"""A Qwen3.5 checkpoint as the Hub has it trains its language model only and is exported in its own layout.

The trained causal LM's state (the checkpoint's language model, changed as a step changes it) goes through the
export's writer: final/ is loaded by `from_pretrained` of the checkpoint's own class and gives the trained model's
logits; it holds the checkpoint's tensor names, shapes and dtypes; the vision tower and the MTP head are the
checkpoint's bytes; config.json keeps both sections; tokenizer, chat template, generation_config and every processor
and tokenizer side file (the processor's chat_template.json too) come through, so the processor reads in final/
what it read in the checkpoint. Dense and MoE, the multimodal layout and the text-only one.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.qwen3_5_checkpoint import (
    GENERATION,
    INDEX,
    PREPROCESSOR,
    PROCESSOR_TEMPLATE,
    TEMPLATE,
    VIDEO_PREPROCESSOR,
    write_qwen3_5_checkpoint,
)
from tests.qwen3_checkpoint import fixtures_dir
from ulysses_trainer.model.checkpoint_keys import header_tensors, loading_problems

CASES = [(False, "conditional"), (True, "conditional"), (False, "causal"), (True, "causal")]


def _files(d: Path) -> list[Path]:
    return sorted({d / f for f in json.loads((d / INDEX).read_text())["weight_map"].values()})


def _stored(d: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in _files(d):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module", params=CASES, ids=[f"{'moe' if m else 'dense'}-{lay}" for m, lay in CASES])
def exported(request, tmp_path_factory):
    """(checkpoint, final/, the trained causal LM): one changed step's weights exported by the trainer's writer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_trainer.data.tokenizer import load_tokenizer
    from ulysses_trainer.model.export_config import exported_config
    from ulysses_trainer.train.chat_export import ExportFiles
    from ulysses_trainer.train.export import _write_export

    moe, layout = request.param
    root = tmp_path_factory.mktemp("q35")
    ckpt = write_qwen3_5_checkpoint(root / "ckpt", moe=moe, layout=layout)
    original = json.loads((ckpt / "config.json").read_text())
    text = AutoConfig.from_pretrained(ckpt).get_text_config(decoder=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, config=text, dtype=torch.float32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in model.parameters():  # what a training step does: every trained tensor changes
            p.add_(0.01 * torch.randn_like(p))
    state = {"causal_lm." + k: v for k, v in model.state_dict().items()}
    final = root / "final"
    files = ExportFiles(load_tokenizer(str(ckpt)), chat=False, source=str(ckpt))
    trained = copy.deepcopy(text)
    trained.use_cache = False  # as the run trains it
    config_json = exported_config(trained, AutoConfig.from_pretrained(ckpt), original, torch.float32, None)
    _write_export(state, trained, str(final) + ".tmp", str(final), files, "causal_lm.", None, config_json, "40KB",
                  str(ckpt))
    return ckpt, final, model.eval()


def test_the_checkpoint_loads_into_the_language_model_alone(exported):
    """The training model is the text causal LM; the vision tower and MTP head are left unread, nothing else."""
    from transformers import AutoConfig

    ckpt, _, _ = exported
    text = AutoConfig.from_pretrained(ckpt).get_text_config(decoder=True)
    assert text.model_type in ("qwen3_5_text", "qwen3_5_moe_text")
    assert loading_problems(text, header_tensors(_files(ckpt))) == []


def test_from_pretrained_of_the_checkpoints_class_gives_the_trained_logits(exported):
    import transformers

    ckpt, final, trained = exported
    cls = getattr(transformers, json.loads((ckpt / "config.json").read_text())["architectures"][0])
    back = cls.from_pretrained(final, dtype=torch.float32).eval()
    before = cls.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, start = (m(input_ids=ids).logits for m in (back, trained, before))
    assert torch.equal(got, want)
    assert (got - start).abs().max() > 1e-3  # the export is the trained model, not the checkpoint


def test_the_export_is_in_the_checkpoints_layout_and_keeps_its_other_tensors(exported):
    """Every tensor name and shape of the checkpoint (a MoE language model's experts fused, its MTP layer's one by
    one); the language model in the dtype trained in (fp32 here); the vision tower and MTP head byte for byte."""
    ckpt, final, _ = exported
    src, out = _stored(ckpt), _stored(final)
    assert set(out) == set(src)
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in src.items()}
    untouched = [k for k in src if k.startswith(("model.visual.", "mtp."))]
    assert any(k.startswith("mtp.") for k in untouched)
    assert all(out[k].dtype == src[k].dtype and _bytes(out[k]) == _bytes(src[k]) for k in untouched)
    trained = [k for k in src if k not in untouched]
    assert all(out[k].dtype == torch.float32 for k in trained)
    assert len(_files(final)) > 1 and not (final / "model.safetensors").exists()


def test_config_tokenizer_generation_config_and_processor_files_come_through(exported):
    from transformers import AutoTokenizer

    ckpt, final, _ = exported
    written, original = (json.loads((d / "config.json").read_text()) for d in (final, ckpt))
    text_key = "text_config" if "text_config" in original else None
    assert written["dtype"] == "float32" and (not text_key or written[text_key]["dtype"] == "float32")
    for cfg in (written, original):
        cfg.pop("transformers_version", None)
        cfg.pop("dtype", None)
        if text_key:
            cfg[text_key].pop("dtype", None)
    assert written == original  # every section as the user wrote it (use_cache too), the dtype trained in apart
    assert json.loads((final / "generation_config.json").read_text()) == GENERATION
    if text_key:
        assert json.loads((final / "preprocessor_config.json").read_text()) == PREPROCESSOR
        assert json.loads((final / "video_preprocessor_config.json").read_text()) == VIDEO_PREPROCESSOR
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template == TEMPLATE
    ids = tok("alpha bravo zulu")["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(ckpt)("alpha bravo zulu")["input_ids"] and 0 < len(ids) <= 6


# the files final/ writes anew (the tokenizer's save): compared by what loads from them, not byte for byte
_RESAVED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def _side_files(d: Path) -> set[str]:
    return {f.name for f in d.iterdir() if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX}


def _processor_view(d: Path) -> tuple[dict, dict, dict]:
    """What AutoProcessor reads of a directory (its own chat template resolution: chat_template.json before
    chat_template.jinja; the image and video processor configs), without the image libraries it would import."""
    from transformers import ProcessorMixin
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    return (ProcessorMixin.get_processor_dict(str(d))[0], ImageProcessingMixin.get_image_processor_dict(str(d))[0],
            BaseVideoProcessor.get_video_processor_dict(str(d))[0])


def test_every_processor_and_tokenizer_side_file_comes_through(exported):
    """final/ holds every file of the checkpoint beside its weights: the processor's chat_template.json,
    preprocessor files, vocab.json and merges.txt byte for byte; AutoProcessor's view of final/ is the
    checkpoint's (the processor's template, not the tokenizer's)."""
    ckpt, final, _ = exported
    assert _side_files(ckpt) <= _side_files(final), _side_files(ckpt) - _side_files(final)
    assert all((final / f).read_bytes() == (ckpt / f).read_bytes() for f in _side_files(ckpt) - _RESAVED)
    assert {"vocab.json", "merges.txt"} <= _side_files(final)
    if (ckpt / "chat_template.json").exists():
        assert _processor_view(final) == _processor_view(ckpt)
        assert _processor_view(final)[0]["chat_template"] == PROCESSOR_TEMPLATE != TEMPLATE


def _hub_template() -> str:
    """Qwen3.5's shipped (thinking) chat template, from the fixtures folder; skip where it is absent."""
    d = fixtures_dir()
    path = d / "qwen3_5" / "qwen3_5_think.jinja" if d else None
    if path is None or not path.is_file():
        pytest.skip("the Qwen3.5 template fixture (shared/fixtures/qwen3_5/qwen3_5_think.jinja) is absent")
    return path.read_text(encoding="utf-8")


def _export_files(ckpt: Path, final: Path, chat: bool, chat_template_path: str | None = None) -> None:
    """The export's files beside the weights (train/chat_export.ExportFiles), the tokenizer as a run loads it."""
    from ulysses_trainer.data.tokenizer import apply_tokenizer_options, load_tokenizer
    from ulysses_trainer.train.chat_export import ExportFiles

    final.mkdir()
    tok = apply_tokenizer_options(load_tokenizer(str(ckpt), "qwen3.5"), chat_template_path, None)
    ExportFiles(tok, chat=chat, source=str(ckpt)).save_pretrained(str(final))


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_template_only_the_processor_carries_is_the_runs_and_the_exports(chat, tmp_path):
    """A checkpoint whose chat template is in the processor's chat_template.json alone (Qwen3.5's own, no
    chat_template.jinja): the run's tokenizer renders with it (not the built-in Qwen3 format), and final/ keeps
    the file as it was, with the tokenizer's template the same, so both loaders of final/ render Qwen3.5's."""
    from transformers import AutoTokenizer

    from ulysses_trainer.data.tokenizer import load_tokenizer

    hub = _hub_template()
    ckpt = write_qwen3_5_checkpoint(tmp_path / "ckpt", processor_template=hub, tokenizer_template=None)
    assert not (ckpt / "chat_template.jinja").exists() and AutoTokenizer.from_pretrained(ckpt).chat_template is None
    assert load_tokenizer(str(ckpt), "qwen3.5").hf_tokenizer.chat_template == hub
    final = tmp_path / "final"
    _export_files(ckpt, final, chat)
    assert (final / "chat_template.json").read_bytes() == (ckpt / "chat_template.json").read_bytes()
    assert AutoTokenizer.from_pretrained(final).chat_template == hub
    assert _processor_view(final) == _processor_view(ckpt)


def test_a_replaced_template_is_the_processors_in_the_export(tmp_path):
    """chat_template_path replaces the checkpoint's template for the run: final/'s chat_template.json carries the
    template trained with (AutoProcessor would otherwise render the checkpoint's), its other keys kept."""
    import json

    from transformers import AutoTokenizer

    ckpt = write_qwen3_5_checkpoint(tmp_path / "ckpt")
    processor = json.loads((ckpt / "chat_template.json").read_text())
    (ckpt / "chat_template.json").write_text(json.dumps({**processor, "note": "kept"}))
    trained = TEMPLATE.replace("<|im_start|>assistant", "<|im_start|>assistant (trained)")
    (tmp_path / "mine.jinja").write_text(trained)
    final = tmp_path / "final"
    _export_files(ckpt, final, chat=True, chat_template_path=str(tmp_path / "mine.jinja"))
    assert json.loads((final / "chat_template.json").read_text()) == {"chat_template": trained, "note": "kept"}
    assert AutoTokenizer.from_pretrained(final).chat_template == trained
    assert _processor_view(final)[0]["chat_template"] == trained


@pytest.mark.slow
@pytest.mark.parametrize("moe, layout", [(False, "conditional"), (True, "conditional"), (False, "causal")],
                         ids=["dense", "moe", "text-only"])
def test_a_hub_layout_checkpoint_trains_and_exports_to_the_same_logits(moe, layout, tmp_path):
    """The whole path: the trainer on a Qwen3.5 checkpoint in the Hub's multimodal layout (or a text-only one), one
    step; final/ loaded by from_pretrained of the checkpoint's class gives the logits of the run's own last
    checkpoint (its ZeRO-3 fp32 state), which differ from the checkpoint trained from; the vision tower and the MTP
    head are the checkpoint's bytes."""

    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.dist_utils import JOB_TIMEOUT_S, job_failure
    from tests.tiny_checkpoint import write_documents
    from tests.warm_ranks import run_bare

    ckpt = write_qwen3_5_checkpoint(tmp_path / "ckpt", moe=moe, layout=layout)
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=8, words_per_doc=31)
    out = tmp_path / "out"
    proc = run_bare(["--model_name_or_path", str(ckpt), "--dataset_name", str(docs), "--max_length", "32",
                     "--max_steps", "1", "--learning_rate", "1e-2", "--bf16", "false", "--max_shard_size", "40KB",
                     "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)  # `python launch/train.py`, forked
    assert proc.returncode == 0, job_failure(proc)
    final = out / "final"
    cls = getattr(transformers, json.loads((ckpt / "config.json").read_text())["architectures"][0])
    exported = cls.from_pretrained(final, dtype=torch.float32).eval()
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoint-1"), tag="ds")
    state = {k.removeprefix("causal_lm."): v for k, v in state.items()}
    text = AutoConfig.from_pretrained(ckpt).get_text_config(decoder=True)
    rebuilt = AutoModelForCausalLM.from_config(text, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    before = cls.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, start = (m.eval()(input_ids=ids).logits for m in (exported, rebuilt, before))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert (got - start).abs().max() > 1e-3  # the step changed the model
    src, written = _stored(ckpt), _stored(final)
    assert set(written) == set(src)
    assert all(_bytes(written[k]) == _bytes(src[k]) for k in src if k.startswith(("model.visual.", "mtp.")))
    assert json.loads((final / "generation_config.json").read_text()) == GENERATION


# an adapter in the causal LM's layout onto the multimodal class: its language model is under model.language_model
TO_CONDITIONAL = {r"^model\.layers\.": "model.language_model.layers."}


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_lora_on_a_hub_layout_checkpoint_adapts_the_language_model_and_merges_into_its_layout(moe, tmp_path):
    """LoRA (all-linear) on the multimodal Hub-layout checkpoint through the real entry, two steps, twice: the
    adapter (merge_lora false) and the merged export. The adapter adapts every Linear of every language-model
    layer of its kind (DeltaNet: in_proj_qkv/z/b/a, out_proj; full attention: q/k/v/o_proj; a dense MLP's gate, up,
    down; a sparse block has none) and nothing of the vision tower or the MTP head; the merged final/ is the
    checkpoint's layout, its vision tower and MTP head the checkpoint's bytes, no LoRA tensor in it, and
    from_pretrained of the checkpoint's class (Qwen3_5[Moe]ForConditionalGeneration) gives the logits of the base
    with the adapter: as its adapter_config loads (AutoPeftModelForCausalLM: the text model), and on the
    multimodal class with TO_CONDITIONAL's key_mapping."""
    import re

    import transformers
    from peft import AutoPeftModelForCausalLM, PeftModel
    from safetensors import safe_open
    from transformers import AutoConfig

    from tests.dist_utils import JOB_TIMEOUT_S, job_failure
    from tests.tiny_checkpoint import write_documents
    from tests.warm_ranks import run_bare

    ckpt = write_qwen3_5_checkpoint(tmp_path / "ckpt", moe=moe)
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=8, words_per_doc=31)
    conditional_cls = getattr(transformers, json.loads((ckpt / "config.json").read_text())["architectures"][0])
    for merge in ("false", "true"):
        proc = run_bare(["--model_name_or_path", str(ckpt), "--dataset_name", str(docs), "--max_length", "32",
                         "--max_steps", "2", "--learning_rate", "1e-2", "--bf16", "false", "--seed", "3",
                         "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0", "--lora_target_modules",
                         "all-linear", "--merge_lora", merge, "--max_shard_size", "40KB",
                         "--output_dir", str(tmp_path / f"merge_{merge}")], timeout=JOB_TIMEOUT_S)  # forked
        assert proc.returncode == 0, job_failure(proc)
    adapter, final = tmp_path / "merge_false" / "final", tmp_path / "merge_true" / "final"

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as h:
        keys = list(h.keys())
    pattern = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_[AB]\.weight")
    assert all(pattern.fullmatch(k) for k in keys), [k for k in keys if not pattern.fullmatch(k)][:3]
    adapted = {pattern.fullmatch(k).groups() for k in keys}
    kinds = AutoConfig.from_pretrained(ckpt).text_config.layer_types
    mixer = {"linear_attention": ("linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")),
             "full_attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))}
    want = {(str(i), mixer[k][0], n) for i, k in enumerate(kinds) for n in mixer[k][1]} | \
        {(str(i), "mlp", n) for i in range(len(kinds)) for n in (() if moe else ("gate_proj", "up_proj", "down_proj"))}
    assert adapted == want and "linear_attention" in kinds and "full_attention" in kinds
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(ckpt)

    src, merged = _stored(ckpt), _stored(final)
    assert {k: tuple(v.shape) for k, v in merged.items()} == {k: tuple(v.shape) for k, v in src.items()}
    untouched = [k for k in src if k.startswith(("model.visual.", "mtp."))]
    assert any(k.startswith("mtp.") for k in untouched) and any(k.startswith("model.visual.") for k in untouched)
    assert all(merged[k].dtype == src[k].dtype and _bytes(merged[k]) == _bytes(src[k]) for k in untouched)
    changed = [k for k in src if k not in untouched and not torch.equal(merged[k].float(), src[k].float())]
    lora = {f"model.language_model.layers.{i}.{m}.{n}.weight" for i, m, n in want}
    assert set(changed) == lora, sorted(set(changed) ^ lora)[:4]  # the adapted Linears alone, every one

    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    exported = conditional_cls.from_pretrained(final, dtype=torch.float32).eval()
    text = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()
    conditional = PeftModel.from_pretrained(conditional_cls.from_pretrained(ckpt, dtype=torch.float32),
                                            adapter, key_mapping=TO_CONDITIONAL).eval()
    assert not [n for n, _ in conditional.named_parameters() if "lora_" in n and ".visual." in n]
    assert all(p.abs().sum() > 0 for n, p in conditional.named_parameters() if "lora_B" in n)  # every one loaded
    before = conditional_cls.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        got, plain = exported(input_ids=ids).logits, before(input_ids=ids).logits
        for m in (text, conditional):
            want_logits = m(input_ids=ids).logits
            assert (got - want_logits).norm() / want_logits.norm() <= 1e-5
    assert (got - plain).norm() / plain.norm() > 1e-4  # the adapter changed the model


def test_a_misnamed_language_model_tensor_is_refused_before_training(tmp_path):
    """The language model of a multimodal checkpoint is checked as a Qwen3 checkpoint is: a renamed tensor is
    named (missing and unused); the vision tower and MTP head are not counted as unused."""
    from safetensors.torch import load_file, save_file

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.errors import ConfigError
    from ulysses_trainer.model.load import check_local_weights, model_config_for

    ckpt = write_qwen3_5_checkpoint(tmp_path / "ckpt")
    cfg = TrainConfig(model_name_or_path=str(ckpt), max_length=64)
    config = model_config_for(cfg)
    assert config.model_type == "qwen3_5_text"  # the language model, not the multimodal wrapper
    check_local_weights(str(ckpt), config)  # complete: passes
    index = json.loads((ckpt / INDEX).read_text())
    name = "model.language_model.norm.weight"
    f = ckpt / index["weight_map"][name]
    tensors = load_file(str(f))
    tensors["model.language_model.final_norm.weight"] = tensors.pop(name)
    save_file(tensors, str(f), metadata={"format": "pt"})
    index["weight_map"]["model.language_model.final_norm.weight"] = index["weight_map"].pop(name)
    (ckpt / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError) as err:
        check_local_weights(str(ckpt), config)
    assert "norm.weight" in str(err.value) and "final_norm" in str(err.value) and "visual" not in str(err.value)


def test_a_hub_ids_cached_snapshot_is_the_source_of_its_files(tmp_path, monkeypatch):
    """A checkpoint given as a Hub id is read from its cached snapshot: the export takes its layout and files from
    there (config.json's directory), as from a local directory."""
    import shutil

    from huggingface_hub import constants

    from ulysses_trainer.train.chat_export import source_file

    ckpt = write_qwen3_5_checkpoint(tmp_path / "ckpt")
    repo = tmp_path / "hub" / "models--Qwen--Qwen3.5-tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(ckpt, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert source_file("Qwen/Qwen3.5-tiny", "config.json") == snapshot / "config.json"
    assert source_file("Qwen/Qwen3.5-tiny", "generation_config.json") == snapshot / "generation_config.json"
    assert source_file("Qwen/Qwen3.5-tiny", "processor_config.json") is None
    assert source_file(None, "config.json") is None

"""LoRA (TRL's names, through PEFT) under ZeRO-3 + Ulysses SP, through the real command on CPU ranks.

Three runs of the tiny preset, 3 steps: sp=1 writing the adapter to final/; sp=2 (2 ranks) writing the
merged model and checkpoints at steps 2 and 3; sp=2 resumed from checkpoint-2. The losses and gradient
norms of sp=1 and sp=2 agree, the resumed step 3 is bitwise the straight one; PEFT loads the adapter onto
the base model (the preset's seeded weights) and AutoModelForCausalLM loads the merged export, and both
give the same logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.test_e2e_train import read_metrics, rel, run_train

ARGS = ["--max_length", "128", "--max_steps", "3", "--bf16", "false", "--seed", "9", "--learning_rate", "1e-2",
        "--gradient_accumulation_steps", "2", "--use_peft", "true", "--lora_r", "8", "--lora_dropout", "0",
        "--lora_target_modules", "[q_proj, v_proj, gate_proj]", "--report_to", "none"]


@pytest.mark.slow
def test_lora_sp2_equals_sp1_and_exports_load(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for

    run_train(1, ARGS + ["--sp_size", "1"], tmp_path / "sp1")
    run_train(2, ARGS + ["--sp_size", "2", "--merge_lora", "true", "--save_steps", "2"], tmp_path / "sp2")
    ref, got = read_metrics(tmp_path / "sp1")[0], read_metrics(tmp_path / "sp2")[0]
    assert len(ref) == len(got) == 3 and ref[-1]["loss"] < ref[0]["loss"]
    for a, b in zip(got, ref):
        assert rel(a["loss"], b["loss"]) <= 1e-5 and rel(a["grad_norm"], b["grad_norm"]) <= 1e-5, (a, b)

    # resume from checkpoint-2 (frozen weights, adapters, their Adam states): step 3 is bitwise the straight run's
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "sp2", resumed)
    shutil.rmtree(resumed / "checkpoint-3")
    shutil.rmtree(resumed / "final")
    (resumed / "latest").write_text("checkpoint-2\n")
    run_train(2, ARGS + ["--sp_size", "2", "--merge_lora", "true", "--save_steps", "2", "--resume_from_checkpoint",
                         "true"], resumed)
    again = read_metrics(resumed)[0]
    assert [r["step"] for r in again] == [1, 2, 3] and again[2]["loss"] == got[2]["loss"]
    assert again[2]["grad_norm"] == got[2]["grad_norm"]

    adapter = tmp_path / "sp1" / "final"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    mc = model_config_for(TrainConfig(max_length=128))
    base = build_model(mc, torch.float32, None, seed=9)
    with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sp2" / "final"), dtype=torch.float32).eval()
    ids = torch.arange(1, 65).unsqueeze(0) * 97 % 151000
    with torch.no_grad():
        a, b = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = build_model(mc, torch.float32, None, seed=9)(input_ids=ids).logits
    assert (a - b).norm() / a.norm() <= 1e-4
    assert (a - plain).norm() / a.norm() > 1e-4  # the adapters changed the model


@pytest.mark.slow
def test_lora_on_qwen3_moe_sp2_equals_sp1_and_the_merged_export_loads(tmp_path):
    """tiny-moe with LoRA on the attention projections (the default targets; a sparse block has no Linear to
    adapt): sp=1 and sp=2 log the same losses, aux losses and gradient norms; the merged export loads as
    Qwen3MoeForCausalLM and differs from the base model."""
    from transformers import AutoModelForCausalLM

    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for

    args = ["--model_name_or_path", "tiny-moe", "--max_length", "128", "--max_steps", "2", "--bf16", "false",
            "--seed", "9", "--learning_rate", "1e-2", "--use_peft", "true", "--lora_r", "8", "--lora_dropout", "0",
            "--report_to", "none"]
    run_train(1, args + ["--sp_size", "1"], tmp_path / "sp1")
    run_train(2, args + ["--sp_size", "2", "--merge_lora", "true"], tmp_path / "sp2")
    ref, got = read_metrics(tmp_path / "sp1")[0], read_metrics(tmp_path / "sp2")[0]
    assert len(ref) == len(got) == 2
    for a, b in zip(got, ref):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert rel(a[key], b[key]) <= 1e-5, (key, a, b)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sp2" / "final"), dtype=torch.float32).eval()
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    plain = build_model(model_config_for(TrainConfig(model_name_or_path="tiny-moe", max_length=128)), torch.float32,
                        None, seed=9)
    ids = torch.arange(1, 65).unsqueeze(0) * 97 % 1000
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, plain(input_ids=ids).logits
    assert (a - b).norm() / b.norm() > 1e-4  # the merged adapters changed the attention projections

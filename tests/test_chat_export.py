"""A Qwen3 checkpoint with Qwen3's shipped chat template, trained on the assistant's turns, and chat exports.

Through the real command on CPU ranks:
- a Qwen3 checkpoint directory (the tiny preset's weights, Qwen3's tokenizer layout, the fixture's template)
  with conversational data (two user queries, tools, tool calls, reasoning) and assistant_only_loss, at sp=1
  and sp=2: equal losses; final/ reloads in plain transformers with the checkpoint's template, its
  generation_config's eos holds <|im_end|> and generation stops when <|im_end|> is produced;
- the tiny preset with LoRA on the same data (the built-in format): final/ is an adapter whose
  base_model_name_or_path is final/base, which AutoPeftModelForCausalLM loads offline; its tokenizer applies
  the built-in format's template and generation stops at the turn end.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.qwen3_checkpoint import QWEN3_GENERATION, qwen3_template_or_skip, write_qwen3_checkpoint
from tests.test_e2e_train import read_metrics, rel, run_train

IM_END, ENDOFTEXT = 151645, 151643
ARGS = ["--max_length", "384", "--max_steps", "2", "--learning_rate", "1e-3", "--bf16", "false", "--seed", "4",
        "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "1", "--save_strategy", "no",
        "--report_to", "none", "--assistant_only_loss", "true"]


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    out = []
    for i in range(n):
        listing = " ".join(f"file{rng.randint(0, 99)}.txt" for _ in range(rng.randint(10, 20)))
        out.append({"messages": [
            {"role": "user", "content": f"Find the largest file, case {i}."},
            {"role": "assistant", "content": "Listing first.", "reasoning_content": "I need the listing.",
             "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {"dir": "."}}}]},
            {"role": "tool", "content": listing},
            {"role": "assistant", "content": f"<think>\nBiggest name.\n</think>\n\nIt is {listing.split()[0]}."},
            {"role": "user", "content": [{"type": "text", "text": "And the smallest?"}]},
            {"role": "assistant", "content": f"It is {listing.split()[-1]}.", "reasoning_content": "Last one."}],
            "tools": json.dumps(tools)})
    return out


def _stops_at_turn_end(model, tok, messages) -> None:
    """Generation from the chat template's prompt, forced to write two tokens then <|im_end|>: it ends there
    (with max_new_tokens room for more) because generation_config's eos holds <|im_end|>."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = ids["input_ids"]
    assert tok.decode(prompt[0]).endswith("<|im_start|>assistant\n")

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - prompt.shape[1]
            forced = torch.full_like(scores, -float("inf"))
            forced[:, [9707, 9707, IM_END, 9707][step]] = 0
            return forced

    assert IM_END in model.generation_config.eos_token_id
    out = model.generate(prompt, attention_mask=ids["attention_mask"], max_new_tokens=4, do_sample=False,
                         logits_processor=LogitsProcessorList([Force()]))
    assert out[0, prompt.shape[1]:].tolist() == [9707, 9707, IM_END]


@pytest.mark.slow
def test_qwen3_checkpoint_with_its_template_trains_assistant_turns_sp1_sp2_and_exports_a_chat_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template = qwen3_template_or_skip()
    ckpt = write_qwen3_checkpoint(tmp_path / "Qwen3-tiny", template)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(4, seed=1)))
    common = ARGS + ["--model_name_or_path", str(ckpt), "--dataset_name", str(data)]
    run_train(1, common + ["--sp_size", "1"], tmp_path / "sp1")
    run_train(2, common + ["--sp_size", "2", "--save_strategy", "steps", "--save_steps", "2"], tmp_path / "sp2")
    ref, got = read_metrics(tmp_path / "sp1")[0], read_metrics(tmp_path / "sp2")[0]
    assert len(ref) == len(got) == 2
    for a, b in zip(got, ref):
        assert rel(a["loss"], b["loss"]) <= 1e-4 and a["num_loss_tokens"] == b["num_loss_tokens"] > 0, (a, b)

    final = tmp_path / "sp2" / "final"
    tok = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    assert tok.chat_template == template  # the checkpoint's own template, as loaded
    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == [IM_END, ENDOFTEXT]
    assert json.loads((final / "generation_config.json").read_text()) == QWEN3_GENERATION  # the checkpoint's own
    _stops_at_turn_end(model, tok, conversations(1, seed=2)[0]["messages"][:1])


@pytest.mark.slow
def test_preset_lora_adapter_loads_offline_with_its_base_and_chat_template(tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from ulysses_trainer.data.qwen3_template import QWEN3_CHAT_TEMPLATE

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(4, seed=3)))
    run_train(1, ARGS + ["--dataset_name", str(data), "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0",
                         "--sp_size", "1", "--save_strategy", "steps", "--save_steps", "2"], tmp_path / "run")
    final = tmp_path / "run" / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((final / "base").resolve())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoPeftModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    assert model.generation_config.eos_token_id[0] == IM_END
    _stops_at_turn_end(model, tok, [{"role": "user", "content": "hi"}])
    # final/base is the preset's seeded model, the frozen weights the adapter was trained on
    from ulysses_trainer.config import TrainConfig
    from ulysses_trainer.model.load import build_model, model_config_for

    seeded = build_model(model_config_for(TrainConfig(max_length=384)), torch.float32, None, seed=4).state_dict()
    loaded = model.get_base_model().state_dict()
    for name, value in seeded.items():
        adapted = name.replace(".weight", ".base_layer.weight")  # a LoRA-wrapped Linear's frozen weight
        assert torch.equal(loaded[adapted if adapted in loaded else name], value), name

"""A user's checkpoint of every family beyond Qwen (Llama and Gemma 3 at sp 2, the rest at sp 1), each with its own
tokenizer and chat template, trained through the rank entry of `deepspeed launch/train.py` on CPU ranks
(tests/warm_ranks.py) on conversations with assistant_only_loss: a run stopped after step 2 and resumed to step 4
logs what the straight 4-step run logs, bitwise (fp32 on the CPU, the tolerance for a resume), and exports the same
final/ bitwise, in the checkpoint's own layout (its tensor names and shards: Mixtral's experts one by one under
block_sparse_moe, Phi-3's fused projections, gpt-oss's fused experts, router and sinks). Each family's own tensors
(gpt-oss's sinks and router, Gemma 3's and OLMo 2's extra norms, Phi-3's fused projections, the MoE routers and
Qwen2-MoE's shared-expert gate, Qwen2's q/k/v biases) are among those trained, so their state is restored.

  straight  4 steps, a checkpoint every 2
  resumed   straight's output_dir cut back to checkpoint-2 (what a run killed in step 4's save leaves: metrics.jsonl
            already holds steps 3 and 4), resumed (`true` = latest) to step 4
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S, job_failure
from tests.family_checkpoints import write_family_checkpoint, write_tokenizer
from tests.test_family_templates import (
    GEMMA_LIKE,
    GEMMA_SPECIALS,
    GPT_OSS_SPECIALS,
    LLAMA31_LIKE,
    LLAMA_SPECIALS,
    MISTRAL_SMALL_MARKED,
    MISTRAL_SPECIALS,
    PHI3_SPECIALS,
    QWEN_SPECIALS,
    _trl_template,
)
from tests.tiny_checkpoint import WORDS
from tests.warm_ranks import run_trainer

pytestmark = pytest.mark.slow
INDEX = "model.safetensors.index.json"
# OLMo 2 Instruct's shape (Tulu's): plain-text role headers, each answer ended by eos
OLMO2_LIKE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + "
    "message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
# Granite 3's shape: role tokens around each role name, each turn ended by eos
GRANITE_LIKE = (
    "{%- for message in messages %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + "
    "message['content'] + eos_token + '\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}")
# id: (model_type, sp, the tokenizer's specials, its chat template (a str, or the name of TRL's copy of the one the
# family ships), bos, whether conversations may open with a system message, the family's own tensors (substrings of
# their names) that training must change)
CASES = {
    "llama-sp2": ("llama", 2, LLAMA_SPECIALS, LLAMA31_LIKE, "<|begin_of_text|>", True, ()),
    "mixtral-sp1": ("mixtral", 1, MISTRAL_SPECIALS, MISTRAL_SMALL_MARKED, "<s>", True, ("block_sparse_moe.gate.",)),
    "mistral-sp1": ("mistral", 1, MISTRAL_SPECIALS, MISTRAL_SMALL_MARKED, "<s>", True, ()),
    "ministral-sp1": ("ministral", 1, MISTRAL_SPECIALS, MISTRAL_SMALL_MARKED, "<s>", True, ()),
    "qwen2-sp1": ("qwen2", 1, QWEN_SPECIALS, "qwen2_5", None, True, ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "gemma3-sp2": ("gemma3_text", 2, GEMMA_SPECIALS, GEMMA_LIKE, "<bos>", True,
                   ("pre_feedforward_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm")),
    "olmo2-sp1": ("olmo2", 1, ("<|system|>", "<|user|>", "<|assistant|>"), OLMO2_LIKE, None, True,
                  ("post_feedforward_layernorm", "q_norm", "k_norm")),
    "phi3-sp1": ("phi3", 1, PHI3_SPECIALS, "phi3_5", None, True, ("qkv_proj", "gate_up_proj")),
    "granite-sp1": ("granite", 1, ("<|start_of_role|>", "<|end_of_role|>"), GRANITE_LIKE, None, True, ()),
    "gpt-oss-sp1": ("gpt_oss", 1, GPT_OSS_SPECIALS, "gptoss", None, False, ("sinks", "mlp.router.", "experts.")),
    "qwen2-moe-sp1": ("qwen2_moe", 1, QWEN_SPECIALS, "qwen2_5", None, True,
                      ("mlp.gate.", "shared_expert_gate", "shared_expert.")),
}


def _conversations(path: Path, n: int, seed: int, system: bool = True) -> Path:
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": words(3)}] if system and rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": words(rng.randint(2, 8))},
                     {"role": "assistant", "content": words(rng.randint(2, 10))}]
        rows.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


def _rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _stored(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def runs(request, tmp_path_factory):
    model_type, sp, specials, template, bos, system, _ = CASES[request.param]
    if "{" not in template:  # the template the family's checkpoints ship, as TRL keeps it
        template = _trl_template(template)
    root = tmp_path_factory.mktemp(request.param)
    ckpt = root / "ckpt"
    vocab = write_tokenizer(ckpt, specials, template, bos=bos)
    write_family_checkpoint(ckpt, model_type, vocab_size=vocab)
    data = _conversations(root / "chat.jsonl", 40, seed=5, system=system)
    args = ["--model_name_or_path", str(ckpt), "--dataset_name", str(data), "--assistant_only_loss", "true",
            "--max_length", "64", "--packing", "true", "--max_steps", "4", "--save_steps", "2", "--sp_size", str(sp),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--lr_scheduler_type", "cosine", "--warmup_steps", "1", "--bf16", "false", "--seed", "3",
            "--logging_steps", "1", "--verify_sp", "false"]

    def train(out: Path, *extra: str):
        proc = run_trainer(sp, [*args, *extra, "--output_dir", str(out)], timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, job_failure(proc)
        return proc

    straight, resumed = root / "straight", root / "resumed"
    train(straight)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    shutil.rmtree(resumed / "final")
    (resumed / "latest").write_text("checkpoint-2\n")
    proc = train(resumed, "--resume_from_checkpoint", "true")
    return request.param, ckpt, straight, resumed, proc


def test_the_resumed_run_logs_the_straight_runs_steps_bitwise(runs):
    _, _, straight, resumed, proc = runs
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert "at step 2" in proc.stdout, proc.stdout[-2000:]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "num_loss_tokens"):
            assert json.dumps(x[key]) == json.dumps(y[key]), (key, x, y)
    assert a[0]["loss"] != a[-1]["loss"]  # it trained


def test_the_resumed_export_is_the_straight_runs_in_the_checkpoints_layout(runs):
    import torch

    case, ckpt, straight, resumed, _ = runs
    got, want, source = _stored(resumed / "final"), _stored(straight / "final"), _stored(ckpt)
    assert set(got) == set(want) == set(source)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert not all(torch.equal(got[k].float(), source[k].float()) for k in got)  # trained
    for part in CASES[case][-1]:  # the family's own tensors: each trained, so its restored state counted
        names = [k for k in got if part in k]
        assert names and all(not torch.equal(got[k].float(), source[k].float()) for k in names), (part, names)
    index = json.loads((resumed / "final" / INDEX).read_text())["weight_map"]
    assert index == json.loads((ckpt / INDEX).read_text())["weight_map"]
    assert (resumed / "final" / "chat_template.jinja").read_text() == (ckpt / "chat_template.jinja").read_text()

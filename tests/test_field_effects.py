"""Small tests for config fields that no other test exercised directly: the HF splits, the AdamW numbers, the
schedule and its kwargs, the eval batch, max_length_policy on conversations."""

from __future__ import annotations

import json
import random

import pytest
import torch

from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.config import TrainConfig
from ulysses_trainer.config.load import build_config
from ulysses_trainer.errors import ConfigError


def test_dataset_train_and_test_split_choose_the_hf_split(monkeypatch):
    import datasets

    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    asked = []

    def load_dataset(name, split):
        asked.append((name, split))
        return datasets.Dataset.from_dict({"text": [f"document {i} of {split}" for i in range(30)]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = TrainConfig(dataset_name="org/data", dataset_train_split="mine", dataset_test_split="held_out",
                      max_length=16, data_cache=False)
    tok = QwenBPETokenizer()
    build_sequences(cfg, tok, split="train")
    build_sequences(cfg, tok, split="eval")
    assert asked == [("org/data", "mine"), ("org/data", "held_out")]


def test_adam_numbers_reach_the_optimizer():
    from ulysses_trainer.ds_config import fill_ds_config, load_ds_config

    cfg = build_config({"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.01})
    _, spec = fill_ds_config(load_ds_config("ds_configs/zero3.json"), cfg, 1, 1, False, bf16=False)
    opt = spec.build([torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults["betas"] == (0.8, 0.95) and opt.defaults["eps"] == 1e-6
    assert opt.defaults["weight_decay"] == 0.01


def _lrs(cfg, steps: int) -> list[float]:
    from ulysses_trainer.train.schedule import build_schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    sched = build_schedule(cfg, opt, steps)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_lr_scheduler_type_and_kwargs_shape_the_schedule():
    linear = _lrs(build_config({"learning_rate": 1.0}), 4)
    assert linear == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert _lrs(build_config({"learning_rate": 1.0, "lr_scheduler_type": "constant"}), 4) == [1.0] * 4
    half = _lrs(build_config({"learning_rate": 1.0, "lr_scheduler_type": "cosine"}), 4)
    full = _lrs(build_config({"learning_rate": 1.0, "lr_scheduler_type": "cosine",
                              "lr_scheduler_kwargs": {"num_cycles": 1.0}}), 4)
    assert half[2] == pytest.approx(0.5) and full[2] == pytest.approx(0.0, abs=1e-12)  # a whole cosine cycle
    with pytest.raises(TypeError):
        _lrs(build_config({"lr_scheduler_type": "linear", "lr_scheduler_kwargs": {"num_cycles": 1.0}}), 2)


def test_per_device_eval_batch_size_is_the_eval_round(tmp_path):
    from ulysses_trainer.train.prepare import prepare

    rng = random.Random(2)
    words = "alpha bravo charlie delta echo foxtrot".split()
    for name, n in (("train.jsonl", 8), ("eval.jsonl", 3)):
        (tmp_path / name).write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))})
                                             + "\n" for _ in range(n)))
    args = ["--max_length", "64", "--dataset_name", str(tmp_path / "train.jsonl"), "--eval_dataset_name",
            str(tmp_path / "eval.jsonl"), "--eval_steps", "1", "--output_dir", str(tmp_path / "out"),
            "--data_cache", "false"]
    rows = len(prepare(load_config(args), 1).eval_data)
    assert prepare(load_config(args + ["--per_device_eval_batch_size", str(rows)]), 1).eval_data is not None
    with pytest.raises(ConfigError, match=f"one eval round needs {rows + 1} .*per_device_eval_batch_size {rows + 1}"):
        prepare(load_config(args + ["--per_device_eval_batch_size", str(rows + 1)]), 1)


def test_max_length_policy_truncates_or_drops_a_long_conversation(tmp_path):
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
            {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = QwenBPETokenizer()
    kept = build_sequences(TrainConfig(dataset_name=str(path), max_length=64), tok)
    dropped = build_sequences(TrainConfig(dataset_name=str(path), max_length=64, max_length_policy="drop"), tok)
    assert len(kept) == 2 and kept.counts.details["truncated"] == 1
    assert len(dropped) == 1 and dropped.counts.details["dropped_too_long"] == 1


def _plan(capsys, *args: str, model: str = "qwen3-4b", gpus: str = "1") -> dict:
    from ulysses_trainer.__main__ import main as cli_main

    # the other levers fixed, so that only the field under test moves the prediction
    fixed = ["--activation_offload", "true", "--keep_attention_outputs", "false", "--checkpoint_every", "1",
             "--optimizer_offload", "true"]
    cli_main(["plan", "--model", model, "--gpus", gpus, "--gpu_memory_gb", "139.8", "--host_memory_gb", "500",
              "--max_length", "65536", "--json",
              "--model_init_kwargs", "{rope_parameters: {rope_type: yarn, factor: auto}}", *fixed, *args])
    return json.loads(capsys.readouterr().out)["plan"]


def test_memory_levers_of_the_config_move_the_planned_peak(capsys):
    base = _plan(capsys)
    assert base["loss_type"] == "chunked_nll" and base["lean_norm"] is True
    assert _plan(capsys, "--loss_type", "nll")["predicted_peak_gpu_gb"] > base["predicted_peak_gpu_gb"]
    assert _plan(capsys, "--loss_chunk_size", "8192")["predicted_peak_gpu_gb"] > base["predicted_peak_gpu_gb"]
    assert _plan(capsys, "--lean_norm", "false")["predicted_peak_gpu_gb"] > base["predicted_peak_gpu_gb"]
    untiled, tiled = _plan(capsys, "--tiled_mlp", "false"), _plan(capsys, "--tiled_mlp", "8")
    assert tiled["tiled_mlp"] == 8 and tiled["predicted_peak_gpu_gb"] < untiled["predicted_peak_gpu_gb"]
    grouped = _plan(capsys, "--experts_implementation", "grouped_mm", model="qwen3-30b-a3b", gpus="8")
    batched = _plan(capsys, "--experts_implementation", "batched_mm", model="qwen3-30b-a3b", gpus="8")
    assert batched["experts_implementation"] == "batched_mm"
    assert batched["predicted_peak_gpu_gb"] > grouped["predicted_peak_gpu_gb"]


def test_seed_decides_the_data_order():
    from types import SimpleNamespace

    from ulysses_trainer.train.data_order import epoch_order

    def order(seed):
        return epoch_order(SimpleNamespace(cfg=build_config({"seed": seed}), train_data=[0] * 50), 0).tolist()

    assert order(3) == order(3) != order(4)

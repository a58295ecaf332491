"""ZeRO JSON: "auto" filling, conflicts with the training config, malformed JSON, batch-size units."""

import json

import pytest
import torch

from tests.dist_utils import run_ranks
from ulysses_trainer.config import DEFAULT_DS_CONFIG, REPO_ROOT, TrainConfig
from ulysses_trainer.ds_config import OptimizerSpec, fill_ds_config, load_ds_config
from ulysses_trainer.errors import ConfigError

ZERO3 = str(REPO_ROOT / "ds_configs" / "zero3.json")
OFFLOAD = str(REPO_ROOT / "ds_configs" / "zero3_offload.json")


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"bf16": False, **kw})


def test_shipped_configs_are_zero3_with_auto_values():
    for path in (ZERO3, OFFLOAD):
        ds = load_ds_config(path)
        z = ds["zero_optimization"]
        assert z["stage"] == 3 and z["stage3_gather_16bit_weights_on_model_save"] is True
        assert ds["train_batch_size"] == ds["gradient_accumulation_steps"] == "auto"
        assert ds["optimizer"]["params"]["lr"] == "auto"
    assert load_ds_config(OFFLOAD)["zero_optimization"]["offload_optimizer"] == {"device": "cpu",
                                                                                  "pin_memory": True}
    assert DEFAULT_DS_CONFIG == "ds_configs/zero3.json"  # the package's copy where the working directory has none


def test_fill_on_cpu_uses_torch_adamw():
    cfg = _cfg(per_device_train_batch_size=2, gradient_accumulation_steps=3, max_grad_norm=0.5,
               learning_rate=2e-5, weight_decay=0.1, adam_beta2=0.95)
    ds, spec = fill_ds_config(load_ds_config(ZERO3), cfg, world_size=4, dp_size=2, device_is_cuda=False, bf16=False,
                              hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 3 * 4  # DeepSpeed counts every rank as data-parallel
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": False}
    assert "optimizer" not in ds and "scheduler" not in ds
    assert spec == OptimizerSpec(lr=2e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    z = ds["zero_optimization"]
    buckets = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    assert tuple(z[k] for k in buckets) == (64 * 64, int(0.9 * 64 * 64), 640)
    assert "auto" not in json.dumps(ds)
    opt = spec.build([torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults["lr"] == 2e-5 and opt.defaults["betas"] == (0.9, 0.95)


def test_fill_without_hidden_size_leaves_bucket_defaults_to_deepspeed():
    ds, _ = fill_ds_config(load_ds_config(ZERO3), _cfg(), 1, 1, False, bf16=False)
    assert "reduce_bucket_size" not in ds["zero_optimization"]


def test_fill_on_cuda_can_keep_deepspeed_adam():
    cfg = _cfg(bf16="auto", learning_rate=1e-5)
    ds, spec = fill_ds_config(load_ds_config(ZERO3), cfg, 8, 1, device_is_cuda=True, bf16=True,
                              use_deepspeed_optimizer=True)
    assert spec is None
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": 0.0}}
    ds2, spec2 = fill_ds_config(load_ds_config(ZERO3), cfg, 8, 1, device_is_cuda=True, bf16=True,
                                use_deepspeed_optimizer=False)
    assert "optimizer" not in ds2 and spec2.lr == 1e-5


def test_offload_with_torch_adamw_tells_deepspeed_to_allow_it():
    ds, spec = fill_ds_config(load_ds_config(OFFLOAD), _cfg(), 2, 2, device_is_cuda=False, bf16=False)
    assert spec is not None and ds["zero_force_ds_cpu_optimizer"] is False


def test_user_train_batch_size_is_in_sequences_per_step():
    cfg = _cfg(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    base = load_ds_config(ZERO3)
    # world 4 = dp 2 x sp 2: 1 x 2 x 2 = 4 sequences per optimizer step
    ds, _ = fill_ds_config({**base, "train_batch_size": 4}, cfg, world_size=4, dp_size=2,
                           device_is_cuda=False, bf16=False)
    assert ds["train_batch_size"] == 8  # converted to DeepSpeed's all-ranks-are-dp unit
    with pytest.raises(ConfigError, match=r"train_batch_size is 8 in .* gives 4 sequences per optimizer "
                                          r"step \(per_device_train_batch_size 1 x "
                                          r"gradient_accumulation_steps 2 x dp 2"):
        fill_ds_config({**base, "train_batch_size": 8}, cfg, world_size=4, dp_size=2, device_is_cuda=False, bf16=False)


@pytest.mark.parametrize("edit, cfg_kw, pattern", [
    ({"gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": 2},
     r"gradient_accumulation_steps is 4 in my.json but the training config gives "
     r"gradient_accumulation_steps = 2"),
    ({"train_micro_batch_size_per_gpu": 2}, {},
     r"train_micro_batch_size_per_gpu is 2 .* per_device_train_batch_size = 1"),
    ({"gradient_clipping": 0.3}, {"max_grad_norm": 1.0}, r"gradient_clipping is 0.3 .* max_grad_norm = 1.0"),
    ({"bf16": {"enabled": True}}, {"bf16": False}, r"bf16.enabled is true .* bf16 = false"),
    ({"fp16": {"enabled": True}}, {}, r"fp16 is not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, {"learning_rate": 1e-4},
     r"optimizer.params.lr is 0.1 .* learning_rate = 0.0001"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, {},
     r"optimizer.params.betas is \[0.9, 0.95\].*set adam_beta1 and adam_beta2"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, {}, r"optimizer type \"Lamb\" .* not supported"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}, {"warmup_steps": 0},
     r"scheduler.params.warmup_num_steps is 10 .* warmup_steps = 0"),
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, {"lr_scheduler_type": "cosine"},
     r"scheduler WarmupLR .* means lr_scheduler_type 'constant_with_warmup'"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, {}, r"scheduler \"OneCycle\" .* not supported"),
    ({"communication_data_type": "auto"}, {}, r"\"auto\" at communication_data_type"),
    ({"zero_optimization": {"stage": 2}}, {},
     r"my.json has zero_optimization.stage 2, but this trainer needs ZeRO stage 3 .*final HF export.*; set "
     r"\"zero_optimization\": \{\"stage\": 3\}"),
    ({"zero_optimization": {}}, {}, r"my.json has no zero_optimization section, but this trainer needs ZeRO stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}}, {},
     r"DeepSpeed rejects my.json: zero_optimization.offload_optimizer.device = \"gpu\": Input should be 'none', "
     r"'cpu' or 'nvme'; fix or remove that field"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "lots"}}, {},
     r"DeepSpeed rejects my.json: zero_optimization.stage3_max_live_parameters = \"lots\": Input should be a "
     r"valid integer"),
])
def test_conflicts_name_both_places(edit, cfg_kw, pattern):
    ds = {**load_ds_config(ZERO3), **edit}
    with pytest.raises(ConfigError, match=pattern):
        fill_ds_config(ds, _cfg(**cfg_kw), 2, 2, device_is_cuda=False, bf16=False, source="my.json")


def test_explicit_values_that_agree_are_kept():
    ds = {**load_ds_config(ZERO3), "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "bf16": {"enabled": False}, "fp16": {"enabled": "auto"},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": 8,
                                                            "warmup_max_lr": "auto"}}}
    out, _ = fill_ds_config(ds, _cfg(gradient_accumulation_steps=2), 2, 2, False, bf16=False, total_steps=8)
    assert out["gradient_accumulation_steps"] == 2 and out["fp16"] == {"enabled": False}
    assert "scheduler" not in out  # the trainer owns the schedule
    with pytest.raises(ConfigError, match="total_num_steps is 8 .* the run's optimizer steps = 5"):
        fill_ds_config(ds, _cfg(gradient_accumulation_steps=2), 2, 2, False, bf16=False, total_steps=5)


def test_malformed_json_reports_line_and_column(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": }\n}\n')
    with pytest.raises(ConfigError, match=r"bad.json is not valid at line 3, column 34"):
        load_ds_config(str(p))
    with pytest.raises(ConfigError, match=r"ZeRO config '.*missing.json' not found"):
        load_ds_config(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_ds_config(str(tmp_path / "list.json"))


def test_relative_path_resolves_from_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_ds_config("ds_configs/zero3_offload.json")["zero_optimization"]["offload_optimizer"]


def _engine_step(rank, world_size, ds_path):
    """Build a ZeRO-3 engine from the filled shipped JSON and take one optimizer step (2 micro-steps)."""
    import deepspeed
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = TrainConfig(bf16=False, gradient_accumulation_steps=2, learning_rate=1e-3)
    ds, spec = fill_ds_config(load_ds_config(ds_path), cfg, world_size=world_size, dp_size=1,
                              device_is_cuda=False, bf16=False, hidden_size=32)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8))
    before = [p.detach().clone() for p in model.parameters()]
    engine, *_ = deepspeed.initialize(model=model, optimizer=spec.build(model.parameters()), config=ds)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, engine.module.parameters()))
    return engine.train_batch_size(), engine.gradient_accumulation_steps(), engine.global_steps, changed


@pytest.mark.slow
def test_filled_config_builds_a_zero3_engine_on_cpu():
    out = run_ranks(2, _engine_step, ZERO3)
    for tbs, gas, steps, changed in out:
        assert (tbs, gas, steps) == (4, 2, 1)  # 1 micro x 2 gas x 2 ranks, one optimizer step
        assert changed

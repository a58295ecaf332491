"""TRL options that stand for one of our settings (issue 33 item 7): decoded once, in the config."""

import pytest

from ulysses_trainer.config import build_config
from ulysses_trainer.errors import ConfigError


def test_warmup_ratio_gives_ceil_of_total_and_warmup_steps_wins():
    assert build_config({"warmup_ratio": 0.25}).warmup_for(10) == 3
    assert build_config({"warmup_ratio": 0.25, "warmup_steps": 1}).warmup_for(10) == 1
    with pytest.raises(ConfigError, match="warmup_ratio"):
        build_config({"warmup_ratio": 1.5})


def test_padding_free_sets_packing():
    assert build_config({"padding_free": True}).packing is True


def test_use_liger_kernel_is_the_triton_norm_and_needs_lean_norm():
    assert build_config({"use_liger_kernel": True}).norm_kernel == "triton"
    with pytest.raises(ConfigError, match="lean_norm"):
        build_config({"use_liger_kernel": True, "lean_norm": False})
    with pytest.raises(ConfigError, match="set only one"):
        build_config({"use_liger_kernel": True, "norm_kernel": "torch"})


def test_save_safetensors_false_is_refused_with_reason():
    with pytest.raises(ConfigError, match="always written as safetensors"):
        build_config({"save_safetensors": False})

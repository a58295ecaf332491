"""The memory planner: each term against hand arithmetic, the settings search, calibration, the CLI."""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.dist_utils import JOB_TIMEOUT_S
from ulysses_trainer.__main__ import main as cli_main
from ulysses_trainer.plan import counts, host_terms, inputs, layer_terms, partitions
from ulysses_trainer.plan import loss_terms as L
from ulysses_trainer.plan import memory as M
from ulysses_trainer.plan.calibration import compare, load_calibration, load_measurements
from ulysses_trainer.plan.inputs import ModelShape, Settings
from ulysses_trainer.plan.longest_fit import Hardware, choose_settings, largest_max_length
from ulysses_trainer.plan.memory import estimate
from ulysses_trainer.vocabulary.layout import Layout
from ulysses_trainer.vocabulary.names import GIB

ROOT = Path(__file__).resolve().parent.parent
Q8 = ModelShape.preset("qwen3-8b")
Q4 = ModelShape.preset("qwen3-4b")
V = 151936

# Qwen3-8B by hand: q, k, v, o projections, q/k norms, gate/up/down, two layer norms; 36 layers,
# untied embedding and lm_head, final norm.
PER_LAYER_8B = 4096 * 4096 + 2 * 4096 * 1024 + 1024 * 4 * 4096 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
N_8B = 36 * PER_LAYER_8B + 2 * V * 4096 + 4096
YARN = ["--model_init_kwargs", '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}']  # past 40,960 positions


def test_parameter_count_qwen3_8b():
    assert PER_LAYER_8B == 192_946_432
    assert counts.num_params(Q8) == N_8B == 8_190_735_360


def test_model_states_qwen3_8b_zero3_8_ranks():
    s = Settings(max_length=8192, layout=Layout(8, 8))
    # every 8B tensor divides by 8, so each rank holds exactly N/8 elements
    assert M.weights_bytes(Q8, s) == 2 * N_8B // 8 == 2_047_683_840
    assert M.gradients_bytes(Q8, s) == 2 * N_8B // 8
    assert M.master_weights_bytes(Q8, s) == 4 * N_8B // 8
    assert M.adam_states_bytes(Q8, s) == 8 * N_8B // 8
    # optimizer offload: nothing of the optimizer left on the GPU, 12 bytes/param + pinned grads on the host
    off = s.with_levers(optimizer_offload=True)
    assert M.gradients_bytes(Q8, off) == M.master_weights_bytes(Q8, off) == M.adam_states_bytes(Q8, off) == 0
    assert host_terms.host_optimizer_bytes(Q8, off) >= 12 * N_8B // 8 + 4 * N_8B // 8 + 2 * N_8B // 8


def test_zero3_partition_pads_each_tensor():
    tiny = ModelShape.preset("tiny")
    s = Settings(max_length=64, layout=Layout(3, 1))  # world 3: tensors that 3 does not divide are padded
    want = sum(-(-n // 3) for n in counts.param_numels(tiny))
    assert want > counts.num_params(tiny) / 3
    assert M.weights_bytes(tiny, s) == 2 * want


def test_checkpoints_1m_tokens_sp8():
    s = Settings(max_length=1_048_576, layout=Layout(8, 8))
    assert inputs.local_tokens(s) == 131_072
    assert M.checkpoint_bytes_per_layer(Q8, s) == 131_072 * 4096 * 2 == GIB
    assert M.checkpoints_gpu_bytes(Q8, s) == 36 * GIB
    off = s.with_levers(activation_offload=6)
    assert M.checkpoints_gpu_bytes(Q8, off) == 30 * GIB
    assert host_terms.host_pool_bytes(Q8, off) == 6 * GIB + 4096  # exact sum (page-aligned slots) + alignment
    every = s.with_levers(activation_offload=36)
    assert M.checkpoints_gpu_bytes(Q8, every) == 2 * GIB  # the one recomputed + the one prefetched


def test_pinned_power_of_two_rounding_reproduces_the_448k_host_story():
    # at 448K a Qwen3-4B checkpoint is ~2.3 GB and per-tensor pinning takes a 4 GiB block each
    s = Settings(max_length=448 * 1024).with_levers(activation_offload=36)
    per = M.checkpoint_bytes_per_layer(Q4, s)
    assert per == 458_752 * 2560 * 2
    assert host_terms.host_pool_bytes(Q4, replace(s, pinned_rounding="pow2")) == 36 * 4 * GIB
    assert host_terms.host_pool_bytes(Q4, s) == 36 * (-(-per // 4096) * 4096) + 4096  # ~78.8 GiB, not 144
    assert partitions.pinned_bytes(3 * GIB // 2, "pow2") == 2 * GIB and partitions.pinned_bytes(GIB, "pow2") == GIB


def test_loss_terms_by_hand():
    t, h, c = 131_072, 4096, 256
    s = Settings(max_length=1_048_576, layout=Layout(8, 8))
    # hidden grad (bf16) + fp32 lm_head grad + the larger of: one chunk's fp32 logits next to the bf16
    # dlogits of 8 chunks, or the final bf16 [V, H] weight grad
    assert L.chunked_loss_bytes(Q8, s) == t * h * 2 + V * h * 4 + max(c * V * 4 + 8 * c * V * 2, V * h * 2)
    assert L.chunked_loss_bytes(Q8, s) == t * h * 2 + V * h * 4 + V * h * 2  # 256 rows: the weight grad wins
    assert L.chunked_loss_bytes(Q8, replace(s, loss_chunk_size=1024)) == t * h * 2 + V * h * 4 + 1024 * V * 20
    plain = replace(s, loss_type="nll")
    assert L.plain_loss_bytes(Q8, plain) == 3 * t * V * 4 + V * h * 2  # 3 fp32 [t, V] in backward
    assert L.loss_bytes(Q8, plain) > 40 * L.loss_bytes(Q8, s)  # 224 GiB vs 4.7 GiB: why chunked is the default


def test_loss_grad_group_matches_the_lever():
    from ulysses_trainer.levers.chunked_loss import GRAD_GROUP

    assert L.LOSS_GRAD_GROUP == GRAD_GROUP


def test_layer_terms_by_hand():
    s = Settings(max_length=65_536)  # sp 1: t = 65,536
    t, h, i, q, k = 65_536, 2560, 9728, 4096, 1024
    assert layer_terms.rmsnorm_saved_bytes(t, h, 2) == t * h * (4 + 2)  # fp32 upcast + bf16 normalized
    assert layer_terms.rmsnorm_saved_bytes(t, h, 4) == t * h * 4  # fp32 input: no upcast copy
    assert layer_terms.rmsnorm_saved_bytes(t, h, 2, lean=True) == t * h * 2  # lean: the bf16 input only
    saved = layer_terms.layer_forward_saved(Q4, replace(s, lean_norm=False))  # HF's norms
    assert saved["MLP intermediates (gate, act, up, product)"] == 4 * t * i * 2
    assert saved["q_norm, k_norm (fp32 upcast, normalized)"] == 6 * t * q + 6 * t * k
    assert saved["input norm (fp32 upcast, normalized, output)"] == 8 * t * h
    assert saved["post-attention norm (fp32 upcast, normalized, output)"] == 8 * t * h
    lean = layer_terms.layer_forward_saved(Q4, s)  # the default: the norms keep their bf16 inputs only
    assert lean["q_norm, k_norm (inputs)"] == 2 * t * q + 2 * t * k
    assert lean["input norm (output)"] == 2 * t * h  # its input is the checkpoint, counted there
    assert lean["post-attention norm (input, output)"] == 4 * t * h
    # tests/test_lean_norm.py counts 4 B per normed element on a bare layer, where the lean input norm's
    # input (2 B per element) is new; here it is the checkpoint, counted there
    assert sum(saved.values()) - sum(lean.values()) == 4 * t * (2 * h + q + k) + 2 * t * h
    assert saved["attention output + LSE (fp32)"] == t * q * 2 + t * 32 * 4
    assert saved["o_proj input"] == 0  # sp 1: the kernel's output itself
    tiled = s.with_levers(tiled_mlp=16)
    assert layer_terms.layer_forward_saved(Q4, tiled)["MLP intermediates (gate, act, up, product)"] == 0
    r = t // 16
    extra = layer_terms.mlp_backward_extra(Q4, tiled)
    assert sum(extra.values()) == t * h * 2 + 6 * r * i * 2 + 2 * r * h * 2
    # sp 8 > 8 KV heads? no: 8 divides 8, no replication; sp 16 on a 32q/8kv model replicates KV twice
    assert inputs.kv_repeat(Q4, 8) == 1 and inputs.kv_repeat(Q4, 16) == 2
    sp16 = Settings(max_length=16 * 4096, layout=Layout(16, 16))
    saved = layer_terms.layer_forward_saved(Q4, sp16)
    assert saved["attention q, k, v (after rope / all-to-all)"] == 4096 * (q + 2 * 2 * k) * 2


def test_tiling_lowers_the_layer_working_set_and_offload_lowers_the_peak():
    s = Settings(max_length=262_144)
    untiled = estimate(Q4, s)
    tiled = estimate(Q4, s.with_levers(tiled_mlp=16))
    assert tiled.phases["layer_backward"] < untiled.phases["layer_backward"]
    off = estimate(Q4, s.with_levers(tiled_mlp=16, activation_offload=20))
    assert off.gpu_peak == tiled.gpu_peak - 20 * M.checkpoint_bytes_per_layer(Q4, s)
    assert off.host_per_rank - tiled.host_per_rank == host_terms.host_pool_bytes(Q4,
                                                                                 s.with_levers(activation_offload=20))


def test_estimate_adds_up():
    e = estimate(Q8, Settings(max_length=1_048_576, layout=Layout(8, 8)).with_levers(tiled_mlp=8, activation_offload=3))
    counted = sum(t.gpu for t in e.terms if e.counts(t) and t.phase != "overhead")
    assert counted == e.gpu_peak
    assert e.peak_phase == max(("layer_backward", "loss"), key=lambda p: e.phases[p])
    assert e.gpu_required == e.gpu_peak + int(e.gpu_peak * 0.05) + GIB
    assert e.host_per_host == 8 * e.host_per_rank


def test_first_step_has_no_adam_states_until_the_step():
    s = Settings(max_length=32_768).with_levers(tiled_mlp=16)
    first = estimate(Q4, replace(s, first_step=True))
    steady = estimate(Q4, s)
    assert first.term("Adam m, v").gpu == 0 and steady.term("Adam m, v").gpu == 8 * counts.num_params(Q4)
    assert first.phases["optimizer_step"] == steady.phases["optimizer_step"] + 8 * counts.num_params(Q4)


def test_bad_settings_are_config_errors():
    from ulysses_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="query heads"):
        estimate(Q8, Settings(max_length=4096, layout=Layout(3, 3)))
    with pytest.raises(ConfigError, match="sp_size must divide the world size"):  # a Layout resolve_layout refuses
        estimate(Q8, Settings(max_length=4096, layout=Layout(12, 8)))
    with pytest.raises(ConfigError, match="activation_offload"):
        estimate(Q8, Settings(max_length=4096).with_levers(activation_offload=37))


# ------------------------------------------------------------------ search


def test_search_no_levers_when_memory_is_ample():
    c = choose_settings(Q8, Settings(max_length=32_768, layout=Layout(8, 8)), Hardware(8, 141, 2000))
    assert c.fits
    lv = c.settings.levers
    assert (lv.activation_offload, lv.tiled_mlp, lv.optimizer_offload) == (0, 1, False)


def test_search_offloads_when_tight_and_picks_the_fewest():
    hw = Hardware(8, 76, 1000)
    c = choose_settings(Q8, Settings(max_length=1_048_576, layout=Layout(8, 8), lean_norm=False), hw)  # HF norms: tight
    s, lv = c.settings, c.settings.levers
    assert c.fits and lv.activation_offload > 0 and not lv.optimizer_offload
    lean = choose_settings(Q8, Settings(max_length=1_048_576, layout=Layout(8, 8)), hw)  # lean norms: no offload needed
    assert lean.fits and lean.settings.levers.activation_offload == 0 and lean.estimate.gpu_peak < c.estimate.gpu_peak
    fits = lambda **kw: estimate(Q8, s.with_levers(**kw)).fits(hw.gpu_memory_gb, hw.host_memory_gb)  # noqa: E731
    assert not fits(activation_offload=lv.activation_offload - 1, tiled_mlp=64)  # one fewer never fits
    assert lv.tiled_mlp == 1 or not fits(tiled_mlp=lv.tiled_mlp - 1)  # one tile fewer does not fit


def test_search_uses_optimizer_offload_only_when_needed_and_reports_no_fit():
    tight = choose_settings(Q8, Settings(max_length=65_536), Hardware(1, 80, 500))
    assert tight.fits and tight.settings.levers.optimizer_offload  # 16 bytes x 8.2B params alone exceed 80 GiB
    fixed = choose_settings(Q8, Settings(max_length=65_536), Hardware(1, 80, 500), optimizer_offload=False)
    assert not fixed.fits


def test_largest_max_length_monotone_in_gpu_memory():
    base = Settings(max_length=1024, layout=Layout(8, 8))
    found = [largest_max_length(Q8, base, Hardware(8, gb, 1000))[0] for gb in (40, 60, 80, 100, 141)]
    assert all(a <= b for a, b in zip(found, found[1:])) and found[0] < found[-1]
    assert all(n % 8192 == 0 for n in found)
    n, choice = largest_max_length(Q8, base, Hardware(8, 80, 1000))
    assert choice.fits and choice.settings.max_length == n
    assert not choose_settings(Q8, replace(base, max_length=n + 8192), Hardware(8, 80, 1000)).fits


# ------------------------------------------------------------------ calibration


def test_calibrated_points_within_ten_percent():
    rows = compare(load_calibration() + load_measurements(ROOT / "benchmarks" / "results"))
    ours = [c for c in rows if c.measurement.system == "ours"]
    assert ours, "no ulysses_trainer points to compare against"
    bad = [(c.measurement.settings.max_length, round(c.gpu_error, 3)) for c in rows
           if abs(c.gpu_error) > 0.10 and not c.measurement.over_predicted]
    assert not bad, bad
    # points marked over-predicted: the model errs on the safe side there, and not by more than a quarter
    marked = [c for c in rows if c.measurement.over_predicted]
    assert all(0 < c.gpu_error <= 0.25 for c in marked), [(c.measurement.source, c.gpu_error) for c in marked]


def test_load_measurements_reads_benchmark_results(tmp_path):
    from ulysses_trainer.vocabulary.names import auto_num_tiles

    doc = {"system": "ours", "model": "qwen3-4b", "settings": {"steps_per_length": 1},
           "points": [{"seq_len": 131072, "status": "ok", "peak_gpu_gb": 70.0, "peak_host_rss_gb": 3.0,
                       "attention": "sdpa", "offloaded_layers": 4},
                      {"seq_len": 262144, "status": "oom", "error": "CUDA out of memory"}]}
    (tmp_path / "long_context_ours_qwen3-4b.json").write_text(json.dumps(doc))
    (tmp_path / "other.json").write_text("{}")  # not a long_context_*.json: ignored
    [m] = load_measurements(tmp_path)
    s = m.settings
    got = (m.system, s.max_length, s.levers.activation_offload, m.peak_gpu_gb, m.peak_host_gb)
    assert got == ("ours", 131072, 4, 70.0, 3.0)
    assert s.levers.tiled_mlp == auto_num_tiles(131072, 2560, 9728) == 16
    assert s.first_step is True  # one step: Adam's m, v appear only inside it


# ------------------------------------------------------------------ command line


def test_cli_refuses_a_max_length_past_the_positions_naming_yarn(capsys):
    args = ["plan", "--model", "qwen3-8b", "--max_length", "1048576", "--gpus", "8", "--gpu_memory_gb", "80",
            "--host_memory_gb", "1000"]
    assert cli_main(args) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.strip()]
    assert len(errors) == 1 and not captured.out, captured
    assert errors[0].startswith("error: max_length 1,048,576 is beyond the model's positions: "
                                "max_position_embeddings is 40,960") and "allow_beyond_positions true" in errors[0]
    assert """'{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}'""" in errors[0]
    assert cli_main(args + YARN + ["--json"]) == 0  # the fix it names
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert cli_main(args + ["--allow_beyond_positions", "true", "--json"]) == 0  # or the user means it


def test_cli_table_and_json(capsys):
    args = ["plan", "--model", "qwen3-8b", "--max_length", "1048576", "--gpus", "8", "--gpu_memory_gb", "80",
            "--host_memory_gb", "1000", *YARN]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "layer checkpoints" in out and "largest max_length that fits" in out and "fits:" in out
    longest = next(line for line in out.splitlines() if line.startswith("largest max_length that fits"))
    assert re.search(r"optimizer_offload (true|false),", longest)  # the config's names and spelling
    assert cli_main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["chosen"]["sp_size"] == 8 and data["largest_max_length"] > 1_048_576
    assert math.isclose(sum(t["gpu_gb"] for t in data["estimate"]["terms"] if t["in_peak"]),
                        data["estimate"]["gpu_required_gb"], rel_tol=1e-9)


def test_cli_recipe(capsys):
    recipe = str(ROOT / "launch" / "recipes" / "reference_8gpu_1m.yaml")
    assert cli_main(["plan", "--config", recipe, "--gpu_memory_gb", "80", "--host_memory_gb", "1000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["gpus"] == 8 and data["chosen"]["max_length"] == 1_048_576 and data["fits"]


def test_cli_states_the_floor_qwen3_5_in_its_json_too(capsys):
    """The text plan states the step's floor and the predicted step's ratio to it; the JSON of a Qwen3.5 recipe
    carries it (with its DeltaNet kernels), a Qwen3 recipe's JSON stays as it was (no step_floor)."""
    args = ["plan", "--gpu_memory_gb", "139.8", "--host_memory_gb", "2000"]
    q35 = str(ROOT / "launch" / "recipes" / "qwen3_5_27b_8gpu_1m.yaml")
    assert cli_main([*args, "--config", q35]) == 0
    assert "x its floor" in capsys.readouterr().out
    assert cli_main([*args, "--config", q35, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    floor = data["step_floor"]
    assert floor["linear_attention kernels s"] > 0 and 1 < floor["predicted over floor"] < 2
    assert floor["floor s"] * floor["predicted over floor"] == pytest.approx(data["plan"]["predicted_step_s"])
    assert cli_main([*args, "--config", str(ROOT / "launch" / "recipes" / "reference_8gpu_1m.yaml"), "--json"]) == 0
    assert "step_floor" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("args, needle", [
    (["plan", "--model", "qwen3-9b", "--max_length", "4096", "--gpus", "1", "--gpu_memory_gb", "80"], "qwen3-9b"),
    (["plan", "--model", "qwen3-8b", "--max_length", "4096", "--gpus", "8", "--sp_size", "3", "--gpu_memory_gb", "80",
      "--host_memory_gb", "100"], "sp_size=3"),
    (["plan", "--model", "qwen3-8b", "--max_length", "4096", "--gpus", "8", "--sp", "3", "--gpu_memory_gb", "80",
      "--host_memory_gb", "100"], "sp_size=3"),  # the earlier spelling, kept for scripts
    (["plan", "--model", "qwen3-8b", "--gpus", "8", "--gpu_memory_gb", "80"], "--max_length"),
    (["plan", "--model", "qwen3-8b", "--max_length", "4096", "--gpus", "8", "--gpu_memory_gb", "-1",
      "--host_memory_gb", "100"], "must be > 0"),
    (["plann"], "unknown subcommand"),
])
def test_cli_bad_input_exit_2(args, needle, capsys):
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("error:")


def test_cli_documents_one_name_per_setting_and_keeps_the_old_spellings(capsys):
    """plan's --help names --sp_size and --gpus_per_node only; --sp and --gpus_per_host still set them."""
    from ulysses_trainer.cli.plan import build_plan_inputs
    from ulysses_trainer.errors import ConfigError

    with pytest.raises(SystemExit):
        build_plan_inputs(["--help"])
    help_text = capsys.readouterr().out
    assert "--sp_size" in help_text and "--gpus_per_node" in help_text
    assert not re.search(r"--sp\b(?!_)", help_text) and "--gpus_per_host" not in help_text
    base = ["--model", "qwen3-8b", "--max_length", "4096", "--gpus", "8", "--gpu_memory_gb", "80",
            "--host_memory_gb", "100"]
    for old, new in ((["--sp", "4", "--gpus_per_host", "4"], ["--sp_size", "4", "--gpus_per_node", "4"]),):
        cfg_old, _, _, machine_old, _ = build_plan_inputs(base + old)
        cfg_new, _, _, machine_new, _ = build_plan_inputs(base + new)
        assert cfg_old.sp_size == cfg_new.sp_size == 4
        assert machine_old.gpus_per_node == machine_new.gpus_per_node == 4
    for spelling in ("--gpus_per_node", "--gpus_per_host"):
        with pytest.raises(ConfigError, match="--gpus_per_node 3 must divide --gpus 8"):
            build_plan_inputs([*base, spelling, "3"])[3].check()


@pytest.mark.slow
def test_cli_calibrate_and_python_m(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ulysses_trainer", "plan", "calibrate", "--results_dir",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=JOB_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert "GPU pred" in out.stdout and "ours" in out.stdout and "worst GPU error" in out.stdout


# ------------------------------------------------------------------ checkpoint_every


def test_checkpoints_held_with_checkpoint_every_by_hand():
    s = Settings(max_length=65_536).with_levers(checkpoint_every=3)  # Qwen3-4B: 36 layers, block starts 0, 3, ..., 33
    at = lambda j, **kw: M.gpu_checkpoints_at(Q4, s.with_levers(**kw), j)  # noqa: E731
    assert at(35) == 12 + 2  # 12 block inputs + the rebuilt inputs of layers 34, 35
    assert at(34) == 12 + 1 and at(33) == 12  # rebuilt inputs freed one by one
    assert at(35, activation_offload=12) == 1 + 2  # all starts on the host: the fetched one + 2 rebuilt
    assert at(33, activation_offload=12) == 1 + 1  # ... and the prefetched start 30 during 33's backward
    assert at(35, activation_offload=11) == 1 + 2  # start 33 stays on the GPU
    assert at(33, activation_offload=11) == 1 + 1
    # checkpoint_every 1 is the per-layer rule: resident layers a..j, fetched + prefetched below them
    one = Settings(max_length=65_536)
    assert M.gpu_checkpoints_at(Q4, one, 35) == 36
    assert M.gpu_checkpoints_at(Q4, one.with_levers(activation_offload=30), 35) == 6
    assert M.gpu_checkpoints_at(Q4, one.with_levers(activation_offload=30), 30) == 1 + 1
    from ulysses_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="between 0 and 12 layers"):
        estimate(Q4, s.with_levers(activation_offload=13))


def test_search_thins_checkpoints_only_when_nothing_else_fits():
    hw = Hardware(1, 139.8, 125.87)  # one H200 and its host, as measured
    base = Settings(max_length=131_072)
    assert choose_settings(Q4, base, hw).settings.levers.checkpoint_every == 1  # 128K fits without it
    per_layer, _ = largest_max_length(Q4, base, hw, checkpoint_every=1)
    thinned, choice = largest_max_length(Q4, base, hw)
    assert choice.settings.levers.checkpoint_every > 1 and choice.settings.levers.optimizer_offload
    assert thinned > 1.5 * per_layer  # what checkpoint_every buys on one GPU
    near = choose_settings(Q4, replace(base, max_length=1_048_576), hw)
    tried_12 = estimate(Q4, near.settings.with_levers(checkpoint_every=12, activation_offload=3))
    assert near.estimate.gpu_required < tried_12.gpu_required  # a miss shows the closest settings


def test_cli_one_gpu_million_tokens_names_checkpoint_every_and_its_cost(capsys):
    args = ["plan", "--model", "qwen3-4b", "--max_length", "1000000", "--gpus", "1", "--gpu_memory_gb", "139.8",
            "--host_memory_gb", "125.9", *YARN]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    k = int(re.search(r"recipe lines: .*checkpoint_every: (\d+)", out).group(1))
    assert k > 1 and "optimizer_offload: true" in out
    pct = round(100 * (k - 1) / k)
    assert f"checkpoint_every {k}: {pct}% of the layers run forward once more in backward (about +" in out
    assert cli_main(args + ["--checkpoint_every", "1"]) == 1  # fixed by the user: no thinning, a miss
    out, err = capsys.readouterr()
    assert "DOES NOT FIT: GPU memory is short by " in out
    assert re.search(r"error: does not fit: GPU memory is short by [\d.]+ GiB \(needs [\d.]+ of 139\.8 GiB per GPU\)"
                     r".*binding limit: GPU memory", err)


def test_grouped_attention_and_kept_outputs_by_hand():
    from ulysses_trainer.plan.layer_terms import attention_backward_extra, unattributed_bytes

    t = 262_144
    s = Settings(max_length=t)
    key = "attention backward, one KV group: fp32 dq accumulator, row sums, repeated k, v, grads"
    gq = Q4.q_width // Q4.kv_heads  # 8 groups of 4 query heads
    assert attention_backward_extra(Q4, s)[key] == t * gq * 4 + t * (Q4.heads // Q4.kv_heads) * 4 + 5 * t * gq * 2
    full = attention_backward_extra(Q4, replace(s, grouped_attention=False))
    assert full["attention backward: fp32 dq accumulator + row sums"] == t * Q4.q_width * 4 + t * Q4.heads * 4
    # 8B at sp=8: one KV head per rank, nothing kept: the all-heads kernel (F.sdpa), not the group path
    assert key not in attention_backward_extra(Q8, Settings(max_length=t * 8, layout=Layout(8, 8)))
    assert unattributed_bytes(Q4, s) == 0 and unattributed_bytes(Q4, replace(s, lean_norm=False)) == 8 * t * Q4.hidden
    # kept attention outputs: all 36 held at the top layer's backward but its own (now its saved output)
    per = t * Q4.q_width * 2 + t * Q4.heads * 4
    base = estimate(Q4, s.with_levers(activation_offload=36))
    kept = estimate(Q4, s.with_levers(activation_offload=36, keep_attention_outputs=36))
    (term,) = [x for x in kept.terms if x.name.startswith("attention outputs kept")]
    assert term.gpu == 35 * per and kept.gpu_peak - base.gpu_peak == 35 * per


def test_attention_path_at_sp8_one_kv_head_per_rank():
    """Qwen3-8B at sp=8 holds one KV head per rank: a layer runs one kernel on all heads (F.sdpa, or the
    stand-in's _StandInFullHeads) unless it keeps its attention output, which takes the KV-group path with its
    one group (attention/grouped.py runs_grouped). What each holds when the kernel's backward runs, in units of
    t x 4096 x 2 B (hidden = q width), as the H200 allocator history of the 1M rehearsals showed (variants A, E
    of benchmarks/results/rehearsal/memory_variants_8b_sp8.json); both peaks land within 1% over."""
    from ulysses_trainer.plan.layer_terms import attention_backward_extra, layer_flow_bytes, layer_working_set

    t = 131_072
    u, rows = t * 4096 * 2, t * 32 * 4  # rows: fp32 row sums (LSE-sized) of the 32 heads' worth
    # the variants ran one step each: no ZeRO-3 trace yet (zero3_trace false)
    s = Settings(max_length=8 * t, layout=Layout(8, 8), attn_implementation="standin_memory_only",
                 zero3_trace=False).with_levers(tiled_mlp=12)
    full, grouped = attention_backward_extra(Q8, s), attention_backward_extra(Q8, s, keeps_output=True)
    # both: d(out) (the all-to-all's result; its send buffer and o_proj's input grad are freed) 1, the
    # residual-stream grad 1; all heads: the kernel's dq, dk, dv 1.5 and its fp32 dq accumulator 2
    assert sum(full.values()) == 5.5 * u + rows
    # one group of 4 query heads: full-size dq, dk, dv 1.5, fp32 accumulator 2, k and v repeated 4 times 2,
    # the kernel's dq, dk, dv at the repeated width 3
    assert sum(grouped.values()) == 10.5 * u + rows
    assert set(layer_flow_bytes(Q8, s)) == {"layer output grad (incoming)", "recomputed layer output"}
    # o_proj's saved input is gone at attention's backward, alive at the MLP's
    ws, phase, detail = layer_working_set(Q8, s)
    assert phase == "MLP backward" and detail["o_proj input"] == u
    ws, phase, detail = layer_working_set(Q8, s, keeps_output=True)
    assert phase == "attention backward" and "o_proj input" not in detail
    # the kept layers are the lowest: with 35 of 36 kept the top layer runs on all heads and the peak is the
    # backward of layer 34, the highest one on the larger group path
    assert M.backward_peak_layer(Q8, s.with_levers(keep_attention_outputs=35)) == 34
    assert M.backward_peak_layer(Q8, s.with_levers(keep_attention_outputs=36)) == 35
    # the real F.sdpa on 4 query heads and their 1 KV head (cuDNN's GQA backward, 256K rehearsal on the H200):
    # one fp32 workspace of twice the accumulator, 2 u more than the stand-in
    sdpa = attention_backward_extra(Q8, replace(s, attn_implementation="sdpa"))
    assert sum(sdpa.values()) - sum(full.values()) == t * 4096 * 4
    # flash_attention_4 runs its dense rows group by group whatever is kept
    assert attention_backward_extra(Q8, replace(s, attn_implementation="flash_attention_4")) == grouped
    # the measured rehearsals: every variant within 0..2% over
    doc = json.loads((ROOT / "benchmarks/results/rehearsal/memory_variants_8b_sp8.json").read_text())
    for p in doc["points"]:
        v = replace(s.with_levers(checkpoint_every=p["checkpoint_every"], activation_offload=p["offloaded_layers"],
                                  keep_attention_outputs=p["kept_attention_layers"]), max_length=p["max_length"])
        err = estimate(Q8, v).gpu_peak / GIB / p["peak_gpu_mem_gb"] - 1
        assert 0 <= err <= (0.01 if p["variant"] in "AE" else 0.02), (p["variant"], err)


def test_zero3_holds_max_live_parameters_from_the_second_step():
    """Step 2 of a ZeRO-3 run keeps parameters gathered up to stage3_max_live_parameters (the H200 allocator
    history of Qwen3-4B at sp=2: 1.88 GiB gathered at step 2's peak, none at step 1's): the first step alone
    (no trace) is that much lower, and the two real sp=2 runs (step 2, NCCL) are predicted within 0.5%."""
    from ulysses_trainer.plan.counts import layer_param_numels
    from ulysses_trainer.plan.inputs import Zero3Knobs
    from ulysses_trainer.plan.layer_terms import layer_gathered_params_bytes

    s = Settings(max_length=131_072, layout=Layout(2, 2)).with_levers(tiled_mlp=5, keep_attention_outputs=36)
    steady, first = layer_gathered_params_bytes(Q4, s), layer_gathered_params_bytes(Q4, replace(s, zero3_trace=False))
    assert steady - first == 1_000_000_000 * 2 - (sum(layer_param_numels(Q4)) + int(0.9 * Q4.hidden**2)) * 2
    assert estimate(Q4, s).gpu_peak - estimate(Q4, replace(s, zero3_trace=False)).gpu_peak == steady - first
    # a smaller stage3_max_live_parameters holds less, never less than the layer and its prefetch
    small = replace(s, zero3=Zero3Knobs(max_live_parameters=1000))
    assert layer_gathered_params_bytes(Q4, small) == first
    sp2 = [m for m in load_calibration() if m.settings.sp_size == 2]
    assert len(sp2) == 2
    for m in sp2:
        err = estimate(m.shape, m.settings).gpu_peak / GIB / m.peak_gpu_gb - 1
        assert abs(err) <= 0.005, (m.model, err)


def test_offload_sub_groups_stay_under_a_power_of_two():
    """ds_configs/zero3_offload.json's sub_group_size: pinned fp32 grad buffers near their exact size (2**28
    itself packs groups just over 1 GiB, each rounded to 2 GiB: 28.1 GiB for 4B, seen in the 1M run)."""
    from ulysses_trainer.plan.inputs import Zero3Knobs

    size = json.loads(Path("ds_configs/zero3_offload.json").read_text())["zero_optimization"]["sub_group_size"]
    host = {g: host_terms.host_optimizer_bytes(Q4, Settings(max_length=1024, zero3=Zero3Knobs(sub_group_size=g))
                                               .with_levers(optimizer_offload=True)) for g in (size, 2**28)}
    exact = counts.num_params(Q4) * 12 + counts.num_params(Q4) * 4 + 8 * GIB
    assert host[size] < 1.03 * exact < host[2**28] - 10 * GIB


def test_cli_keeps_attention_outputs_in_what_is_left(capsys):
    args = ["plan", "--model", "qwen3-4b", "--gpus", "1", "--gpu_memory_gb", "139.8", "--host_memory_gb", "125.9",
            "--json", *YARN]
    assert cli_main(args + ["--max_length", "131072"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    kept = plan["keep_attention_outputs"]
    assert 0 < kept <= 36 and plan["kept_attention_layers"] == list(range(kept))
    assert plan["predicted_gpu_required_gb"] <= 139.8
    # at 1M little is left over: a few outputs at most (how many depends on the search's other levers)
    assert cli_main(args + ["--max_length", "1048576"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["keep_attention_outputs"] <= 3 and plan["predicted_gpu_required_gb"] <= 139.8


def test_cli_longest_does_not_depend_on_the_length_asked(capsys):
    """The longest length is a property of the model, machine and fixed levers: asking for a short, a long or an
    unfitting max_length reports the same one; the plan at that length fits and one unit more does not. (The
    search once took the ZeRO-3 sub-groups of whatever placement the asked length's plan chose, so a plan that
    did not fit reported a longer "largest" than one that did.)"""
    base = ["plan", "--config", "launch/recipes/moe_8gpu_1m.yaml", "--gpu_memory_gb", "139.8",
            "--host_memory_gb", "560", "--attn_implementation", "sdpa", "--json"]

    def ask(n: int) -> dict:
        cli_main(base + ["--max_length", str(n)])
        return json.loads(capsys.readouterr().out)

    found = {ask(n)["largest_max_length"] for n in (1_048_576, 5_865_472, 6_774_784)}
    assert len(found) == 1, found
    longest = found.pop()
    assert ask(longest)["fits"] and not ask(longest + 8192)["fits"]


def test_the_fa4_stand_in_is_planned_as_flash_attention_4():
    """A memory-only rehearsal of a flash-attn-4 run: its stand-in takes the same per-layer path (every layer
    group by group, even one KV head per rank), so the plan holds the same bytes; the plain stand-in (ours' rule:
    all heads at once there) holds other bytes, which is why the rehearsal picks by the run's kernel."""
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.vocabulary.names import STANDIN, STANDIN_FA4

    moe = ModelShape.from_config(preset_config("qwen3-30b-a3b"))
    for shape in (Q8, moe):
        s = Settings(max_length=4_194_304, layout=Layout(8, 8)).with_levers(tiled_mlp=32, checkpoint_every=2,
                                                                  activation_offload=18)
        fa4, twin, plain = (estimate(shape, replace(s, attn_implementation=k))
                             for k in ("flash_attention_4", STANDIN_FA4,
                                                                             STANDIN))
        assert twin.gpu_peak == fa4.gpu_peak and twin.host_per_host == fa4.host_per_host
        assert plain.gpu_peak != fa4.gpu_peak

"""The benchmark entry point: named cases that reproduce the benchmark tables of docs/benchmarks.md.

    python benchmarks/suite.py                          # list the cases
    python benchmarks/suite.py CASE [CASE ...] [--out DIR] [--dry-run]

Every case is a list of calls run one after another in fresh processes (DeepSpeed keeps parts of an engine
alive, so train-mode lengths each get their own): benchmark scripts on one H200 (Qwen3-4B; flash-attn-4
installed for the `fa4` cases), the real trainer (`launch/train.py`, its metrics.jsonl in DIR/NAME/), the
rehearsal (`ulysses-trainer rehearse`), and multi-GPU cases under the DeepSpeed launcher (`sp_*`: two GPUs of
one host). Each call writes the file named like the committed one in benchmarks/results/ into DIR (default:
$OUT, else bench_out/); `python benchmarks/plot_results.py` turns results into the plot and table. `smoke`
runs the scripts on CPU with the tiny preset in about a minute. To use both GPUs of a host for two
one-GPU cases at once, start two suites with CUDA_VISIBLE_DEVICES=0 and =1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

M = "qwen3-4b"
LC, KERNELS, PROFILE = "benchmarks/long_context.py", "benchmarks/attention_kernels.py", "benchmarks/profile_step.py"
WARM = ("--warmup-tokens", "8192")  # one untimed 8K step first: kernel compilation stays out of the timed step
FWDBWD = ("--mode", "fwdbwd")
KEPT_OFFLOADED = ("--keep-attention-outputs", "true", "--offload", "true")


def _lc(out: str, system: str, lengths: str, *extra: str) -> tuple[str, ...]:
    return (LC, "--system", system, "--model", M, "--lengths", lengths, *extra, "--out", out)


OUT = "{out}"  # replaced by the output directory
CARD = "{card}"  # replaced by the local GPU's short name (h100, h200: ulysses_trainer.plan.cards.card_of)
DS2 = ("-m", "deepspeed.launcher.runner", "--num_gpus", "2")  # the launcher, both GPUs of this host
# the trainer's runs: fixed schedule, nothing saved (the step time is what is measured)
RUN = ("--bf16", "true", "--learning_rate", "1e-5", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
       "--save_strategy", "no", "--seed", "42", "--overwrite_output_dir", "true")
LONG, REF = "launch/recipes/one_gpu_4b_long.yaml", "launch/recipes/reference_8gpu_1m.yaml"
MOE = "launch/recipes/moe_8gpu_1m.yaml"
# Qwen3-30B-A3B's layer shape at reduced depth on one GPU: 4 of its 48 layers, 131,072 tokens (what one GPU of the
# 1M sp=8 job holds), so the run's peak memory and step time can be held against the plan's for the same shape
MOE_REDUCED = ("--config", MOE, "--sp_size", "1", "--max_length", "131072", "--max_steps", "3",
               "--model_init_kwargs", '{"num_hidden_layers": 4, "rope_parameters": {"rope_type": "yarn", "factor": 4}}')
AGENT, ONE_1M = "launch/recipes/agent_sessions_1m.yaml", "launch/recipes/one_gpu_4b_1m.yaml"
Q35_27B, Q35_35B = "launch/recipes/qwen3_5_27b_8gpu_1m.yaml", "launch/recipes/qwen3_5_35b_a3b_8gpu_1m.yaml"
LLAMA_8B_1M = "launch/recipes/llama_3_1_8b_8gpu_1m.yaml"
AGENT_DATA = ("--dataset_name", "synthetic:agent_sessions", "--assistant_only_loss", "true")
SP2_KERNELS = ("--attn_implementation", "sdpa", "--norm_kernel", "torch")  # the real sp=2 runs' (no FA4, no Liger)


def _train(name: str, *args: str, gpus: int = 1) -> tuple[str, ...]:
    launch = DS2 if gpus == 2 else ()
    return (*launch, "launch/train.py", *RUN, "--output_dir", f"{OUT}/{name}", *args)


PROF_REHEARSAL = "benchmarks/profile_rehearsal.py"
# the reference rehearsal's arguments (rehearse_reference's), for the scripts that wrap it
REF_REHEARSAL = ("--bf16", "true", "--seed", "42", "--save_strategy", "no", "--config", REF, "--gpus", "8",
                 "--host_memory_gb", "560", "--warmup_length", "8192")


def _reduced(layers: int) -> tuple[str, ...]:
    """The reference recipe at `layers` of its 36 layers, its defaults' levers pinned (auto would re-plan them for
    the shallower model): every attention output kept, no offload, 12 MLP tiles, Adam on the GPU."""
    rope = '"rope_parameters": {"rope_type": "yarn", "factor": 4, "rope_theta": 1000000.0}'
    return ("--model_init_kwargs", f'{{"num_hidden_layers": {layers}, {rope}}}', "--attn_implementation",
            "flash_attention_4", "--norm_kernel", "triton", "--tiled_mlp", "12", "--activation_offload", "0",
            "--keep_attention_outputs", str(layers), "--optimizer_offload", "false")


def _rehearse(name: str, *args: str) -> tuple[str, ...]:
    return ("-m", "ulysses_trainer", "rehearse", "--bf16", "true", "--seed", "42", "--save_strategy", "no",
            "--out", f"{OUT}/rehearse_{name}.json", *args)


CASES: dict[str, tuple[str, list[tuple[str, ...]]]] = {
    "kernels": ("attention kernels alone, 32K-256K; ours one KV group at a time (cuDNN)", [
        (KERNELS, "--lengths", "32768,65536,131072,262144", "--iters", "2", "--out", "attention_kernels_h200.json"),
        ("benchmarks/kernel_api_probe.py", "--lengths", "131072", "--out", "kernel_api_probe.json")]),
    "kernels_fa4": ("attention kernels with flash-attn-4, 128K and 256K", [
        (KERNELS, "--lengths", "131072,262144", "--iters", "2", "--kernels",
         "sdpa_cudnn,ours_grouped_cudnn,flash_attention_4,ours_grouped_fa4",
         "--out", "attention_kernels_h200_fa4.json")]),
    "data_dependence": ("kernel speed on random vs small vs zero data: FA4 and cuDNN attention (1M tokens, 4 q / 1 kv "
                        "heads) and a bf16 matmul 131072x4096->12288; the copy rate of the rehearsal's fill", [
        ("benchmarks/data_dependence.py", "--out", "data_dependence_h200.json")]),
    "fa4_options": ("flash-attn-4's options at one KV head per rank (1M tokens, 4 q / 1 kv heads, random data): "
                    "GQA packing forward / backward, K and V expanded to all heads", [
        ("benchmarks/fa4_options.py", "--out", "fa4_options_h200.json")]),
    "train": ("full ZeRO-3 + AdamW steps: hf and alst to their OOM, ours 32K-128K", [
        _lc("long_context_hf_qwen3-4b.json", "hf", "32768,65536"),
        _lc("long_context_alst_qwen3-4b_a.json", "alst", "32768,65536", "--offload", "true"),
        *(_lc(f"long_context_ours_train_qwen3-4b_{n}.json", "ours", str(n), "--steps", "2")
          for n in (32768, 65536, 131072))]),
    "train_1m": ("1,048,576 tokens, Adam on the host, 1 in 4 layer inputs kept, 7 offloaded, stand-in attention", [
        _lc("long_context_ours_train_qwen3-4b_1048576_standin_every4_off7.json", "ours", "1048576",
            "--standin-from", "1", "--checkpoint-every", "4", "--offload", "7", "--offload-optimizer")]),
    "fwdbwd": ("forward+backward: alst 128K/256K, ours 256K real and stand-in, ours keeping attention outputs", [
        _lc("long_context_alst_fwdbwd_qwen3-4b.json", "alst", "131072", *FWDBWD, "--offload", "true"),
        _lc("long_context_alst_fwdbwd_qwen3-4b_262144.json", "alst", "262144", *FWDBWD, "--offload", "true"),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_grouped.json", "ours", "262144", *FWDBWD),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_standin_grouped.json", "ours", "262144", *FWDBWD,
            "--standin-from", "1"),
        _lc("long_context_ours_fwdbwd_qwen3-4b_131072_kept_auto.json", "ours", "131072", *FWDBWD,
            "--keep-attention-outputs", "auto"),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_kept.json", "ours", "262144", *FWDBWD, *KEPT_OFFLOADED)]),
    "fwdbwd_warm": ("forward+backward after an untimed 8K step, alst vs ours (cuDNN) in one session", [
        _lc("long_context_alst_fwdbwd_qwen3-4b_131072_warm.json", "alst", "131072", *FWDBWD, "--offload", "true",
            *WARM),
        _lc("long_context_alst_fwdbwd_qwen3-4b_262144_warm.json", "alst", "262144", *FWDBWD, "--offload", "true",
            *WARM),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_kept_cudnn_warm.json", "ours", "262144", *FWDBWD,
            *KEPT_OFFLOADED, *WARM)]),
    "fwdbwd_fa4": ("forward+backward with flash-attn-4 after an untimed 8K step, 128K and 256K", [
        _lc("long_context_ours_fwdbwd_qwen3-4b_131072_kept_auto_fa4_warm.json", "ours", "131072", *FWDBWD,
            "--kernel", "flash_attention_4", "--keep-attention-outputs", "auto", "--offload", "true", *WARM),
        _lc("long_context_ours_fwdbwd_qwen3-4b_262144_kept_fa4_warm.json", "ours", "262144", *FWDBWD,
            "--kernel", "flash_attention_4", *KEPT_OFFLOADED, *WARM)]),
    "profile": ("where the 256K step's time goes: torch.profiler over 8 and 1 of 36 layers (per layer = diff / 7)", [
        (PROFILE, "--model", M, "--length", "262144", "--layers", str(n), *KEPT_OFFLOADED,
         "--out", f"profile_262144_l{n}_offtrue_tiledauto_fixed.json") for n in (8, 1)]),
    "sp_exact": ("2 GPUs: sp=2 over NCCL = sp=1, bf16, the first two steps (tests/test_gpu_sp.py)", [
        ("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_gpu_sp.py")]),
    "sp_scale4b": ("Qwen3-4B at 131,072 tokens: sp=1 on one GPU, then sp=2 on two (recipe defaults)", [
        _train("sp1_4b_131k", "--config", LONG, "--max_length", "131072", "--max_steps", "2", "--sp_size", "1"),
        _train("sp2_4b_131k", "--config", LONG, "--max_length", "131072", "--max_steps", "2", "--sp_size", "2",
               gpus=2)]),
    "sp_8b": ("Qwen3-8B at 262,144 tokens, sp=2 (131,072 tokens per GPU, as in the 8-GPU 1M run)", [
        _train("sp2_8b_262k", "--config", REF, "--max_length", "262144", "--max_steps", "2", "--sp_size", "2",
               gpus=2)]),
    "sp_comm": ("NCCL bus bandwidth of the step's collectives on 2 GPUs (the rehearsal's comm model reads it)", [
        (*DS2, "benchmarks/comm_bandwidth.py", "--out", f"{OUT}/comm_bandwidth_h200_x2.json")]),
    "sp_profile": ("where the sp=2 step of Qwen3-4B at 131K spends its time: NCCL buckets, exposed comm", [
        (*DS2, "benchmarks/profile_train.py", "--out", f"{OUT}/profile_train_sp2_4b_131072.json", "--config", LONG,
         "--max_length", "131072", "--sp_size", "2", *RUN, "--output_dir", f"{OUT}/profile")]),
    "rehearse_sp2": ("rank 0 of the sp_scale4b / sp_8b sp=2 jobs on one GPU, their settings pinned (cuDNN, torch "
                     "norms: what the real runs had)", [
        _rehearse("sp2_4b_131k", "--gpus", "2", "--config", LONG, "--max_length", "131072", "--sp_size", "2",
                  "--keep_attention_outputs", "36", "--activation_offload", "0", "--optimizer_offload", "false",
                  *SP2_KERNELS),
        _rehearse("sp2_8b_262k", "--gpus", "2", "--config", REF, "--max_length", "262144", "--sp_size", "2",
                  "--keep_attention_outputs", "11", "--activation_offload", "0", "--optimizer_offload", "false",
                  "--warmup_length", "65536", *SP2_KERNELS)]),
    "rehearse_reference": ("rank 0 of the reference run (Qwen3-8B, 1M, sp=8) on one GPU; an 8-GPU node's host RAM", [
        _rehearse("reference_8gpu_1m", "--config", REF, "--gpus", "8", "--host_memory_gb", "560",
                  "--warmup_length", "8192")]),
    "rehearse_llama_8b_1m": ("rank 0 of Llama-3.1-8B at 1,048,576 tokens on 8 GPUs (sp=8) on one GPU, the reference's "
                             "shape on another family (its preset's stand-in tokenizer); a 2 TB, 128-core node's host, "
                             "the last step timed layer by layer", [
        _rehearse("llama_3_1_8b_8gpu_1m", "--config", LLAMA_8B_1M, "--gpus", "8", "--host_memory_gb", "2000",
                  "--host_cores", "128", "--warmup_length", "8192", "--layer_times")]),
    "rehearse_gpt_oss_20b_1m": ("rank 0 of gpt-oss-20b at 1,048,576 tokens on 8 GPUs (sp=8: 131,072 tokens, 8 query "
                                "heads and 1 KV head of 64 a rank) on one GPU, YaRN stretched to the length; cuDNN "
                                "for the full layers (the sink widens heads to 72); a 2 TB, 128-core node's host, the "
                                "last step timed layer by layer", [
        _rehearse(f"gpt_oss_20b_8gpu_1m_{CARD}", "--model_name_or_path", "gpt-oss-20b", "--gpus", "8",
                  "--max_length", "1048576", "--model_init_kwargs",
                  '{"rope_parameters": {"rope_type": "yarn", "factor": "auto"}}', "--attn_implementation", "sdpa",
                  "--host_memory_gb", "2000", "--host_cores", "128", "--warmup_length", "8192", "--layer_times")]),
    "sink_attention": ("gpt-oss's attention alone at its sp=8 rank shape (8 q / 1 kv heads of 64, sinks): the sliding "
                       "layers' batched blocks (against the per-block loop at 131,072), the full layers through "
                       "each installed kernel, 131,072 and 1,048,576 tokens", [
        ("benchmarks/sink_attention.py", "--lengths", "131072,1048576", "--out", f"sink_attention_{CARD}.json")]),
    "rehearse_reference_library_tiles": ("the same rehearsal with flash-attn-4's own tiles instead of the trainer's "
                                         "(run it next to rehearse_reference, on the same machine)", [
        (PROF_REHEARSAL, "--no_profile", "--fa4_tiles", "library", "--out",
         "rehearse_reference_8gpu_1m_library_tiles.json", "--", *REF_REHEARSAL)]),
    "profile_reference": ("the reference rehearsal's kernels under torch.profiler at 4 and 8 of its 36 layers (one "
                          "layer = the difference / 4), and at 4 with the library's flash-attn-4 tiles", [
        (PROF_REHEARSAL, "--fa4_tiles", tiles, "--out", f"profile_rehearsal_ref_l{n}_{tiles}.json", "--",
         *REF_REHEARSAL, "--steps", "3", *_reduced(n))
        for n, tiles in ((4, "trainer"), (8, "trainer"), (4, "library"))]),
    "fa4_tuned": ("flash-attn-4 through the trainer's calls (its tiles) against the library's defaults, 4 query "
                  "heads over 1 KV head, at 1M and 256K tokens", [
        ("benchmarks/fa4_options.py", "--length", str(n), "--iters", it, "--variants", "library,trainer",
         "--out", f"fa4_tuned_h200_{name}.json") for n, it, name in ((1048576, "2", "1m"), (262144, "3", "256k"))]),
    "rehearse_longest": ("memory only (stand-in attention): Qwen3-8B at 5,242,880 tokens on 8 GPUs, rank 0", [
        _rehearse("longest_8b_5242880", "--config", REF, "--gpus", "8", "--max_length", "5242880",
                  "--host_memory_gb", "560", "--standin", "--steps", "1")]),
    "rehearse_two_nodes": ("rank 0 of 16 GPUs on two nodes, sp=16 (KV heads copied), 1M tokens, 50 GB/s between", [
        _rehearse("two_nodes_sp16", "--config", REF, "--gpus", "16", "--sp_size", "16", "--gpus_per_node", "8",
                  "--internode_gbps", "50", "--host_memory_gb", "560", "--warmup_length", "65536")]),
    "defaults_256k": ("the one-GPU 256K recipe with its defaults through the trainer: two full train steps "
                      "(the first compiles kernels)", [
        _train("defaults_4b_262144", "--config", LONG, "--max_steps", "2")]),
    "agent_sessions_256k": ("masking costs ~nothing: the one-GPU 256K recipe on agent sessions with "
                            "assistant_only_loss, then on plain text (defaults_256k's run), two steps each", [
        _train("agent_sessions_4b_262144", "--config", LONG, "--max_steps", "2", *AGENT_DATA),
        _train("defaults_4b_262144", "--config", LONG, "--max_steps", "2")]),
    "agent_sessions_1m": ("the agent-sessions recipe at 1M on one GPU, then the plain-text one_gpu_4b_1m recipe "
                          "with the same settings, two steps each (~40 min a step)", [
        _train("agent_sessions_4b_1048576", "--config", AGENT, "--max_steps", "2"),
        _train("text_4b_1048576", "--config", ONE_1M, "--max_steps", "2")]),
    "norms": ("the lean RMSNorm's kernels alone (torch ops vs Liger's Triton), then their GPU exactness tests", [
        ("benchmarks/norm_kernels.py", "--out", "norm_kernels_h200.json"),
        ("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_gpu_norm.py")]),
    "moe_experts": ("one Qwen3-30B-A3B sparse block alone, 131,072 rows, bf16 fwd+bwd: eager / grouped_mm / "
                    "batched_mm x 1, 4, 8 tiles (plan/rates.EXPERTS_TFLOPS)", [
        ("benchmarks/moe_experts.py", "--out", "moe_experts_h200.json")]),
    "moe_reduced": ("Qwen3-30B-A3B's layer at 4 layers deep, 131,072 tokens, one GPU, the trainer: tokens/s and "
                    "peak memory in metrics.jsonl, the end-of-run 'predicted vs measured' line against the plan", [
        _train("moe_reduced_4l_131072", *MOE_REDUCED)]),
    "rehearse_moe_1m": ("rank 0 of Qwen3-30B-A3B at 1,048,576 tokens on 8 GPUs (sp=8) on one GPU; the node's host "
                        "RAM", [
        _rehearse("moe_8gpu_1m", "--config", MOE, "--gpus", "8", "--host_memory_gb", "560",
                  "--warmup_length", "8192", "--layer_times")]),
    "rehearse_moe_longest": ("memory only (flash-attn-4's stand-in): Qwen3-30B-A3B at the plan's longest with "
                             "flash-attn-4 on 8 GPUs with 560 GB host (4,628,480 tokens), rank 0", [
        _rehearse("moe_longest_4628480", "--config", MOE, "--gpus", "8", "--max_length", "4628480",
                  "--host_memory_gb", "560", "--attn_implementation", "flash_attention_4", "--standin",
                  "--steps", "1")]),
    "rehearse_moe_all_heads_5865472": ("memory only (the all-heads stand-in): Qwen3-30B-A3B at 5,865,472 tokens on "
                                       "8 GPUs with 560 GB host, rank 0", [
        _rehearse("moe_longest_5865472", "--config", MOE, "--gpus", "8", "--max_length", "5865472",
                  "--host_memory_gb", "560", "--standin", "--steps", "1")]),
    "rope": ("RoPE alone per rank, 131,072-1,048,576 tokens, Qwen3-4B/8B heads: transformers' rotate_half vs the "
             "fused Triton kernel (vs Liger's where installed), then the GPU exactness tests of it and of rows "
             "with pads on every attention kernel", [
        ("benchmarks/rope_kernels.py", "--out", f"{OUT}/rope"),
        ("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_gpu_packed.py", "tests/test_gpu_rope.py")]),
    "packed_epoch": ("a mixed packed epoch through the trainer on one H200 (Qwen3-4B, 262,144 tokens, 6 rows of "
                     "synthetic mixed agent sessions): each row's step against FLOP-proportional a + b*sum(l_i^2)/L^2",
                     [("benchmarks/packed_epoch.py", "--out", f"{OUT}/packed_epoch", "--rows", "6", "--budget_s", "540",
                       "--", "--config", "launch/recipes/one_gpu_4b_sessions.yaml", "--output_dir",
                       f"{OUT}/packed_epoch/run")]),
    "qwen3_5_gpu_tests": ("Qwen3.5 on the GPU: bf16 against stock transformers with each DeltaNet kernel, fla against "
                          "torch on packed documents (needs fla-core; the first run compiles fla's kernels, ~3 min)", [
        ("-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_gpu_qwen3_5.py")]),
    "rehearse_qwen3_5_27b_1m": ("rank 0 of Qwen3.5-27B at 1,048,576 tokens on 8 GPUs (sp=8) on one GPU; the node's "
                                "host RAM", [
        _rehearse("qwen3_5_27b_8gpu_1m", "--config", Q35_27B, "--gpus", "8", "--host_memory_gb", "560",
                  "--warmup_length", "8192")]),
    "rehearse_qwen3_5_27b_1m_nodes": ("rank 0 of Qwen3.5-27B at 1,048,576 tokens on 8 GPUs (sp=8) of a node with "
                                      "1 TB, then 2 TB of host RAM and 128 cores, timed; the offloaded inputs share "
                                      "two host slots (--host_standin), so a machine with less RAM than the rank's "
                                      "share runs it (needs fla-core)", [
        _rehearse(f"qwen3_5_27b_8gpu_1m_{gb}gb_{CARD}", "--config", Q35_27B, "--gpus", "8", "--host_memory_gb", gb,
                  "--host_cores", "128", "--host_standin", "--warmup_length", "8192", "--norm_kernel", "triton",
                  "--attn_implementation", "sdpa") for gb in ("1000", "2000")]),
    "rehearse_qwen3_5_35b_1m": ("rank 0 of Qwen3.5-35B-A3B at 1,048,576 tokens on 8 GPUs (sp=8) on one GPU; the "
                                "node's host RAM", [
        _rehearse("qwen3_5_35b_a3b_8gpu_1m", "--config", Q35_35B, "--gpus", "8", "--host_memory_gb", "560",
                  "--warmup_length", "8192")]),
    "rehearse_qwen3_5_35b_1m_steps": ("the 35B-A3B 1M rehearsal with two timed steps, its layer inputs offloaded as "
                                      "auto chooses, the last step timed layer by layer (where the reduced-depth "
                                      "profiles put 118 s, the first full-depth rehearsal measured 138 s)", [
        _rehearse("qwen3_5_35b_a3b_8gpu_1m_steps3", "--config", Q35_35B, "--gpus", "8", "--host_memory_gb", "560",
                  "--warmup_length", "8192", "--steps", "3", "--layer_times")]),
    "rehearse_qwen3_5_35b_1m_no_offload": ("as rehearse_qwen3_5_35b_1m_steps with no layer input offloaded", [
        _rehearse("qwen3_5_35b_a3b_8gpu_1m_steps3_no_offload", "--config", Q35_35B, "--gpus", "8",
                  "--host_memory_gb", "560", "--warmup_length", "8192", "--steps", "3", "--activation_offload", "0",
                  "--layer_times")]),
    "profile_qwen3_5_35b": ("Qwen3.5-35B-A3B's recipe at 4 and 8 of its 40 layers under torch.profiler (one block of 3 "
                            "DeltaNet + 1 full-attention layer = the difference; the full run's levers, no offload; "
                            "needs fla-core)", [
        (PROF_REHEARSAL, "--out", f"profile_rehearsal_35b_l{n}.json", "--", "--bf16", "true", "--seed", "42",
         "--save_strategy", "no", "--config", Q35_35B, "--gpus", "8", "--host_memory_gb", "560", "--warmup_length",
         "8192", "--steps", "3", "--model_init_kwargs",
         f'{{"num_hidden_layers": {n}, "rope_parameters": {{"rope_type": "yarn", "factor": 4, '
         '"rope_theta": 10000000.0}}', "--tiled_mlp", "4", "--activation_offload", "0",
         "--keep_attention_outputs", str(n), "--optimizer_offload", "false", "--norm_kernel", "triton",
         "--attn_implementation", "sdpa") for n in (4, 8)]),
    "rehearse_qwen3_5_27b_longest": ("memory only (stand-in attention; DeltaNet, conv and the rest real): Qwen3.5-27B "
                                     "at the plan's longest on 8 H200s with the plan's assumed 2,236.8 GiB host, "
                                     "2,777,088 tokens, rank 0; the host stand-in holds two offload slots and counts "
                                     "the rest, so a host with less RAM than the node's rehearses it", [
        _rehearse("qwen3_5_27b_2777088_standin", "--config", Q35_27B, "--gpus", "8", "--max_length", "2777088",
                  "--host_memory_gb", "2236.8", "--model_init_kwargs",
                  "{rope_parameters: {rope_type: yarn, factor: auto, rope_theta: 10000000.0}}",
                  "--standin", "--host_standin", "--steps", "1")]),
    "card_rates": ("every kernel rate the planner reads, measured on this machine's GPU into files named with its card "
                   "(plan/rates.py's tables for that card are rebuilt from them): attention at head_dim 128 (32/8 "
                   "heads, 32K-256K; 1M at 4/1 with a bf16 matmul), flash-attn-4's tile gain at 256K and 1M, the "
                   "RMSNorm and RoPE kernels, a Qwen3-30B-A3B sparse block, Gated DeltaNet's rule and conv and "
                   "attention at head_dim 256 (needs flash-attn-4 and fla-core for their rows), DeepSpeed's CPU "
                   "Adam on the host's cores, and the Qwen3-4B profiles at 1 and 8 layers the dense and chunked-loss "
                   "rates come from", [
        (KERNELS, "--lengths", "32768,65536,131072,262144", "--iters", "2", "--kernels",
         "sdpa_cudnn,sdpa_flash_expanded_kv,ours_grouped_cudnn,ours_grouped_fa4",
         "--out", f"attention_kernels_{CARD}.json"),
        ("benchmarks/data_dependence.py", "--data", "random", "--out", f"data_dependence_{CARD}.json"),
        *(("benchmarks/fa4_options.py", "--length", str(n), "--iters", it, "--variants", "library,trainer",
           "--out", f"fa4_tuned_{CARD}_{name}.json") for n, it, name in ((1048576, "2", "1m"), (262144, "3", "256k"))),
        ("benchmarks/norm_kernels.py", "--out", f"norm_kernels_{CARD}.json"),
        ("benchmarks/rope_kernels.py", "--tokens", "131072,262144,524288", "--models", "qwen3-4b",
         "--out", f"{OUT}/rope_{CARD}"),
        ("benchmarks/moe_experts.py", "--impls", "eager,grouped_mm", "--out", f"moe_experts_{CARD}.json"),
        ("benchmarks/deltanet_kernels.py", f"{OUT}/deltanet_{CARD}.json", "--cases", "delta_rule,conv,attention_hd256",
         "--lengths", "1048576"),
        ("benchmarks/cpu_adam.py", "--cores", "16,8,4", "--out", f"cpu_adam_{CARD}.json"),
        *(("benchmarks/profile_step.py", "--model", "qwen3-4b", "--length", "262144", "--offload", "true",
           "--keep-attention-outputs", "true", "--tiled-mlp", "auto", "--kernel", "sdpa", "--norm-kernel", "torch",
           "--rope", "torch", "--layers", str(n),
           "--out", f"profile_262144_l{n}_offtrue_tiledauto_torch_norms_rope_{CARD}.json") for n in (1, 8))]),
    "profile_qwen3_5_35b_kernels": ("Qwen3.5-35B-A3B's recipe at 4 of its 40 layers under torch.profiler, once with "
                                    "cuDNN and once with flash-attn-4 for its head_dim-256 full-attention layer, the "
                                    "full run's levers otherwise (needs fla-core and flash-attn-4)", [
        (PROF_REHEARSAL, "--out", f"profile_rehearsal_35b_l4_{kernel}_{CARD}.json", "--", "--bf16", "true", "--seed",
         "42", "--save_strategy", "no", "--config", Q35_35B, "--gpus", "8", "--host_memory_gb", "560",
         "--warmup_length", "8192", "--steps", "3", "--model_init_kwargs",
         '{"num_hidden_layers": 4, "rope_parameters": {"rope_type": "yarn", "factor": 4, "rope_theta": 10000000.0}}',
         "--tiled_mlp", "4", "--activation_offload", "0", "--keep_attention_outputs", "4", "--optimizer_offload",
         "false", "--norm_kernel", "triton", "--attn_implementation", kernel, "--layer_times")
        for kernel in ("sdpa", "flash_attention_4")]),
    "smoke": ("CPU check of the scripts: tiny preset, 256 tokens", [
        (LC, "--system", "ours", "--model", "tiny", "--lengths", "256", *FWDBWD, "--out", "smoke_long_context.json"),
        (PROFILE, "--model", "tiny", "--length", "128", "--keep-attention-outputs", "true",
         "--out", "smoke_profile.json"),
        ("benchmarks/moe_experts.py", "--model", "tiny-moe", "--tokens", "256", "--device", "cpu", "--tiles", "1,3",
         "--iters", "1", "--out", "smoke_moe_experts.json")]),
}


def local_card() -> str:
    """This machine's GPU as the results' file names say it (h100, h200, ...; cpu without one)."""
    import torch

    from ulysses_trainer.plan.cards import card_of

    return card_of(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


def commands(case: str, out_dir: str, card: str | None = None) -> list[list[str]]:
    """The calls of one case, with their --out inside out_dir and {card} the local GPU's name."""
    calls = []
    for script, *args in CASES[case][1]:
        if "--out" in args and OUT not in " ".join(args):  # a script's own --out: a file name inside out_dir
            i = args.index("--out") + 1
            args[i] = os.path.join(out_dir, args[i])
        if any(CARD in a for a in args) and card is None:
            card = local_card()
        calls.append([sys.executable, *(a.replace(OUT, out_dir).replace(CARD, card or "") for a in (script, *args))])
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", metavar="CASE")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="directory for the JSON results")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        print(f"error: unknown case {', '.join(unknown)}; pick from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if not args.cases:
        for name, (what, _) in CASES.items():
            print(f"{name:12s} {what}")
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failed = 0
    for case in args.cases:
        for cmd in commands(case, os.path.abspath(args.out)):
            print("+", " ".join(cmd[1:]), flush=True)
            if not args.dry_run:
                os.makedirs(args.out, exist_ok=True)
                failed += subprocess.run(cmd, cwd=root).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# GPU call B (one H200): forward+backward side by side: ours 32K/128K/256K and ALST 128K, real attention;
# then the trainer itself on CUDA (tiny preset, 2 steps).
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
M=${MODEL:-qwen3-4b}
timeout 290 python benchmarks/long_context.py --system ours --mode fwdbwd --model $M --lengths 32768,131072,262144 --out "$R/long_context_ours_fwdbwd.json" 2>&1 | grep -E '^\{|Error|error' | tail -8
timeout 110 python benchmarks/long_context.py --system alst --mode fwdbwd --offload true --model $M --lengths 131072 --out "$R/long_context_alst_fwdbwd.json" 2>&1 | grep -E '^\{|Error|error' | tail -4
timeout 90 python -m deepspeed.launcher.runner --num_gpus 1 launch/train.py --max_steps 2 --max_length 2048 --output_dir /tmp/tiny_gpu 2>&1 | grep -E "^\{'loss|rror|offload" | tail -5

#!/usr/bin/env bash
# GPU call A (one H200): a CUDA smoke run of ours, the attention kernels, and 32K-128K for the three systems.
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
M=${MODEL:-qwen3-4b}
timeout 120 python benchmarks/long_context.py --system ours --model tiny --lengths 4096 --out "$R/smoke.json" 2>&1 | grep -E '^\{|Error|error' | tail -5
timeout 150 python benchmarks/attention_kernels.py --lengths 32768,65536,131072,262144 --iters 2 --out "$R/attention_kernels.json" 2>&1 | grep -E '^\{|Error' | tail -30
timeout 200 python benchmarks/long_context.py --system ours --model $M --lengths 32768,65536,131072 --out "$R/long_context_ours_a.json" 2>&1 | grep -E '^\{|Error|error' | tail -8
timeout 60 python benchmarks/long_context.py --system hf --model $M --lengths 32768,65536 --out "$R/long_context_hf.json" 2>&1 | grep -E '^\{|Error|error' | tail -4
timeout 100 python benchmarks/long_context.py --system alst --offload true --model $M --lengths 32768,65536 --out "$R/long_context_alst_a.json" 2>&1 | grep -E '^\{|Error|error' | tail -4

#!/usr/bin/env bash
# GPU call B (one H200): forward+backward side by side, ours 32K-256K (real) and ALST at 256K (real).
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
M=${MODEL:-qwen3-4b}
timeout 300 python benchmarks/long_context.py --system ours --mode fwdbwd --model $M --lengths 32768,65536,131072,262144 --out "$R/long_context_ours_fwdbwd.json" 2>&1 | grep -E '^\{|Error|error' | tail -8
timeout 270 python benchmarks/long_context.py --system alst --mode fwdbwd --offload true --model $M --lengths 262144 --out "$R/long_context_alst_fwdbwd.json" 2>&1 | grep -E '^\{|Error|error' | tail -4

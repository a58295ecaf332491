#!/usr/bin/env bash
# Issue 8 on nvidia-h200-x2: sp=2 over NCCL vs sp=1 on one GPU, same batch, through the real trainer (bf16);
# then the step time of Qwen3-4B at 131,072 tokens with sp=2.
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
run() {  # run NAME NGPU ARGS...
  local name=$1 n=$2; shift 2
  timeout 280 python -m deepspeed.launcher.runner --num_gpus "$n" --master_port $((29600 + RANDOM % 200)) \
    launch/train.py --bf16 true --learning_rate 1e-5 --warmup_steps 0 --lr_scheduler_type constant --save_strategy no \
    --output_dir "/tmp/$name" "$@" 2>&1 | grep -E "^\{'loss|rror|offloading" | tail -4
  cp "/tmp/$name/metrics.jsonl" "$R/metrics_$name.jsonl" 2>/dev/null
}
run sp1_0.6b_32k 1 --model_name_or_path qwen3-0.6b --max_length 32768 --max_steps 2 --sp_size 1
run sp2_0.6b_32k 2 --model_name_or_path qwen3-0.6b --max_length 32768 --max_steps 2 --sp_size 2
run sp1_4b_32k 1 --model_name_or_path qwen3-4b --max_length 32768 --max_steps 2 --sp_size 1
run sp2_4b_32k 2 --model_name_or_path qwen3-4b --max_length 32768 --max_steps 2 --sp_size 2
run sp2_4b_128k 2 --model_name_or_path qwen3-4b --max_length 131072 --max_steps 2 --sp_size 2

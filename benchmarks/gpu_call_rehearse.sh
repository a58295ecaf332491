#!/usr/bin/env bash
# Rehearsal calls (issue 14), one case per call: `bash benchmarks/gpu_call_rehearse.sh CASE`. Results go to
# $OUT (default /tmp/out). bandwidth / sp2_* need nvidia-h200-x2; the rehearsals need one GPU (GPU 0; the
# x2 machine's second GPU can run another with CUDA_VISIBLE_DEVICES=1).
#   bandwidth      NCCL bus bandwidth, 2 GPUs -> comm_bandwidth_h200_x2.json (commit to benchmarks/results/)
#   sp2_4b         real sp=2 Qwen3-4B at 131,072 tokens (2 steps), then its rehearsal on GPU 0
#   sp2_8b         real sp=2 Qwen3-8B at 262,144 tokens (2 steps), then its rehearsal on GPU 0
#   count_8b       collectives counted vs modelled for Qwen3-8B, sp=8 and sp=2, at a short length
#   reference      the reference recipe (Qwen3-8B, 1M, sp=8) rehearsed as rank 0 of 8, 8K-token warm-up
#   longest L      memory-only rehearsal of Qwen3-8B at L tokens on 8 GPUs (default 5,242,880)
#   two_nodes_sp16     16 GPUs on two nodes, sp=16 (KV heads copied), 1M tokens, rank 0
#   two_nodes_sp8dp2   16 GPUs on two nodes, sp=8 x dp=2 (two 1M sequences per step), rank 0
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
COMM=${COMM:-benchmarks/results/comm_bandwidth_h200_x2.json}
[ -f "$R/comm_bandwidth_h200_x2.json" ] && COMM="$R/comm_bandwidth_h200_x2.json"
rehearse() {  # rehearse NAME TIMEOUT ARGS...
  local name=$1 t=$2; shift 2
  local comm=(); [ -f "$COMM" ] && comm=(--comm "$COMM")
  timeout "$t" python -m ulysses_trainer rehearse ${comm[@]+"${comm[@]}"} --bf16 true --out "$R/rehearse_$name.json" "$@" \
    2>&1 | grep -E "ulysses_trainer|rror" | tail -8
}
real() {  # real NAME ARGS...: the trainer under the deepspeed launcher, 2 GPUs
  local name=$1; shift
  timeout 400 python -m deepspeed.launcher.runner --num_gpus 2 --master_port $((29600 + RANDOM % 200)) \
    launch/train.py --bf16 true --learning_rate 1e-5 --warmup_steps 0 --lr_scheduler_type constant \
    --save_strategy no --max_steps 2 --output_dir "/tmp/$name" "$@" 2>&1 | grep -E "^\{'loss|rror|ulysses_trainer" | tail -6
  cp "/tmp/$name/metrics.jsonl" "$R/metrics_$name.jsonl" 2>/dev/null
}
case "${1:-}" in
  bandwidth)
    timeout 300 python -m deepspeed.launcher.runner --num_gpus 2 benchmarks/comm_bandwidth.py \
      --out "$R/comm_bandwidth_h200_x2.json" 2>&1 | tail -30 ;;
  sp2_4b)
    real sp2_4b_131k --model_name_or_path qwen3-4b --max_length 131072 --sp_size 2
    rehearse sp2_4b_131k 400 --gpus 2 --model_name_or_path qwen3-4b --max_length 131072 --sp_size 2 ;;
  sp2_8b)
    real sp2_8b_262k --model_name_or_path qwen3-8b --max_length 262144 --sp_size 2
    rehearse sp2_8b_262k 500 --gpus 2 --model_name_or_path qwen3-8b --max_length 262144 --sp_size 2 ;;
  count_8b)
    rehearse count_8b_sp8 250 --gpus 8 --model_name_or_path qwen3-8b --max_length 65536 --count_collectives
    rehearse count_8b_sp2 250 --gpus 2 --model_name_or_path qwen3-8b --max_length 32768 --count_collectives ;;
  reference)
    rehearse reference_8gpu_1m 590 --config launch/recipes/reference_8gpu_1m.yaml --gpus 8 --warmup_length 65536 ;;
  longest)
    L=${2:-5242880}
    rehearse longest_8b_$L 590 --config launch/recipes/reference_8gpu_1m.yaml --gpus 8 --max_length "$L" \
      --standin --steps 1 ;;
  two_nodes_sp16)
    rehearse two_nodes_sp16 590 --config launch/recipes/reference_8gpu_1m.yaml --gpus 16 --sp_size 16 \
      --gpus_per_node 8 --internode_gbps 50 --warmup_length 65536 ;;
  two_nodes_sp8dp2)
    rehearse two_nodes_sp8_dp2 590 --config launch/recipes/reference_8gpu_1m.yaml --gpus 16 --sp_size 8 \
      --gpus_per_node 8 --internode_gbps 50 --warmup_length 65536 ;;
  *) echo "usage: $0 bandwidth|sp2_4b|sp2_8b|count_8b|reference|longest [L]|two_nodes_sp16|two_nodes_sp8dp2" >&2
     exit 2 ;;
esac

#!/usr/bin/env bash
# Real sequence-parallel runs on a 2-GPU host through the real command (bf16, NCCL). Cases:
#   exact     tests/test_gpu_sp.py: sp=2 vs sp=1, same batch (qwen3-0.6b, 32K)
#   scale4b   Qwen3-4B at 131,072 tokens: sp=1 on one GPU, then sp=2 on two (recipe defaults otherwise)
#   comm      NCCL bus bandwidth of the step's collectives (benchmarks/comm_bandwidth.py)
#   ref8b     Qwen3-8B at 262,144 tokens with sp=2 (131,072 tokens per GPU, as in the 8-GPU 1M reference run)
#   profile   where the sp=2 step of scale4b spends its time (benchmarks/profile_train.py)
# Results go to $OUT (default /tmp/out).
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
export PATH=/tmp/site/bin:$PATH
COMMON="--bf16 true --learning_rate 1e-5 --warmup_steps 0 --lr_scheduler_type constant --save_strategy no --seed 42"
train() {  # train NAME NGPU ARGS...
  local name=$1 n=$2; shift 2
  timeout 330 python -m deepspeed.launcher.runner --num_gpus "$n" --master_port $((29600 + RANDOM % 300)) \
    launch/train.py $COMMON --output_dir "/tmp/$name" "$@" 2>&1 | grep -E "^\{'loss|rror|\[ulysses_trainer\]" | tee "$R/$name.log"
  cp "/tmp/$name/metrics.jsonl" "$R/metrics_$name.jsonl" 2>/dev/null
}
for c in "$@"; do case $c in
  exact) timeout 420 python -m pytest -q -s -p no:cacheprovider tests/test_gpu_sp.py 2>&1 | tail -8 | tee "$R/gpu_sp_test.log" ;;
  scale4b)
    train sp1_4b_131k 1 --config launch/recipes/one_gpu_4b_long.yaml --max_length 131072 --max_steps 2 --sp_size 1
    train sp2_4b_131k 2 --config launch/recipes/one_gpu_4b_long.yaml --max_length 131072 --max_steps 2 --sp_size 2 ;;
  comm) timeout 120 python -m deepspeed.launcher.runner --num_gpus 2 --master_port 29933 benchmarks/comm_bandwidth.py \
          --out "$R/comm_bandwidth_h200_x2.json" 2>&1 | grep -E "busbw|rror" ;;
  ref8b) train sp2_8b_262k 2 --config launch/recipes/reference_8gpu_1m.yaml --max_length 262144 --max_steps 2 --sp_size 2 ;;
  profile) timeout 240 python -m deepspeed.launcher.runner --num_gpus 2 --master_port 29944 benchmarks/profile_train.py \
          --out "$R/profile_train_sp2_4b_131072.json" --config launch/recipes/one_gpu_4b_long.yaml --max_length 131072 \
          --sp_size 2 $COMMON --output_dir /tmp/prof 2>&1 | grep -E "^\{|rror" ;;
  *) echo "unknown case $c"; exit 2 ;;
esac; done

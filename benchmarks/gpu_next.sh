#!/usr/bin/env bash
# The measurements issue 5 still lacks (done: alst256 and one_gpu_1m, see README), for the next session's one-H200 time (each line ~its own call).
# Start each call with the make-wheelhouse line (../shared/offline-gpu/README.md); carry .whl.
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
M=${MODEL:-qwen3-4b}
case "${1:-}" in
  speed128)   # ALST and ours (kept attention outputs, auto) at 128K in one run: the 1.29x of the README
    # compares ours with an ALST number from an earlier session
    timeout 200 python benchmarks/long_context.py --system alst --mode fwdbwd --offload true --model $M \
      --lengths 131072 --out "$R/long_context_alst_fwdbwd_131072.json"
    timeout 200 python benchmarks/long_context.py --system ours --mode fwdbwd --model $M --lengths 131072 \
      --keep-attention-outputs auto --out "$R/long_context_ours_fwdbwd_131072_kept_auto.json" ;;
  trainer_kept)   # the trainer's own `keep_attention_outputs: auto` (free-memory decision in Trainer._plan_offload)
    # in a real ZeRO-3 + AdamW step, against the same run without it
    for keep in false auto; do
      timeout 280 deepspeed --num_gpus 1 launch/train.py --model_name_or_path $M --max_length 131072 \
        --bf16 true --max_steps 2 --keep_attention_outputs $keep --output_dir /tmp/kept_$keep \
        2>&1 | grep -E "ulysses_trainer|loss" | tee "$R/trainer_kept_$keep.log"
    done ;;
  standin_nan)   # why the stand-in's grad norm was not finite at 4B on the GPU (fine on CPU fp32/bf16)
    for off in 0 2; do
      timeout 250 python benchmarks/long_context.py --system ours --model $M --lengths 65536 --steps 2 \
        --standin-from 1 --offload $off --out "$R/standin_nan_off$off.json"
    done ;;
  fa4)   # after the three make-fa4-parts carries: the kernel table and ours with flash-attn-4
    timeout 200 python benchmarks/attention_kernels.py --lengths 32768,131072,262144 --out "$R/attention_kernels_fa4.json"
    timeout 350 python benchmarks/long_context.py --system ours --mode fwdbwd --kernel flash_attention_4 \
      --model $M --lengths 32768,131072 --out "$R/long_context_ours_fa4.json" ;;
  lean128k)   # lean norms vs HF norms, real attention, full train step: memory saved, time cost
    for lean in true false; do
      timeout 270 python benchmarks/long_context.py --system ours --model $M --lengths 131072 --steps 2 \
        --lean-norm $lean --out "$R/long_context_ours_train_131072_lean_$lean.json"
    done ;;
  profile256)   # where the 256K step's time goes beyond attention: 8 of 36 layers (per-layer time scales),
    # kept outputs + all inputs offloaded (the 165.5 s setting), then without tiling, then without offload
    for v in "true auto" "true false" "false auto"; do set -- $v
      timeout 200 python benchmarks/profile_step.py --model $M --length 262144 --layers 8 --keep-attention-outputs true \
        --offload $1 --tiled-mlp $2 --out "$R/profile_262144_l8_off$1_tiled$2.json"
    done ;;
  *) echo "usage: $0 profile256|speed128|trainer_kept|standin_nan|fa4|lean128k"; exit 2 ;;
esac

#!/usr/bin/env bash
# GPU calls for issue 5, one case per call. Run in session 4: profile256, chain1-3 (flash-attn-4 in three carries,
# the 256K profile and the same-session 256K comparison). Not run yet: speed128 (128K ran in session 4 with FA4
# instead), trainer_kept, standin_nan, fa4 (superseded by chain3), lean128k.
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
  chain1)   # flash-attn-4 part 1 of 3 (make-fa4-parts; carry .whl .fa4p1 .fa4w), then the 256K profile with
    # this session's fixes (loss gradient groups, no tiled forward in the recompute): 8 layers and 1
    mkdir -p /tmp/store/w && cp .fa4p1/* /tmp/store/ && cp .fa4w/*.whl /tmp/store/w/
    for n in 8 1; do
      timeout 200 python benchmarks/profile_step.py --model $M --length 262144 --layers $n --keep-attention-outputs true \
        --offload true --out "$R/profile_262144_l${n}_offtrue_tiledauto_fixed.json"
    done ;;
  chain2)   # part 2 (carry .whl .fa4p2); ALST at 256K again, for the same-session comparison
    cp .fa4p2/* /tmp/store/
    timeout 400 python benchmarks/long_context.py --system alst --mode fwdbwd --offload true --model $M \
      --lengths 262144 --warmup-tokens 8192 --out "$R/long_context_alst_fwdbwd_qwen3-4b_262144_s4.json" ;;
  chain3)   # part 3 (carry .whl .fa4p3): install flash-attn-4, kernel table, ours at 256K with FA4 and cuDNN
    cp .fa4p3/* /tmp/store/ && cat /tmp/store/part00 /tmp/store/part01 /tmp/store/part02 \
      > /tmp/store/w/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/store/w/*.whl
    timeout 150 python benchmarks/attention_kernels.py --lengths 131072,262144 --iters 2 \
      --kernels sdpa_cudnn,ours_grouped_cudnn,flash_attention_4,ours_grouped_fa4 --out "$R/attention_kernels_fa4.json"
    for k in flash_attention_4 sdpa; do
      timeout 250 python benchmarks/long_context.py --system ours --mode fwdbwd --kernel $k --model $M --lengths 262144 \
        --keep-attention-outputs true --offload true --warmup-tokens 8192 --out "$R/long_context_ours_fwdbwd_262144_kept_$k.json"
    done ;;
  *) echo "usage: $0 chain1|chain2|chain3|profile256|speed128|trainer_kept|standin_nan|fa4|lean128k"; exit 2 ;;
esac

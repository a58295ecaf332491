#!/usr/bin/env bash
# The measurements issue 5 still lacks, for the next session's one-H200 time (each line ~its own call).
# Start each call with the make-wheelhouse line (../shared/offline-gpu/README.md); carry .whl.
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
M=${MODEL:-qwen3-4b}
case "${1:-}" in
  alst256)   # the side-by-side at 256K (ours 256K fwd+bwd is in benchmarks/results: 199.8 s)
    timeout 560 python benchmarks/long_context.py --system alst --mode fwdbwd --offload true --model $M \
      --lengths 262144 --out "$R/long_context_alst_fwdbwd_256k.json" ;;
  standin_nan)   # why the stand-in's grad norm was not finite at 4B on the GPU (fine on CPU fp32/bf16)
    for off in 0 2; do
      timeout 250 python benchmarks/long_context.py --system ours --model $M --lengths 65536 --steps 2 \
        --standin-from 1 --offload $off --out "$R/standin_nan_off$off.json"
    done ;;
  fa4)   # after the three make-fa4-parts carries: the kernel table and ours with flash-attn-4
    timeout 200 python benchmarks/attention_kernels.py --lengths 32768,131072,262144 --out "$R/attention_kernels_fa4.json"
    timeout 350 python benchmarks/long_context.py --system ours --mode fwdbwd --kernel flash_attention_4 \
      --model $M --lengths 32768,131072 --out "$R/long_context_ours_fa4.json" ;;
  train_longest)   # one length per process in train mode (DeepSpeed keeps engine memory between lengths)
    for L in 262144 393216; do
      timeout 280 python benchmarks/long_context.py --system ours --model $M --lengths $L --steps 2 \
        --standin-from 1 --out "$R/long_context_ours_train_$L.json"
    done ;;
  *) echo "usage: $0 alst256|standin_nan|fa4|train_longest"; exit 2 ;;
esac

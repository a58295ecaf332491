#!/usr/bin/env bash
# Pack fla-core 0.6.0 with Triton 3.7.1 for a GPU machine that has no package registry (torch 2.11 ships Triton 3.6,
# whose gated chunk backward is wrong on Hopper: fla refuses it). Triton's wheel is ~200 MB, so this keeps only what
# the NVIDIA path needs (no AMD compiler libraries, no Blackwell ptxas, no profiler), packs /tmp/site as one xz archive
# and splits it into two git-ignored folders .flap1 .flap2 (~48 MB each), to be sent one per command.
#
# On the GPU machine, two commands back to back (it keeps /tmp between commands while it stays up):
#   1) send .flap1:  mkdir -p /tmp/flastore && cp .flap1/* /tmp/flastore/
#   2) send .flap2:  cp .flap2/* /tmp/flastore/ && cat /tmp/flastore/part* | xz -dc | tar -x -C /tmp \
#                      && chmod +x /tmp/site/triton/backends/nvidia/bin/*
#   then put /tmp/site first on PYTHONPATH.
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
for d in .flap1 .flap2; do grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; mkdir -p "$d"; rm -f "$d"/*; done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d "$work" \
  triton==3.7.1 fla-core==0.6.0
mkdir -p "$work/site"
for w in "$work"/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
# the AMD backend stays (Triton discovers every backend it registers) but its large libraries are not needed
rm -rf "$work/site/triton/backends/nvidia/lib/cupti" "$work/site/triton/backends/nvidia/bin/ptxas-blackwell" \
  "$work/site/triton/_C/libproton.so" "$work/site/triton/instrumentation" "$work/site/triton/plugins"
(cd "$work" && tar -cf - site | xz -T0 -6 > site.tar.xz)
split -n 2 -d "$work/site.tar.xz" "$work/part" && mv "$work/part00" .flap1/ && mv "$work/part01" .flap2/
du -sh .flap1 .flap2

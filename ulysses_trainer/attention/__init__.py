"""Attention kernels behind the Ulysses all-to-all: SDPA, flash-attn 2, flash-attn 4."""

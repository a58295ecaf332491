"""The planner's measured rates per GPU card: one `Rates` record per card in plan/cards.py, each table rebuilt from
that card's files in benchmarks/results/ by a test (tests/test_card_rates.py), and the rule that picks one.

Torch-free. The H200's tables are plan/rates.py's constants. The H100's come from its own runs of
`benchmarks/suite.py card_rates` (files named *_h100*) and of `benchmarks/profile_step.py` (the dense rate and the
chunked loss's rates: the H200's profiles of Qwen3-4B at 262,144 tokens, 1 and 8 layers, run again on it with the
kernels they ran then). What a card does not measure it takes from the H200, listed in `borrowed` so the plan says
so (the H100 borrows nothing). Field names are plan/rates.py's constant names: the families read a table as they
read that module (`rates.EXPERTS_TFLOPS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import rates as h200
from .cards import CARDS, card_of

# the H100's points ran the trainer's own flash-attn-4 calls (its tiles), so no tile gain is applied to them
H100_KERNEL_SOURCES = {
    "sdpa": (("attention_kernels_h100.json", "sdpa_cudnn"), ("data_dependence_h100.json", "ours_grouped_cudnn")),
    "flash_attention_4": (("attention_kernels_h100.json", "ours_grouped_fa4"),
                          ("data_dependence_h100.json", "ours_grouped_fa4")),
    "flash_attention_2": (("attention_kernels_h100.json", "sdpa_flash_expanded_kv"),),
}
H100_HD256 = ("attention_kernels_hd256_h100.json", {"sdpa": "sdpa_cudnn", "flash_attention_4": "flash_attention_4"})
H100_DELTANET = "deltanet_kernels/h100.json"
# benchmarks/sink_attention.py on the H100: gpt-oss-20b's rank at sp=8 (8 q / 1 kv heads of 64, widened to 72 by the
# sink's column), cuDNN at 131K and 1M, flash-attn-4 at 131K (tests/test_card_rates.py rebuilds both tables)
SINK_SOURCES = ("sink_attention/sink_attention_sdpa_h100.json", "sink_attention/sink_attention_fa4_h100.json")
SINK_RATES_H100 = {"flash_attention_4": ((131072, 423.75, 413.35),),
                   "sdpa": ((131072, 327.16, 274.23), (1048576, 282.66, 281.06))}
WINDOW_BLOCK_TFLOPS_H100 = (128, 30.86, 19.93)  # window, fwd, bwd: 1M tokens, masked SDPA on gathered key blocks
# benchmarks/profile_step.py on the H100: the H200's LOSS_SOURCES runs (Qwen3-4B, 262,144 tokens, 1 and 8 layers,
# cuDNN, offload and kept outputs) with the torch norms and HF's RoPE ops they ran (`--norm-kernel torch --rope
# torch`): the chunked loss's rates as rates.loss_rates_from_results reads them, the dense rate as the H200's
# scaled by the 8-layer runs' kernel seconds outside attention (rates.dense_rate_from_results)
H100_PROFILE_SOURCES = ("profile_262144_l1_offtrue_tiledauto_torch_norms_rope_h100.json",
                        "profile_262144_l8_offtrue_tiledauto_torch_norms_rope_h100.json")
# one device-to-device copy of 1 GiB (data_dependence_*.json "copy_d2d"): H100 1451 GB/s, H200 2012 GB/s; the
# fused GPU Adam is memory-bound, so the H200's effective bandwidth scales by their ratio
COPY_GBPS = {"h100": 1451.41, "h200": 2012.26}


@dataclass(frozen=True)
class Rates:
    """One card's measured tables (plan/rates.py names the units and the sources of each)."""

    card: str
    KERNEL_RATES: dict
    HD256_RATES: dict
    HD256_SOURCE: str
    NORM_S_PER_ELEMENT: dict
    ROPE_S_PER_ELEMENT: dict
    EXPERTS_TFLOPS: dict
    GPU_BANDWIDTH: float
    borrowed: tuple[str, ...] = ()  # what this card takes from the H200's tables (not measured on it)
    MEASURED_HEAD_SHAPE: tuple[int, int, int] = h200.MEASURED_HEAD_SHAPE
    DENSE_TFLOPS: float = h200.DENSE_TFLOPS
    # (cores, seconds per parameter) of one rank's CPU Adam step: the H200's is one point, a whole trainer update
    # (plan/rates.py); a card measured with benchmarks/cpu_adam.py has one point per core count it ran
    CPU_ADAM_BY_CORES: tuple[tuple[int, float], ...] = ((h200.CPU_ADAM_MEASURED_CORES, h200.CPU_ADAM_S_PER_PARAM),)
    GPU_ADAM_BYTES_PER_PARAM: int = h200.GPU_ADAM_BYTES_PER_PARAM
    EXPERTS_MEASURED_ROWS: int = h200.EXPERTS_MEASURED_ROWS
    LOSS_MATMUL_TFLOPS: float = h200.LOSS_MATMUL_TFLOPS
    LOSS_S_PER_LOGIT: float = h200.LOSS_S_PER_LOGIT
    DELTANET_SOURCE: str = h200.DELTANET_SOURCE
    DELTANET_RULE_S: tuple[float, float] = h200.DELTANET_RULE_S
    DELTANET_RULE_PEAK_BYTES: float = h200.DELTANET_RULE_PEAK_BYTES
    DELTANET_CONV_S: float = h200.DELTANET_CONV_S
    DELTANET_RULE_CARD: str = "H200"  # the cards the DeltaNet rule's and conv's rates were measured on
    DELTANET_CONV_CARD: str = "H200"
    DELTANET_CONV_SOURCE: str = h200.DELTANET_SOURCE
    CPU_ADAM_SOURCE: str = "a Qwen3-4B trainer step on the H200 (plan/rates.py)"
    # sparse blocks measured whole in their own shape (a shared expert inside the block's seconds): (experts, top_k,
    # hidden, intermediate, shared expert width) -> the file; the planner times such a block at its own rate
    # (families/qwen3_moe.SparseMoeMlp.time_parts), any other at EXPERTS_TFLOPS (Qwen3-30B-A3B's block)
    BLOCK_SOURCES: tuple[tuple[tuple[int, int, int, int, int], str], ...] = ()
    BLOCK_TFLOPS: tuple[tuple[tuple[int, int, int, int, int], dict], ...] = ()
    # attention with sinks (gpt-oss) by kernel, (tokens, forward, backward TFLOP/s) at its sp=8 rank shape, and the
    # sliding layers' batched block path (its window, forward, backward TFLOP/s): benchmarks/sink_attention.py,
    # measured on SINK_CARD (every card takes them until its own are measured; the plan's note names the card)
    # DeltaNet mixers measured whole in their own shape (GatedDeltaNet.measured_key -> the file, forward+backward
    # seconds per local token): the planner times such a mixer at its own rate (families/qwen3_5.GatedDeltaNet.seconds)
    MIXER_SOURCES: tuple[tuple[tuple[int, int, int, int, int], str], ...] = ()
    MIXER_S_PER_TOKEN: tuple[tuple[tuple[int, int, int, int, int], float], ...] = ()
    SINK_RATES: dict = field(default_factory=lambda: dict(SINK_RATES_H100))
    WINDOW_BLOCK_TFLOPS: tuple[int, float, float] = WINDOW_BLOCK_TFLOPS_H100
    SINK_CARD: str = "H100"

    @property
    def name(self) -> str:
        """The card as people say it (H100)."""
        return self.card.upper()

    def cpu_adam_s_per_param(self, cores: float) -> float:
        """Seconds per parameter of a CPU Adam step on `cores` host cores: between measured core counts the line
        between them; under the fewest, that rate scaled by cores; over the most, the most's rate (more cores than
        measured are not assumed to help: 8 -> 16 cores gained 1.37x on the H100 host, memory-bound), except for a
        table of one point, which scales by cores either way (nothing else measured)."""
        pts = self.CPU_ADAM_BY_CORES
        (c0, r0), (c1, r1) = pts[0], pts[-1]
        if len(pts) == 1 or cores <= c0:
            return r0 * c0 / cores
        if cores >= c1:
            return r1
        (a, ra), (b, rb) = next((p, q) for p, q in zip(pts, pts[1:]) if cores <= q[0])  # sorted by cores
        return ra + (rb - ra) * (cores - a) / (b - a)


H200 = Rates(card="h200", KERNEL_RATES=h200.KERNEL_RATES, HD256_RATES=h200.HD256_RATES,
             HD256_SOURCE=h200.DELTANET_SOURCE, NORM_S_PER_ELEMENT=h200.NORM_S_PER_ELEMENT,
             ROPE_S_PER_ELEMENT=h200.ROPE_S_PER_ELEMENT, EXPERTS_TFLOPS=h200.EXPERTS_TFLOPS,
             GPU_BANDWIDTH=h200.GPU_BANDWIDTH)

# one H100 80GB HBM3, torch 2.11, cuDNN of its CUDA 13 build, flash-attn-4 4.0.0b36 (tests/test_card_rates.py
# rebuilds every table from the files)
H100 = Rates(
    card="h100",
    # attention_kernels_h100.json (32K-256K, 32/8 heads of 128) and data_dependence_h100.json (1M, 4/1, random)
    KERNEL_RATES={
        "sdpa": ((32768, 654.07, 554.18), (65536, 569.43, 555.01), (131072, 579.13, 531.78),
                 (262144, 525.73, 540.89), (1048576, 512.95, 542.66)),
        "flash_attention_4": ((32768, 697.99, 626.87), (65536, 664.51, 626.35), (131072, 701.4, 619.13),
                              (262144, 694.3, 623.33), (1048576, 700.53, 628.28)),
        "flash_attention_2": ((32768, 339.98, 323.53), (65536, 320.09, 324.58), (131072, 316.38, 324.49),
                              (262144, 312.93, 325.94)),
    },
    # attention_kernels_hd256_h100.json: 2 query heads over 1 KV head of 256 (Qwen3.5-35B-A3B's rank at sp=8);
    # flash-attn-4's backward at head_dim 256 falls to 161 TFLOP/s fwd+bwd at 1M on this card (cuDNN: 417)
    HD256_RATES={"sdpa": ((262144, 422.78), (1048576, 417.03)),
                 "flash_attention_4": ((262144, 375.45), (1048576, 161.14))},
    HD256_SOURCE=H100_HD256[0],
    NORM_S_PER_ELEMENT={"torch": {"hidden": (1.4897e-11, 5.0507e-11), "head": (1.5468e-11, 5.7186e-11)},
                        "triton": {"hidden": (1.686e-12, 4.173e-12), "head": (1.666e-12, 6.575e-12)}},
    ROPE_S_PER_ELEMENT={"torch": (1.3551e-11, 1.892e-11), "triton": (1.6101e-12, 1.8091e-12)},
    EXPERTS_TFLOPS={"eager": ((1, 64.62), (4, 18.71), (8, 10.16)),
                    "grouped_mm": ((1, 197.72), (4, 141.86), (8, 134.99))},
    GPU_BANDWIDTH=round(h200.GPU_BANDWIDTH * COPY_GBPS["h100"] / COPY_GBPS["h200"], -9),
    # deltanet_kernels/h100.json: fla's rule at 1M over the 27B's 2 key / 6 value heads, 0.105 s fwd+bwd (the
    # H200's: 0.105 s); h100_conv.json: fla's conv at 1M over their 1,280 channels, 0.0124 s (the H200's: 0.012)
    DELTANET_SOURCE=H100_DELTANET,
    DELTANET_RULE_S=(4.1365e-09, 1.6622e-08),
    DELTANET_RULE_PEAK_BYTES=4158.7,
    DELTANET_RULE_CARD="H100",
    DELTANET_CONV_S=9.2131e-12,
    DELTANET_CONV_CARD="H100",
    DELTANET_CONV_SOURCE="deltanet_kernels/h100_conv.json",
    # cpu_adam_h100.json: DeepSpeed's CPU Adam alone on the one-H100 machine's host (16 cores), 1e9 parameters in
    # the offload sub-groups; the fp32 -> bf16 conversion of the copy back is not in it
    CPU_ADAM_BY_CORES=((4, 5.113e-10), (8, 2.401e-10), (16, 1.747e-10)),
    CPU_ADAM_SOURCE="cpu_adam_h100.json",
    # moe/moe_experts_35b_h100.json: Qwen3.5-35B-A3B's block (256 experts of 512, top-8, a shared expert of 512)
    BLOCK_SOURCES=(((256, 8, 2048, 512, 512), "moe/moe_experts_35b_h100.json"),),
    BLOCK_TFLOPS=(((256, 8, 2048, 512, 512), {"grouped_mm": ((1, 144.84), (2, 106.81), (4, 102.91))}),),
    # deltanet_kernels/mixer_35b_a3b_sp8_h100.json: Qwen3.5-35B-A3B's mixer of one sp=8 rank, 0.260 s fwd+bwd at 1M
    MIXER_SOURCES=(((2048, 16, 32, 128, 128), "deltanet_kernels/mixer_35b_a3b_sp8_h100.json"),),
    MIXER_S_PER_TOKEN=(((2048, 16, 32, 128, 128), 1.9871e-06),),
    # H100_PROFILE_SOURCES: outside attention the 8-layer run took 7.66 s of kernels against the H200's 7.07 (its
    # matmuls 3.08 s on both, its elementwise work slower); the lm_head's matmuls at 743.6 TFLOP/s (H200: 775.9)
    DENSE_TFLOPS=346.9,
    LOSS_MATMUL_TFLOPS=743.6,
    LOSS_S_PER_LOGIT=3.1284e-11,
)

TABLES: dict[str, Rates] = {"h200": H200, "h100": H100}
# the files each card's tables come from (tests/test_card_rates.py): norm, rope, experts
SOURCES = {"h200": (h200.NORM_SOURCE, h200.ROPE_SOURCE, h200.EXPERTS_SOURCE),
           "h100": ("norm_kernels_h100.json", "rope/rope_kernels_h100_to_512k.json", "moe/moe_experts_h100.json")}


def rates_for(gpu_name: str | None, gpu_memory_gb: float | None = None) -> tuple[Rates, list[str]]:
    """The table for a device (its name, or a card's short name), and the plan's notes about the choice: a known
    card takes its own (with what it borrows); an unknown one the card nearest in memory (the H200 with no
    memory given); none at all (no GPU here, no --gpu) the H200's."""
    if gpu_name is None:
        return H200, ["rates of an H200 assumed"]
    card = gpu_name.lower() if gpu_name.lower() in TABLES else card_of(gpu_name)
    notes: list[str] = []
    if card is None:
        card = "h200" if gpu_memory_gb is None else min(
            TABLES, key=lambda c: abs(CARDS[c].memory_gb - gpu_memory_gb))
        notes.append(f"rates measured on an {card.upper()}, the nearest measured card, not on {gpu_name}")
    table = TABLES[card]
    if table.borrowed:
        named = ", ".join(table.borrowed[:-1]) + " and " * (len(table.borrowed) > 1) + table.borrowed[-1]
        notes.append(f"{table.name} rates: {named} measured on an H200")
    return table, notes

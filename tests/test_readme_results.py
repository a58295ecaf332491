"""The documented measured numbers are the committed result files (a re-run that changes a file must change
docs/benchmarks.md, and a hand-edited number there or in the README's results fails here)."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "defaults_256k"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"  # the page that holds every benchmark table


def _row(page: str, label: str) -> str:
    rows = [line for line in page.splitlines() if line.startswith(f"| {label}")]
    assert len(rows) == 1, f"docs/benchmarks.md: expected one 256K-defaults row starting '| {label}', found {len(rows)}"
    return rows[0]


def _measured_s(name: str) -> float:
    steps = [json.loads(line) for line in (RESULTS / f"metrics_defaults_4b_262144_{name}.jsonl").open()]
    last = steps[-1]
    return last["num_tokens"] / len(steps) / last["tokens_per_s"]  # tokens per step / rate


def test_256k_defaults_table_is_the_metrics_files():
    page = BENCHMARKS.read_text()
    runs = {"cudnn": "cuDNN (`sdpa`), torch norms", "cudnn_triton_norms": "cuDNN (`sdpa`), Triton norms",
            "fa4": "flash-attn-4, torch norms", "fa4_triton_norms": "flash-attn-4, Triton norms"}
    for name, label in runs.items():
        steps = [json.loads(line) for line in (RESULTS / f"metrics_defaults_4b_262144_{name}.jsonl").open()]
        last = steps[-1]
        row = _row(page, label)
        measured_s = _measured_s(name)
        assert f"**{measured_s:.1f}**" in row, (name, measured_s, row)
        assert f"/ {last['peak_gpu_mem_gb']:.1f} (" in row, (name, last["peak_gpu_mem_gb"], row)
        assert row.rstrip(" |").endswith(f"{steps[0]['loss']:.4f}"), (name, steps[0]["loss"], row)


def test_readme_headline_256k_step_times_are_the_metrics_files():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("- **Qwen3-4B, 262,144 tokens, one GPU**")
    bullet = " ".join(readme[start:].split("\n- ", 1)[0].split())  # the bullet, its lines joined
    assert f"{_measured_s('fa4_triton_norms'):.1f} s/step with flash-attn-4 and the Triton norms" in bullet, bullet
    assert f"({_measured_s('cudnn_triton_norms'):.1f} s with cuDNN)" in bullet, bullet


def test_fa4_tile_table_is_the_result_file():
    """docs/rehearsal.md's flash-attn-4 tile rows are benchmarks/results/fa4_tiles_h200.json's, and the gain it
    states is the best pair against the mean of the trainer's two rows."""
    page = " ".join((ROOT / "docs" / "rehearsal.md").read_text().replace("**", "").split())
    rows = json.loads((ROOT / "benchmarks" / "results" / "fa4_tiles_h200.json").read_text())["rows"]
    timed = [r for r in rows if "error" not in r]
    others = [r for r in timed if r["variant"] != "trainer"]
    assert all(f"{r['fwd_bwd_s']:.3f} | {r['fwd_bwd_tflops']:.0f} |" in page for r in others)
    trainer = [r["fwd_bwd_s"] for r in timed if r["variant"] == "trainer"]
    best = min(timed, key=lambda r: r["fwd_bwd_s"])
    assert best["variant"] == "fwd192_smem_pv_bwd_m80"
    mean = sum(trainer) / len(trainer)
    assert f"{100 * (1 - best['fwd_bwd_s'] / mean):.1f}% faster" in page
    assert f"({best['fwd_bwd_s']:.3f} against {mean:.3f} s)" in page
    assert all(max(r["max_abs_diff_vs_trainer"].values()) <= 0.016 for r in timed if "max_abs_diff_vs_trainer" in r)

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


REHEARSAL = ROOT / "benchmarks" / "results" / "rehearsal"


def _page(name: str) -> str:
    return " ".join((ROOT / name).read_text().replace("**", "").split())


def test_reference_rehearsal_figures_are_the_result_files():
    """The README's and docs/rehearsal.md's reference-run figures are the committed rehearsals': the trainer's
    flash-attn-4 tiles and, on the same machine, the library's; both on local fill with every update run."""
    ours = json.loads((REHEARSAL / "rehearse_reference_8gpu_1m.json").read_text())
    lib = json.loads((REHEARSAL / "rehearse_reference_8gpu_1m_library_tiles.json").read_text())
    assert lib["fa4_tiles"] == "library" and lib["rehearsal"]["attention_kernel"] == "flash_attention_4"
    lib = lib["rehearsal"]
    for r in (ours, lib):
        assert r["collective_fill"] == "local" and not any(r["optimizer_update_skipped"])
    assert ours["comm_s_estimate"] == lib["comm_s_estimate"]  # the same job: only the kernel's tiles differ
    readme, page = _page("README.md"), _page("docs/rehearsal.md")
    assert f"{ours['predicted_step_s']:.1f} s/step" in readme
    assert f"compute {ours['compute_s']:.2f} s" in page and f"= {ours['predicted_step_s']:.1f} s/step" in page
    assert f"compute {lib['compute_s']:.2f} s, {lib['predicted_step_s']:.1f} s/step" in page
    assert f"take {lib['compute_s'] - ours['compute_s']:.1f} s off the step" in page


def test_reference_step_table_is_the_profiles():
    """docs/rehearsal.md's term-by-term table: one layer = (8-layer profile - 4-layer profile) / 4 per bucket;
    the once-per-step row is the 4-layer run's rest outside attention; the sum is the unprofiled step within 1%."""
    l4, l8 = (json.loads((REHEARSAL / f"profile_rehearsal_ref_l{n}_trainer.json").read_text())["seconds_by_bucket"]
              for n in (4, 8))
    per = {k: (l8[k] - l4[k]) / 4 for k in l4}
    attention = ("attention forward", "attention backward")
    rest = [k for k in per if k not in (*attention, "matmul")]
    page = (ROOT / "docs" / "rehearsal.md").read_text()
    for label, s in (("forward", per["attention forward"]), ("backward", per["attention backward"]),
                     ("matmul", per["matmul"]), ("rest", sum(per[k] for k in rest))):
        assert f"| {s:.3f} | {36 * s:.1f} |" in page, (label, s)
    once = sum(l4[k] - 4 * per[k] for k in per if k not in attention)
    assert f"| | {once:.1f} |" in page
    total = 36 * sum(per.values()) + once
    assert f"| {sum(per.values()):.3f} | **{total:.1f}** |" in page
    step = json.loads((REHEARSAL / "rehearse_reference_8gpu_1m.json").read_text())["compute_s"]
    assert abs(total / step - 1) < 0.01


def test_trainer_fa4_tiles_table_is_the_result_files():
    page = (ROOT / "docs" / "rehearsal.md").read_text()
    for name in ("fa4_tuned_h200_1m.json", "fa4_tuned_h200_256k.json"):
        rows = {r["variant"]: r for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]}
        lib, ours = rows["library"], rows["trainer"]
        assert max(ours["max_abs_diff_vs_library"].values()) <= 0.016  # the same attention to bf16 rounding
        cell = lambda r: f"{r['fwd_s']:.3f} + {r['bwd_s']:.3f} = {r['fwd_s'] + r['bwd_s']:.3f}"  # noqa: E731
        gain = 100 * (1 - ours["fwd_bwd_s"] / lib["fwd_bwd_s"])
        assert f"| {lib['seq_len']:,} | {cell(lib)} | {cell(ours)} | {gain:.1f}% |" in page

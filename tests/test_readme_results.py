"""The README's measured numbers are the committed result files (a re-run that changes a file must change the
README, and a hand-edited README number fails here)."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "defaults_256k"


def _row(readme: str, label: str) -> str:
    rows = [line for line in readme.splitlines() if line.startswith(f"| {label}")]
    assert len(rows) == 1, f"README: expected one 256K-defaults row starting '| {label}', found {len(rows)}"
    return rows[0]


def test_256k_defaults_table_is_the_metrics_files():
    readme = (ROOT / "README.md").read_text()
    runs = {"cudnn": "cuDNN (`sdpa`), torch norms", "cudnn_triton_norms": "cuDNN (`sdpa`), Triton norms",
            "fa4": "flash-attn-4, torch norms", "fa4_triton_norms": "flash-attn-4, Triton norms"}
    for name, label in runs.items():
        steps = [json.loads(line) for line in (RESULTS / f"metrics_defaults_4b_262144_{name}.jsonl").open()]
        last = steps[-1]
        row = _row(readme, label)
        measured_s = last["num_tokens"] / len(steps) / last["tokens_per_s"]  # tokens per step / rate
        assert f"**{measured_s:.1f}**" in row, (name, measured_s, row)
        assert f"/ {last['peak_gpu_mem_gb']:.1f} (" in row, (name, last["peak_gpu_mem_gb"], row)
        assert row.rstrip(" |").endswith(f"{steps[0]['loss']:.4f}"), (name, steps[0]["loss"], row)

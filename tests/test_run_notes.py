"""What a run says it did to the user's files: a bf16 checkpoint trained in fp32 (a CPU run) exports float32 and
says so; overwrite_output_dir says what it removed. One CPU rank, in this process."""

from __future__ import annotations

import json

import torch

from tests.test_disk_space import _main
from tests.tiny_checkpoint import write_checkpoint, write_documents
from ulysses_trainer.model.export_config import dtype_change_note


def test_a_bf16_checkpoint_trained_in_fp32_exports_float32_and_says_so(tmp_path, monkeypatch, capsys):
    model = write_checkpoint(tmp_path / "model", dtype=torch.bfloat16)
    assert json.loads((model / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=20, words_per_doc=31)
    out = tmp_path / "run"
    args = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32", "--max_steps", "1",
            "--bf16", "false", "--report_to", "none", "--output_dir", str(out)]
    rc, text = _main(args, monkeypatch, capsys)
    assert rc == 0, text[-3000:]
    exported = json.loads((out / "final" / "config.json").read_text())
    assert exported.get("dtype", exported.get("torch_dtype")) == "float32"  # the weights as trained
    note = f"final/ holds float32 weights, the dtype trained in, while {model} stores bfloat16"
    assert note in text and "load it with dtype=torch.bfloat16" in text
    assert dtype_change_note(str(model), bf16=True) is None  # trained in bf16: nothing to say
    assert dtype_change_note(None, bf16=False) is None  # a preset has no stored dtype

    (out / "runs" / "mine.txt").parent.mkdir(exist_ok=True)
    (out / "runs" / "mine.txt").write_text("kept")
    rc, text = _main(args + ["--overwrite_output_dir", "true"], monkeypatch, capsys)
    assert rc == 0, text[-3000:]
    line = next(x for x in text.splitlines() if "overwrite_output_dir: removed" in x)
    assert f"removed the previous run's files from {out}: " in line
    for name in ("checkpoint-1/", "final/", "metrics.jsonl", "config.json", "latest"):
        assert name in line, line
    assert "mine.txt" not in line and (out / "runs" / "mine.txt").read_text() == "kept"

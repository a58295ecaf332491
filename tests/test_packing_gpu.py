"""benchmarks/packing_gpu.py and packed_step.py's rows: first-fit keeps the order, the attention share counts
the real documents only (the pads are segments the kernels leave out), and the epoch's fit recovers a straight
line's step times."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import packing_gpu  # noqa: E402
from benchmarks.packed_step import packed_row  # noqa: E402
from ulysses_trainer.data.sequences import SequenceDataset  # noqa: E402
from ulysses_trainer.plan.attention_share import row_fractions  # noqa: E402


def test_next_fit_keeps_the_order_and_the_share_counts_the_documents_only():
    assert packing_gpu.next_fit([5, 4, 3, 6, 1], 10) == [[5, 4], [3, 6, 1]]
    pos, keep = packed_row([3, 2], 8)  # 3 pads continue the second document
    assert pos[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4] and keep[0].tolist() == [True] * 5 + [False] * 3
    assert packing_gpu.ratio([3, 2], 8) == pytest.approx((3 * 4 + 2 * 3) / (8 * 9))
    ds = SequenceDataset(np.zeros(8, np.int32), pos[0].numpy().astype(np.int32), 8, "t", 2, None, lengths=np.array([5]))
    assert row_fractions(ds)[0] == pytest.approx((9 + 4) / 64)  # the plan's l^2, same spans


def test_epoch_fit_recovers_a_line_and_sums_it_over_each_strategy(tmp_path):
    rows = {"a": [100, 60], "b": [200], "c": [50, 50, 50, 50]}
    L, fa, fb = 256, 7.0, 30.0
    phases = {f"row {k}": {"step_s": fa + fb * packing_gpu.ratio(v, L), "real_tokens": sum(v)} for k, v in rows.items()}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "m.json").write_text(json.dumps({"device": "x", "phases": phases}))
    a = SimpleNamespace(sessions=40, seed=1, max_length=L, rows=str(tmp_path / "rows.json"),
                        measured=str(tmp_path / "m.json"), out=str(tmp_path / "e.json"))
    packing_gpu.epoch_cmd(a)
    out = json.loads((tmp_path / "e.json").read_text())
    assert out["fit"]["a_s"] == pytest.approx(fa) and out["fit"]["b_s"] == pytest.approx(fb)
    for name, bins in packing_gpu.packings(40, 1, L).items():
        s = out["strategies"][name]
        assert s["rows"] == len(bins) and s["real_tokens"] == sum(map(sum, bins))
        assert s["epoch_s"] == pytest.approx(sum(fa + fb * packing_gpu.ratio(r, L) for r in bins))
    assert out["strategies"]["bfd"]["rows"] <= out["strategies"]["next_fit"]["rows"]

"""How full do packed sequences get? The same mixed-length agent sessions through `ulysses-trainer data` under
each packing_strategy (CPU only, no model).

    python benchmarks/packing_fill.py --sessions 500 --max_length 262144 --out packing_fill_262144.json

Writes --sessions synthetic sessions of mixed lengths (data/agent_sessions.py: 4K-400K tokens, log-normal,
median 60K; seed --seed) to a jsonl file once, then runs `python -m ulysses_trainer data --json --show 0` on it
for each strategy with assistant_only_loss and packing, and records the counts: sequences, real tokens, pad
tokens, fill_ratio (real tokens / sequence tokens), and the sessions' token lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ulysses_trainer.data.agent_sessions import (  # noqa: E402
    _CHARS_PER_TOKEN,  # noqa: E402
    TOOLS,
    agent_session,
    mixed_session_tokens,
)

STRATEGIES = ("next_fit", "bfd", "wrapped")


def write_sessions(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            target = mixed_session_tokens(rng)
            f.write(json.dumps({"messages": agent_session(rng, int(target * _CHARS_PER_TOKEN)), "tools": TOOLS}) + "\n")


def counts(path: Path, strategy: str, max_length: int, model: str) -> dict:
    cmd = [sys.executable, "-m", "ulysses_trainer", "data", "--json", "--show", "0", "--dataset_name", str(path),
           "--model_name_or_path", model, "--max_length", str(max_length), "--assistant_only_loss", "true",
           "--packing", "true", "--packing_strategy", strategy]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return {"command": " ".join(cmd[1:]), **json.loads(out.stdout)["counts"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max_length", type=int, default=262144)
    ap.add_argument("--model", default="qwen3-4b", help="whose tokenizer (a preset: the shipped Qwen BPE)")
    ap.add_argument("--data", default="/tmp/mixed_sessions.jsonl", help="the sessions file (written if absent)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--out", default=None, help="file name under benchmarks/results/")
    a = ap.parse_args()
    path = Path(a.data)
    if not path.exists():
        write_sessions(path, a.sessions, a.seed)
    rows = {s: counts(path, s, a.max_length, a.model) for s in a.strategies.split(",")}
    result = {"sessions": a.sessions, "seed": a.seed, "max_length": a.max_length, "strategies": rows}
    for s, c in rows.items():
        print(f"{s:9s} sequences {c['sequences']:5d}  real tokens {c['tokens']:10d}  pad {c['pad_tokens']:9d}  "
              f"fill {100 * c['fill_ratio']:.1f}%  truncated {c.get('truncated', 0)}  split {c.get('split', 0)}")
    if a.out:
        (ROOT / "benchmarks" / "results" / a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

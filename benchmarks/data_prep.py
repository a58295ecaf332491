"""Data preparation at scale: generate a synthetic dataset, then time one preparation of it.

    python benchmarks/data_prep.py generate --out /tmp/prep --sessions_mb 40 --text_mb 20
    python benchmarks/data_prep.py measure --data /tmp/prep/sessions.jsonl --max_length 131072 \
        --assistant_only_loss true --cache_dir /tmp/prep/cache [--num_proc 2] [--template chatml]

    python benchmarks/data_prep.py dataline --checkout . --num_gpus 2 -- --dataset_name /tmp/prep/text.jsonl \
        --max_length 8192 --max_steps null --num_train_epochs 1 --data_cache_dir /tmp/prep/cache

`dataline` starts the real command (`deepspeed --num_gpus N <checkout>/launch/train.py ...`, CPU ranks) and
stops it once rank 0 prints its data line, printing the seconds to that line. `measure` runs the trainer's
own preparation of the training rows (train/data_cache.prepared_sequences where the code has it, else
data/documents.build_sequences) in this process and prints one JSON line: seconds, tokens, tokens/s,
peak RSS (GiB). Run it twice with the same cache_dir for cold and warm; with PYTHONPATH at another
checkout it measures that code (the "before" numbers of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path


def generate(out: Path, sessions_mb: float, text_mb: float, seed: int) -> None:
    """Agent sessions ({"messages", "tools"}, ~100K tokens each) and plain-text documents, as jsonl."""
    import random

    from ulysses_trainer.data.agent_sessions import agent_sessions
    from ulysses_trainer.data.synthetic import synthetic_document

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sessions.jsonl", "w") as f:
        for session in agent_sessions(seed, mean_tokens=100_000):
            f.write(json.dumps(session) + "\n")
            if f.tell() > sessions_mb * 2**20:
                break
    rng = random.Random(seed)
    with open(out / "text.jsonl", "w") as f:
        while f.tell() < text_mb * 2**20:
            f.write(json.dumps({"text": synthetic_document(rng, 4000)}) + "\n")
    for name in ("sessions.jsonl", "text.jsonl"):
        print(f"{out / name}: {(out / name).stat().st_size / 2**20:.1f} MiB")


# a checkpoint's own ChatML template (not Qwen3's, which the built-in format renders): the template path
CHATML = ("{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}"
          "{% for c in m.tool_calls %}\nCALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
          "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(template: str | None):
    """The Qwen BPE; with template "chatml", as a checkpoint's HF tokenizer carrying CHATML."""
    import tempfile

    from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
    from ulysses_trainer.data.tokenizer import load_tokenizer

    if template is None:
        return load_tokenizer(None)
    d = tempfile.mkdtemp(prefix="data_prep_tok_")
    QwenBPETokenizer().save_pretrained(d)
    config = Path(d) / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CHATML}))
    return load_tokenizer(d)


def measure(args: argparse.Namespace) -> dict:
    from ulysses_trainer.config import TrainConfig

    fields = dict(dataset_name=args.data, max_length=args.max_length, assistant_only_loss=args.assistant_only_loss,
                  packing=args.packing)
    if "data_cache_dir" in TrainConfig.__dataclass_fields__:
        fields.update(data_cache_dir=args.cache_dir, data_cache=args.cache_dir is not None)
    if args.num_proc is not None:
        fields["dataset_num_proc"] = args.num_proc
    cfg = TrainConfig(**fields)
    tokenizer = _tokenizer(args.template)
    try:
        from ulysses_trainer.train.data_cache import prepared_sequences as prepare
    except ImportError:  # a checkout without the cache
        from ulysses_trainer.data.documents import build_sequences as prepare
    start = time.perf_counter()  # the preparation alone (imports and the tokenizer's load are not in it)
    ds = prepare(cfg, tokenizer)
    seconds = time.perf_counter() - start
    tokens = int(ds.lengths.sum()) if ds.lengths is not None else int(len(ds.tokens))  # real, not padding
    return {"data": args.data, "seconds": round(seconds, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / max(seconds, 1e-3)), "rows": len(ds),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            # the largest of the worker processes (dataset_num_proc), each on its own
            "peak_rss_worker_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)}


def dataline(checkout: Path, num_gpus: int, train_args: list[str]) -> dict:
    import os
    import signal
    import socket
    import subprocess
    import tempfile

    deepspeed = Path(sys.executable).with_name("deepspeed")
    out = tempfile.mkdtemp(prefix="data_prep_run_")
    with socket.socket() as sock:  # a free port: a job just killed may still hold the default one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(deepspeed), "--master_port", str(port), "--num_gpus", str(num_gpus),
           str(checkout / "launch" / "train.py"), *train_args, "--output_dir", out, "--bf16", "false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    seconds, line = None, ""
    for line in proc.stdout:
        if line.startswith("[ulysses_trainer] data:"):
            seconds = time.perf_counter() - start
            break
    os.killpg(proc.pid, signal.SIGKILL)  # the job this function started, in its own session
    proc.wait()
    return {"checkout": str(checkout), "num_gpus": num_gpus, "seconds_to_data_line": None if seconds is None
            else round(seconds, 1), "line": line.strip()[:200]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--sessions_mb", type=float, default=40)
    g.add_argument("--text_mb", type=float, default=20)
    g.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("measure")
    m.add_argument("--data", required=True)
    m.add_argument("--max_length", type=int, default=131072)
    m.add_argument("--assistant_only_loss", type=lambda s: s == "true", default=False)
    m.add_argument("--packing", type=lambda s: s == "true", default=False)
    m.add_argument("--cache_dir", default=None, help="the data cache; none: no cache")
    m.add_argument("--num_proc", type=int, default=None, help="dataset_num_proc")
    m.add_argument("--template", choices=["chatml"], default=None,
                   help="render with a checkpoint's own ChatML template (the template path)")
    d = sub.add_parser("dataline")
    d.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    d.add_argument("--num_gpus", type=int, default=2)
    d.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "dataline":
        rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        print(json.dumps(dataline(args.checkout, args.num_gpus, rest)), flush=True)
    elif args.cmd == "generate":
        generate(args.out, args.sessions_mb, args.text_mb, args.seed)
    else:
        print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    from ulysses_trainer.cli.console import use_console

    use_console()  # the package's messages as the commands show them
    sys.exit(main())

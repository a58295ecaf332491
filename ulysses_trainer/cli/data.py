"""`ulysses-trainer data --config RECIPE [--json] [--show N] [--name value ...]`: what the trainer will see.

Builds the training sequences exactly as the trainer does (no GPU, no model) and prints the first N in the
order training takes them (the seeded permutation of the first epoch, train/data_order.py) with their trained
spans marked, then the counts: examples read, used, truncated, dropped, tokens, trained tokens, sequences.
--json prints {"sequences": [{"row", "segments": [{"text", "trained"}], "tokens", "trained_tokens"}],
"counts": {...}} (row: the sequence's index in the data, in file order).
A token is "trained" when it is a target of the loss (the first token of an example never is).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..errors import EXIT_INVALID, EXIT_OK, ConfigError
from ..parallel.sharding import IGNORE_INDEX
from .argv import load_config, split_argv, walk
from .console import use_console

USAGE = ("usage: ulysses-trainer data [--config RECIPE.yaml] [--json] [--show N] [--name value ...]\n"
         "  the training sequences as the trainer builds them: the first N (default 3) in the training order\n"
         "  (seeded) with trained spans marked [[like this]], then the counts; --json for the machine-readable form")


def _split(argv: list[str]) -> tuple[bool, int, list[str]]:
    """(--json, --show N, the rest for the config parser)."""
    ours, rest = split_argv(argv, own={"json", "show"}, flags={"json"})
    as_json, show = False, 3
    for a in walk(ours, flags={"json"}):
        if a.name == "json":
            as_json = True
        elif a.name == "show":
            if not (a.value or "").isdigit():
                raise ConfigError(f"--show needs a number of sequences, got {a.value or ''!r}")
            show = int(a.value)
        else:
            raise ConfigError(f"unexpected argument {a.args[0]!r}; arguments are `--name value` pairs")
    return as_json, show, rest


def _targets(row: dict[str, Any]) -> Any:
    """Tokens that are a loss target: labelled, and not the first of a document (nothing predicts it)."""
    return (row["labels"] != IGNORE_INDEX) & (row["position_ids"] != 0)


def sequence_segments(row: dict[str, Any], real_tokens: int, tokenizer: Any) -> dict[str, Any]:
    """One row as runs of tokens that are all trained or all not, decoded (pads left out)."""
    ids = row["input_ids"][:real_tokens].tolist()
    trained = _targets(row)[:real_tokens].tolist()
    segments, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or trained[j] != trained[start]:
            segments.append({"text": tokenizer.decode(ids[start:j]), "trained": bool(trained[start])})
            start = j
    return {"segments": segments, "tokens": len(ids), "trained_tokens": int(sum(trained))}


def describe(argv: list[str]) -> tuple[dict[str, Any], bool]:
    from ..data.documents import build_sequences
    from ..data.tokenizer import apply_tokenizer_options, family_vocabulary, load_tokenizer
    from ..families import family
    from ..model.load import checkpoint_source, model_config_for
    from ..train.data_order import epoch_permutation

    as_json, show, rest = _split(argv)
    cfg = load_config(rest)
    model_config = model_config_for(cfg)
    vocabulary = family_vocabulary(family(model_config.model_type), model_config)  # what a preset is tokenized with
    tokenizer = apply_tokenizer_options(load_tokenizer(checkpoint_source(cfg.model_name_or_path), vocabulary),
                                        cfg.chat_template_path, cfg.eos_token)
    ds = build_sequences(cfg, tokenizer, split="train")
    first = epoch_permutation(cfg.seed, len(ds), 0)[:show].tolist()  # what step 1 onwards trains, in order
    seqs = [{"row": i, **sequence_segments(ds[i], ds.real_tokens(i), tokenizer)} for i in first]
    counts = ds.counts.to_dict()
    if "trained_tokens" not in counts:  # text: every token but a row's first is a target, pads excepted
        counts["trained_tokens"] = sum(int(_targets(ds[i]).sum()) for i in range(len(ds)))
    counts.update(kind=ds.kind, source=ds.source, max_length=ds.max_length, examples_total=ds.documents_total,
                  tokenizer=tokenizer.name)  # what tokenized it: a checkpoint's own, the Qwen BPE or a stand-in
    return {"sequences": seqs, "counts": counts}, as_json


def _text_report(out: dict[str, Any]) -> str:
    lines = []
    for n, s in enumerate(out["sequences"]):
        lines.append(f"--- sequence {n} (row {s['row']} of the data): {s['tokens']} tokens, {s['trained_tokens']} "
                     f"trained ([[...]])")
        lines.append("".join(f"[[{g['text']}]]" if g["trained"] else g["text"] for g in s["segments"]))
    lines.append("--- counts")
    lines += [f"  {k}: {v}" for k, v in out["counts"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return EXIT_OK
    use_console()
    try:
        out, as_json = describe(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(json.dumps(out, indent=1, ensure_ascii=False) if as_json else _text_report(out))
    return EXIT_OK

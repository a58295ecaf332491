"""Suggestions for unknown config names: names from TRL / transformers that mean one of our settings.

One small table, so that fields added later (which then stop being unknown) are easy to strike out.
"""

from __future__ import annotations

import difflib

# other trainers' name -> what to set here instead
TRL_NAMES: dict[str, str] = {
    "torch_dtype": "dtype (bfloat16 / float32), or bf16 (true/false)",
    "fp16": "bf16 (this trainer trains in bf16 or fp32)",
    "fp32": "bf16 false",
    "evaluation_strategy": "eval_strategy",
    "logging_strategy": "logging_steps",
    "dataset_kwargs": "dataset_text_field / text_file_split",
    "max_seq_length": "max_length",
    "activation_offloading": "activation_offload",
    "attn_implementation_kwargs": "attn_implementation",
    "optim": "the optimizer section of the ZeRO JSON (deepspeed)",
}


def suggest(name: str, fields: list[str]) -> str:
    """'; did you mean ...?' for an unknown name, or a pointer to --help."""
    if name in TRL_NAMES and name not in fields:
        return f"; this trainer's setting for that is {TRL_NAMES[name]}"
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else "; run with --help for the list of fields"

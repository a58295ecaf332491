"""`deepspeed launch/train.py [--config RECIPE.yaml] [--name value ...]`: parse, check, train.

Exit codes (CONTRACT.md): 0 success or clean stop on SIGTERM; 2 invalid input, reported before any
heavy work with nothing written; 1 any other failure.
"""

from __future__ import annotations

import os
import sys
import traceback

from ..errors import EXIT_FAILURE, EXIT_INVALID, EXIT_OK, ConfigError


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _init_distributed(device: str) -> None:
    import deepspeed

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "RANK" in os.environ:
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        from ..config import load_config
        from .prepare import prepare, world_size_from_env

        cfg = load_config(argv)
        plan = prepare(cfg, world_size_from_env())
    except ConfigError as exc:
        if _is_main_rank():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_INVALID
    try:
        from .trainer import Trainer

        _init_distributed(plan.device)
        return Trainer(plan).train() or EXIT_OK
    except ConfigError as exc:  # found only once the engine exists (e.g. host RAM for offload)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_INVALID
    except KeyboardInterrupt as exc:
        print(f"[ulysses_trainer] interrupted: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    except Exception:
        traceback.print_exc()
        return EXIT_FAILURE

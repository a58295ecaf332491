"""What every rank runs: `deepspeed --module ulysses_trainer.cli.rank ...` (`ulysses-trainer train` starts it so;
launch/train.py, the checkout's script, calls run()). It works wherever the package is importable, without a
checkout."""

import os
import sys


def run() -> None:
    """cli.train.main, then exit with its code without interpreter finalization."""
    # Before torch touches CUDA: long sequences fragment the caching allocator without this.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        from .train import main

        code = main()
    except KeyboardInterrupt:  # Ctrl-C while torch and DeepSpeed import (main() handles its own)
        if os.environ.get("RANK", "0") == "0":
            print("[ulysses_trainer] interrupted before training: nothing written", file=sys.stderr)
        code = 130
    # Every file is closed and the process group destroyed by now. Skip interpreter finalization: C++
    # threads torn down there can still abort the process (exit -6 after a finished run; seen once with
    # gloo on CPU), which would turn a success into a failure for the launcher.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()

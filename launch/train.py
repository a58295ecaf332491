"""Training entry point: `deepspeed --num_gpus N launch/train.py [--config RECIPE.yaml] [--name value ...]`."""

import os
import sys

# Before torch touches CUDA: long sequences fragment the caching allocator without this.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

if __name__ == "__main__":
    try:
        from ulysses_trainer.cli.train import main

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

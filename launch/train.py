"""Training entry point: `deepspeed --num_gpus N launch/train.py [--config RECIPE.yaml] [--name value ...]`.

A thin script for a checkout; the code is ulysses_trainer/cli/rank.py (what `ulysses-trainer train` runs)."""

import os
import sys

# Before torch touches CUDA: long sequences fragment the caching allocator without this.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

if __name__ == "__main__":
    from ulysses_trainer.cli.rank import run

    run()

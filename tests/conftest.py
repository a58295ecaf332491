import multiprocessing.process
import os
import subprocess
import sys
import tempfile

import pytest

# Make `tests.dist_utils` importable from spawned ranks and keep CPU runs quiet and deterministic.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Every run starts from empty caches, as on a new machine: no font cache, HF/datasets cache or compiled
# kernels that an earlier run left can make a test pass here and fail there. Spawned ranks inherit these.
CACHE_ROOT = tempfile.mkdtemp(prefix="ulysses-test-caches-")
for var, sub in (("MPLCONFIGDIR", "matplotlib"), ("HF_HOME", "hf"), ("HF_DATASETS_CACHE", "hf/datasets"),
                 ("XDG_CACHE_HOME", "xdg"), ("TRITON_CACHE_DIR", "triton"),
                 ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TORCH_EXTENSIONS_DIR", "torch_extensions")):
    os.environ[var] = os.path.join(CACHE_ROOT, sub)

# The package's messages reach stdout/stderr as under the commands (tests call library code directly)
from ulysses_trainer.cli.console import use_console  # noqa: E402

use_console()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Queries, not runs: DeepSpeed's CPU accelerator asks numactl/lscpu for the core layout, and matplotlib
# asks fontconfig for the fonts when it builds its font cache (on every new machine, and here every run).
HARMLESS_QUERIES = {"numactl", "lscpu", "fc-list"}


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """Only tests marked slow (or gpu, which run elsewhere) may start a process: `-m "not slow"` stays fast."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("gpu"):
        return

    execute_child = subprocess.Popen._execute_child

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")

    def refuse_popen(self, args, *rest, **kwargs):
        if (args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]) in HARMLESS_QUERIES:
            return execute_child(self, args, *rest, **kwargs)
        refuse()

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(CACHE_ROOT, ignore_errors=True)

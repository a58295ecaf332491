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


# The longest tests first and the in-process ones last: under -n the workers then end together, instead of one
# waiting while the other runs a long test it took late. (Each of these starts many processes; a module of tests
# sharing a fixture's runs is one unit of work for --dist loadgroup, and those units go out first anyway.)
LONGEST_FIRST = ("tests/test_readme_examples.py", "tests/test_e2e_masks.py", "tests/test_moe.py",
                 "tests/test_e2e_lora.py", "tests/test_chat_export.py", "tests/test_run_dir.py")


def _run_order(item: pytest.Item) -> tuple[int, int]:
    path = item.nodeid.split("::", 1)[0]
    if path in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(path)
    return (1 if item.get_closest_marker("slow") else 2), 0


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_run_order)  # stable: a file's tests keep their order
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


@pytest.fixture(autouse=True)
def _no_job_left():
    """What a test started with dist_utils.start_job and left running is killed after it (its process group)."""
    yield
    from tests.dist_utils import kill_started

    kill_started()


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(CACHE_ROOT, ignore_errors=True)

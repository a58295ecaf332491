"""Start CPU ranks with gloo (the DeepSpeed CPU accelerator) and collect what each returns.

Usage in a test::

    results = run_ranks(2, my_fn, arg1, arg2)   # my_fn(rank, world_size, *args) -> picklable

`my_fn` must be a module-level function (it is pickled into the rank, a fork of tests/warm_ranks.py's server).
Each rank gets the caller's environment plus MASTER_ADDR/PORT, RANK, LOCAL_RANK and WORLD_SIZE, and
`init_distributed("gloo")` (DeepSpeed's, minus its CPU shm op) is called before `my_fn`, so `torch.distributed`
and DeepSpeed engines work inside it.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The most a launched job of the tests may take before it counts as hung: generous, so that a machine whose cores
# other work shares (CI beside other jobs: a run's start-up alone then takes minutes) still passes.
JOB_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, env: dict[str, str], fn: Callable, args: tuple, queue: Any) -> None:
    from tests.warm_ranks import adopt, rank_environment

    adopt(rank_environment(env, rank, world_size, port))  # the caller's environment, as a spawned rank's
    try:
        from ulysses_trainer.parallel.init import init_distributed

        init_distributed("gloo")
        out = fn(rank, world_size, *args)
        # plain bytes: torch tensors put on an mp queue would live in this process's shared memory
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = JOB_TIMEOUT_S) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks, forked from the preloaded server of
    tests/warm_ranks.py; return results by rank."""
    from tests.warm_ranks import context

    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, env, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
                break  # the other ranks may be stuck in a collective
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def unverified(args: list[str]) -> list[str]:
    """`args` with verify_sp false unless they name it: the launched tests of other things (faults, stops, resume,
    data, export) skip the startup check's few seconds; the runs that check it, and the exactness runs that keep it
    on as a user's run has it (tests/test_e2e_train.py, tests/test_train_runs.py, the README's commands), say so."""
    return list(args) if "--verify_sp" in args else [*args, "--verify_sp", "false"]


def train_command(num_gpus: int, args: list[str]) -> list[str]:
    """The real `deepspeed --num_gpus N launch/train.py ...` command, on a free master port (verify_sp: unverified)."""
    import shutil
    import sys
    from pathlib import Path

    deepspeed = Path(sys.executable).with_name("deepspeed")
    found = str(deepspeed) if deepspeed.exists() else shutil.which("deepspeed")
    # a DeepSpeed installed without its scripts on PATH (pip --target): the module the command runs
    launcher = [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*launcher, "--master_port", str(free_port()), "--num_gpus", str(num_gpus), "launch/train.py",
            *unverified(args)]


STARTED: list[subprocess.Popen] = []  # jobs start_job began; conftest's reaper kills what a test left running


def start_job(cmd: list[str], log: Any, env: dict, text: bool = False) -> subprocess.Popen:
    """`cmd` in its own session (so a test signals exactly its processes, as a terminal's Ctrl-C does), output to
    `log` (an open file, or subprocess.PIPE); killed after the test if it still runs (kill_started)."""
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=text,
                           start_new_session=True)
    STARTED.append(job)
    return job


def kill_started() -> None:
    """A test that failed while its job ran (a held rank included) leaves no process behind."""
    while STARTED:
        job = STARTED.pop()
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()


def main_captured(argv: list[str]) -> tuple[int, str]:
    """The real command's main (cli/train.main) in this process (a rank of run_ranks): (exit code, its stderr)."""
    import contextlib
    import io

    from ulysses_trainer.cli.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def train_env() -> dict[str, str]:
    """Environment for a training subprocess: one thread per rank, offline, unbuffered, no launcher vars."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (/proc/vmstat), None where unreadable."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except OSError:
        return None


def _memory_now() -> str:
    try:
        with open("/proc/meminfo") as f:
            mib = {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f)}
    except OSError:
        return "memory: unreadable"
    return (f"memory now: {mib.get('MemAvailable')} MiB available, {mib.get('Shmem')} MiB in shared memory "
            f"(/dev/shm), load {os.getloadavg()[0]:.1f}")


def run_job(cmd: list[str], timeout: float, cwd: str | None = None, env: dict | None = None):
    """subprocess.run of a launched job (capture_output, text) that also records whether the kernel
    OOM-killed a process while it ran (res.oom_kills: None where the counter is unreadable)."""
    before = _oom_kills()
    res = subprocess.run(cmd, cwd=cwd or ROOT, env=env or train_env(), capture_output=True, text=True,
                         timeout=timeout)
    after = _oom_kills()
    res.oom_kills = None if before is None or after is None else after - before
    return res


def job_failure(res) -> str:
    """Why a launched job failed: every rank's error lines (the first rank to fail is the cause; the others
    only report the lost peer), native deaths included (the launcher's "exits with return code = -9", "terminate
    called", "Fatal Python error"), whether the OOM killer ended a process meanwhile, memory now, the log's tail."""
    log = (res.stdout or "") + (res.stderr or "")
    errors = [line for line in log.splitlines()
              if re.search(r"Error|error:|Traceback|exits with|warning:|terminate called|Fatal Python", line)]
    shown = errors if len(errors) <= 40 else errors[:20] + ["..."] + errors[-20:]
    oom = getattr(res, "oom_kills", None)
    return "\n".join([f"{' '.join(map(str, res.args))} exited {res.returncode}", *shown, "----",
                      f"OOM kills while it ran: {'unknown' if oom is None else oom}", _memory_now(), "----",
                      log[-4000:]])


def zero3_config(world_size: int, **zero: object) -> dict:
    """A ZeRO-3 config for CPU tests that partitions even tiny parameters (persistence threshold 0)."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world_size,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def sp_zero3_step(model, state, ids, *, position_ids=None, labels=None, pad_to_multiple_of: int | None = None,
                  optimizer: Callable | None = None) -> dict:
    """Inside a rank: one training step's forward and backward of a parallelized `model` (on `state`) in a ZeRO-3
    engine (zero3_config; `optimizer(params)`, default SGD at lr 0: no step is taken) over this rank's shard of
    `ids` (this dp rank's sequence), the loss normalised over every rank's tokens as the trainer does
    (loss_for_backward). Returns the global loss, the full gradients under the stock model's names, the step's
    token count, the shard and the engine."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from ulysses_trainer import global_loss, loss_for_backward, shard_batch, step_token_count

    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(state.world_size),
                                      optimizer=(optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.0)))(
                                          model.parameters()))
    shard = shard_batch(ids, position_ids=position_ids, labels=labels, sp_size=state.sp_size,
                        sp_rank=state.sp_rank, pad_to_multiple_of=pad_to_multiple_of)
    tokens = step_token_count(shard.num_valid, state)
    loss_sum = engine(**shard.model_inputs())
    engine.backward(loss_for_backward(loss_sum, tokens, state), scale_wrt_gas=False)
    grads = {n.removeprefix("causal_lm."): safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    return {"loss": global_loss(float(loss_sum), tokens, state), "grads": grads, "tokens": tokens, "shard": shard,
            "engine": engine}


def stock_zero3_step(model, world_size: int, ids, *, wire: Callable | None = None) -> tuple[float, dict, Any]:
    """Inside a rank: a stock HF causal LM in a ZeRO-3 engine that partitions even tiny parameters with small
    buckets (so each module really gathers and reductions happen between its parts), AdamW; `wire(engine)` before
    the step; one forward + backward of `ids` (labels = ids). Returns (loss, {name: full grad as numpy}, engine):
    numpy, since tensors cross the result queue as shared memory that dies with the rank."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    config = zero3_config(world_size, reduce_bucket_size=20_000, stage3_prefetch_bucket_size=20_000)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    if wire is not None:
        wire(engine)
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    grads = {n: safe_get_full_grad(p).numpy().copy() for n, p in engine.module.named_parameters()}
    return out.loss.item(), grads, engine


def tiny_zero3_sp_step(rank: int, world_size: int, pcfg, *, layers: int | None = None, seq: int = 41,
                       small_buckets: bool = False):
    """Inside a rank: a tiny Qwen3 (seed 5) under `parallelize(pcfg)` in a ZeRO-3 engine (SGD, lr 0), one
    forward + backward of a fixed `seq`-token sequence sharded over the `world` ranks.
    Returns (loss, {name: full grad as numpy}, the parallelized model)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from ulysses_trainer import make_parallel_state, parallelize, shard_batch
    from ulysses_trainer.families.presets import preset_config
    from ulysses_trainer.model.load import build_model

    cfg = preset_config("tiny")
    if layers is not None:
        cfg.num_hidden_layers = layers
        cfg.layer_types = ["full_attention"] * layers
    model = parallelize(build_model(cfg, torch.float32, seed=5), make_parallel_state(world_size), pcfg)
    buckets = {"reduce_bucket_size": 20_000, "stage3_prefetch_bucket_size": 20_000} if small_buckets else {}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=zero3_config(world_size, **buckets))
    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(9))
    loss = engine(**shard_batch(ids, sp_size=world_size, sp_rank=rank).model_inputs())
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).numpy().copy() for n, p in engine.module.named_parameters()}
    return float(loss.detach()), grads, model

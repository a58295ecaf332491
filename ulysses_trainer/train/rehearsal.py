"""One rank of an N-GPU job, built and stepped by the trainer's own code on torch's fake process group
(parallel/fake.py): what a rehearsal measures. The command (`ulysses-trainer rehearse`, cli/rehearse.py)
adds the modelled communication."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def comm_job(prepared, gpus_per_node: int, levers):
    """The comm model's view of the run the trainer makes from `prepared`: the planner's own call (Job.of of the
    plan's settings, with the ZeRO-3 sizes as the plan read them) with `levers`, the lever record (Levers) the
    rehearsed model ran."""
    from ..plan.collectives import Job

    return dataclasses.replace(Job.of(prepared.resolved.run, prepared.cfg.gradient_accumulation_steps, gpus_per_node),
                               levers=levers)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _partition_stats(module, world_size: int) -> dict[str, int]:
    """This rank's ZeRO-3 parameter partitions against the full tensors."""
    full = local = excess = 0
    for p in module.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        mine = int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else n
        full, local = full + n, local + mine
        excess = max(excess, mine - -(-n // world_size))
    return {"param_numel": full, "param_partition_numel": local, "param_partition_max_excess": excess}


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What to rehearse of the job that `plan` describes."""

    rank: int = 0
    steps: int = 2  # the first is a warm-up; the rest are timed (with standin, 1 is enough: memory only)
    standin: bool = False
    # the offloaded layer inputs share HOST_STANDIN_SLOTS host slots (HostPool.held_slots), so a host smaller than
    # the job's rehearses it: the same copies, each recompute from another layer's input (real activations, so the
    # kernels see the job's kind of data and the time holds; the values do not); the host share is counted
    host_standin: bool = False
    layer_times: bool = False  # the last step's seconds layer by layer (train/layer_times.py)
    gpus_per_node: int = 8
    count_collectives: bool = False
    warmup_length: int | None = None  # tokens of the warm-up step's sequences; None: max_length
    collective_fill: str = "local"  # what collectives leave in their outputs (parallel/fake.py)
    # the CPU cores this rank runs on, as its share of the job's node (its CPU Adam's): None, all of this machine's
    cores: int | None = None
    # a context each train step runs in, given the step's index and the step count (a profiler around the last
    # one, say); inside the timed span, so what it costs shows in that step's time
    around_step: Callable[[int, int], contextlib.AbstractContextManager] | None = None


@contextlib.contextmanager
def cores_share(n: int | None):
    """Every thread of this process on the first `n` CPUs it may use, as one rank of a node shares the node's
    cores with the others (CPU Adam's OpenMP threads included); restored after. None: unchanged."""
    import os

    tasks = [int(t) for t in os.listdir("/proc/self/task")] if hasattr(os, "sched_setaffinity") else []
    allowed = sorted(os.sched_getaffinity(0)) if tasks else []
    if n is None or not tasks or n >= len(allowed):
        yield
        return
    before = {t: os.sched_getaffinity(t) for t in tasks}
    share = set(allowed[:n])
    for t in tasks:
        os.sched_setaffinity(t, share)
    try:
        yield
    finally:
        for t in [int(t) for t in os.listdir("/proc/self/task")]:
            with contextlib.suppress(OSError):  # a thread that ended in between
                os.sched_setaffinity(t, before.get(t, set(allowed)))


# slots a host stand-in holds: the one a layer's forward copy writes and the one the next backward's fetch reads
HOST_STANDIN_SLOTS = 2


def warmup_row(row: dict, length: int) -> dict:
    """`row` shrunk to `length` tokens with its layout kept: its documents' starts and its pads scaled by
    length / its length, each document at least one token. The warm-up step then takes the kernel paths the
    row's own step takes (one document or packed, pads or none): Triton compiles a varlen kernel apart from the
    dense one, and a compile left to the first timed step is counted in its time."""
    import torch

    ids, pos = row["input_ids"], row["position_ids"]
    full = int(ids.shape[-1])
    if length >= full:
        return row
    real = int(row.get("real_tokens", full))
    starts = sorted({0, *(pos[:real] == 0).nonzero().flatten().tolist()})
    # pads stay pads (at least one) and real tokens stay real (at least one)
    real_new = length if real >= full else min(length - 1, max(1, round(real * length / full)))
    kept: list[int] = []
    for s in starts:
        t = 0 if not kept else min(max(round(s * length / full), kept[-1] + 1), real_new - 1)
        if kept and t <= kept[-1]:
            break  # no token left for another document
        kept.append(t)
    at = torch.arange(length)
    doc_start = torch.tensor(kept)[torch.searchsorted(torch.tensor(kept), at, right=True) - 1]  # [length]
    out = {"input_ids": ids[:length], "position_ids": (at - doc_start).to(pos.dtype)}  # pads continue the last
    if "labels" in row:
        out["labels"] = row["labels"][:length]
    if real < full:
        out["real_tokens"] = real_new
    return out


def _warmup_batches(trainer, length: int | None, timed_step: int) -> list:
    """The timed step's shards cut to `length` tokens, each row's layout kept (warmup_row): kernels compile and
    autotune for the paths the timed step takes (one document or packed: Triton compiles and tunes varlen kernels
    apart, and step 0's rows need not be laid out as the timed step's), and DeepSpeed records its module order as at
    the full length, in less time."""
    from . import data_order as order

    if length is None:
        return trainer.micro_batches(0)
    rows = order.micro_batch_rows(trainer.prepared, trainer.state.dp_rank, timed_step)  # this rank's, per micro-batch
    return [trainer.shard_rows([warmup_row(r, length) for r in micro]) for micro in rows]


def _tune_for_the_timed_length(prepared, log) -> float | None:
    """After a warm-up shorter than the run: tune the kernels whose autotuning is keyed by the token count
    (attention/length_tuned.py) for the timed step's, outside the timed step; the seconds it took (None: none)."""
    from ..attention import length_tuned

    # a micro-batch's tokens after the all-to-all
    tokens = prepared.cfg.per_device_train_batch_size * prepared.padded_length
    t0 = time.perf_counter()
    names = length_tuned.tune_for_tokens(tokens)
    _sync(prepared.device)
    if not names:
        return None
    seconds = time.perf_counter() - t0
    log.info(f"rehearsal: tuned for the timed step's {tokens:,} tokens after the warm-up ({', '.join(names)}: its "
             f"autotuning is keyed by the token count), {seconds:.2f} s, not timed")
    return seconds


def _layer_timer(trainer, cuda: bool):
    from .layer_times import LayerTimes
    from .out_of_memory import decoder_layers

    return LayerTimes(decoder_layers(trainer.model), trainer.model.checkpointer, cuda)


def _host_offload(pool, host_standin: bool, peak_host_gb: float) -> dict[str, Any]:
    """The offload pool's host bytes held and counted, and the rank's host peak as the job would have it: the
    measured peak plus the slots counted but not held (the same as measured without the host stand-in)."""
    held = 0 if pool is None else pool.nbytes
    counted = 0 if pool is None else pool.counted_bytes
    return {"host_standin": host_standin, "host_offload_held_gb": held / 2**30,
            "host_offload_counted_gb": counted / 2**30, "peak_host_job_gb": peak_host_gb + (counted - held) / 2**30}


def run_rehearsal(prepared, opts: Rehearsal) -> dict[str, Any]:
    """Build the trainer as rank opts.rank of prepared.world_size on the fake group and run opts.steps train
    steps (and, with count_collectives, one more that records the collectives issued). Returns what was
    measured (memory, step times, partitions, collectives counted); nothing of the comm model."""
    import torch

    from ..parallel.fake import CollectiveLog, fake_process_group
    from .adam_states import materialize_adam_states
    from .metrics import peak_gpu_mem_gb, peak_host_mem_gb
    from .trainer import Trainer

    cuda = prepared.device == "cuda"
    with fake_process_group(opts.rank, prepared.world_size, opts.gpus_per_node, prepared.device,
                            opts.collective_fill):
        if opts.host_standin:  # the pool is made with the model and pinned with the engine: say it now
            prepared = dataclasses.replace(prepared, host_held_slots=HOST_STANDIN_SLOTS)
        # no verify_sp: the fake group's collectives move no data, so the parallelized model cannot equal the stock one
        prepared = dataclasses.replace(prepared, cfg=dataclasses.replace(prepared.cfg, verify_sp=False))
        trainer = Trainer(prepared)
        engine = trainer.engine
        pool = None if trainer.model.checkpointer is None else trainer.model.checkpointer.pool
        adam_bytes = materialize_adam_states(engine)  # held from step 1 on, as in every real step after the first
        times, losses, skipped = [], [], []
        tuned_s = None
        for step in range(opts.steps):
            warmup = step == 0 and opts.steps > 1
            _sync(prepared.device)
            t0 = time.perf_counter()
            before = engine.skipped_steps
            batches = (_warmup_batches(trainer, opts.warmup_length, opts.steps - 1) if warmup
                       else trainer.micro_batches(step))
            timer = _layer_timer(trainer, cuda) if opts.layer_times and step == opts.steps - 1 else None
            with opts.around_step(step, opts.steps) if opts.around_step else contextlib.nullcontext():
                with cores_share(opts.cores), timer or contextlib.nullcontext():
                    loss, grad_norm, _ = trainer.train_step(batches)
                _sync(prepared.device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            skipped.append(engine.skipped_steps > before)
            log.info(f"rehearsal step {step + 1}/{opts.steps}: {times[-1]:.3f} s"
                     f"{' (warm-up)' if warmup else ''}; loss {loss:.4g} (meaningless)"
                     f"{', update skipped (non-finite gradient norm)' if skipped[-1] else ''}")
            if warmup and opts.warmup_length is not None:
                tuned_s = _tune_for_the_timed_length(prepared, log)
        if any(skipped) and opts.collective_fill == "local" and not opts.standin:
            # real-looking values give finite gradients; a skipped update would leave the optimizer untimed (the
            # stand-in computes no attention, so its outputs, and the gradients after them, are anything)
            raise RuntimeError(f"rehearsal update skipped (non-finite gradient norm) in step(s) "
                               f"{[i + 1 for i, s in enumerate(skipped) if s]} although every collective left "
                               f"finite local values: the step itself produced a non-finite gradient")
        # bare fake group or stand-in: a skipped update ran no optimizer; time one over this rank's partitions
        opt_s = None
        if skipped[-1]:
            _sync(prepared.device)
            t0 = time.perf_counter()
            materialize_adam_states(engine)
            _sync(prepared.device)
            opt_s = time.perf_counter() - t0
        host_gb = peak_host_mem_gb()
        memory = {"peak_gpu_mem_gb": peak_gpu_mem_gb(),
                  "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
                  "peak_host_mem_gb": host_gb, **_host_offload(pool, opts.host_standin, host_gb)}
        counted = None
        if opts.count_collectives:  # after the memory and time readings it would distort
            with CollectiveLog() as issued:
                trainer.train_step(trainer.micro_batches(opts.steps))
            counted = issued.ops
        from ..plan.card_rates import rates_for

        ck = trainer.model.checkpointer
        stash = trainer.model.attention.stash
        out = {"collective_fill": opts.collective_fill, "step_s": times, "losses": losses,
               "optimizer_update_skipped": skipped,
               "optimizer_step_s_added": opt_s, "length_tuning_s": tuned_s, "adam_state_bytes": adam_bytes,
               "collectives_counted": counted,
               **memory, "offloaded_layers": len(ck.offload_layers) if ck is not None else 0,
               "kept_attention_layers": len(stash.layers) if stash is not None else 0,
               "attention_kernel": trainer.model.attention.kernel, "mlp_tiles": trainer.resolved.run.levers.tiled_mlp,
               "checkpoint_every": trainer.resolved.run.levers.checkpoint_every,
               "optimizer_offload": trainer.resolved.run.levers.optimizer_offload,
               "predicted_by_plan_step_s": trainer.resolved.predicted.step_s,
               "predicted_by_plan_peak_gpu_gb": trainer.resolved.predicted.peak_gpu_gb,
               "device": torch.cuda.get_device_name() if cuda else "cpu",
               # the plan's step and floor beside what was measured, with the card whose rates it read
               "plan_step_s": trainer.resolved.predicted.step_s,
               "plan_floor_s": dict(trainer.resolved.predicted.floor).get("floor s"),
               "plan_rates_card": rates_for(torch.cuda.get_device_name() if cuda else None)[0].card,
               "layer_times": None if timer is None else timer.result(),
               **_partition_stats(trainer.model, prepared.world_size)}
        trainer = engine = None  # noqa: F841 - drop the engine before the group goes
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out



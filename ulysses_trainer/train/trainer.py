"""The training loop on the DeepSpeed engine: sharded steps, exact accounting, logs, checkpoints."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace

import deepspeed
import torch
from tqdm import tqdm
from transformers import get_scheduler

from ..config import config_to_dict
from ..errors import ConfigError
from ..model.load import build_model, checkpoint_source
from ..model.parallelize import SequenceParallelCausalLM, apply, parallelize
from ..names import resolve_report_to
from ..parallel.comm import all_reduce
from ..parallel.loss import aux_for_backward, global_aux_loss, global_loss, loss_for_backward, step_token_count
from ..parallel.sharding import Shard, shard_batch
from ..parallel.state import ParallelState, make_parallel_state
from ..plan.resolve import resolve_plan
from ..plan.types import Plan
from . import checkpoint as ckpt
from .logging import MetricsFile, log_line
from .metrics import peak_gpu_mem_gb, peak_host_mem_gb, predicted_vs_measured, train_flops_per_sequence
from .position_loss import write_per_position_loss
from .prepare import RunPlan
from .reporters import Reporters


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm that the run cannot skip (nan_policy=stop), or a non-finite
    state about to be saved. The run ends with exit code 1 and the last checkpoint untouched."""


class StopSignal:
    """SIGTERM/SIGINT: stop at the next step boundary and save; a second signal stops at once.

    A second signal within RELAY_WINDOW_S of the first is the same request: on Ctrl-C (or a signal
    sent to the whole job) each rank gets the signal itself and, milliseconds later, the SIGTERM that
    the deepspeed launcher relays to its ranks.
    """

    RELAY_WINDOW_S = 2.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.requested = False
        self._clock, self._first = clock, 0.0

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = self._clock()
        if self.requested and now - self._first > self.RELAY_WINDOW_S:
            raise KeyboardInterrupt(f"second signal {signum}: stopping now")
        if not self.requested:
            self.requested, self._first = True, now


class Trainer:
    def __init__(self, plan: RunPlan):
        self.plan, self.cfg = plan, plan.cfg
        self.state: ParallelState = make_parallel_state(plan.sp_size)
        self.device = torch.device(plan.device, int(os.environ.get("LOCAL_RANK", 0))) \
            if plan.device == "cuda" else torch.device("cpu")
        if plan.device == "cuda":
            torch.cuda.set_device(self.device)
        self.stop = StopSignal()
        self.step = 0
        self.num_tokens = 0
        self.last_aux_loss: float | None = None  # a sparse model's load-balancing loss of the last step
        self.model = self._build_model()
        self.engine = self._build_engine()
        self.metrics = MetricsFile(self.cfg.output_dir)
        self.reporters = Reporters(resolve_report_to(self.cfg.report_to), self.cfg.output_dir,
                                   config_to_dict(self.cfg))

    # ------------------------------------------------------------------ setup
    def _build_model(self) -> SequenceParallelCausalLM:
        """The model with every mechanism installed; which layers offload or keep outputs is set by apply."""
        plan, cfg, first = self.plan, self.cfg, self.plan.resolved
        dtype = torch.bfloat16 if plan.bf16 else torch.float32
        with torch.device(self.device):
            model = build_model(plan.model_config, dtype, checkpoint_source(cfg.model_name_or_path), seed=cfg.seed)
        # host_memory_gb None: the pool detects, with a margin
        mechanisms = first.model_plan(cfg.host_memory_gb, plan.machine.ranks_per_host, levers=False)
        return parallelize(model, self.state, mechanisms)

    def _build_engine(self):
        plan, cfg = self.plan, self.cfg
        optimizer = plan.optimizer.build(self.model.parameters()) if plan.optimizer is not None else None
        def schedule(opt):  # DeepSpeed hands over its base optimizer; it steps and saves the schedule
            return get_scheduler(cfg.lr_scheduler_type, opt, num_warmup_steps=cfg.warmup_steps,
                                 num_training_steps=plan.total_steps)

        engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=plan.ds_config,
                                               lr_scheduler=schedule)
        self.resolved = self._resolve_after_engine()
        apply(self.model, self.resolved)
        self._report_plan()
        return engine

    def _resolve_after_engine(self) -> Plan:
        """The plan again (the same function as `ulysses-trainer plan`), now with the free GPU memory the engine
        left: it differs from the first one only when the GPU holds less than the memory model expected."""
        plan = self.plan
        if plan.device != "cuda":
            return plan.resolved
        torch.cuda.empty_cache()  # blocks torch cached during initialize are free for the run
        free, _ = torch.cuda.mem_get_info(self.device)
        machine = replace(plan.machine, gpu_free_after_engine_gb=free / 2**30)
        return resolve_plan(self.cfg, plan.shape, machine, plan.zero, bf16=plan.bf16, engine_plan=plan.resolved)

    def _report_plan(self) -> None:
        r = self.resolved
        if not self.state.is_main:
            return
        print(f"[ulysses_trainer] plan: {r.summary()}", flush=True)
        if r.decided:
            print(f"[ulysses_trainer] auto chose: {', '.join(r.decided)}", flush=True)
        for note in r.notes:
            print(f"[ulysses_trainer] plan note: {note}", flush=True)
        if not r.fits:
            print(f"[ulysses_trainer] warning: the plan does not fit: {r.shortage()} (the memory model errs on "
                  f"the high side; the run may still fit)", flush=True)
        if r.gradient_checkpointing:
            n, saved, off = r.num_layers, len(r.saved_layers), len(r.offload_layers)
            kept = f"1 in {r.checkpoint_every} layers keeps its input" if r.checkpoint_every > 1 else \
                "every layer keeps its input"
            print(f"[ulysses_trainer] checkpoints: {kept} ({saved}/{n}), {off} in pinned host memory "
                  f"({r.checkpoint_bytes_per_layer * off / 2**30:.2f} GiB)", flush=True)
            print(f"[ulysses_trainer] attention outputs kept for the recompute: {len(r.kept_attention_layers)}/{n} "
                  "layers", flush=True)

    def _report_predicted_vs_measured(self, step_times: list[float]) -> None:
        """End of run: the plan's step time and GPU peak next to what the run measured."""
        r = self.resolved
        if not self.state.is_main or r.predicted_step_s is None or not step_times:
            return
        print(predicted_vs_measured(r.predicted_step_s, r.predicted_peak_gpu_gb, step_times, peak_gpu_mem_gb()),
              flush=True)

    # ------------------------------------------------------------------ data
    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed + epoch)
        return torch.randperm(len(self.plan.train_data), generator=g)

    def _micro_batches(self, step: int) -> list[Shard]:
        """This rank's shards for optimizer step `step` (deterministic: resume lands on the same data)."""
        plan, cfg = self.plan, self.cfg
        micro = cfg.per_device_train_batch_size
        epoch, j = divmod(step, plan.steps_per_epoch)
        order = self._order(epoch)[j * plan.sequences_per_step:(j + 1) * plan.sequences_per_step]
        shards = []
        for m in range(cfg.gradient_accumulation_steps):
            start = (m * plan.dp_size + self.state.dp_rank) * micro
            shards.append(self._shard([plan.train_data[int(i)] for i in order[start:start + micro]]))
        return shards

    def _shard(self, rows: list[dict]) -> Shard:
        ids = torch.stack([r["input_ids"] for r in rows])  # [micro, L]
        pos = torch.stack([r["position_ids"] for r in rows])
        pad = getattr(self.plan.tokenizer, "pad_token_id", None) or 0
        return shard_batch(ids, position_ids=pos, sp_size=self.state.sp_size, sp_rank=self.state.sp_rank,
                           pad_to_multiple_of=self.cfg.pad_to_multiple_of, pad_token_id=pad).to(self.device)

    # ------------------------------------------------------------------ steps
    def train_step(self, shards: list[Shard]) -> tuple[float, float, int]:
        tokens = step_token_count(sum(s.num_valid for s in shards), self.state)
        local_sum, aux_sum, coef = 0.0, 0.0, self.model.aux_loss_coef
        for shard in shards:
            loss_sum = self.engine(**shard.model_inputs())
            local_sum += float(loss_sum.detach())
            objective = loss_for_backward(loss_sum, tokens, self.state)
            aux = self.model.aux_loss  # a sparse model's load-balancing loss (None for dense)
            if aux is not None:
                aux_sum += float(aux.detach())
                objective = objective + aux_for_backward(aux, coef, len(shards))
            self.engine.backward(objective, scale_wrt_gas=False)
            self.engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        loss = global_loss(local_sum, tokens, self.state)
        self.last_aux_loss = None
        if self.model.router_stats is not None:  # logged beside loss, which includes coef x aux (as TRL)
            self.last_aux_loss = global_aux_loss(aux_sum, len(shards), self.state)
            loss += coef * self.last_aux_loss
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return loss, grad_norm, tokens

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted eval loss, sharded exactly like training."""
        data, b = self.plan.eval_data, self.cfg.per_device_eval_batch_size
        self.engine.eval()
        total, count = 0.0, 0
        per_round = b * self.plan.dp_size
        rounds = range(0, len(data) - per_round + 1, per_round)  # every rank runs the same rounds
        for start in tqdm(rounds, desc="eval", unit="batch", leave=False, dynamic_ncols=True,
                          disable=not self.state.is_main):
            lo = start + self.state.dp_rank * b
            shard = self._shard([data[i] for i in range(lo, lo + b)])  # SequenceDataset takes int indices
            total += float(self.engine(**shard.model_inputs()))
            count += shard.num_valid
        self.engine.train()
        tokens = step_token_count(count, self.state)
        return global_loss(total, tokens, self.state)

    # ------------------------------------------------------------------ loop
    def _client_state(self) -> dict:
        return {"step": self.step, "num_tokens": self.num_tokens, "rng_cpu": torch.get_rng_state(),
                "config": config_to_dict(self.cfg)}

    def _save(self) -> None:
        if not self._params_finite():  # never write a non-finite state over a good checkpoint
            raise NonFiniteError(f"the parameters are not finite at step {self.step}; not saving (the last "
                                 f"checkpoint stays intact). Check the model weights or lower learning_rate")
        ckpt.save_checkpoint(self.engine, self.cfg.output_dir, self.step, self._client_state(),
                             self.state.is_main, model_config=self.plan.model_config)

    def _params_finite(self) -> bool:
        """Every rank's parameter partitions (ZeRO-3 keeps them in ds_tensor) are finite (collective)."""
        bad = any(not bool(torch.isfinite(getattr(p, "ds_tensor", p)).all())
                  for p in self.engine.module.parameters())
        return all_reduce(torch.tensor([float(bad)]), "max").item() == 0

    def resume(self, path: str) -> None:
        client = ckpt.load_checkpoint(self.engine, path)
        self.step, self.num_tokens = int(client["step"]), int(client["num_tokens"])
        torch.set_rng_state(client["rng_cpu"])
        if self.state.is_main:
            self.metrics.truncate_after(self.step)
            self.reporters.resume_at(self.step)
            print(f"[ulysses_trainer] resumed from {path} at step {self.step}", flush=True)

    def train(self) -> int:
        cfg, plan = self.cfg, self.plan
        if self.state.is_main:
            if plan.clear_output_dir:  # overwrite_output_dir: no old checkpoint, row or export survives
                ckpt.clear_previous_run(cfg.output_dir)
            os.makedirs(cfg.output_dir, exist_ok=True)
            with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
                json.dump(config_to_dict(cfg), f, indent=1)
        if plan.resume_path:  # found and checked by prepare()
            self.resume(plan.resume_path)
        self._open_reporters()
        self.stop.install()
        saving = cfg.save_strategy != "no"
        flops_per_step = train_flops_per_sequence(plan.model_config, cfg.max_length) * plan.sequences_per_step
        bar = tqdm(total=plan.total_steps, initial=self.step, disable=not self.state.is_main, unit="it",
                   dynamic_ncols=True)
        step_times: list[float] = []
        while self.step < plan.total_steps:
            t0 = time.perf_counter()
            skipped_before = self.engine.skipped_steps
            loss, grad_norm, tokens = self.train_step(self._micro_batches(self.step))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self._non_finite_step(loss, grad_norm, self.engine.skipped_steps > skipped_before, bar)
            self.step += 1
            self.num_tokens += plan.sequences_per_step * cfg.max_length  # real input tokens, all ranks
            dt = time.perf_counter() - t0
            step_times.append(dt)
            bar.update(1)
            if self.step % cfg.logging_steps == 0 or self.step == plan.total_steps:
                self._log(loss, grad_norm, dt, tokens, flops_per_step, bar)
            if cfg.eval_steps and self.step % cfg.eval_steps == 0:
                self._log_eval(self.evaluate(), bar)
            stop_now = self._stop_agreed()
            if saving and ((cfg.save_steps and self.step % cfg.save_steps == 0) or stop_now):
                self._save()
            if stop_now:
                if self.state.is_main:
                    bar.write(f"[ulysses_trainer] stop signal: saved step {self.step}, exiting" if saving else
                              f"[ulysses_trainer] stop signal: stopped at step {self.step}, not saved "
                              f"(save_strategy no)")
                bar.close()
                return 0
        bar.close()
        self.reporters.close()  # (a stopped run's rows are flushed as they are logged)
        self._report_predicted_vs_measured(step_times)
        if cfg.plot_per_position_loss:
            write_per_position_loss(self.engine, self.model, self._micro_batches(self.step - 1)[-1], self.state,
                                    cfg.loss_chunk_size, cfg.max_length,
                                    os.path.join(cfg.output_dir, "per_position_loss.png"),
                                    f"{cfg.model_name_or_path}: per-position loss after step {self.step}")
        if not saving:
            return 0
        if not (cfg.save_steps and self.step % cfg.save_steps == 0):
            self._save()
        ckpt.export_hf(self.engine, plan.model_config, cfg.output_dir, plan.tokenizer, self.state.is_main)
        return 0

    def _open_reporters(self) -> None:
        """Rank 0 starts the report_to reporters; if that fails (e.g. no wandb login) every rank stops
        here, before the first step, with rank 0's message."""
        error = None
        if self.state.is_main:
            try:
                self.reporters.open()
            except ConfigError as exc:
                error = exc
        if all_reduce(torch.tensor([float(error is not None)]), "max").item() > 0:
            raise error or ConfigError("report_to: rank 0 could not start its reporters (see its error)")

    def _non_finite_step(self, loss: float, grad_norm: float, update_discarded: bool, bar) -> None:
        """nan_policy for a step whose global loss or gradient norm is not finite (same on every rank).

        DeepSpeed's ZeRO optimizer discards an update whose gradient norm is not finite (it clears the
        reduced gradients and leaves parameters, optimizer moments and its step count alone; engine
        .skipped_steps counts it). `skip` relies on that and only checks it happened; the schedule then
        moves on with the step counter and the data position.
        """
        what = f"step {self.step + 1}: loss {loss}, grad_norm {grad_norm}"
        if self.cfg.nan_policy == "stop":
            raise NonFiniteError(f"{what}; stopping without saving (nan_policy=stop; the last checkpoint is "
                                 f"intact). Lower learning_rate, check the data, or set nan_policy skip")
        if not update_discarded:
            raise NonFiniteError(f"{what}, but DeepSpeed applied the update (it discards only updates whose "
                                 f"gradient norm is not finite), so it cannot be skipped; stopping without "
                                 f"saving")
        self.engine.lr_scheduler.step()
        if self.state.is_main:
            bar.write(f"[ulysses_trainer] warning: {what}; update skipped (nan_policy=skip): parameters and "
                      f"optimizer state kept as they were")

    def _stop_agreed(self) -> bool:
        """Every rank must agree to stop at the same step (the save is collective)."""
        return bool(all_reduce(torch.tensor([float(self.stop.requested)]), "max").item() > 0)

    def _log(self, loss, grad_norm, dt, tokens, flops_per_step, bar) -> None:
        lr = self.engine.lr_scheduler.get_last_lr()[0]
        epoch = self.step / (self.plan.epoch_steps or self.plan.steps_per_epoch)  # fraction of one data pass
        row = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "learning_rate": lr,
               "num_tokens": self.num_tokens, "epoch": epoch,
               "tokens_per_s": tokens / dt, "tflops_per_gpu": flops_per_step / dt / self.state.world_size / 1e12,
               "peak_gpu_mem_gb": peak_gpu_mem_gb(), "peak_host_mem_gb": peak_host_mem_gb()}
        if self.last_aux_loss is not None:
            row["aux_loss"] = self.last_aux_loss
        if self.state.is_main:
            bar.write(log_line(row))
            self.metrics.append(row)
            self.reporters.log(row)

    def _log_eval(self, eval_loss: float, bar) -> None:
        if self.state.is_main:
            bar.write(str({"eval_loss": round(eval_loss, 4), "step": self.step}))
            row = {"step": self.step, "eval_loss": eval_loss}
            self.metrics.append(row)
            self.reporters.log(row)

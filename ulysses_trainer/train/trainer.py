"""The training loop on the DeepSpeed engine: sharded steps, exact accounting, logs, checkpoints."""

from __future__ import annotations

import logging
import math
import os
import time

import torch
from tqdm import tqdm

from ..config import config_to_dict
from ..parallel.comm import all_reduce
from ..parallel.loss import aux_for_backward, global_aux_loss, global_loss, loss_for_backward, step_token_count
from ..parallel.sharding import Shard
from ..parallel.state import ParallelState, make_parallel_state
from ..plan.types import Plan
from . import checkpoint as ckpt
from . import data_order as order
from . import evaluation, export
from . import run_report as report
from .build import build_engine, build_model
from .evaluation import EvalResult
from .metrics import device_peak_tflops, peak_gpu_mem_gb, peak_host_mem_gb, row_model_flops, throughput
from .non_finite import NonFiniteError, non_finite_step
from .out_of_memory import OutOfGpuMemory, Where, decoder_layers, oom_message, pinned_levers
from .position_loss import write_per_position_loss
from .prepare import PreparedRun
from .resume_check import run_record
from .run_log import LogInterval, RunLog
from .schedule import set_peak_learning_rate
from .stop_signal import StopSignal
from .strategies import ends_epoch, eval_due, log_due, save_due
from .verify_sp import verify_due
from .verify_sp_run import verify_run

log = logging.getLogger(__name__)



class Trainer:
    def __init__(self, prepared: PreparedRun):
        self.prepared, self.cfg = prepared, prepared.cfg
        self.state: ParallelState = make_parallel_state(prepared.layout)
        self.device = torch.device(prepared.device, int(os.environ.get("LOCAL_RANK", 0))) \
            if prepared.device == "cuda" else torch.device("cpu")
        if prepared.device == "cuda":
            torch.cuda.set_device(self.device)
        self.stop = StopSignal(on_request=self._say_stopping)
        self.step = 0
        self.num_tokens = 0  # real (non-pad) input tokens so far, all ranks (TRL's num_tokens)
        self.num_loss_tokens = 0  # trained target tokens so far, all ranks
        self.last_aux_loss: float | None = None  # a sparse model's load-balancing loss of the last step
        self.interval = LogInterval()  # the steps since the last logged row (their loss is logged as one mean)
        self._bar = None
        self.where = Where()  # the step, phase and layer running: named by an out-of-memory error
        if self.state.is_main:  # before memory climbs: the plan and the data
            report.report_run_name(self.cfg.run_name)
            report.report_plan(prepared.resolved, before_build=True, digest=prepared.plan_digest)
            report.report_data(prepared)
        try:  # the build step (build.py); from the engine on, self.prepared holds the plan the run runs
            self.where.enter("building the model")
            self.model, self.peft_model = build_model(prepared, self.state, self.device)
            self.where.enter("building the engine")
            self.engine, self.prepared = build_engine(prepared, self.model, self.device)
        except torch.OutOfMemoryError:  # as in a step: one line, no collective (the peers may be in the build's)
            raise self._out_of_memory() from None
        if self.state.is_main:  # the after-engine phase, named: what the measured free memory changed
            after = self.prepared
            report.report_replan(prepared.resolved, after.resolved, after.machine.gpu_free_after_engine_gb,
                                 after.plan_digest)
        self.where.watch(decoder_layers(self.model), self.model.checkpointer)
        self.run_log = RunLog(self.prepared, self.state.is_main)
        self._saved_step: int | None = None  # the step the last checkpoint holds
        if verify_due(self.cfg.verify_sp, resuming=bool(prepared.resume_path)):  # before anything of the run is written
            self.where.enter("verify_sp: a copy of the model and its gradients; verify_sp false skips it")
            try:
                verify_run(self.prepared, self.model.causal_lm, self.state, self.device)
            except torch.OutOfMemoryError:  # the one OOM line, naming the check
                raise self._out_of_memory() from None

    @property
    def resolved(self) -> Plan:
        """The plan the run runs (the one after the engine once it is built)."""
        return self.prepared.resolved

    def _say_stopping(self) -> None:
        """The first stop request, from the signal handler: one line from rank 0."""
        if self.state.is_main:
            report.say_stopping(self.cfg.save_strategy)

    # ------------------------------------------------------------------ data
    # public with train_step, engine, model, prepared, resolved and state: what a rehearsal (rehearsal.py) and the
    # benchmarks drive a step with
    def micro_batches(self, step: int) -> list[Shard]:
        """This rank's shards for optimizer step `step` (deterministic: resume lands on the same data)."""
        return [self.shard_rows(rows) for rows in order.micro_batch_rows(self.prepared, self.state.dp_rank, step)]

    def shard_rows(self, rows: list[dict]) -> Shard:
        """This rank's shard of one micro-batch of rows (any rows: a rehearsal's warm-up cuts its own)."""
        return order.shard_rows(rows, self.prepared, self.state, self.device)

    # ------------------------------------------------------------------ steps
    def train_step(self, shards: list[Shard]) -> tuple[float, float, int]:
        tokens = step_token_count(sum(s.num_valid for s in shards), self.state)
        local_sum, aux_sum, coef = 0.0, 0.0, self.model.aux_loss_coef
        where = self.where
        for shard in shards:
            where.enter("forward")
            loss_sum = self.engine(**shard.model_inputs())
            local_sum += float(loss_sum.detach())
            objective = loss_for_backward(loss_sum, tokens, self.state)
            aux = self.model.aux_loss  # a sparse model's load-balancing loss (None for dense)
            if aux is not None:
                aux_sum += float(aux.detach())
                objective = objective + aux_for_backward(aux, coef, len(shards))
            where.enter("backward")
            self.engine.backward(objective, scale_wrt_gas=False)
            where.enter("optimizer step")
            self.engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        loss = global_loss(local_sum, tokens, self.state)
        self.last_aux_loss = None
        if self.model.router_stats is not None:  # logged beside loss, which includes coef x aux (as TRL)
            self.last_aux_loss = global_aux_loss(aux_sum, len(shards), self.state)
            loss += coef * self.last_aux_loss
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return loss, grad_norm, tokens

    def evaluate(self) -> EvalResult:
        """Token-weighted eval loss, its loss by position and the recall probe's score (evaluation.py), sharded
        exactly like training. Collective."""
        self.engine.eval()
        try:
            return evaluation.evaluate(self.model, self.prepared.eval_data, self.cfg.per_device_eval_batch_size,
                                       self.cfg.max_length, self.state, self.shard_rows, self.prepared.recall_probe)
        finally:
            self.engine.train()

    # ------------------------------------------------------------------ loop
    def _client_state(self) -> dict:
        return {"step": self.step, "num_tokens": self.num_tokens, "num_loss_tokens": self.num_loss_tokens,
                "rng_cpu": torch.get_rng_state(), "log_interval": self.interval.state(),
                "config": config_to_dict(self.cfg)}

    def _save(self) -> None:
        self.where.enter("checkpoint save")
        if not self._params_finite():  # never write a non-finite state over a good checkpoint
            raise NonFiniteError(f"the parameters are not finite at step {self.step}; not saving (the last "
                                 f"checkpoint stays intact). Check the model weights or lower learning_rate")
        prepared = self.prepared
        self._saved_step = self.step
        if self.cfg.save_only_model:  # the weights as an HF export, no optimizer state (not resumable)
            self._export(f"checkpoint-{self.step}")
            ckpt.mark_weights_only(self.cfg.output_dir, self.step, self.state.is_main, self.cfg.save_total_limit)
            return
        ckpt.save_checkpoint(self.engine, self.cfg.output_dir, self.step, self._client_state(),
                             self.state.is_main, model_config=prepared.model_config,
                             run_config=run_record(config_to_dict(self.cfg), prepared.world_size, prepared.sp_size,
                                                   prepared.dp_size),
                             total_limit=self.cfg.save_total_limit)

    def _params_finite(self) -> bool:
        """Every rank's parameter partitions (ZeRO-3 keeps them in ds_tensor) are finite (collective)."""
        bad = any(not bool(torch.isfinite(getattr(p, "ds_tensor", p)).all())
                  for p in self.engine.module.parameters())
        return all_reduce(torch.tensor([float(bad)]), "max").item() == 0

    def resume(self, path: str) -> None:
        client = ckpt.load_checkpoint(self.engine, path)
        self.step, self.num_tokens = int(client["step"]), int(client["num_tokens"])
        self._saved_step = self.step  # the checkpoint resumed from holds this step
        self.num_loss_tokens = int(client.get("num_loss_tokens", 0))  # checkpoints from before it was kept: 0
        torch.set_rng_state(client["rng_cpu"])
        # a checkpoint between two logged rows: the next row's mean still covers the steps before it
        self.interval = LogInterval.from_state(client.get("log_interval"))
        changes = self.prepared.config_changes
        if "learning_rate" in changes:  # the checkpoint's schedule carries its own peak: give it the new one
            set_peak_learning_rate(self.engine.lr_scheduler, self.cfg.learning_rate)
        self.run_log.resume_at(self.step, path, changes)

    def train(self) -> int:
        try:
            return self._train()
        except torch.OutOfMemoryError:  # no collective from here: the peers may be inside the step
            raise self._out_of_memory() from None
        finally:  # the bar's line ends before any message (an error line must start its own line)
            if self._bar is not None:
                self._bar.close()

    def _train(self) -> int:
        cfg, prepared = self.cfg, self.prepared
        if self.state.is_main:
            # overwrite_output_dir, or a fresh start where a run stopped before its first step (config.json, empty
            # TensorBoard events): nothing the trainer wrote before survives, and nothing else is touched
            if prepared.clear_output_dir or not prepared.resume_path:
                removed = ckpt.clear_previous_run(cfg.output_dir)
                if removed:  # said: what overwrite_output_dir deleted
                    log.info(ckpt.describe_removed(cfg.output_dir, removed, prepared.clear_output_dir))
            os.makedirs(cfg.output_dir, exist_ok=True)
        if prepared.resume_path:  # found and checked by prepare()
            self.where.enter("loading the checkpoint")
            self.resume(prepared.resume_path)
            if self.step >= prepared.total_steps and self.state.is_main:  # e.g. the export failed on a full disk
                log.info(f"training already finished at step {self.step} "
                         f"({os.path.basename(os.path.normpath(prepared.resume_path))}): writing the final export only")
        self.run_log.write_run_config(self.prepared, self.step)
        self.run_log.open_reporters()
        self.stop.install()
        saving = cfg.save_strategy != "no"
        row_flops = row_model_flops(prepared.shape, prepared.train_data)  # each row's real documents (metrics.py)
        peak = device_peak_tflops(self.device)
        if self.state.is_main:
            log.info("mfu: model FLOPs of the real documents / " + (
                f"{peak[0]:g} TFLOP/s per GPU, the dense bf16 peak of an {peak[1]}" if peak else
                "no known peak for this device (mfu null)"))
        bar = self._bar = tqdm(total=prepared.total_steps, initial=self.step, disable=not self.state.is_main,
                               unit="it", dynamic_ncols=True)
        step_times: list[float] = []
        while self.step < prepared.total_steps:
            t0 = time.perf_counter()
            skipped_before = self.engine.skipped_steps
            self.where.step = self.step + 1
            loss, grad_norm, tokens = self.train_step(self.micro_batches(self.step))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self._non_finite_step(loss, grad_norm, self.engine.skipped_steps > skipped_before, bar)
            real_tokens = order.step_real_tokens(prepared, self.step)
            flops = float(row_flops[order.step_rows(prepared, self.step).numpy()].sum())
            self.step += 1
            self.num_tokens += real_tokens
            self.num_loss_tokens += tokens
            self.interval.add(loss, tokens, self.last_aux_loss)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            bar.update(1)
            epoch_end = ends_epoch(self.step, prepared.sequences_per_step, len(prepared.train_data))
            if log_due(cfg, self.step, prepared.total_steps, epoch_end):
                self._log(loss, grad_norm, dt, real_tokens, throughput(flops, dt, self.state.world_size, peak), bar)
            if eval_due(cfg, self.step, epoch_end):
                self.where.enter("evaluation")
                self._log_eval(self.evaluate(), bar)
            stop_now = self._stop_agreed()
            if saving and (save_due(cfg, self.step, epoch_end) or stop_now):
                self._save()
            if stop_now:
                if self.state.is_main:
                    bar.write(f"[ulysses_trainer] stop signal: saved step {self.step}, exiting" if saving else
                              f"[ulysses_trainer] stop signal: stopped at step {self.step}, not saved "
                              f"(save_strategy no)")
                bar.close()
                return 0
        bar.close()
        self.run_log.close()
        if self.state.is_main:
            report.report_predicted_vs_measured(self.resolved, step_times)
        if cfg.plot_per_position_loss:
            self.where.enter("per-position loss")
            write_per_position_loss(self.engine, self.model, self.micro_batches(self.step - 1)[-1], self.state,
                                    cfg.loss_chunk_size, cfg.max_length,
                                    os.path.join(cfg.output_dir, "per_position_loss.png"),
                                    f"{cfg.model_name_or_path}: per-position loss after step {self.step}")
        if not saving:
            return 0
        if self._saved_step != self.step:  # the last step's checkpoint, unless a save step (or the resume) holds it
            self._save()
        self.where.enter("final export")
        self._export("final")
        return 0

    def _export(self, name: str) -> None:
        export.export_model(self.engine, self.prepared, self.peft_model, self.state.is_main, name)

    def _out_of_memory(self) -> OutOfGpuMemory:
        """The one line for an OOM where self.where says (the plan command is added by the command line)."""
        p = self.resolved.predicted
        message = oom_message(self.where, self.device, p.peak_gpu_gb, p.gpu_required_gb)
        return OutOfGpuMemory(message, pinned_levers(self.cfg))

    def _non_finite_step(self, loss: float, grad_norm: float, update_discarded: bool, bar) -> None:
        """nan_policy for a step whose global loss or gradient norm is not finite (same on every rank)."""
        warning = non_finite_step(self.step + 1, loss, grad_norm, self.cfg.nan_policy, update_discarded)
        self.engine.lr_scheduler.step()
        if self.state.is_main:
            bar.write(warning)

    def _stop_agreed(self) -> bool:
        """Every rank must agree to stop at the same step (the save is collective). The same all-reduce
        carries a failed metrics write on rank 0, so that every rank stops with its cause."""
        failed = self.run_log.failure_code()
        stop, code = all_reduce(torch.tensor([float(self.stop.requested), float(failed)]), "max").tolist()
        if code:
            self.run_log.raise_failure(int(code))
        return stop > 0

    def _log(self, loss, grad_norm, dt, tokens, rates, bar) -> None:
        """One row: loss (and aux_loss) the mean of the step losses since the last row (HF's), token_weighted_loss
        their token-weighted mean where there are several; the rest of the last step."""
        loss, token_weighted, aux_loss = self.interval.take(loss)
        lr = self.engine.lr_scheduler.get_last_lr()[0]
        epoch = order.epoch_of(self.prepared, self.step)  # passes over the data
        row = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "learning_rate": lr,
               "num_tokens": self.num_tokens, "num_loss_tokens": self.num_loss_tokens, "epoch": epoch,
               "tokens_per_s": tokens / dt, **rates,  # tflops_per_gpu, mfu: the real documents' FLOPs
               "peak_gpu_mem_gb": peak_gpu_mem_gb(), "peak_host_mem_gb": peak_host_mem_gb()}
        if token_weighted is not None:  # a row over several steps: the loss of all their tokens together
            row["token_weighted_loss"] = token_weighted
        if aux_loss is not None:
            row["aux_loss"] = aux_loss
        self.run_log.step_row(row, bar)

    def _log_eval(self, result: EvalResult, bar) -> None:
        self.run_log.eval_row(self.step, result.fields(), bar)

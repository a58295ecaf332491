"""Everything checked before any heavy work: config, ZeRO JSON, model shape, tokenizer, data.

Every rank runs this identically, after the process group exists (a launched job): the machine probes are
reduced over the ranks and the plan's digest compared, so every rank runs one plan. Any ConfigError ends
the run with exit code 2 and nothing written to output_dir.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import TrainConfig, config_to_dict, validate_config
from ..data.accounting import check_something_trained
from ..data.order import steps_of, trained_rows
from ..data.recall_probe import RecallProbe, build_recall_probe
from ..data.tokenizer import apply_tokenizer_options, check_tokenizer_fits, family_vocabulary, load_tokenizer
from ..ds_config import OptimizerSpec, load_ds_config, zero_config_for
from ..ds_config_record import filled_line
from ..errors import ConfigError
from ..families import family
from ..model.load import check_local_weights, checkpoint_source, model_config_for
from ..model.lora import check_lora
from ..plan.attention_share import AttentionShare, timed_from_data
from ..plan.counts import num_params
from ..plan.inputs import ModelShape
from ..plan.resolve import LeverSearch, plan_from, resolve_plan, search_plan
from ..plan.types import Machine, Plan, ZeroSettings, read_zero
from ..probe import this_machine
from ..vocabulary.layout import Layout
from ..vocabulary.names import resolve_report_to
from .agreement import agree_machine, check_same_plan
from .checkpoint import CHECKPOINT, check_checkpoint_model, check_output_dir, find_checkpoint, trainer_checkpoints
from .data_cache import prepared_sequences
from .evaluation import covered_rows, position_edges
from .out_of_memory import check_gpu_fits, check_host_fits
from .output_guard import DiskNeed, check_writable, disk_line, peak_checkpoints, run_need
from .resume_check import check_resume_config, run_record
from .strategies import ends_epoch, save_due


@dataclass
class PreparedRun:
    """The prepared run: what prepare decided and loaded, its Plan as `resolved`. The plan's values (layout, kernel,
    bf16, padded length) are read from `resolved`, never copied: after the engine is built the trainer replaces it
    with the plan it runs."""

    cfg: TrainConfig
    world_size: int
    device: str
    # every lever decided (plan/resolve.py) from the total GPU memory; the trainer searches the levers again with
    # the free memory it measures once the engine is built (plan/resolve.replan_after_engine: lever fields only)
    resolved: Plan
    layout: Layout  # decided once by validate_config: sp x dp
    machine: Machine
    shape: ModelShape
    model_config: Any
    tokenizer: Any
    train_data: list
    eval_data: list | None
    ds_config: dict
    optimizer: OptimizerSpec | None
    steps_per_epoch: int  # whole steps in one pass over the rows (the order itself runs on: data_order.py)
    total_steps: int
    sequences_per_step: int
    resume_path: str | None = None  # the checkpoint-<step> directory to resume from
    epoch_steps: int | None = None  # optimizer steps in one pass over the data (None: steps_per_epoch)
    clear_output_dir: bool = False  # overwrite_output_dir over a previous run: rank 0 clears it first
    config_changes: dict = field(default_factory=dict)  # resume: {name: (checkpoint's, this run's)} let through
    disk: str = ""  # the `disk:` line: what the run holds in output_dir at its peak, and the free space
    plan_digest: str = ""  # the digest of `resolved`, the same on every rank (train/agreement.py)
    source: str | None = None  # the weights' directory or Hub id (model/load.checkpoint_source); None: a preset
    reporters: list[str] = field(default_factory=list)  # report_to, decoded once (vocabulary/names.resolve_report_to)
    recall_probe: RecallProbe | None = None  # eval_recall_probe: the probe rows (data/recall_probe.py)
    host_held_slots: int | None = None  # a memory rehearsal's host stand-in (train/rehearsal.py); None in training
    # packed rows: the attention of the rows the run trains (data_share), the plan's after the engine too
    attention: AttentionShare | None = None
    zero_filled: str = ""  # the startup line of what the trainer filled into the ZeRO JSON (ds_config.filled_line)

    @property
    def sp_size(self) -> int:
        return self.resolved.run.sp_size

    @property
    def dp_size(self) -> int:
        return self.resolved.run.dp_size

    @property
    def bf16(self) -> bool:
        return self.resolved.run.bf16

    @property
    def attn_implementation(self) -> str:
        return self.resolved.run.attn_implementation

    @property
    def padded_length(self) -> int:
        return self.resolved.run.padded_length


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare(cfg: TrainConfig, world_size: int, training: bool = True, host_cores: int | None = None) -> PreparedRun:
    """Every check and decision before heavy work, in one descent: the plan's inputs, the one plan search and the
    refusals it decides before the data, the data, the plan timed from the data, the output_dir and the filled
    DeepSpeed JSON. training=False (the rehearsal): output_dir is neither checked nor written, and on CPU host
    memory is checked for the one rank it runs, and `host_cores` (the job's node's CPU cores) replaces this
    machine's in the CPU Adam's time."""
    ins = _inputs(cfg, world_size)
    if host_cores is not None:
        ins = dataclasses.replace(ins, machine=dataclasses.replace(ins.machine, host_cores=host_cores))
    search = search_plan(cfg, ins.shape, ins.machine, ins.zero, layout=ins.layout)  # the run's one search
    resolved, digest = _refuse_before_data(cfg, ins, search, world_size, training)
    data = _read_data(cfg, ins, resolved.run.dp_size)
    if data.share is not None:  # packed rows: the search's settings timed from the data's documents (no new search)
        resolved = plan_from(search, attention=data.share)
        digest = check_same_plan(resolved, "after the data is read")  # every rank reads the same rows
    return _run_plan(cfg, world_size, training, ins, data, resolved, digest)


@dataclass
class _Inputs:
    """What the config names, loaded and checked: the plan's inputs (layout, model shape, agreed machine, ZeRO
    settings) and what the run reads later (the ZeRO JSON, the checkpoint to resume, the report_to names)."""

    layout: Layout
    reporters: list[str]
    device: str
    ds_raw: dict
    resume_path: str | None
    model_config: Any
    shape: ModelShape
    machine: Machine
    zero: ZeroSettings

    def zero_config(self, cfg: TrainConfig, plan: Plan, world_size: int,
                    total_steps: int | None) -> tuple[dict, OptimizerSpec | None]:
        """The ZeRO JSON filled for `plan` (ds_config.zero_config_for): `plan` refuses the same JSONs."""
        return zero_config_for(self.ds_raw, cfg, plan, world_size, device_is_cuda=self.device == "cuda",
                               hidden_size=self.model_config.hidden_size, source=str(cfg.deepspeed),
                               total_steps=total_steps)


def _inputs(cfg: TrainConfig, world_size: int) -> _Inputs:
    """The layout, report_to, LoRA, the ZeRO JSON, the checkpoint to resume, the model config and its weights,
    the model's shape and the machine every rank plans from."""
    layout = validate_config(cfg, world_size)  # the layout, decided once
    reporters = resolve_report_to(cfg.report_to)  # known names, each installed: what the trainer opens
    if cfg.use_peft:
        check_lora(cfg)  # peft installed, a valid LoraConfig
    device = _device()
    ds_raw = load_ds_config(cfg.deepspeed)
    resume_path = find_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir)
    model_config = model_config_for(cfg)
    if resume_path:
        check_checkpoint_model(resume_path, model_config)
    check_local_weights(cfg.model_name_or_path, model_config)
    shape = ModelShape.from_config(model_config)  # built once: every plan reads it
    # every rank plans from the same machine: its probes reduced over the ranks (a no-op without a group)
    machine = agree_machine(this_machine(world_size, cfg.host_memory_gb))
    return _Inputs(layout, reporters, device, ds_raw, resume_path, model_config, shape, machine,
                   read_zero(ds_raw, str(cfg.deepspeed)))


def _refuse_before_data(cfg: TrainConfig, ins: _Inputs, search: LeverSearch, world_size: int,
                        training: bool) -> tuple[Plan, str]:
    """(the plan without the data's share, its digest or "" with packing), refused before a long tokenization
    where it cannot run: the ZeRO JSON against it, the host and the GPU memory. Memory does not depend on the
    share (it moves the step time only), so these refusals are those of the plan timed from the data. Without
    packing this is the run's plan, its digest checked on every rank."""
    plan = plan_from(search)  # every lever checked and decided
    ins.zero_config(cfg, plan, world_size, cfg.max_steps)  # the JSON against the config, before the data (as `plan`)
    digest = "" if timed_from_data(cfg) else check_same_plan(plan, "before the model is built")
    check_host_fits(plan, ins.machine, ins.device, ranks_here=None if training else 1)  # a rehearsal: one rank
    if training:  # a rehearsal measures what fits: it is not refused
        # the levers the config pinned, auto: another config, so its own search (only when refusing)
        check_gpu_fits(plan, cfg, lambda c: resolve_plan(c, ins.shape, ins.machine, ins.zero, layout=ins.layout))
    return plan, digest


@dataclass
class _Data:
    """The tokenizer, the train and eval rows, the steps they make and, with packing, their attention share."""

    source: str | None
    tokenizer: Any
    train: Any
    eval_data: Any
    per_step: int
    total: int
    recall_probe: RecallProbe | None
    share: AttentionShare | None


def _read_data(cfg: TrainConfig, ins: _Inputs, dp_size: int) -> _Data:
    """The tokenizer and the data, checked: enough rows for one step and one eval round, something trained."""
    model_config = ins.model_config
    source = checkpoint_source(cfg.model_name_or_path)
    vocabulary = family_vocabulary(family(model_config.model_type), model_config)  # what a preset is tokenized with
    tokenizer = apply_tokenizer_options(load_tokenizer(source, vocabulary), cfg.chat_template_path, cfg.eos_token)
    check_tokenizer_fits(tokenizer, model_config)
    per_step = dp_size * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    # the whole dataset: the order is a permutation of all of it, whatever max_steps (TRL's sampler)
    train = prepared_sequences(cfg, tokenizer, split="train", dp_size=dp_size)
    check_something_trained(train.counts, "dataset", cfg.assistant_only_loss, cfg.completion_only_loss)
    if len(train) < per_step:
        raise ConfigError(f"the data makes {len(train)} sequences of {cfg.max_length} tokens but one optimizer "
                          f"step needs {per_step} (dp {dp_size} x batch {cfg.per_device_train_batch_size} x "
                          f"accumulation {cfg.gradient_accumulation_steps}); add data or lower those")
    eval_data = None
    if cfg.evaluates:
        # max_eval_samples bounds both the tokenizing and every evaluation
        eval_data = prepared_sequences(cfg, tokenizer, split="eval", dp_size=dp_size,
                                       num_sequences=cfg.max_eval_samples)
        check_something_trained(eval_data.counts, "eval dataset", cfg.assistant_only_loss, cfg.completion_only_loss)
        per_round = dp_size * cfg.per_device_eval_batch_size
        if len(eval_data) < per_round:  # else evaluate() runs no round and would log eval_loss 0
            raise ConfigError(f"the eval data makes {len(eval_data)} sequences of {cfg.max_length} tokens "
                              f"but one eval round needs {per_round} (dp {dp_size} x per_device_eval_batch_size "
                              f"{cfg.per_device_eval_batch_size}); add eval data, raise max_eval_samples "
                              f"or lower those")
    # num_train_epochs: every row trained that many times (a step may straddle two epochs: data_order.py)
    total = steps_of(cfg.max_steps, cfg.num_train_epochs, len(train), per_step)
    recall_probe = None
    if cfg.eval_recall_probe and eval_data is not None:  # before heavy work: a row too short for it is exit 2
        recall_probe = build_recall_probe(eval_data, position_edges(cfg.max_length), cfg.seed, tokenizer.encode,
                                          covered_rows(len(eval_data), cfg.per_device_eval_batch_size, dp_size))
    # attention timed from the packed rows' documents (without: one document a row)
    share = data_share(train, cfg.seed, per_step, total) if timed_from_data(cfg) else None
    return _Data(source, tokenizer, train, eval_data, per_step, total, recall_probe, share)


def _run_plan(cfg: TrainConfig, world_size: int, training: bool, ins: _Inputs, data: _Data, resolved: Plan,
              digest: str) -> PreparedRun:
    """The resume's config check, output_dir and its disk need, and the DeepSpeed JSON filled for the plan."""
    sp_size, dp_size = resolved.run.sp_size, resolved.run.dp_size
    resume_path, train, total, per_step = ins.resume_path, data.train, data.total, data.per_step
    config_changes: dict = {}
    if resume_path:
        config_changes = check_resume_config(resume_path, run_record(config_to_dict(cfg), world_size, sp_size, dp_size),
                                             cfg.allow_config_change)
    clear_output_dir = False
    if training:  # after the data: a missing data file is reported as such, not as an output_dir problem
        clear_output_dir = check_output_dir(cfg.output_dir, resume_path, cfg.overwrite_output_dir)
    steps_per_epoch = len(train) // per_step
    disk = ""
    if training:
        need = disk_need(cfg, resume_path, clear_output_dir, total, num_params(ins.shape), world_size,
                         resolved.run.bf16, per_step, len(train))
        problem = check_writable(cfg.output_dir, need)
        if problem:
            raise ConfigError(problem)
        disk = disk_line(cfg.output_dir, need)
    # torch's fused AdamW on the GPU (no JIT build); DeepSpeed's CPU Adam only where states live on the host
    ds, opt = ins.zero_config(cfg, resolved, world_size, total)
    zero_filled = filled_line(ins.ds_raw, ds, str(cfg.deepspeed))
    return PreparedRun(cfg=cfg, world_size=world_size, device=ins.device, resolved=resolved, layout=ins.layout,
                   machine=ins.machine, shape=ins.shape, model_config=ins.model_config, tokenizer=data.tokenizer,
                   train_data=train, eval_data=data.eval_data, ds_config=ds, optimizer=opt,
                   steps_per_epoch=steps_per_epoch, epoch_steps=steps_per_epoch, total_steps=total,
                   sequences_per_step=per_step, resume_path=resume_path, clear_output_dir=clear_output_dir,
                   config_changes=config_changes, plan_digest=digest, disk=disk, source=data.source,
                   reporters=ins.reporters, recall_probe=data.recall_probe, attention=data.share,
                   zero_filled=zero_filled)


def data_share(train: Any, seed: int, per_step: int, steps: int) -> AttentionShare:
    """The attention of the rows a run of `steps` optimizer steps trains, in the trainer's order: what the trainer
    and `ulysses-trainer plan` (the same function) time attention from."""
    return AttentionShare.of(train, trained_rows(seed, len(train), per_step, steps))


def disk_need(cfg: TrainConfig, resume_path: str | None, clear_output_dir: bool, total_steps: int, params: int,
              world_size: int, bf16: bool, sequences_per_step: int, rows: int) -> DiskNeed:
    """What the run holds in output_dir at its peak (train/output_guard.py): a resume starts from its
    checkpoint's step, beside the checkpoints already on disk (none once overwrite_output_dir clears them). The
    saves are the trainer's own rule (train/strategies.save_due: every save_steps, or each epoch's end)."""
    if cfg.save_strategy == "no":
        return run_need(params, world_size, bf16, 0)
    # a fresh start clears the previous run's files (trainer.py), a resume keeps its checkpoints
    on_disk = list(trainer_checkpoints(cfg.output_dir)) if resume_path and not clear_output_dir else []
    named = CHECKPOINT.fullmatch(os.path.basename(os.path.normpath(resume_path))) if resume_path else None
    start = int(named.group(1)) if named else 0
    def due(step: int) -> bool:
        return save_due(cfg, step, ends_epoch(step, sequences_per_step, rows))

    peak = peak_checkpoints(total_steps, due, cfg.save_total_limit, start, on_disk)
    return run_need(params, world_size, bf16, peak, len(on_disk))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))

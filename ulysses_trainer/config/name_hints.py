"""Answers for unknown config names: TRL / transformers names that mean one of our settings, TRL names this
trainer does not support (with the reason), and a did-you-mean only for a name that is truly close.

Small tables, so that fields added later (which then stop being unknown) are easy to strike out.
tests/test_trl_names.py checks that every SFTConfig field is a field here or has an entry below.
"""

from __future__ import annotations

from ..errors import close_name

# other trainers' name -> what to set here instead
TRL_NAMES: dict[str, str] = {
    "torch_dtype": "dtype (bfloat16 / float32), or bf16 (true/false)",
    "fp16": "bf16 (this trainer trains in bf16 or fp32)",
    "fp32": "bf16 false",
    "evaluation_strategy": "eval_strategy",
    "dataset_kwargs": "dataset_text_field / text_file_split",
    "max_seq_length": "max_length",
    "activation_offloading": "activation_offload",
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    "attn_implementation_kwargs": "attn_implementation",
    "optim": "the optimizer section of the ZeRO JSON (deepspeed)",
    "optim_args": "the optimizer section of the ZeRO JSON (deepspeed)",
    "liger_kernel_config": "use_liger_kernel (Liger's fused RMSNorm)",
    "router_aux_loss_coef": "model_init_kwargs {router_aux_loss_coef: X} (the model config's coefficient)",
    "use_rslora": "peft_config {use_rslora: true} (any LoraConfig key goes in peft_config)",
    "use_dora": "peft_config {use_dora: true} (any LoraConfig key goes in peft_config)",
    "lora_modules_to_save": "peft_config {modules_to_save: [...]} (any LoraConfig key goes in peft_config)",
    "lora_task_type": "peft_config {task_type: ...} (CAUSAL_LM is the default here)",
    "parallelism_config": "sp_size (sequence parallel) and the ZeRO JSON (deepspeed)",
    "use_cpu": "nothing: the device is CUDA when there is one, else the CPU",
    "logging_dir": "run_name (TensorBoard writes to output_dir/runs/RUN_NAME/)",
    "data_seed": "seed (one seed decides the weights' init and the data order)",
}

_HUB = "the trainer does not upload; push output_dir/final/ yourself (e.g. `huggingface-cli upload`)"
_DS = "this trainer shards with DeepSpeed ZeRO-3 only (deepspeed: the ZeRO JSON)"
_LOADER = "the rows are prepared in memory before training (no DataLoader)"
_EVAL = "evaluation computes eval_loss only (eval_steps / eval_strategy, per_device_eval_batch_size)"
_TRACKERS = "report_to supports tensorboard and wandb"
_LOGS = "the trainer's log lines are fixed (rank 0 logs; metrics.jsonl holds every row)"

# TRL / TrainingArguments options that do not apply here -> why (refused with this reason, never a hint)
REFUSED: dict[str, str] = {
    **{n: _HUB for n in ("push_to_hub", "hub_model_id", "hub_token", "hub_private_repo", "hub_strategy",
                         "hub_always_push", "hub_revision")},
    **{n: _DS for n in ("fsdp", "fsdp_config", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
                        "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "ddp_timeout",
                        "accelerator_config")},
    **{n: _LOADER for n in ("dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
                            "dataloader_persistent_workers", "dataloader_prefetch_factor",
                            "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns",
                            "label_names", "length_column_name", "train_sampling_strategy")},
    **{n: _EVAL for n in ("prediction_loss_only", "eval_accumulation_steps", "eval_delay", "eval_on_start",
                          "eval_do_concat_batches", "eval_use_gather_object", "include_for_metrics",
                          "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval")},
    **{n: _TRACKERS for n in ("project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")},
    **{n: _LOGS for n in ("log_level", "log_level_replica", "log_on_each_node", "disable_tqdm")},
    "load_best_model_at_end": "final/ is the last step's model; pick a checkpoint-<step> by eval_loss in "
                              "metrics.jsonl",
    "metric_for_best_model": "no best-model tracking: final/ is the last step's model",
    "greater_is_better": "no best-model tracking: final/ is the last step's model",
    "auto_find_batch_size": "the plan (`ulysses-trainer plan`) sizes memory; set per_device_train_batch_size",
    "torch_compile": "the model is not compiled (its attention and checkpointing are the trainer's own)",
    "torch_compile_backend": "the model is not compiled (its attention and checkpointing are the trainer's own)",
    "torch_compile_mode": "the model is not compiled (its attention and checkpointing are the trainer's own)",
    "label_smoothing_factor": "the loss is the plain token NLL (loss_type)",
    "neftune_noise_alpha": "NEFTune embedding noise is not implemented",
    "average_tokens_across_devices": "always on: the loss is token-weighted over every rank",
    "logging_nan_inf_filter": "always on: a non-finite step stays out of the logged mean (nan_policy decides "
                              "the step)",
    "include_num_input_tokens_seen": "num_tokens is always logged",
    "save_on_each_node": "rank 0 writes the shared files, every rank its ZeRO shards",
    "ignore_data_skip": "a resume always continues the data order where it stopped",
    "restore_callback_states_from_checkpoint": "there are no callbacks",
    "enable_jit_checkpoint": "checkpoints are written at save steps, the end and on a stop signal",
    "torch_empty_cache_steps": "the memory plan fixes what stays on the GPU",
    "tf32": "matmul precision is torch's default (train in bf16 for speed)",
    "full_determinism": "runs are deterministic for a fixed seed and layout (tests/test_e2e_train.py)",
    "skip_memory_metrics": "peak_gpu_mem_gb and peak_host_mem_gb are always logged",
    "debug": "no debug modes; `ulysses-trainer rehearse` measures a step",
    "do_train": "a run always trains (`ulysses-trainer plan` / `rehearse` do not)",
    "do_eval": "eval_steps or eval_strategy turn evaluation on",
    "do_predict": "there is no prediction step",
    "optim_target_modules": "the optimizer trains every trainable weight (LoRA: the adapters)",
    "use_cache": "training runs without a KV cache; final/ turns it on for generation",
    "trust_remote_code": "the model code is built in (Qwen3 and Qwen3-MoE)",
    "truncation_mode": "max_length_policy truncate keeps the first max_length tokens (keep_start); keep_end is "
                       "not supported",
    "shuffle_dataset": "the order is always TRL's seeded shuffle of the whole dataset (seed)",
    "eval_packing": "the eval data is built as the training data (packing applies to both)",
    "pad_token": "pads are the eos id and never trained (eos_token sets it)",
    "dataset_config": "an HF dataset's config name is not supported; save that config locally (save_to_disk) "
                      "and give its path as dataset_name",
    "load_in_4bit": "quantised training is not supported",
    "load_in_8bit": "quantised training is not supported",
    "model_revision": "give a local checkpoint directory (or a hub id at its default revision)",
}


def refusal(name: str) -> str | None:
    """The reason a known TRL option is not supported here, or None."""
    return REFUSED.get(name)


def suggest(name: str, fields: list[str]) -> str:
    """'; did you mean ...?' for an unknown name that is truly close to a field, or a pointer to --help."""
    if name in TRL_NAMES and name not in fields:
        return f"; this trainer's setting for that is {TRL_NAMES[name]}"
    close = close_name(name, fields)
    return f"; did you mean {close!r}?" if close else "; run with --help for the list of fields"

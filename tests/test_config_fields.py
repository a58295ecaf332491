"""Every config field has a test that shows its effect or its refusal: FIELD_TESTS maps each field to one such
test (file::function). A field added without an entry fails here, and so does an entry naming a test that does
not exist, or one whose module never mentions the field by its exact name."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from ulysses_trainer.config import TrainConfig

TESTS = Path(__file__).resolve().parent

FIELD_TESTS = {
    # model
    "model_name_or_path": "test_chat_export.py::test_qwen3_checkpoint_with_its_template_trains_assistant_turns_sp1_"
                          "sp2_and_exports_a_chat_model",
    "model_init_kwargs": "test_export.py::test_yarn_and_model_init_kwargs_are_exported_as_trained",
    "attn_implementation": "test_resolve.py::test_auto_takes_flash_attention_4_whenever_installed",
    "gradient_checkpointing": "test_resolve.py::test_without_checkpointing_the_autos_offload_and_keep_nothing",
    "checkpoint_every": "test_e2e_train.py::test_checkpoint_every_2_with_offload_and_kept_attention_trains_as_"
                        "every_layer",
    "activation_offload": "test_resolve.py::test_activation_offload_true_with_checkpoint_every_2_plans",
    "keep_attention_outputs": "test_resolve.py::test_flash_attention_2_keeps_no_attention_outputs",
    "tiled_mlp": "test_field_effects.py::test_memory_levers_of_the_config_move_the_planned_peak",
    "lean_norm": "test_field_effects.py::test_memory_levers_of_the_config_move_the_planned_peak",
    "norm_kernel": "test_resolve.py::test_auto_takes_the_fused_norm_kernel_where_installed_and_predicts_it_faster",
    "experts_implementation": "test_field_effects.py::test_memory_levers_of_the_config_move_the_planned_peak",
    "deltanet_kernel": "test_qwen3_5.py::test_deltanet_kernel_auto_takes_fla_where_installed_and_the_plan_names_it",
    "optimizer_offload": "test_resolve.py::test_the_ds_config_gets_the_plans_optimizer_placement",
    "host_memory_gb": "test_reliability_units.py::test_cpu_run_that_exceeds_host_memory_is_refused_with_the_"
                      "plans_numbers",
    "loss_type": "test_field_effects.py::test_memory_levers_of_the_config_move_the_planned_peak",
    "loss_chunk_size": "test_field_effects.py::test_memory_levers_of_the_config_move_the_planned_peak",
    # parallelism
    "sp_size": "test_e2e_train.py::test_sp1_sp2_sp4_same_losses_grad_norms_and_eval_loss",
    "deepspeed": "test_bad_inputs.py::test_bad_input_exits_2_with_one_message_and_no_output_dir",
    # data
    "dataset_name": "test_data.py::test_jsonl_joined_end_to_end_and_cut",
    "dataset_text_field": "test_data.py::test_non_text_field",
    "dataset_num_proc": "test_data_prep.py::test_dataset_num_proc_workers_tokenize_the_same_rows",
    "chat_template_path": "test_trl_options.py::test_chat_template_path_file_or_tokenizer_dir_replaces_the_template",
    "eos_token": "test_trl_options.py::test_eos_token_ends_text_documents_and_must_be_known",
    "data_cache": "test_data_prep.py::test_second_prepare_reads_the_cache_bitwise_without_tokenizing",
    "data_cache_dir": "test_data_prep.py::test_no_home_and_no_dir_means_no_cache",
    "text_file_split": "test_data.py::test_txt_file_is_one_document_with_its_newlines",
    "dataset_train_split": "test_field_effects.py::test_dataset_train_and_test_split_choose_the_hf_split",
    "dataset_test_split": "test_field_effects.py::test_dataset_train_and_test_split_choose_the_hf_split",
    "eval_dataset_name": "test_prepare.py::test_max_eval_samples_bounds_the_eval_set",
    "max_length": "test_data.py::test_jsonl_joined_end_to_end_and_cut",
    "packing": "test_data.py::test_wrapped_packing_position_ids_restart_at_documents_and_rows",
    "packing_strategy": "test_data.py::test_wrapped_packing_position_ids_restart_at_documents_and_rows",
    "pad_to_multiple_of": "test_config.py::test_validation_messages",
    # optimisation
    "learning_rate": "test_field_effects.py::test_lr_scheduler_type_and_kwargs_shape_the_schedule",
    "lr_scheduler_type": "test_field_effects.py::test_lr_scheduler_type_and_kwargs_shape_the_schedule",
    "warmup_steps": "test_trl_options.py::test_warmup_ratio_gives_ceil_of_total_and_warmup_steps_wins",
    "weight_decay": "test_field_effects.py::test_adam_numbers_reach_the_optimizer",
    "adam_beta1": "test_field_effects.py::test_adam_numbers_reach_the_optimizer",
    "adam_beta2": "test_field_effects.py::test_adam_numbers_reach_the_optimizer",
    "adam_epsilon": "test_field_effects.py::test_adam_numbers_reach_the_optimizer",
    "max_grad_norm": "test_ds_config.py::test_fill_on_cpu_uses_torch_adamw",
    "max_steps": "test_prepare.py::test_the_whole_file_is_read_whatever_max_steps",
    "num_train_epochs": "test_train_order.py::test_order_covers_the_whole_dataset_each_epoch_whatever_max_steps",
    "per_device_train_batch_size": "test_ds_config.py::test_user_train_batch_size_is_in_sequences_per_step",
    "per_device_eval_batch_size": "test_field_effects.py::test_per_device_eval_batch_size_is_the_eval_round",
    "gradient_accumulation_steps": "test_e2e_train.py::test_two_accumulation_steps_equal_one_step_of_both_sequences",
    "bf16": "test_config.py::test_resolve_bf16",
    "allow_beyond_positions": "test_plan.py::test_cli_refuses_a_max_length_past_the_positions_naming_yarn",
    "allow_over_plan": "test_out_of_memory.py::test_allow_over_plan_goes_past_the_check_and_says_what_to_expect",
    "seed": "test_field_effects.py::test_seed_decides_the_data_order",
    "nan_policy": "test_faults.py::test_nan_policy_skip_leaves_the_state_bitwise_unchanged_and_trains_on",
    "verify_sp": "test_e2e_train.py::test_verify_sp_checks_sp2_at_the_first_start_and_changes_no_number",
    # output
    "output_dir": "test_bad_inputs.py::test_output_dir_that_is_a_file",
    "overwrite_output_dir": "test_train_runs.py::test_overwrite_removes_what_the_trainer_wrote_and_nothing_else",
    "logging_steps": "test_train_runs.py::test_logged_loss_is_the_mean_over_the_logging_interval",
    "logging_strategy": "test_trl_strategies_run.py::test_epoch_strategies_and_logging_first_step",
    "logging_first_step": "test_trl_strategies_run.py::test_epoch_strategies_and_logging_first_step",
    "run_name": "test_trl_strategies_run.py::test_run_name_is_the_first_line_and_the_tensorboard_run",
    "save_steps": "test_trl_options.py::test_log_eval_save_due_by_strategy",
    "plot_per_position_loss": "test_position_loss.py::test_per_position_loss_png_from_a_training_run",
    "save_strategy": "test_trl_strategies_run.py::test_epoch_strategies_and_logging_first_step",
    "save_only_model": "test_trl_strategies_run.py::test_save_only_model_writes_loadable_weights_without_optimizer_"
                       "state",
    "save_total_limit": "test_train_runs.py::test_save_total_limit_keeps_the_newest_across_a_resume",
    "max_shard_size": "test_export.py::test_max_shard_size_reads_as_transformers_reads_it",
    "eval_steps": "test_reporters.py::test_real_command_report_to_tensorboard_has_the_losses_of_metrics_jsonl",
    "report_to": "test_reporters.py::test_real_command_report_to_tensorboard_has_the_losses_of_metrics_jsonl",
    "max_eval_samples": "test_prepare.py::test_max_eval_samples_bounds_the_eval_set",
    "eval_recall_probe": "test_position_loss.py::test_eval_rows_carry_the_loss_by_position_and_the_recall_probe_"
                         "and_the_plot_is_written",
    "resume_from_checkpoint": "test_e2e_train.py::test_resume_from_step_2_is_bitwise_the_straight_run",
    # conversations, prompt-completion, TRL spellings
    "assistant_only_loss": "test_data_command.py::test_data_json_trains_every_assistant_content_and_no_other",
    "completion_only_loss": "test_trl_options.py::test_completion_only_loss_on_text_is_refused_by_the_data_command",
    "max_length_policy": "test_field_effects.py::test_max_length_policy_truncates_or_drops_a_long_conversation",
    "special_text": "test_conversations.py::test_special_text_encodes_or_drops_and_counts_the_example",
    "gradient_checkpointing_kwargs": "test_trl_names.py::test_gradient_checkpointing_kwargs_offload",
    "eval_strategy": "test_trl_strategies_run.py::test_epoch_strategies_and_logging_first_step",
    "dtype": "test_trl_names.py::test_dtype_and_eval_strategy",
    # LoRA
    "use_peft": "test_e2e_lora.py::test_lora_sp2_equals_sp1_and_exports_load",
    "lora_r": "test_lora.py::test_plan_counts_the_adapters_peft_makes",
    "lora_alpha": "test_lora.py::test_merged_state_dict_equals_peft_merge",
    "lora_dropout": "test_lora.py::test_plan_counts_the_adapters_peft_makes",
    "lora_target_modules": "test_lora.py::test_plan_counts_the_adapters_peft_makes",
    "peft_config": "test_lora.py::test_lora_config_refusals",
    "merge_lora": "test_e2e_lora.py::test_lora_sp2_equals_sp1_and_exports_load",
    # TRL / TrainingArguments options
    "warmup_ratio": "test_trl_options.py::test_warmup_ratio_gives_ceil_of_total_and_warmup_steps_wins",
    "lr_scheduler_kwargs": "test_field_effects.py::test_lr_scheduler_type_and_kwargs_shape_the_schedule",
    "use_liger_kernel": "test_trl_options.py::test_use_liger_kernel_is_the_triton_norm_and_needs_lean_norm",
    "padding_free": "test_trl_options.py::test_padding_free_sets_packing",
    "save_safetensors": "test_trl_options.py::test_save_safetensors_false_is_refused_with_reason",
    # resume and data checks
    "allow_config_change": "test_reliability_units.py::test_resume_comparison_refuses_what_breaks_exactness_naming_"
                           "both_values",
    "pad_last_sequence": "test_reliability_units.py::test_data_accounting_counts_skipped_records_and_the_tail",
}


def _test_functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")}


def test_every_field_has_a_test_and_every_entry_is_a_field():
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    missing = [f for f in fields if f not in FIELD_TESTS]
    assert not missing, f"add an entry (a test showing the effect or the refusal) to FIELD_TESTS for {missing}"
    assert not set(FIELD_TESTS) - set(fields), f"entries for fields that no longer exist: " \
                                               f"{sorted(set(FIELD_TESTS) - set(fields))}"


def test_every_named_test_exists_and_its_module_mentions_the_field():
    wrong = []
    for name, ref in FIELD_TESTS.items():
        module, _, function = ref.partition("::")
        path = TESTS / module
        if not path.is_file():
            wrong.append(f"{name}: {module} is not in tests/")
        elif function not in _test_functions(path):
            wrong.append(f"{name}: {module} has no test function {function}")
        elif not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", path.read_text()):
            # the name as a whole word (a fixture of the module may set it for the test): `seed` is not
            # mentioned by `seeds`, nor `max_length` by `max_length_policy`
            wrong.append(f"{name}: {module} never mentions it")
    assert not wrong, "\n".join(wrong)

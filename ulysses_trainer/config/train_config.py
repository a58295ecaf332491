"""The typed training config: every field, its type, default and help line.

Field names follow TRL's SFTConfig / TrainingArguments where TRL has one; the rest are ours. Made from
defaults < YAML recipe < `--name value` on the command line by config/load.py; TRL's spellings are decoded
when it is made (config/trl.py). Every problem is a ConfigError (exit 2) whose message names the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from ..families import PRESETS
from .trl import decode_trl_spellings

# the checkout's root (recipes, benchmarks); an installed package has only PACKAGE_DIR, which ships the ZeRO
# JSONs as package data (ulysses_trainer/ds_configs/, the same files as the checkout's ds_configs/)
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_DS_CONFIG = "ds_configs/zero3.json"  # a shipped name: the working directory's file, else the package's

AttnImpl = Literal["auto", "sdpa", "flash_attention_2", "flash_attention_4"]
NormKernel = Literal["auto", "triton", "torch"]
ExpertsImpl = Literal["auto", "eager", "batched_mm", "grouped_mm"]
DeltanetKernel = Literal["auto", "fla", "torch"]
LossType = Literal["chunked_nll", "nll"]
NanPolicy = Literal["skip", "stop"]
SaveStrategy = Literal["steps", "no", "epoch"]
LogStrategy = Literal["steps", "no", "epoch"]
TextFileSplit = Literal["document", "paragraph", "line"]
SchedulerType = Literal["linear", "cosine", "constant", "constant_with_warmup"]
MaxLengthPolicy = Literal["truncate", "drop"]
SpecialText = Literal["encode", "drop"]
PackingStrategy = Literal["bfd", "wrapped", "next_fit"]
EvalStrategy = Literal["no", "steps", "epoch"]
DType = Literal["auto", "bfloat16", "float32", "float16"]
Auto = Literal["auto"]


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a help line (shown by --help); mutable defaults are copied."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Everything a run needs. The defaults are the embedded CPU run (tiny model, synthetic data)."""

    # model
    model_name_or_path: str = _f("tiny", f"a preset ({', '.join(PRESETS)}) or an HF checkpoint dir")
    model_init_kwargs: Union[dict, None] = _f(
        None, "model config overrides, e.g. {rope_parameters: {rope_type: yarn, factor: auto}}")
    attn_implementation: AttnImpl = _f("auto", "attention kernel; auto = fastest installed")
    gradient_checkpointing: bool = _f(True, "recompute each decoder layer in backward")
    checkpoint_every: Union[int, Auto] = _f(
        "auto", "keep every k-th layer's input only; backward rebuilds the others (+1 forward for k-1 of k "
        "layers); auto = 1 unless nothing fits without thinning")
    activation_offload: Union[bool, int, Auto] = _f(
        "auto", "offload checkpointed layer inputs to host: false, true (all), N layers, or auto")
    keep_attention_outputs: Union[bool, int, Auto] = _f(
        "auto", "keep attention outputs from the checkpoint's forward so the recompute skips the kernel "
        "(faster, more memory): false, true (all layers), N layers, or auto (what fits on the GPU)")
    tiled_mlp: Union[bool, int, Auto] = _f("auto", "sequence-tiled MLP: false, true, N tiles, or auto")
    lean_norm: bool = _f(True, "RMSNorms keep only their input for backward (no fp32 copies); same results")
    norm_kernel: NormKernel = _f(
        "auto", "the lean RMSNorms' kernel: triton (Liger-Kernel's fused RMSNorm, CUDA), torch (torch ops); "
        "auto = triton where installed")
    experts_implementation: ExpertsImpl = _f(
        "auto", "a sparse (MoE) model's experts kernel, transformers' experts_implementation: grouped_mm, eager "
        "(a loop over experts), batched_mm (gathers each token's expert weights: far more memory); auto = grouped_mm")
    deltanet_kernel: DeltanetKernel = _f(
        "auto", "a Gated DeltaNet layer's (Qwen3.5) rule kernel: fla (flash-linear-attention, CUDA), torch (the "
        "chunked rule in torch ops); auto = fla where installed on a GPU")
    optimizer_offload: Union[bool, Auto] = _f(
        "auto", "Adam's fp32 master, m and v on the host (ZeRO-Offload, DeepSpeed's CPU Adam): true, false, or "
        "auto (when it makes the step faster, e.g. by leaving room to keep attention outputs); an "
        "offload_optimizer section in the ZeRO JSON wins")
    host_memory_gb: Union[float, None] = _f(None, "host RAM (GiB) the offload may pin; null = detected")
    loss_type: LossType = _f("chunked_nll", "chunked_nll never builds [L, vocab] logits; nll is plain")
    loss_chunk_size: int = _f(256, "rows per chunk of the chunked loss")
    # parallelism
    sp_size: Union[int, None] = _f(None, "sequence-parallel degree; null = world size (dp = 1)")
    deepspeed: Union[str, dict] = _f(DEFAULT_DS_CONFIG, "path to the ZeRO JSON (or the dict itself)")
    # data
    dataset_name: Union[str, None] = _f(
        None, "HF dataset name, local file or directory (parquet/jsonl/json/txt/arrow), synthetic:text or "
        "synthetic:agent_sessions (or synthetic:agent_sessions_mixed: 4K-400K tokens, median 60K); null = "
        "synthetic:text, or synthetic:agent_sessions with assistant_only_loss")
    dataset_text_field: str = _f("text", "column holding the document text")
    dataset_num_proc: Union[int, None] = _f(
        None, "TRL's: worker processes that render and tokenize the data (on the preparing rank, when the whole "
        "dataset is read); the rows are the same as in-process; null = in-process (text: the tokenizer's threads)")
    chat_template_path: Union[str, None] = _f(
        None, "TRL's: a Jinja file or a tokenizer directory whose chat template replaces the tokenizer's (the same "
        "checks as a checkpoint's own); final/ ships it")
    eos_token: Union[str, None] = _f(
        None, "TRL's: the token ending each text document and string completion (and the pad); it must be one "
        "of the tokenizer's tokens; null = the tokenizer's (<|endoftext|> for Qwen)")
    data_cache: bool = _f(True, "keep the tokenized rows of local data files for a relaunch or resume: rank 0 "
                                "prepares, the other ranks read its rows")
    data_cache_dir: str | None = _f(None, "where data_cache keeps them; null = ~/.cache/ulysses_trainer/data")
    text_file_split: TextFileSplit = _f(
        "document", "a .txt file is one document (newlines kept); paragraph = split at blank lines, line = "
        "one document per line (jsonl: one per record)")
    dataset_train_split: str = _f("train", "split of an HF dataset to train on")
    dataset_test_split: str = _f("test", "split of an HF dataset to evaluate on")
    eval_dataset_name: Union[str, None] = _f(
        None, "evaluation data (same forms as dataset_name); null = dataset_test_split of dataset_name")
    max_length: int = _f(4096, "tokens per training sequence (documents are joined end to end)")
    packing: bool = _f(False, "keep document boundaries: position_ids restart at each document")
    packing_strategy: PackingStrategy = _f(
        "bfd", "with packing: bfd (best-fit decreasing: whole documents, fullest sequences; TRL's default), "
        "wrapped (documents joined and cut at max_length; TRL's), next_fit (whole documents in their order, a "
        "new sequence when the next does not fit)")
    pad_to_multiple_of: Union[int, None] = _f(None, "pad sequences to a multiple of this; null = sp's need")
    # optimisation
    learning_rate: float = _f(1e-4, "peak learning rate (AdamW)")
    lr_scheduler_type: SchedulerType = _f("linear", "learning-rate schedule after warmup")
    warmup_steps: int = _f(0, "linear warmup steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "gradient clipping norm; 0 = no clipping")
    max_steps: Union[int, None] = _f(None, "optimizer steps; -1 or null = num_train_epochs decides (TRL's default)")
    num_train_epochs: float = _f(1.0, "passes over the data when max_steps is -1 or null (the synthetic data "
                                      "holds 4 steps)")
    per_device_train_batch_size: int = _f(1, "sequences per dp rank per micro-step")
    per_device_eval_batch_size: int = _f(1, "sequences per dp rank per eval step")
    gradient_accumulation_steps: int = _f(1, "micro-steps per optimizer step")
    bf16: Union[bool, Auto] = _f("auto", "bf16 mixed precision; auto = on for CUDA devices that support it")
    seed: int = _f(42, "seed for weights init, data order and dropout")
    nan_policy: NanPolicy = _f("stop", "on a non-finite loss or grad norm: skip the step, or stop")
    verify_sp: Union[bool, Auto] = _f(
        "auto", "before step 1, the parallelized model against stock transformers on the first row's first "
        "tokens (loss, gradient norm, sampled gradients); a difference stops the run naming the layer type; auto = "
        "on at a run's first start, off at resume")
    # output
    output_dir: str = _f("out/default", "checkpoints, metrics.jsonl and the final export")
    overwrite_output_dir: bool = _f(
        False, "replace a previous run in output_dir (its checkpoints, metrics.jsonl, final/); without it such "
        "a directory is refused unless the run resumes from it")
    logging_steps: int = _f(1, "log every N optimizer steps")
    logging_strategy: LogStrategy = _f(
        "steps", "TRL's: steps (every logging_steps and the last), epoch (at each epoch end and the last step), no "
        "(no train rows; eval rows still)")
    logging_first_step: bool = _f(False, "TRL's: also log the first step")
    run_name: Union[str, None] = _f(
        None, "TRL's: names the run: TensorBoard writes to output_dir/runs/RUN_NAME/, wandb's run name, the "
        "startup line; null = output_dir's name (TensorBoard: output_dir/runs/)")
    save_steps: Union[int, None] = _f(None, "checkpoint every N steps (always at the end); null = end only")
    plot_per_position_loss: bool = _f(False, "at the end, write output_dir/per_position_loss.png (one more "
                                             "forward of the last sequence)")
    save_strategy: SaveStrategy = _f(
        "steps", "steps = every save_steps and at the end; epoch = at each epoch end (and at the end); no = write "
        "no checkpoint and no final export (benchmarks, dry runs)")
    save_only_model: bool = _f(
        False, "TRL's: checkpoints hold the model weights only (HF safetensors, no optimizer or scheduler state: "
        "much smaller); a run cannot resume from one")
    save_total_limit: Union[int, None] = _f(None, "keep at most N checkpoints; null = all")
    max_shard_size: Union[str, None] = _f(
        None, "final/'s safetensors files are at most this size each, with model.safetensors.index.json when there "
        "are several (transformers' save_pretrained max_shard_size: 5GB, 500MB, ...); null = the checkpoint's own "
        "sharding (its largest file, so a checkpoint of 3 shards exports as 3), 5GB for a preset")
    eval_steps: Union[int, None] = _f(None, "evaluate every N steps; null = never")
    report_to: Union[str, list] = _f(
        "auto", "also log the metrics to: none, tensorboard (output_dir/runs/), wandb, a list of them, all "
        "(every installed one) or auto (tensorboard when installed)")
    max_eval_samples: Union[int, None] = _f(
        None, "evaluate on at most N sequences of max_length (the first N of the eval data); null = all of it")
    eval_recall_probe: bool = _f(
        False, "each evaluation also runs the recall probe: facts placed early in every eval row are asked for at "
        "its end, the accuracy by distance goes in metrics.jsonl (one more forward per eval row)")
    resume_from_checkpoint: Union[str, bool, None] = _f(
        None, "checkpoint dir to resume from; true = the latest in output_dir")
    # conversations and prompt-completion data (TRL SFTConfig names)
    assistant_only_loss: bool = _f(
        False, "conversational data: train only on the assistant turns (each after its header, through its "
               "<|im_end|> and the newline after it)")
    completion_only_loss: Union[bool, None] = _f(
        None, "prompt-completion data: train only on the completion; null = true (TRL's default)")
    max_length_policy: MaxLengthPolicy = _f(
        "truncate", "a conversation or prompt-completion pair (or a text document packed whole: packing_strategy bfd, "
        "next_fit) longer than max_length: truncate (keep its first "
        "max_length tokens, TRL's) or drop it; both are counted (ulysses-trainer data)")
    special_text: SpecialText = _f(
        "encode", "a conversation or prompt-completion pair whose message text holds a special token's string "
        "(<|im_end|> in a file a tool read): encode (the string as ordinary text, never the token's id) or drop the "
        "example; both are counted in the data summary")
    # TRL spellings of settings above (decoded once, here: see TrainConfig.__post_init__)
    gradient_checkpointing_kwargs: Union[dict, None] = _f(
        None, "TRL's: {offload: true} = activation_offload true, {offload: false} = false; use_reentrant is "
        "accepted and has no effect (the trainer's own layer checkpoints are used)")
    eval_strategy: Union[EvalStrategy, None] = _f(
        None, "TRL's: no (never evaluate), steps (every eval_steps, default logging_steps), epoch (at each epoch "
        "end); null = eval_steps decides")
    dtype: Union[DType, None] = _f(None, "TRL's model dtype: bfloat16 = bf16 true, float32 = bf16 false, auto")
    # LoRA through PEFT (TRL's names)
    use_peft: bool = _f(False, "train LoRA adapters (PEFT) on a frozen model instead of every weight")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = _f(0.05, "dropout on the LoRA input (0 for runs that must equal another exactly)")
    lora_target_modules: Union[list, str, None] = _f(
        None, "module names to adapt, e.g. [q_proj, v_proj] or all-linear; null = PEFT's default for the model")
    peft_config: Union[dict, None] = _f(
        None, "a PEFT LoraConfig mapping (r, lora_alpha, target_modules, ...); its keys win over the lora_* fields")
    merge_lora: bool = _f(False, "final/ holds the merged model (AutoModelForCausalLM loads it) instead of the adapter")

    # TRL / TrainingArguments options (each decoded in __post_init__ or read where it acts; docs/configuration.md)
    warmup_ratio: float = _f(0.0, "warmup as a fraction of the total steps (ceil); warmup_steps > 0 wins, as in HF")
    lr_scheduler_kwargs: Union[dict, None] = _f(
        None, "extra arguments of the lr_scheduler_type schedule, e.g. {num_cycles: 0.5} for cosine")
    use_liger_kernel: bool = _f(False, "Liger-Kernel's fused RMSNorm: true = norm_kernel triton (lean_norm true)")
    padding_free: bool = _f(False, "TRL's: no padding between examples; here = packing true (position_ids restart "
                                   "at each example, attention stays within it)")
    save_safetensors: bool = _f(True, "final/ is written as safetensors (false is refused: it always is)")

    # resume and data checks
    allow_config_change: bool = _f(
        False, "resume even where the config differs from the checkpoint's in a way that changes the results "
        "(model, max_length, sp/dp layout, data, seed, batch, optimizer); harmless changes always go through")
    allow_beyond_positions: bool = _f(
        False, "train a max_length beyond the positions the model covers (max_position_embeddings, or what its "
        "rope scaling stretches them to) on the rope as it is, without a stretch (YaRN, or a llama3 checkpoint's "
        "own with a larger factor); without it such a max_length is refused")
    allow_over_plan: bool = _f(
        False, "start even where the plan's GPU memory exceeds the device by more than the memory model's "
        "worst measured under-prediction (3.1%); the run then most likely stops out of GPU memory")
    pad_last_sequence: bool = _f(
        False, "pad the tokens after the last full sequence into one more sequence (pads not trained on) "
        "instead of dropping them")

    def __post_init__(self) -> None:
        decode_trl_spellings(self)  # TRL's spellings become the fields they stand for

    def origin(self, name: str) -> str:
        """Where a field's value came from, for messages: "recipe PATH", "the command line", or "the default" (the
        field's default, or a value it holds that config.load.build_config did not record)."""
        given = _ORIGINS.get(id(self), {})  # recorded by config.load.build_config; not a field, so never saved
        if name in given:
            return given[name]
        return "the default" if getattr(self, name) == FIELDS[name].default else "the training config"

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates at all (every eval_steps, or at each epoch end)."""
        return bool(self.eval_steps) or self.eval_strategy == "epoch"

    def warmup_for(self, total_steps: int) -> int:
        """Warmup steps: warmup_steps when > 0, else ceil(warmup_ratio × total) (HF's get_warmup_steps)."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total_steps)


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}

# id(TrainConfig) -> {field: where its value came from} for the configs build_config made (TrainConfig.origin);
# outside the instance, so that its __dict__ holds its fields only; an entry goes with its config
_ORIGINS: dict[int, dict[str, str]] = {}


def record_origins(cfg: TrainConfig, origins: dict[str, str]) -> None:
    """Remember where `cfg`'s given values came from ("recipe PATH", "the command line"), for its messages."""
    _ORIGINS[id(cfg)] = origins
    weakref.finalize(cfg, _ORIGINS.pop, id(cfg), None)
HINTS: dict[str, Any] = typing.get_type_hints(TrainConfig)


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config as a JSON-safe dict (saved next to checkpoints)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))

"""Where a run's rows go, and what they hold: the line on stdout (`log_line`), metrics.jsonl and events.jsonl
(`MetricsFile`), the report_to reporters (`Reporters`; rank 0 writes), config.json and ds_config.json; the loss a row
logs over the steps since the last one (`LogInterval`). A failed write on rank 0 stops every rank together with its
cause: the ranks agree on it at a collective every rank runs (the run config's write, or the step's end), never one
rank alone. What the run says about itself (the plan, the data, the end): run_report.py.

The line and metrics.jsonl: `{'loss': ..., 'grad_norm': ..., ...}` on stdout, one JSON object per logged step (full
float precision) in the file.

The steps since the last logged row: their loss is logged as one mean, as the HF Trainer (and TRL) log it.

The logged `loss` is the plain mean of the interval's step losses: sum(step loss) / steps, what transformers'
Trainer logs (the per-step losses summed, divided by the steps since the last log). Each step's loss is the
token-weighted mean over that step's trained tokens (all ranks, all micro-steps). Where the interval spans more
than one step, `token_weighted_loss` is the loss of all its tokens together: sum(step loss x its trained tokens)
/ their sum. A non-finite step (nan_policy skip) stays out of both means, as HF's logging_nan_inf_filter keeps it
out; an interval of only non-finite steps logs the last one's value. `aux_loss` (MoE) is the mean of the steps'.
The interval is saved in checkpoints, so a resume between two rows logs what the uninterrupted run logs.

`report_to` (TRL's name): every metrics.jsonl row also goes to TensorBoard and/or Weights & Biases.

run_name (TRL's) names the run: TensorBoard writes to output_dir/runs/RUN_NAME/, wandb names its run so.
Tags follow the HF Trainer's: `train/loss`, `train/grad_norm`, ... for a train row, `eval/loss` for
an eval row, at global step = the row's `step`. Reporters open on the first row (nothing is written
before the run starts) and only rank 0 logs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import config_to_dict
from ..ds_config_record import DS_CONFIG_FILE
from ..errors import ConfigError
from ..parallel.comm import all_reduce
from ..vocabulary.names import TENSORBOARD_DIR
from . import run_report as report
from .checkpoint import EVENTS_FILE, agree_on_failure
from .eval_plot import PLOT, eval_rows, native_window, plot_eval_by_position
from .output_guard import OutputWriteError, describe_failure, failure_message
from .prepare import PreparedRun
from .resume_check import notes as resume_notes

log = logging.getLogger(__name__)

Failure = tuple[str, int, str]  # (the path, describe_failure's code, the error's text)


class RunLog:
    def __init__(self, prepared: PreparedRun, is_main: bool):
        cfg = prepared.cfg
        self.is_main = is_main
        self.output_dir = cfg.output_dir
        self.metrics = MetricsFile(cfg.output_dir)
        self.events = MetricsFile(cfg.output_dir, EVENTS_FILE)  # not training rows: metrics.jsonl's all carry loss
        self.reporters = Reporters(prepared.reporters, cfg.output_dir, config_to_dict(cfg), cfg.run_name)
        self.failure: Failure | None = None  # rank 0's failed row write, agreed at the step's end
        self.window = native_window(prepared.model_config)  # drawn on the eval plot
        self.title = f"{cfg.model_name_or_path}, max_length {cfg.max_length:,}: eval loss by position"

    def write_run_config(self, prepared: PreparedRun, step: int) -> None:
        """config.json: this run's config, layout and data accounting; on resume the earlier runs' configs
        stay in its `history` with the step each change took effect. ds_config.json: the ZeRO JSON the engine
        runs, every "auto" filled. Rank 0 writes. Collective."""
        failure = None
        if self.is_main:
            path = os.path.join(self.output_dir, "config.json")
            record = report.run_config_record(prepared, step, path)
            try:
                with open(path, "w") as f:
                    json.dump(record, f, indent=1)
                path = os.path.join(self.output_dir, DS_CONFIG_FILE)
                with open(path, "w") as f:
                    json.dump(prepared.ds_config, f, indent=1)
            except OSError as exc:
                failure = (path, describe_failure(exc, path), str(exc))
        code = agree_on_failure(failure[1] if failure else 0)
        if code:
            raise self._write_error(code, failure)

    def open_reporters(self) -> None:
        """Rank 0 starts the report_to reporters; if that fails (e.g. no wandb login) every rank stops here,
        before the first step, with rank 0's message. Collective."""
        error = None
        if self.is_main:
            try:
                self.reporters.open()
            except ConfigError as exc:
                error = exc
        if all_reduce(torch.tensor([float(error is not None)]), "max").item() > 0:
            raise error or ConfigError("report_to: rank 0 could not start its reporters (see its error)")

    def resume_at(self, step: int, path: str, changes: dict) -> None:
        """Rank 0: the rows past the checkpoint's step dropped, and the config changes let through noted."""
        if not self.is_main:
            return
        self.metrics.truncate_after(step)
        self.events.truncate_after(step)
        self.reporters.resume_at(step)
        log.info(f"resumed from {path} at step {step}")
        if changes:
            for line in resume_notes(changes):
                log.info(f"config change at step {step}: {line}")
            self.events.append({"step": step, "config_change": {k: list(v) for k, v in changes.items()}})

    def step_row(self, row: dict, bar) -> None:
        """A training row: the reference-style line above the progress bar, metrics.jsonl, the reporters."""
        self._emit(row, log_line(row), bar)

    def eval_row(self, step: int, fields: dict, bar) -> None:
        """An eval row (evaluation.EvalResult.fields: eval_loss, its loss by position, the recall probe's), then
        output_dir/eval_loss_by_position.png redrawn from metrics.jsonl's eval rows."""
        shown = {"eval_loss": round(fields["eval_loss"], 4), "step": step}
        if "eval_recall" in fields:
            shown["eval_recall"] = round(fields["eval_recall"], 4)
        self._emit({"step": step, **fields}, str(shown), bar)
        if self.is_main and self.failure is None:
            path = os.path.join(self.output_dir, PLOT)
            try:
                plot_eval_by_position(eval_rows(self.metrics.path), path, self.window, self.title)
            except OSError as exc:  # rank 0 only: the ranks agree on it at the step's end
                self.failure = (path, describe_failure(exc, path), str(exc))

    def failure_code(self) -> int:
        """This rank's failed row write (0: none), for the step end's all-reduce."""
        return self.failure[1] if self.failure else 0

    def raise_failure(self, code: int) -> None:
        """The agreed failure (code from any rank: rank 0 holds the path and the text)."""
        raise self._write_error(code, self.failure)

    def close(self) -> None:
        self.reporters.close()  # (a stopped run's rows are flushed as they are logged)

    def _emit(self, row: dict, line: str, bar) -> None:
        """Rank 0: the line above the progress bar, the row in metrics.jsonl and to the reporters."""
        if self.is_main:
            bar.write(line)
            self._append(row)
            self.reporters.log(row)

    def _append(self, row: dict) -> None:
        try:
            self.metrics.append(row)
        except OSError as exc:  # rank 0 only: the ranks agree on it at the step's end
            if self.failure is None:
                self.failure = (self.metrics.path, describe_failure(exc, self.metrics.path), str(exc))

    def _write_error(self, code: int, failure: Failure | None) -> OutputWriteError:
        where = failure[0] if failure else self.output_dir
        return OutputWriteError(failure_message(os.path.basename(where), where, code, failure[2] if failure else ""))


def log_line(row: dict) -> str:
    """`{'loss': 4.311, 'grad_norm': 29.25, 'learning_rate': 1e-05, 'num_tokens': 1049000.0, 'epoch': 0.25}`;
    a sparse (MoE) model's row ends with its `'aux_loss'` (the router's load-balancing loss, in `loss` times
    router_aux_loss_coef)."""
    shown = {"loss": round(row["loss"], 4), "grad_norm": round(row["grad_norm"], 4),
             "learning_rate": row["learning_rate"], "num_tokens": float(row["num_tokens"]),
             "epoch": round(row["epoch"], 4)}
    if row.get("aux_loss") is not None:
        shown["aux_loss"] = round(row["aux_loss"], 4)
    return str(shown)


class MetricsFile:
    """Appends one JSON object per logged step (metrics.jsonl; events.jsonl: what happened at a step that is not a
    logged step, e.g. a config change at a resume); on resume drops rows past the checkpoint's step."""

    def __init__(self, output_dir: str, name: str = "metrics.jsonl"):
        self.path = os.path.join(output_dir, name)

    def truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)

    def append(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


@dataclass
class LogInterval:
    steps: list[tuple[float, int]] = field(default_factory=list)  # (global step loss, trained tokens)
    aux: list[float] = field(default_factory=list)

    def add(self, loss: float, tokens: int, aux_loss: float | None = None) -> None:
        self.steps.append((float(loss), int(tokens)))
        if aux_loss is not None:
            self.aux.append(float(aux_loss))

    def take(self, last_loss: float) -> tuple[float, float | None, float | None]:
        """(mean of the step losses, their token-weighted mean or None for a one-step interval, mean aux_loss or
        None) of the interval, which starts again empty."""
        spanned = len(self.steps) > 1
        finite = [(loss, n) for loss, n in self.steps if math.isfinite(loss)]
        tokens = sum(n for _, n in finite)
        if not finite:
            loss = weighted = last_loss
        elif len(finite) == 1:  # logging_steps 1: the step's own value, bit for bit
            loss = weighted = finite[0][0]
        else:
            loss = sum(v for v, _ in finite) / len(finite)
            weighted = sum(v * n for v, n in finite) / tokens if tokens else loss  # no token trained: each is 0
        aux = sum(self.aux) / len(self.aux) if self.aux else None
        self.steps, self.aux = [], []
        return loss, weighted if spanned else None, aux

    def state(self) -> dict:
        return {"steps": [list(s) for s in self.steps], "aux": list(self.aux)}

    @classmethod
    def from_state(cls, state: dict | None) -> LogInterval:
        """From a checkpoint's client state (None: a checkpoint from before it was kept, an empty interval)."""
        if not state:
            return cls()
        return cls([(float(v), int(n)) for v, n in state["steps"]], [float(a) for a in state["aux"]])




def tensorboard_dir(output_dir: str, run_name: str | None = None) -> str:
    """output_dir/runs/, or output_dir/runs/RUN_NAME/ for a named run (TensorBoard shows it by that name)."""
    runs = os.path.join(output_dir, TENSORBOARD_DIR)
    return os.path.join(runs, run_name) if run_name else runs


def tag(key: str) -> str:
    """metrics.jsonl key -> reporter tag: eval_loss -> eval/loss, loss -> train/loss."""
    return "eval/" + key[len("eval_"):] if key.startswith("eval_") else "train/" + key


def _scalars(row: dict) -> dict[str, float]:
    return {tag(k): float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoardReporter:
    """Event files in output_dir/runs/, read by `tensorboard --logdir output_dir/runs`."""

    def __init__(self, log_dir: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops the events past its checkpoint, as metrics.jsonl drops its rows
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log(self, row: dict) -> None:
        for name, value in _scalars(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"])
        self.writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """A wandb run in output_dir (WANDB_MODE=offline, WANDB_PROJECT and the other WANDB_* are wandb's own)."""

    def __init__(self, output_dir: str, config: dict[str, Any], run_name: str | None = None):
        import wandb

        project = os.environ.get("WANDB_PROJECT", "ulysses_trainer")
        self._wandb = wandb
        try:
            self.run = wandb.init(project=project, dir=output_dir, config=config,
                                  name=run_name or os.path.basename(os.path.normpath(output_dir)))
        except wandb.errors.UsageError as exc:  # e.g. no API key, no tty to ask for one
            raise ConfigError(f"report_to wandb: {exc} (or set WANDB_API_KEY, or WANDB_MODE=offline to log "
                              f"without an account)") from None

    def log(self, row: dict) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service has written the run file (offline: 1 in ~3 runs of
        # wandb 0.31 left only its header); the service's shutdown waits for it
        self._wandb.teardown()


class Reporters:
    """The `report_to` reporters of one run, opened on the first row they get."""

    def __init__(self, names: list[str], output_dir: str, config: dict[str, Any], run_name: str | None = None):
        self.names, self.output_dir, self.config, self.run_name = names, output_dir, config, run_name
        self.resume_step: int | None = None
        self._open: list[Any] | None = None

    def resume_at(self, step: int) -> None:
        """Rows up to `step` are already logged (by the run this one resumes)."""
        self.resume_step = step

    def open(self) -> None:
        """Start the reporters now (else at the first row): a wandb login problem shows before training."""
        if self._open is not None:
            return
        self._open = []
        for name in self.names:
            if name == "tensorboard":
                purge = None if self.resume_step is None else self.resume_step + 1
                self._open.append(TensorBoardReporter(tensorboard_dir(self.output_dir, self.run_name), purge))
            elif name == "wandb":
                self._open.append(WandbReporter(self.output_dir, self.config, self.run_name))

    def log(self, row: dict) -> None:
        self.open()
        for reporter in self._open:
            reporter.log(row)

    def close(self) -> None:
        for reporter in self._open or []:
            reporter.close()
        self._open = None

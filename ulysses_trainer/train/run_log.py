"""Where a run's rows go: the line on stdout, metrics.jsonl and the report_to reporters (rank 0 writes), and
config.json. A failed write on rank 0 stops every rank together with its cause: the ranks agree on it at
a collective every rank runs (the run config's write, or the step's end), never one rank alone."""

from __future__ import annotations

import json
import logging
import os

import torch

from ..config import config_to_dict
from ..ds_config import DS_CONFIG_FILE
from ..errors import ConfigError
from ..parallel.comm import all_reduce
from . import run_report as report
from .checkpoint import EVENTS_FILE, agree_on_failure
from .eval_plot import PLOT, eval_rows, native_window, plot_eval_by_position
from .logging import MetricsFile, log_line
from .output_guard import OutputWriteError, describe_failure, failure_message
from .prepare import RunPlan
from .reporters import Reporters
from .resume_check import notes as resume_notes

log = logging.getLogger(__name__)

Failure = tuple[str, int, str]  # (the path, describe_failure's code, the error's text)


class RunLog:
    def __init__(self, plan: RunPlan, is_main: bool):
        cfg = plan.cfg
        self.is_main = is_main
        self.output_dir = cfg.output_dir
        self.metrics = MetricsFile(cfg.output_dir)
        self.events = MetricsFile(cfg.output_dir, EVENTS_FILE)  # not training rows: metrics.jsonl's all carry loss
        self.reporters = Reporters(plan.reporters, cfg.output_dir, config_to_dict(cfg), cfg.run_name)
        self.failure: Failure | None = None  # rank 0's failed row write, agreed at the step's end
        self.window = native_window(plan.model_config)  # drawn on the eval plot
        self.title = f"{cfg.model_name_or_path}, max_length {cfg.max_length:,}: eval loss by position"

    def write_run_config(self, plan: RunPlan, step: int) -> None:
        """config.json: this run's config, layout and data accounting; on resume the earlier runs' configs
        stay in its `history` with the step each change took effect. ds_config.json: the ZeRO JSON the engine
        runs, every "auto" filled. Rank 0 writes. Collective."""
        failure = None
        if self.is_main:
            path = os.path.join(self.output_dir, "config.json")
            record = report.run_config_record(plan, step, path)
            try:
                with open(path, "w") as f:
                    json.dump(record, f, indent=1)
                path = os.path.join(self.output_dir, DS_CONFIG_FILE)
                with open(path, "w") as f:
                    json.dump(plan.ds_config, f, indent=1)
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

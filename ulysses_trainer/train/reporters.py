"""`report_to` (TRL's name): every metrics.jsonl row also goes to TensorBoard and/or Weights & Biases.

run_name (TRL's) names the run: TensorBoard writes to output_dir/runs/RUN_NAME/, wandb names its run so.
Tags follow the HF Trainer's: `train/loss`, `train/grad_norm`, ... for a train row, `eval/loss` for
an eval row, at global step = the row's `step`. Reporters open on the first row (nothing is written
before the run starts) and only rank 0 logs.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError

TENSORBOARD_DIR = "runs"  # output_dir/runs/, as the HF Trainer's default logging_dir


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

"""A Hugging Face ``Trainer`` loop as a team would run it under torchrun: it never imports phalanx. A tiny
model made from its config (nothing is downloaded), random data, CPU and gloo. A callback (the Trainer's own
API) appends one JSON line per step to ``<dir>/steps-<pid>.jsonl`` and stretches each step by
``--step-time``. What phalanx knows of it comes from ``phalanx-run``'s instrumentation (phalanx.instrument):
the steps of the Trainer's optimizer and the all-reduces of its DDP model."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class TinyConfig(PretrainedConfig):
    model_type = "phalanx-tiny"

    def __init__(self, hidden: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden = hidden


class Tiny(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = nn.Sequential(nn.Linear(16, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))
        self.post_init()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, y), "logits": out}


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(16, generator=g), "y": torch.randn(1, generator=g)}


class StepLog(TrainerCallback):
    def __init__(self, path: Path, step_time: float) -> None:
        self.log = path.open("a")
        self.step_time = step_time

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.step_time)
        entry = {"step": state.global_step - 1, "time": time.time(), "rank": int(os.environ["RANK"])}
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    training = TrainingArguments(
        output_dir=str(d / "out"), max_steps=args.steps, per_device_train_batch_size=8, use_cpu=True,
        ddp_backend="gloo", report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no",
        dataloader_num_workers=0, learning_rate=1e-3,
    )  # fmt: skip
    trainer = Trainer(
        model=Tiny(TinyConfig()),
        args=training,
        train_dataset=Data(),
        callbacks=[StepLog(d / f"steps-{os.getpid()}.jsonl", args.step_time)],
    )
    trainer.train()


if __name__ == "__main__":
    main()

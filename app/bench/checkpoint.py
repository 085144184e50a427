"""`dflash bench checkpoint CONFIG`: how long a checkpoint holds training, written in place vs in the background.

The config's drafter (its exact shape, on the run's device) gets an AdamW state from one optimizer
step, then is checkpointed `--repeats` times each way into DIR:
- in place: `save_checkpoint` on the training thread (what training paid before), so training
  waits for the whole write, checksum and fsync;
- background: `CheckpointWriter.save` (what the trainer does), so training waits only for the host
  copy, and the write finishes behind it; the write's own time is reported too.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from app.checkpoint.store import save_checkpoint
from app.checkpoint.writer import CheckpointWriter
from app.config import RunConfig
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.loading import pick_device
from app.model.target import target_text_config
from app.train.step import build_optimizer


def run_checkpoint_bench(config: RunConfig, workdir: Path, repeats: int) -> dict[str, Any]:
    device = pick_device(config.train.device)
    arch = DrafterArch.from_config(config, target_text_config(config.target))
    drafter = DFlashDrafter(arch, seed=config.train.seed, device=device)
    optimizer = build_optimizer(drafter, config.train, device)
    for parameter in drafter.parameters():  # one step gives the optimizer its full state
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()

    def state() -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], dict[str, Any]]:
        return drafter.state_dict(), optimizer.state_dict(), {"cpu": torch.get_rng_state()}, {"bench": True}

    in_place, paused, written = [], [], []
    writer = CheckpointWriter(workdir / "background", keep_last=1)
    for step in range(1, repeats + 1):
        started = time.perf_counter()
        save_checkpoint(workdir / "in_place", step, *state(), keep_last=1)
        in_place.append(time.perf_counter() - started)

        started = time.perf_counter()
        writer.save(step, *state())
        paused.append(time.perf_counter() - started)
        writer.completed(block=True)
        written.append(time.perf_counter() - started)
    size = sum(p.stat().st_size for p in (workdir / "in_place").rglob("*") if p.is_file())
    shutil.rmtree(workdir / "in_place")
    shutil.rmtree(workdir / "background")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "checkpoint_bytes": size,
        "in_place_s": statistics.median(in_place),
        "background_pause_s": statistics.median(paused),
        "background_first_pause_s": paused[0],  # the first save also allocates the host buffers
        "background_write_s": statistics.median(written),
        "repeats": repeats,
    }


def format_report(result: dict[str, Any]) -> str:
    gigabytes = result["checkpoint_bytes"] / 1e9
    in_place, pause = result["in_place_s"], result["background_pause_s"]
    return "\n".join(
        [
            f"checkpoint of a {result['parameters'] / 1e6:.1f}M-parameter drafter + AdamW state: {gigabytes:.2f} GB "
            f"on {result['device']} (torch {result['torch']}), median of {result['repeats']}",
            f"in place:   training waits {in_place:.2f}s ({gigabytes / in_place:.2f} GB/s)",
            f"background: training waits {pause:.2f}s for the host copy (the first save, which allocates "
            f"the host buffers: {result['background_first_pause_s']:.2f}s); the write completes "
            f"{result['background_write_s']:.2f}s after the save began",
            f"training pause: {pause / in_place:.0%} of the in-place save ({in_place / pause:.1f}x shorter)",
        ]
    )

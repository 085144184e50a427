"""The training loop: feature batches in, drafter checkpoints out, resumable exactly.

Everything that decides what step N computes is a function of (config, step, data cursor):
data order and anchors come from (seed, epoch, batch index), the learning rate from the step,
feature noise from (seed, step). So a run resumed from a checkpoint (weights, optimizer, cursor)
takes bit-identical steps to one that never stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.atomic import write_json_atomic
from app.checkpoint.store import check_training_signal, load_latest_checkpoint, save_checkpoint
from app.config import RunConfig, default_gamma
from app.data.batch import FeatureBatch
from app.data.batching import BatchPlanner, DataCursor, PlannedBatch
from app.data.dataset import load_training_data, tokenizer_fingerprint
from app.data.tokenize import pad_token_id
from app.errors import UserError
from app.evaluate.prompts import prompts_from_dataset
from app.evaluate.speculative import evaluate_tau
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.objective import drafter_loss, feature_noise_std
from app.model.target import TargetModel, load_target
from app.pipeline.colocated import ColocatedFeatureSource
from app.telemetry.logline import LogLine
from app.telemetry.reporter import HealthWatch, MetricsFile, Reporter
from app.train.schedule import learning_rate

Log = Callable[[str], None]


class TrainingStopped(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was written at `step` and the run can be resumed."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by signal at step {step}; checkpoint {checkpoint}; resume with --resume")
        self.step = step
        self.checkpoint = checkpoint


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf: the run stops, naming the step and the batch that did it."""

    def __init__(self, step: int, planned: PlannedBatch) -> None:
        super().__init__(
            f"non-finite loss at step {step} (epoch {planned.epoch}, batch {planned.index}, "
            f"samples {planned.sample_ids[:8]}{'...' if len(planned.sample_ids) > 8 else ''}); "
            f"resume from the last checkpoint with a lower train.lr or inspect those samples"
        )


@dataclass
class StepOutput:
    """One optimizer step's metrics, still on the device (read them on log steps only)."""

    loss: torch.Tensor
    acc: torch.Tensor
    streak: torch.Tensor
    noise: float
    grad_norm: torch.Tensor


@dataclass
class TrainResult:
    """What a finished (or max_steps-capped) run produced."""

    run_dir: Path
    steps: int
    checkpoint: Path
    losses: list[float]
    """Loss of every step this process trained, in order (golden curves, resume checks)."""
    evals: list[dict[str, Any]] = field(default_factory=list)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA device is visible")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def tokenizer_dir(config: RunConfig) -> Path:
    """The target tokenizer's directory: `target.tokenizer`, else the target's own."""
    target = config.target
    if target.tokenizer is not None:
        return Path(target.tokenizer)
    if target.path is not None:
        return Path(target.path)
    if target.builtin is not None:
        from app.model.tiny_lm import ensure_tiny_lm

        return ensure_tiny_lm()
    raise UserError(
        "target.tokenizer: required with target.architecture (a random-weight target has no tokenizer)"
    )


def load_tokenizer(config: RunConfig) -> PreTrainedTokenizerBase:
    directory = tokenizer_dir(config)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"{directory}: cannot load a tokenizer ({str(error).splitlines()[0]})") from None


def training_signal(
    config: RunConfig, target: TargetModel, tokenizer: PreTrainedTokenizerBase
) -> dict[str, Any]:
    """What defines what the drafter learns; a resume must not change any of it."""
    source = config.target
    identity = source.path or source.builtin or json.dumps(source.architecture, sort_keys=True)
    return {
        "train.anchors": config.train.anchors,
        "drafter.block_size": config.drafter.block_size,
        "drafter.target_layer_ids": target.layer_ids,
        "drafter.mask_token_id": config.drafter.mask_token_id,
        "drafter.num_layers": config.drafter.num_layers,
        "target": identity,
        "target.seed": source.seed if source.architecture is not None else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


class Trainer:
    """Single-process trainer (target and drafter colocated); the distributed trainer reuses `train_step`."""

    def __init__(
        self,
        config: RunConfig,
        *,
        resume: bool = False,
        log: Log = print,
        reporters: list[Reporter] | None = None,
        watches: list[HealthWatch] | None = None,
    ) -> None:
        self.config = config
        self.log = log
        self.reporters: list[Reporter] = [MetricsFile(), *(reporters or [])]
        self.watches: list[HealthWatch] = watches or []
        self.run_dir = Path(config.train.output_dir)
        self.device = pick_device(config.train.device)
        self.tokenizer = load_tokenizer(config)
        # Data is loaded (and an empty dataset refused) before any model is built.
        self.train_data, self.eval_data = load_training_data(config, self.tokenizer)
        log(self.train_data.summary.describe())
        self.planner = BatchPlanner.from_config(self.train_data.lengths, config.data, config.train.seed)
        self.total_steps = self.planner.total_batches(config.train.epochs)
        if config.train.max_steps is not None:
            self.total_steps = min(self.total_steps, config.train.max_steps)

        self.target = load_target(config, self.device)
        self.drafter = DFlashDrafter(DrafterArch.from_config(config, self.target), seed=config.train.seed).to(
            self.device
        )
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=config.train.lr,
            betas=config.train.betas,
            weight_decay=config.train.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.gamma = config.train.gamma or default_gamma(config.drafter.block_size)
        self.signal = training_signal(config, self.target, self.tokenizer)
        self.step = 0
        self.cursor = DataCursor()
        if resume:
            self._resume()
        self._stop_requested = False

    # ---- the step ---------------------------------------------------------------------------------

    def train_step(self, features: FeatureBatch) -> StepOutput:
        """One optimizer step on one feature batch (no host sync: metrics stay on the device)."""
        train = self.config.train
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, self.total_steps, train)
        noise_std = feature_noise_std(train, self.step)
        autocast = torch.autocast(
            self.device.type,
            dtype=torch.bfloat16,
            enabled=self.device.type == "cuda" and train.precision == "bf16",
        )
        with autocast:
            out = drafter_loss(
                self.drafter,
                features,
                self.target.embed_tokens,
                self.target.lm_head,
                gamma=self.gamma,
                chunk_size=train.loss_chunk_size,
                noise_std=noise_std,
                generator=self._noise_generator() if noise_std > 0 else None,
            )
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepOutput(out.loss.detach(), out.acc, out.streak, out.noise, grad_norm.detach())

    def _noise_generator(self) -> torch.Generator:
        digest = hashlib.blake2b(
            f"noise:{self.config.train.seed}:{self.step}".encode(), digest_size=8
        ).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little") >> 1)

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        config, train = self.config, self.config.train
        self._write_run_files()
        source = ColocatedFeatureSource(
            self.target,
            self.train_data,
            self.planner,
            token_budget=config.data.token_budget,
            anchors=train.anchors,
            pad_token_id=pad_token_id(self.tokenizer),
            seed=train.seed,
        )
        self.log(
            f"training {sum(p.numel() for p in self.drafter.parameters()) / 1e6:.2f}M drafter parameters on "
            f"{self.device}: {self.total_steps} steps ({train.epochs} epochs of "
            f"{self.planner.total_batches(1)} batches), resuming at step {self.step}"
        )
        losses: list[float] = []
        evals: list[dict[str, Any]] = []
        window = _Window(time.monotonic(), self.step, 0, 0)
        pending: list[tuple[PlannedBatch, StepOutput]] = []
        started = time.monotonic()
        checkpoint = self.run_dir
        previous_handlers = self._install_signal_handlers()
        exit_reason = "completed"
        try:
            for planned, features in source.batches(self.cursor, train.epochs):
                if self.step >= self.total_steps:
                    break
                pending.append((planned, self.train_step(features)))
                self.cursor = planned.next_cursor
                if self.step % config.telemetry.log_every == 0 or self.step == self.total_steps:
                    losses += self._log(pending, window, source, started, planned.epoch)
                    pending = []
                    window = _Window(
                        time.monotonic(), self.step, source.stats.target_batches, source.stats.real_tokens
                    )
                if train.eval_every and self.step % train.eval_every == 0:
                    evals.append(self.evaluate())
                if self.step % train.save_every == 0 or self._stop_requested:
                    checkpoint = self.save()
                if self._stop_requested:
                    exit_reason = "stopped"
                    raise TrainingStopped(self.step, checkpoint)
            if pending:
                losses += self._log(pending, window, source, started, self.cursor.epoch)
            checkpoint = self.save()
        except TrainingStopped:
            raise
        except BaseException as error:
            exit_reason = (
                f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
            raise
        finally:
            source.close()
            self._restore_signal_handlers(previous_handlers)
            for reporter in self.reporters:
                reporter.on_exit(exit_reason, self.step)
        self.log(f"done: {self.step} steps in {time.monotonic() - started:.0f}s; checkpoint {checkpoint}")
        return TrainResult(self.run_dir, self.step, checkpoint, losses, evals)

    def _log(
        self,
        pending: list[tuple[PlannedBatch, StepOutput]],
        window: _Window,
        source: ColocatedFeatureSource,
        started: float,
        epoch: int,
    ) -> list[float]:
        """Average the window's metrics (one host sync per log line, not per step) and print the line."""
        outputs = [out for _, out in pending]
        losses = torch.stack([out.loss.float() for out in outputs]).tolist()
        for offset, ((planned, _), loss) in enumerate(zip(pending, losses, strict=True)):
            if not math.isfinite(loss):
                raise NonFiniteLoss(window.step + offset + 1, planned)
        grad_norm = torch.stack([out.grad_norm.float() for out in outputs]).mean().item()
        acc = torch.stack([out.acc.float() for out in outputs]).mean().item()
        streak = torch.stack([out.streak.float() for out in outputs]).mean().item()
        now = time.monotonic()
        seconds = max(now - window.started, 1e-9)
        steps = self.step - window.step
        batches_per_epoch = len(self.planner.plan(epoch))
        remaining = self.total_steps - self.step
        line = LogLine(
            elapsed_s=now - started,
            step=self.step,
            loss=sum(losses) / len(losses),
            acc=acc,
            streak=streak,
            lr=self.optimizer.param_groups[0]["lr"],
            noise=outputs[-1].noise,
            target_batches_per_s=(source.stats.target_batches - window.target_batches) / seconds,
            drafter_batches_per_s=steps / seconds,
            tokens_per_s=(source.stats.real_tokens - window.real_tokens) / seconds,
            q_pre=source.stats.q_pre,
            q_hs=source.stats.q_hs,
            epoch_progress=epoch + self.cursor.batch / max(1, batches_per_epoch),
            eta_s=remaining * seconds / max(1, steps),
            memory_gb=_cuda_memory_gb(self.device),
        )
        record = {**asdict(line), "step_losses": losses, "grad_norm": grad_norm}
        line.events = record["events"] = [event for watch in self.watches for event in watch.check(record)]
        self.log(line.render())
        for reporter in self.reporters:
            reporter.on_log(record)
        return losses

    # ---- eval -------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Acceptance length tau of the current drafter on held-out prompts (greedy speculative decoding)."""
        train = self.config.train
        prompts = prompts_from_dataset(self.eval_data, train.eval_prompts)
        autocast = torch.bfloat16 if self.device.type == "cuda" and train.precision == "bf16" else None
        self.drafter.eval()
        try:
            result = evaluate_tau(
                self.target,
                self.drafter,
                prompts,
                train.eval_max_new_tokens,
                self.tokenizer.eos_token_id,
                autocast,
            )
        finally:
            self.drafter.train()
        record = {
            "step": self.step,
            "eval": {"tau": result.tau, "rounds": result.rounds, "generated_tokens": result.generated_tokens},
        }
        self.log(
            f"eval step={self.step}: tau={result.tau:.3f} over {result.rounds} rounds of {len(prompts)} prompts"
        )
        for reporter in self.reporters:
            reporter.on_log(record)
        return record["eval"]

    # ---- checkpoints --------------------------------------------------------------------------------

    def save(self) -> Path:
        """Write a complete checkpoint of the current step and tell the reporters."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        path = save_checkpoint(
            self.run_dir,
            self.step,
            self.drafter.state_dict(),
            self.optimizer.state_dict(),
            rng,
            {
                "cursor": self.cursor.state_dict(),
                "plan": self.planner.fingerprint,
                "total_steps": self.total_steps,
                "signal": self.signal,
            },
            keep_last=self.config.train.keep_last,
        )
        for reporter in self.reporters:
            reporter.on_checkpoint(path, self.step)
        return path

    def _resume(self) -> None:
        checkpoint = load_latest_checkpoint(self.run_dir, map_location=self.device)
        if checkpoint is None:
            self.log(f"no checkpoint in {self.run_dir}; starting from step 0")
            return
        check_training_signal(checkpoint.state["signal"], self.signal, checkpoint.path)
        if checkpoint.state["plan"] != self.planner.fingerprint:
            raise UserError(
                f"{checkpoint.path}: cannot resume: the training data or batching settings changed "
                f"(batch plan {checkpoint.state['plan']} != {self.planner.fingerprint})"
            )
        self.drafter.load_state_dict(checkpoint.model_state)
        self.optimizer.load_state_dict(checkpoint.optimizer_state)
        torch.set_rng_state(checkpoint.rng_state["cpu"])
        if "cuda" in checkpoint.rng_state and self.device.type == "cuda":
            torch.cuda.set_rng_state(checkpoint.rng_state["cuda"], self.device)
        self.step = checkpoint.step
        self.cursor = DataCursor.from_state_dict(checkpoint.state["cursor"])
        self.log(
            f"resumed from {checkpoint.path} at step {self.step} (epoch {self.cursor.epoch}, batch {self.cursor.batch})"
        )

    # ---- run directory ------------------------------------------------------------------------------

    def _write_run_files(self) -> None:
        from app.env import collect_fingerprint, save_fingerprint

        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.config.model_dump(mode="json")
        fingerprint = collect_fingerprint()
        write_json_atomic(self.run_dir / "config.json", config)
        save_fingerprint(fingerprint, self.run_dir / "fingerprint.json")
        for reporter in self.reporters:
            reporter.on_start(self.run_dir, config, fingerprint)

    # ---- signals ------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        def request_stop(signum: int, frame: Any) -> None:
            self.log(f"received {signal.Signals(signum).name}: checkpointing after this step")
            self._stop_requested = True

        return {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class _Window:
    """Counters at the previous log line; rates are over the window since then."""

    started: float
    step: int
    target_batches: int
    real_tokens: int


def _cuda_memory_gb(device: torch.device) -> tuple[float, float] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / 1e9, torch.cuda.memory_reserved(device) / 1e9

"""The training loop: feature batches in, drafter checkpoints out, resumable exactly.

Everything that decides what step N computes is a function of (config, step, data cursor):
data order and anchors come from (seed, epoch, batch index), the learning rate from the step,
feature noise from (seed, step, position in the round). So a run resumed from a checkpoint
(weights, optimizer, cursor) takes bit-identical steps to one that never stopped.

One trainer serves every drafter rank. Each optimizer step trains one round of the epoch plan
(`app.pipeline.assignment`): this rank's `grad_accum` micro-batches, gradients averaged over the
drafter group by DDP. Alone (no runtime) it is the colocated single-process trainer; under torchrun
it is a colocated rank (own target, own share of each round) or a split drafter rank (features from
target ranks, the target's embedding and LM head received from target 0). Only drafter rank 0 logs,
evaluates and writes checkpoints; the cursor it saves is global (the plan position), so resume works
for any topology.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.atomic import write_json_atomic
from app.checkpoint.store import PREFIX, check_run_directory, checkpoint_root, load_latest_checkpoint
from app.checkpoint.writer import CheckpointWriteError, CheckpointWriter, SavedCheckpoint
from app.compile.prepare import CompileReport, prepare_compiled_training
from app.config import RunConfig
from app.data.batching import BatchPlanner, DataCursor, plan_stats
from app.data.tokenize import pad_token_id
from app.env.guard import ALLOW_SETTING, EnvironmentCheck, check_environment
from app.env.record import append_start
from app.errors import UserError
from app.evaluate.evaluator import Evaluator
from app.evaluate.prompts import prompts_from_dataset
from app.model.drafter import DFlashDrafter, DrafterArch, with_derived_defaults
from app.model.drafter_init import init_from_target
from app.model.flops import forward_flops, step_flops
from app.model.objective import TreeSample, feature_noise_std, noise_generator
from app.model.target import resolve_layer_ids, target_dtype, target_text_config
from app.pipeline.assignment import RoundPlanner
from app.pipeline.colocated import ColocatedFeatureSource
from app.pipeline.distributed import Runtime
from app.pipeline.inputs import load_run_inputs
from app.pipeline.remote import RemoteFeatureSource
from app.pipeline.sidechannel import StartPoint
from app.pipeline.source import FeatureSource, StepBatches
from app.pipeline.transport import receive_heads
from app.telemetry.compile_watches import compile_watches
from app.telemetry.hardware import reference_peak
from app.telemetry.logline import legend
from app.telemetry.reporter import HealthWatch, Reporter, RunStart
from app.train.metrics import StepOutput, StepSums, TrainingMetrics
from app.train.reporting import run_telemetry
from app.train.resume import check_resumable, refuse_if_all_damaged
from app.train.schedule import learning_rate, schedule_settings
from app.train.setup import training_signal
from app.train.signals import StopRequest
from app.train.step import BorrowedHeads, DrafterStep

Log = Callable[[str], None]


class TrainingStopped(Exception):
    """SIGTERM/SIGINT arrived; a checkpoint was written at `step` and the run can be resumed."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by signal at step {step}; checkpoint {checkpoint}; resume with --resume")
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class TrainResult:
    """What a finished (or max_steps-capped) run produced."""

    run_dir: Path
    steps: int
    checkpoint: Path
    losses: list[float]
    """Loss of every step this process trained, in order (golden curves, resume checks); in a
    distributed run, the mean over every drafter rank's batches of the step."""
    evals: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """The drafter's training loop on one rank (alone: target and drafter colocated in this process).

    It reports what its config says (`app.train.reporting`); `reporters` and `watches` join those."""

    def __init__(
        self,
        config: RunConfig,
        *,
        resume: bool = False,
        log: Log = print,
        reporters: list[Reporter] | None = None,
        watches: list[HealthWatch] | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self.is_logger = runtime is None or runtime.layout.is_logger
        self.log = log
        self.telemetry = run_telemetry(
            config, log, is_logger=self.is_logger, reporters=reporters or [], watches=watches or []
        )
        self.run_dir = Path(config.train.output_dir)
        self.environment = self._check_start(resume)
        self.checkpoints = CheckpointWriter(self.run_dir, keep_last=config.train.keep_last)
        # Data is loaded (and an empty dataset refused) before any model is built.
        inputs = load_run_inputs(
            config,
            runtime,
            fingerprint=self.environment.fingerprint,
            with_target=runtime is None or runtime.layout.colocated,
        )
        self.environment = self.environment.also_accepting(inputs.accepted)
        self.device, self.tokenizer, self.target = inputs.device, inputs.tokenizer, inputs.target
        assert inputs.train_data is not None and inputs.eval_data is not None
        self.train_data, self.eval_data = inputs.train_data, inputs.eval_data
        self.planner, self.rounds, self.total_steps = self._plan()
        self.heads, arch, layer_ids = self._target_side()
        self.config = config = with_derived_defaults(config, arch)  # what config.json records
        self.drafter = DFlashDrafter(arch, seed=config.train.seed, device=self.device)
        if config.drafter.init == "target" and self.target is not None:
            self._note(init_from_target(self.drafter, self.target))
        self.drafter_step = DrafterStep(config, self.drafter, self.heads, self.device)
        self._tree_sample = TreeSample.from_config(config.train, config.telemetry.tree_streak_blocks)
        self.optimizer = self.drafter_step.optimizer
        self.signal = training_signal(config, layer_ids, self.tokenizer)
        self.step, self.cursor = 0, DataCursor()
        self.resumed = self._start_point(resume)
        self.compile_report = self._prepare_compiled()
        self.stop_request = StopRequest(self._note)
        self.peak = reference_peak(config.telemetry.peak_tflops, self.device, config.train.precision)
        self.metrics = TrainingMetrics(
            self.telemetry, runtime=runtime, planner=self.planner, total_steps=self.total_steps,
            device=self.device, peak=self.peak, noise=config.train.feature_noise_std > 0,
            colocated=self.target is not None,
        )  # fmt: skip

    # ---- the start --------------------------------------------------------------------------------

    def _check_start(self, resume: bool) -> EnvironmentCheck:
        """The run directory and the environment, checked before the target and the data load: a wrong
        directory or a drifted environment is refused in seconds, not minutes."""
        if self.is_logger:
            check_run_directory(self.run_dir, resume)
        return check_environment(
            self.run_dir if self.is_logger else None,
            resume=resume,
            allow_drift=self.config.train.allow_environment_drift,
        )

    def _plan(self) -> tuple[BatchPlanner, RoundPlanner, int]:
        """The epoch plan of the training data, its rounds on this layout and the steps the run trains."""
        config, data = self.config, self.train_data
        self._note(data.summary.describe())
        planner = BatchPlanner.from_config(data.lengths, config.data, config.train.seed)
        shapes = planner.shapes
        self._note(
            f"target batches (epoch 0): {plan_stats(planner.plan(0), data.lengths, shapes).describe()}"
            f"; the run's {shapes.describe()}"
        )
        layout = self.runtime.layout if self.runtime is not None else None
        rounds = RoundPlanner.for_layout(planner, layout, config.train.grad_accum)
        total_steps = rounds.total_steps(config.train.epochs)
        if config.train.max_steps is not None:
            total_steps = min(total_steps, config.train.max_steps)
        return planner, rounds, total_steps

    def _target_side(self) -> tuple[BorrowedHeads, DrafterArch, list[int]]:
        """The heads the drafter borrows (a split drafter rank, without the target, receives them from
        target 0), the drafter's shape and the target layers it reads."""
        config, target = self.config, self.target
        if target is None:
            text_config = target_text_config(config.target)
            heads = BorrowedHeads(*receive_heads(self.runtime, target_dtype(config.target, self.device)))
            layer_ids = resolve_layer_ids(config.drafter, text_config.num_hidden_layers)
            return heads, DrafterArch.from_config(config, text_config), layer_ids
        heads = BorrowedHeads(target.embed_tokens, target.lm_head)
        return heads, DrafterArch.from_config(config, target), target.layer_ids

    # ---- the step ---------------------------------------------------------------------------------

    def train_step(self, batches: StepBatches) -> StepOutput:
        """One optimizer step over this rank's micro-batches (no host sync: metrics stay on the device).

        Gradients accumulate over the micro-batches (their mean); with DDP the all-reduce runs on the
        last one only and averages over the drafter group. Padding batches carry zero loss: alone
        they are skipped, with DDP they run so every rank all-reduces alike.
        """
        step, train = self.drafter_step, self.config.train
        noise_std = feature_noise_std(train, self.step)
        distributed = step.replicated
        micro = batches.micro
        sums = StepSums.zeros(self.device)
        tree = self._tree_sample if (self.step + 1) % self.config.telemetry.log_every == 0 else None
        flops = torch.zeros((), dtype=torch.int64, device=self.device)
        for number, item in enumerate(micro):
            if item.planned is None and not distributed:
                continue
            last = number == len(micro) - 1
            position = number * self.rounds.drafters + self._drafter_index
            with step.accumulating(last):  # forward and backward both inside
                out = step.backward(
                    item.features,
                    micro_batches=len(micro),
                    noise_std=noise_std,
                    generator=noise_generator(train.seed, self.step, position, self.device)
                    if noise_std > 0
                    else None,
                    tree_sample=tree if last and item.planned is not None else None,
                )
            if item.planned is not None:
                sums.add(out)
                flops += step_flops(forward_flops(self.drafter.arch, item.features.row))
        grad_norm = step.apply(learning_rate(self.step, self.total_steps, train), loss=sums.loss)
        self.step += 1
        return StepOutput(sums, float(noise_std), grad_norm.detach(), batches.round, flops)

    @property
    def _drafter_index(self) -> int:
        return self.runtime.layout.index if self.runtime is not None else 0

    # ---- the loop ---------------------------------------------------------------------------------

    def _announce_start(self) -> None:
        """The run's first lines: what trains where and how long, the log line's legend, who feeds whom."""
        config, train = self.config, self.config.train
        epochs = (
            f"{train.epochs} epochs of {self.planner.total_batches(1)} batches, {self.rounds.size} per step"
        )
        if self.total_steps < self.rounds.total_steps(train.epochs):
            epochs = f"capped by train.max_steps; {epochs} would be {self.rounds.total_steps(train.epochs)}"
        self._note(
            f"training {sum(p.numel() for p in self.drafter.parameters()) / 1e6:.2f}M drafter parameters on "
            f"{self._where()}: {self.total_steps} steps ({epochs}), "
            + (f"resuming at step {self.step}" if self.resumed else "from step 0")
        )
        self._note(legend(config, self.device, self.peak, colocated=self.target is not None))
        if self.rounds.feeding is not None:  # split: who feeds whom, and the traffic between nodes
            width, itemsize = self.drafter.arch.feature_size, self.heads.embed_tokens.weight.dtype.itemsize
            self._note(self.rounds.feeding.describe(config.data.token_budget, width, itemsize))
        if train.eval_every and self.target is None:
            self._note(
                "periodic eval (train.eval_every) needs the target on the drafter rank: skipped in a split "
                "topology; measure tau offline with `dflash eval RUN_DIR` on the checkpoints"
            )

    def run(self) -> TrainResult:
        train, metrics = self.config.train, self.metrics
        if self.is_logger:
            self._write_run_files()
        source = self._feature_source()
        self._announce_start()
        losses: list[float] = []
        evals: list[dict[str, Any]] = []
        metrics.start(self.step)
        checkpoint = self.run_dir
        self.stop_request.install()
        exit_reason = "completed"
        try:
            for batches in source.steps(self.cursor, train.epochs, self.total_steps - self.step):
                metrics.add(self.train_step(batches))
                self.cursor = batches.next_cursor
                if self.step % self.config.telemetry.log_every == 0 or self.step == self.total_steps:
                    losses += self._log(source)
                if self._eval_due():
                    with metrics.paused(evaluation=True):
                        evals.append(self.evaluate())
                stop = self.stop_request.agreed(self.runtime)
                if self.step % train.save_every == 0 or stop:
                    metrics.refuse_non_finite(self.step)  # no non-finite state is ever checkpointed
                    with metrics.paused():
                        checkpoint = self.save()
                self._report_checkpoints(self.checkpoints.completed(block=stop))
                if stop:
                    exit_reason = "stopped"
                    raise TrainingStopped(self.step, checkpoint)
            losses += self._log(source)  # the steps since the last line, if the data ran out first
            checkpoint = self.save()
            self._report_checkpoints(self.checkpoints.completed(block=True))
        except TrainingStopped:
            raise
        except BaseException as error:
            exit_reason = (
                f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
            raise
        finally:
            source.close()
            self.stop_request.restore()
            self._settle_checkpoints()
            self._finish(exit_reason)
        self._note(f"done: {self.step} steps in {metrics.elapsed_s:.0f}s; checkpoint {checkpoint}")
        return TrainResult(self.run_dir, self.step, checkpoint, losses, evals)

    def _log(self, source: FeatureSource) -> list[float]:
        lr = self.optimizer.param_groups[0]["lr"]
        return self.metrics.log(self.step, self.cursor, source.stats, lr)

    def _eval_due(self) -> bool:
        """Periodic eval runs on the logging rank when it holds the target (the others wait at the next step)."""
        every = self.config.train.eval_every
        return bool(every) and self.step % every == 0 and self.target is not None and self.is_logger

    def _feature_source(self) -> FeatureSource:
        config, runtime = self.config, self.runtime
        if self.target is not None:
            return ColocatedFeatureSource(
                self.target, self.train_data, self.rounds, drafter=self._drafter_index,
                token_budget=config.data.token_budget, anchors=config.train.anchors,
                pad_token_id=pad_token_id(self.tokenizer), seed=config.train.seed,
                prefetch=config.topology.prefetch_batches, forward=self.compile_report.target_forward,
                final_hidden=config.train.soft_targets > 0,
            )  # fmt: skip
        assert runtime is not None
        return RemoteFeatureSource(
            runtime,
            self.rounds,
            token_budget=config.data.token_budget,
            anchors=config.train.anchors,
            feature_size=self.drafter.arch.feature_size,
            dtype=self.heads.embed_tokens.weight.dtype,
            capacity=config.topology.feature_queue,
        )

    def _finish(self, exit_reason: str) -> None:
        if self.runtime is not None and self.is_logger and not exit_reason.startswith("failed"):
            self.runtime.side.publish_finished(exit_reason, self.step)  # target ranks stop waiting
        self.telemetry.on_exit(exit_reason, self.step)

    # ---- eval -------------------------------------------------------------------------------------

    @functools.cached_property
    def evaluator(self) -> Evaluator:
        """tau on `train.eval_prompts` held-out prompts (the rank must hold the target)."""
        if self.target is None:
            raise UserError("eval: this rank holds no target (split topology); use `dflash eval RUN_DIR`")
        prompts = prompts_from_dataset(self.eval_data, self.config.train.eval_prompts)
        return Evaluator(self.config, self.target, self.tokenizer, prompts.ids, domains=prompts.domains)

    def evaluate(self) -> dict[str, Any]:
        """Acceptance length tau of the current drafter on held-out prompts (greedy speculative decoding)."""
        result = self.evaluator(self.drafter)
        if self.device.type == "cuda":  # eval's blocks, left reserved, read as training's memory growing
            torch.cuda.empty_cache()
        record = {"step": self.step, "eval": result.summary()}
        self.log(f"eval step={self.step}: {result.summary_line()}")
        self.telemetry.on_record(record)
        return record["eval"]

    # ---- checkpoints --------------------------------------------------------------------------------

    def save(self) -> Path:
        """Checkpoint the current step (drafter rank 0 only): the state is copied to host memory now
        and written in the background; the reporters hear of it once it is complete."""
        if not self.is_logger:
            return checkpoint_root(self.run_dir) / f"{PREFIX}{self.step:08d}"
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return self.checkpoints.save(
            self.step,
            self.drafter.state_dict(),
            self.optimizer.state_dict(),
            rng,
            {
                "cursor": self.cursor.state_dict(),
                "plan": self.planner.fingerprint,
                "total_steps": self.total_steps,
                "schedule": schedule_settings(self.total_steps, self.config.train),
                "signal": self.signal,
                "batches_per_step": self.rounds.size,
            },
        )

    def _report_checkpoints(self, saved: list[SavedCheckpoint]) -> None:
        for checkpoint in saved:
            self.telemetry.on_checkpoint(checkpoint.path, checkpoint.step)

    def _settle_checkpoints(self) -> None:
        """On the way out, also of a failure: the write in flight completes and is reported."""
        try:
            self._report_checkpoints(self.checkpoints.completed(block=True))
        except CheckpointWriteError as error:  # the run is already failing; say this too
            self.log(f"error: {error}")

    def _resume(self) -> bool:
        """Load the latest good checkpoint into this rank; False when there is none."""
        checkpoint = load_latest_checkpoint(self.run_dir, map_location=self.device)
        if checkpoint is None:
            refuse_if_all_damaged(self.run_dir)
            self.log(f"no checkpoint in {self.run_dir}; starting from step 0")
            return False
        check_resumable(
            checkpoint,
            signal=self.signal,
            plan=self.planner.fingerprint,
            total_steps=self.total_steps,
            batches_per_step=self.rounds.size,
            train=self.config.train,
            log=self.log,
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
        return True

    def _agree_on_start(self, runtime: Runtime, resumed: bool) -> bool:
        """Drafter rank 0 publishes where training starts; every other rank (targets too) takes it."""
        if self.is_logger:
            runtime.side.publish_start(StartPoint(self.step, self.cursor, resumed))
            return resumed
        start = runtime.side.wait_start(runtime.recv_timeout_s)
        self.step, self.cursor = start.step, start.cursor
        return start.resumed

    def _start_point(self, resume: bool) -> bool:
        """Whether training resumes: drafter rank 0 loads the latest good checkpoint, and under torchrun
        every rank takes the step and cursor it publishes."""
        resumed = self._resume() if resume and self.is_logger else False
        if self.runtime is not None:
            resumed = self._agree_on_start(self.runtime, resumed)
        return resumed

    def _prepare_compiled(self) -> CompileReport:
        """Main thread, before the feature source (and any thread or worker) exists: load, warm up,
        verify; then DDP over the drafter group, which broadcasts the (resumed) weights."""
        report = prepare_compiled_training(self.config, self.drafter_step, self.log, self.target)
        self.telemetry.watch(compile_watches(report, self.config))
        if self.runtime is not None and self.runtime.layout.num_drafters > 1:
            self.drafter_step.replicate(self.runtime, self.resumed)
        return report

    # ---- run directory ------------------------------------------------------------------------------

    def _write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.config.model_dump(mode="json")
        write_json_atomic(self.run_dir / "config.json", config)
        check = self.environment
        start = append_start(
            self.run_dir, check.fingerprint, step=self.step, accepted=check.accepted, new_run=not self.resumed,
            config=config,
        )  # fmt: skip
        for line in start.accepted:
            self.log(f"warning: DEGRADED start, accepted by {ALLOW_SETTING}: {line}")
        for line in check.notes:
            self.log(f"note: {line}")
        environment = {"start": start.start, "accepted": start.accepted}
        self.telemetry.on_start(
            RunStart(self.run_dir, config, check.fingerprint, self.compile_report.to_dict(), environment)
        )

    def _note(self, line: str) -> None:
        """A line only the logging rank prints (every drafter rank would print the same)."""
        if self.is_logger:
            self.log(line)

    def _where(self) -> str:
        if self.runtime is None:
            return str(self.device)
        layout = self.runtime.layout
        if layout.colocated:
            return f"{layout.num_drafters} colocated ranks ({self.device.type})"
        return f"{layout.num_drafters} drafter + {layout.num_targets} target ranks ({self.device.type})"

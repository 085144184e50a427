"""Real torchrun jobs of `dflash train` for the tests: one agent (a node) or several, their output,
their workers, and what the run directory logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny.toml"

KILL_RUN_STEPS = 30
"""Long enough that a run cannot finish before the test kills a rank at step 2 (queues are 1 deep)."""


def split(targets: int, drafters: int, nodes: int = 1) -> list[str]:
    """The overrides of a split topology of `targets` + `drafters` ranks over `nodes` nodes."""
    return [
        f"topology.target_ranks={targets}",
        f"topology.drafter_ranks={drafters}",
        f"topology.nnodes={nodes}",
        f"topology.nproc_per_node={(targets + drafters) // nodes}",
    ]


def child_environment() -> dict[str, str]:
    """Environment of the torchrun job: bytecode cached outside the tree, so that the 2-8 cold
    interpreter starts of each job do not recompile torch and transformers every time (this
    environment may set PYTHONDONTWRITEBYTECODE)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(Path.home() / ".cache" / "dflash" / "pycache")
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets anyway; the in-process references match it
    return env


def agent(options: list[str], overrides: list[str], log: Path, *flags: str) -> subprocess.Popen:
    """One torchrun agent (one node) with `options`, running `dflash train CONFIG overrides flags`."""
    command = [
        sys.executable, "-m", "torch.distributed.run", *options,
        "-m", "app", "train", str(CONFIG), *overrides, *flags,
    ]  # fmt: skip
    with open(log, "w") as handle:
        return subprocess.Popen(
            command, cwd=ROOT, env=child_environment(), stdout=handle, stderr=subprocess.STDOUT
        )


def torchrun(nproc: int, overrides: list[str], log: Path, *flags: str) -> subprocess.Popen:
    """A one-node job of `nproc` processes."""
    return agent(["--standalone", f"--nproc-per-node={nproc}"], overrides, log, *flags)


def finish(process: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    process.wait(timeout=timeout)
    return log.read_text()


def logged_steps(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def workers(agent: subprocess.Popen) -> dict[int, int]:
    """Global rank -> pid of each of torchrun's workers (children of the agent, by their RANK)."""
    found = {}
    for child in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        ranks = [entry[5:] for entry in environ if entry.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = int(child)
    return found


def worker_pid(agent: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker for global `rank`."""
    found = workers(agent)
    assert rank in found, f"no worker with RANK={rank} among {found}"
    return found[rank]


def kill_node(agent: subprocess.Popen) -> None:
    """A node lost at once: its agent and every worker SIGKILLed, nothing left to say goodbye."""
    pids = [agent.pid, *workers(agent).values()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def one_thread(function):
    """Run `function()` with one intra-op thread, like torchrun's workers: CPU sums then match bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function()
    finally:
        torch.set_num_threads(threads)


def assert_resumed_like_the_reference(run_dir: Path, resumed_from: int, reference: Path) -> None:
    """A run resumed at `resumed_from` ends with the reference's final weights and its losses after it."""
    from safetensors.torch import load_file

    final = f"checkpoints/step_{KILL_RUN_STEPS:08d}"
    resumed_weights = load_file(run_dir / final / "model.safetensors")
    for name, weight in load_file(reference / final / "model.safetensors").items():
        assert torch.equal(resumed_weights[name], weight), name
    reference_losses = [step["loss"] for step in logged_steps(reference)]
    resumed_losses = [step["loss"] for step in logged_steps(run_dir) if step["step"] > resumed_from]
    assert resumed_losses[-(KILL_RUN_STEPS - resumed_from) :] == reference_losses[resumed_from:]

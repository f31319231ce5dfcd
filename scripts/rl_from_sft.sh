#!/bin/bash
# Copy a finished run's state up to the end of its SFT phase into a new run folder, so an RL-only
# variant can be resumed from the same SFT checkpoint:  rl_from_sft.sh runs/SRC runs/DST
# then: agentrl train --resume runs/DST --set minutes=M --set ...
set -euo pipefail
src=$1; dst=$2
test ! -e "$dst"
mkdir -p "$dst"
for f in config.toml prompt.json learner-sft.toml trajectories_base.jsonl; do cp "$src/$f" "$dst/"; done
cp -al "$src/sft" "$dst/sft"
cp -a "$src/tasks" "$dst/tasks"
mkdir -p "$dst/evals" "$dst/logs"
for f in "$src"/evals/base_tool_call-* "$src"/evals/sft-*; do cp "$f" "$dst/evals/"; done
python3 - "$src" "$dst" <<'PY'
import json, sys
src, dst = sys.argv[1:]
phases = json.load(open(f"{src}/phases.json"))
keep = {k: phases[k] for k in ("baseline", "sft")}
json.dump(keep, open(f"{dst}/phases.json", "w"), indent=1)
evals = [json.loads(l) for l in open(f"{src}/evals.jsonl")]
with open(f"{dst}/evals.jsonl", "w") as f:
    for e in evals:
        if e["label"] in ("base_tool_call", "naive_rag", "sft"):
            f.write(json.dumps(e) + "\n")
PY
echo "$dst ready"

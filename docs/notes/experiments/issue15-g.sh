#!/bin/bash
# Issue 15 lever G: RL-only from E's SFT checkpoint (plan on), 1- and 2-hop questions mixed from the first step.
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
scripts/rl_from_sft.sh runs/i15-e-s0 runs/i15-g-s0
PYTHONSAFEPATH=1 .venv/bin/python -P -m agentrl.cli train --resume runs/i15-g-s0 --set minutes=16 \
  --set 'tasks.options.curriculum=[{hops=[1,2]}]' \
  --set learner.trainer.advantage.dynamic_sampling=true \
  --set env.rewards.duplicate_call=0.0 --set env.rewards.malformed_call=0.0 --set env.rewards.no_action=0.0 \
  --set eval.without_tools=false --set eval.transfer=false

"""How well a policy's search count separates 1-hop from 2-hop questions (issue 15, lever sets E-H).

For each held-out question of the run's world, the probability the policy gives to "1" against "2"
right after `<think>searches: ` (the `plan` option's count), by hop count, with the AUC of that
probability as a 1-hop-vs-2-hop score. Greedy decoding writes "1" only where it is above 0.5, so a
policy can separate the questions (AUC well above 0.5) and still write the same count for all of them.

    python -P docs/notes/experiments/plan_probe.py RUN_DIR/hf [WORKED_EXAMPLES]

The tasks, the environment and its options come from the exported run config
(RUN_DIR/hf/agentrl/config.toml), with `plan` on. WORKED_EXAMPLES: the hop counts of the worked
examples in the prompt, in this order for every question ("2,1" puts the 1-hop example last, to see
whether the count is copied from the nearest example); default: the run's own setting (with
`shuffle_worked_examples`, each question's own order).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.engine.chat import ChatFormat
from agentrl.engine.environments import env_options
from agentrl.engine.qa import MultiHopQAEnv, plan_text
from agentrl.engine.tasksets import load_taskset
from agentrl.engine.tools import LocalSearchTool
from agentrl.evaluate import EXPORTED_CONFIG
from agentrl.runconfig import load_run_config


def main(model_dir: str, worked_examples: tuple[int, ...] | None = None) -> None:
    config = load_run_config(Path(model_dir) / EXPORTED_CONFIG).config
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    taskset = load_taskset(config.tasks, Path(tempfile.mkdtemp()))
    options = dataclasses.replace(env_options(config.env), plan=True)
    if worked_examples is not None:
        options = dataclasses.replace(options, worked_examples=list(worked_examples), shuffle_worked_examples=False)
    env = MultiHopQAEnv(ChatFormat(tokenizer), config.env, options)
    env.register_tool(LocalSearchTool([json.loads(line) for line in open(taskset.corpus)]))
    (one,), (two,) = (tokenizer.encode(d, add_special_tokens=False) for d in "12")
    prefix = tokenizer.encode(plan_text(0).split("0")[0], add_special_tokens=False)  # "<think>searches: "
    p_one: dict[int, list[float]] = {1: [], 2: []}
    with torch.no_grad():
        for task in taskset.heldout:
            probs = torch.softmax(model(torch.tensor([[*env.reset(task).token_ids, *prefix]])).logits[0, -1], -1)
            p_one[task.metadata["num_hops"]].append(float(probs[one] / (probs[one] + probs[two])))
    shown = ",".join(map(str, worked_examples)) if worked_examples else "as trained"
    print(f"worked examples: {shown} ({'shuffled per task' if options.shuffle_worked_examples else 'fixed order'})")
    for hops, values in p_one.items():
        print(f"{hops}-hop: n={len(values)} p(1) mean {statistics.mean(values):.3f} median {statistics.median(values):.3f} "
              f"min {min(values):.3f} max {max(values):.3f}; greedy writes 1 on {sum(v > 0.5 for v in values)}")
    auc = sum((a > b) + 0.5 * (a == b) for a in p_one[1] for b in p_one[2]) / (len(p_one[1]) * len(p_one[2]))
    print(f"AUC of p(1), 1-hop against 2-hop: {auc:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(x) for x in sys.argv[2].split(",")) if len(sys.argv) > 2 else None)

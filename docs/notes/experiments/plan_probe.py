"""How well a policy's search count separates 1-hop from 2-hop questions (issue 15, lever sets E/F).

For each held-out question of the embedded default's world, the probability the policy gives to
"1" against "2" right after `<think>searches: ` (the `plan` option's count), by hop count, with the
AUC of that probability as a 1-hop-vs-2-hop score. Greedy decoding writes "1" only where it is
above 0.5, so a policy can separate the questions (AUC well above 0.5) and still write the same
count for all of them.

    python -P docs/notes/experiments/plan_probe.py RUN_DIR/hf [WORLD_SEED] [WORKED_EXAMPLES]

WORKED_EXAMPLES: the hop counts of the worked examples in the prompt, in order (default "1,2", the
lever sets' setting); "2,1" puts the 1-hop example last, to see whether the count is copied from
the nearest example.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig
from agentrl.engine.qa import MultiHopQAEnv, QAOptions, plan_text
from agentrl.engine.tasksets import TasksConfig, load_taskset
from agentrl.engine.tools import LocalSearchTool


def main(model_dir: str, world_seed: int = 0, worked_examples: tuple[int, ...] = (1, 2)) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    options = {"seed": world_seed, "num_companies": 400, "heldout_num": 96, "heldout_hops": [1, 2], "num_train": 400,
               "transfer_num": 0}
    taskset = load_taskset(TasksConfig(loader="synthetic", options=options), Path(tempfile.mkdtemp()))
    env = MultiHopQAEnv(ChatFormat(tokenizer), EnvConfig(max_turns=4, tool_list="signature"),
                        QAOptions(worked_examples=list(worked_examples), plan=True))
    env.register_tool(LocalSearchTool([json.loads(line) for line in open(taskset.corpus)]))
    (one,), (two,) = (tokenizer.encode(d, add_special_tokens=False) for d in "12")
    prefix = tokenizer.encode(plan_text(0).split("0")[0], add_special_tokens=False)  # "<think>searches: "
    p_one: dict[int, list[float]] = {1: [], 2: []}
    with torch.no_grad():
        for task in taskset.heldout:
            probs = torch.softmax(model(torch.tensor([[*env.reset(task).token_ids, *prefix]])).logits[0, -1], -1)
            p_one[task.metadata["num_hops"]].append(float(probs[one] / (probs[one] + probs[two])))
    for hops, values in p_one.items():
        print(f"{hops}-hop: n={len(values)} p(1) mean {statistics.mean(values):.3f} median {statistics.median(values):.3f} "
              f"min {min(values):.3f} max {max(values):.3f}; greedy writes 1 on {sum(v > 0.5 for v in values)}")
    auc = sum((a > b) + 0.5 * (a == b) for a in p_one[1] for b in p_one[2]) / (len(p_one[1]) * len(p_one[2]))
    print(f"AUC of p(1), 1-hop against 2-hop: {auc:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0,
         tuple(int(x) for x in sys.argv[3].split(",")) if len(sys.argv) > 3 else (1, 2))

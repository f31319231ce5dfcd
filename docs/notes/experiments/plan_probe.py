"""Probe: p(count token) after '<think>searches: ' for each held-out question, by hop count."""
import sys, json, statistics
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig
from agentrl.engine.qa import MultiHopQAEnv, QAOptions
from agentrl.engine.tasksets import TasksConfig, load_taskset
from agentrl.engine.tools import LocalSearchTool
import tempfile, pathlib

model_dir = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
chat = ChatFormat(tok)
ts = load_taskset(TasksConfig(loader="synthetic", options={"seed": int(sys.argv[2]) if len(sys.argv) > 2 else 0,
                  "num_companies": 400, "heldout_num": 96, "heldout_hops": [1, 2], "num_train": 400, "transfer_num": 0}),
                  pathlib.Path(tempfile.mkdtemp()))
env = MultiHopQAEnv(chat, EnvConfig(max_turns=4, tool_list="signature"), QAOptions(worked_examples=[1, 2], plan=True))
from agentrl.engine.tools import Tool
passages = [json.loads(l) for l in open(ts.corpus)]
env.register_tool(LocalSearchTool(passages))
ids_1, ids_2 = tok.encode("1", add_special_tokens=False), tok.encode("2", add_special_tokens=False)
assert len(ids_1) == len(ids_2) == 1
prefix = tok.encode("<think>searches: ", add_special_tokens=False)
res = {1: [], 2: []}
with torch.no_grad():
    for t in ts.heldout:
        ids = list(env.reset(t).token_ids) + prefix
        logits = model(torch.tensor([ids])).logits[0, -1]
        p = torch.softmax(logits, -1)
        res[t.metadata["num_hops"]].append(float(p[ids_1[0]] / (p[ids_1[0]] + p[ids_2[0]])))
for h, v in res.items():
    print(h, len(v), "mean p(1)=%.3f median=%.3f min=%.3f max=%.3f" % (statistics.mean(v), statistics.median(v), min(v), max(v)))
pairs = sum((a > b) + 0.5 * (a == b) for a in res[1] for b in res[2]) / (len(res[1]) * len(res[2]))
print("AUC p(1) separates 1-hop from 2-hop:", round(pairs, 3))
for thr in (0.2, 0.25, 0.3, 0.35, 0.4, 0.5):
    print(thr, "1-hop say 1:", sum(x > thr for x in res[1]), "/", len(res[1]), " 2-hop say 1:", sum(x > thr for x in res[2]), "/", len(res[2]))

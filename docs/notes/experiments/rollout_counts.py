"""Tabulate a QA rollout file (`agentrl rollout --out FILE`) by hop count, the search count the
policy wrote (`<think>searches: N`, "-" when it wrote none) and the searches it made, with how many
of those episodes were exact matches (issue 15, session 8). Prints a Markdown table.

    python3 docs/notes/experiments/rollout_counts.py FILE.jsonl
"""

from __future__ import annotations

import collections
import json
import re
import sys


def main(path: str) -> None:
    episodes: collections.Counter = collections.Counter()
    correct: collections.Counter = collections.Counter()
    for line in open(path):
        record = json.loads(line)
        hops = "1" if "-1h-" in record["task_id"] else "2"
        after = record["text"][record["text"].rfind("Question: "):]  # this episode, past the worked examples
        plan = re.search(r"<think>searches: (\d)", after)
        key = (hops, plan.group(1) if plan else "-", after.count("<tool_call>"))
        episodes[key] += 1
        correct[key] += int(record["metrics"].get("em", 0))
    print("| hops | wrote | searched | episodes | EM 1 |\n| --- | --- | --- | --- | --- |")
    for key in sorted(episodes):
        print(f"| {key[0]} | {key[1]} | {key[2]} | {episodes[key]} | {correct[key]} |")


if __name__ == "__main__":
    main(sys.argv[1])

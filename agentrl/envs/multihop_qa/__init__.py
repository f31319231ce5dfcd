"""Multi-hop question answering with a search tool (Agent-R1's setting), the embedded default's job.

    env.py      MultiHopQAEnv ([env] class = "multihop_qa") and its Naive RAG baseline
    tasks.py    the seeded synthetic world; HotpotQA / 2WikiMultihopQA / MuSiQue readers; passages
    loaders.py  the "synthetic" and "datasets" task loaders ([tasks] loader)
    metrics.py  EM / F1 with the SQuAD / HotpotQA normalisation

Import rule: that of agentrl.envs.
"""

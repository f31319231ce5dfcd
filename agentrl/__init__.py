"""agentrl: an asynchronous actor-learner engine for agentic RL.

This folder holds the applications, which wire the components together, and agentrl.common:

    cli.py        `agentrl COMMAND ...`: one entry point, a subcommand per component or application
    train.py      `agentrl train`: the supervisor (the run's state and processes, main);
                  phases/ its phases, budget.py its time-budget rules, summary.py its JSON line,
                  launch/ where its processes go
    runconfig.py  the run config tree, resolved from layers and checked across components
    evaluate.py   `agentrl eval` / `agentrl rollout`;  export.py `agentrl export`
    progress.py   status line, progress bar, TensorBoard / W&B of a run;  report.py report.md and plots
    demo.py       a quick tour of the inference path
    common/       what both processes share (see its __init__)

The components live beside it and install under this name: agentrl.engine (engine/),
agentrl.learner (learner/), agentrl.kernels (kernels/), agentrl.toolservers (toolservers/).
Import rule: the applications here may import any component; no component imports them
(tests/test_layout.py checks it).
"""

__version__ = "0.1.0"

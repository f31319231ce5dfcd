"""The config files of the run's child processes, written by the supervisor into the run directory:
RUN_DIR/learner-PHASE.toml (a `LearnerConfig`, learner/config.py) and RUN_DIR/actor.toml (an
`ActorConfig`, engine/actor.py). Each holds the run's sections for that process, the endpoints the
launcher reserved for it, and the credentials the run provisioned (agentrl/credentials.py)."""

from __future__ import annotations

from pathlib import Path

from agentrl.common.config import dump_toml, layer, to_dict


def write_learner_config(config, phase: str, overrides: dict, *, slot, out: Path, credentials, model_dir: str,
                         server_urls: list[str], services_file: Path) -> tuple[Path, dict]:
    """RUN_DIR/learner-PHASE.toml for the learner placed in `slot` (its endpoints are free ports
    there), checked by the learner's own rules here, before anything starts: (path, its data)."""
    base = layer(to_dict(config.learner), overrides)
    data = {
        **base,
        "transport": {**base["transport"], **credentials.learner()[0],
                      "group_endpoint": slot.free_endpoint(), "version_endpoint": slot.free_endpoint()},
        "output_dir": str(out / phase),
        "mode": "sft" if phase == "sft" else "rl",
        "model_dir": model_dir,
        "server_urls": server_urls,
        "services_file": str(services_file),
        "progress_bar": False,
        "seed": config.seed,
    }
    path = out / f"learner-{phase}.toml"
    path.write_text(dump_toml(data))
    from agentrl.learner.service import check_runnable, load_config

    check_runnable(load_config(path), str(path))
    return path, data


def write_actor_config(config, learner_data: dict, *, services, out: Path, credentials, model_dir: str,
                       services_file: Path) -> Path:
    """RUN_DIR/actor.toml: the actor-side sections of the run, the services, and the learner's
    endpoints (with the run's client keys when the learner uses CurveZMQ)."""
    data = {
        "vllm": services.vllm_urls,
        "vllm_model": services.vllm_model,
        "remote_tools": to_dict(services.remote),
        "local_tools": to_dict(services.local),
        "model_dir": model_dir,
        "group_endpoint": learner_data["transport"]["group_endpoint"],
        "version_endpoint": learner_data["transport"]["version_endpoint"],
        **credentials.learner()[1],
        "max_group_frame_bytes": config.learner.transport.max_group_frame_bytes,
        "out_dir": str(out / "actor"),
        "tasks": to_dict(config.tasks),
        "env": to_dict(config.env),
        "orchestrator": to_dict(config.orchestrator),
        "agent": to_dict(config.agent),
        "services_file": str(services_file),
        "signal_window": config.rl.no_signal_groups,
    }
    path = out / "actor.toml"
    path.write_text(dump_toml(data))
    return path

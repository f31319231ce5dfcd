"""The run config: shipped configs parse, layers and --set compose, and every bad value fails in
seconds with exit 2, the source, the key path and what is accepted, before any process starts."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from agentrl.common.config import ConfigError, dump_toml, parse_override, to_dict
from agentrl.learner.config import LearnerConfig
from agentrl.runconfig import DEFAULT_CONFIG, config_data, load_run_config
from agentrl.train import main as train_main

CONFIGS = sorted(DEFAULT_CONFIG.parent.glob("*.toml"))
# The examples layer over the embedded default too: a change to it must leave them valid.
EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*/config.toml"))
# And so does the tests' tiny run, which every test and benchmark that starts a run layers over.
TINY_RUN = Path(__file__).resolve().parent / "tiny_run.toml"


def test_configs_are_shipped():
    assert {p.name for p in CONFIGS} >= {"cpu_default.toml", "gpu_agent_r1.toml"}


@pytest.mark.parametrize("path", CONFIGS + EXAMPLE_CONFIGS + [TINY_RUN],
                         ids=lambda p: p.name if p.parent in (DEFAULT_CONFIG.parent, TINY_RUN.parent) else p.parent.name)
def test_shipped_config_resolves_and_its_learners_validate(path):
    resolved = load_run_config(path)
    config = resolved.config
    assert config.minutes > 0
    # The learners the supervisor derives: [learner], and [sft.learner] layered over it.
    assert LearnerConfig(**to_dict(config.learner)).mode == "rl"
    if config.sft.enabled:
        from agentrl.common.config import layer

        LearnerConfig(**layer(to_dict(config.learner), config.sft.learner))


def test_cpu_recipe_trains_each_step_as_one_row():
    """The CPU recipe's learner speed rests on a step being one packed row (the shared prompt then
    runs once through the frozen layers: cpu_default.toml, docs/notes/learner-and-kernels.md)."""
    config = load_run_config().config
    from agentrl.common.config import layer

    sft = LearnerConfig(**layer(to_dict(config.learner), config.sft.learner))
    for learner in (config.learner, sft):
        assert learner.trainer.max_row_tokens >= learner.tokens_per_step


def test_a_partial_config_changes_only_what_it_names(tmp_path):
    path = tmp_path / "lr.toml"
    path.write_text("[learner.trainer.optimizer]\nlr = 3e-5\n")
    default = load_run_config().config
    resolved = load_run_config(path)
    config = resolved.config
    assert config.learner.trainer.optimizer.lr == 3e-5
    # Everything else is the embedded default's (a bare file once replaced it: held-out 64 -> 48,
    # group size 6 -> 8, trainable layers 8 -> all).
    assert config.tasks.options["heldout_num"] == default.tasks.options["heldout_num"] == 64
    assert config.orchestrator.group_size == default.orchestrator.group_size == 6
    assert config.learner.trainer.train_layers == default.learner.trainer.train_layers == 8
    assert resolved.origins[("learner", "trainer", "optimizer", "lr")] == str(path)
    assert resolved.origins[("orchestrator", "group_size")].startswith("the embedded default")


def test_set_overrides_after_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[orchestrator]\ngroup_size = 4\n")
    resolved = load_run_config(path, ["orchestrator.group_size=3", "env.tool_list=json",
                                      'services.tools=["search"]', "learner.trainer.optimizer.lr=2e-5"])
    config = resolved.config
    assert config.orchestrator.group_size == 3 and config.env.tool_list == "json"
    assert config.services.tools == ["search"] and config.learner.trainer.optimizer.lr == 2e-5
    assert resolved.origins[("orchestrator", "group_size")] == "--set orchestrator.group_size=3"


def test_set_values_are_toml_values_else_strings():
    assert parse_override("a.b=3") == (("a", "b"), 3)
    assert parse_override("a=2e-5") == (("a",), 2e-5)
    assert parse_override("a=true") == (("a",), True)
    assert parse_override('a=["x", "y"]') == (("a",), ["x", "y"])
    assert parse_override("a=signature") == (("a",), "signature")
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_override("no-equals-sign")


def test_switching_the_task_loader_brings_its_own_options(tmp_path):
    data = tmp_path / "dev.json"
    data.write_text("[]")
    path = tmp_path / "datasets.toml"
    path.write_text(f'[tasks]\nloader = "datasets"\n[[tasks.options.eval_files]]\nformat = "hotpotqa"\npath = "{data}"\n')
    config = load_run_config(path).config
    assert config.tasks.loader == "datasets" and set(config.tasks.options) == {"eval_files"}


def test_switching_the_env_class_brings_its_own_options(tmp_path):
    """The default's multi-hop options (plan, progress, retrieval term) must not reach another
    environment, whose `[env.options]` is checked against its own dataclass."""
    assert load_run_config(None).config.env.options  # the default sets some: the test means something
    path = tmp_path / "arith.toml"
    (tmp_path / "arithmetic.py").write_text(Path("examples/arithmetic/arithmetic.py").read_text())
    path.write_text('[env]\nclass = "arithmetic.py:ArithmeticEnv"\n')  # the file's folder, not the working directory
    assert load_run_config(path).config.env.options == {}
    sets = ["env.class=examples/arithmetic/arithmetic.py:ArithmeticEnv"]
    assert load_run_config(None, sets).config.env.options == {}
    # Naming the same class keeps the options.
    assert load_run_config(None, ["env.class=multihop_qa"]).config.env.options == load_run_config(None).config.env.options


def test_print_config_round_trips(capsys, tmp_path):
    assert train_main(["--print-config", "--set", "orchestrator.group_size=5"]) == 0
    text = capsys.readouterr().out
    data = tomllib.loads(text)
    assert data["orchestrator"]["group_size"] == 5 and data["tasks"]["options"]["heldout_num"] == 64
    # What a run writes as its config.toml resolves back to the same config.
    config = load_run_config().config
    written = tmp_path / "config.toml"
    written.write_text(dump_toml(config_data(config)))
    assert load_run_config(written, base=None).config == config


PLUGIN = '''
class NotAnEnv:
    pass


def untyped(x):
    """Has no type hint, so no schema."""
    return x
'''

BAD = [
    # (file text or None, extra argv, the message must match)
    ('minutes = "ten"\n', [], r"bad.toml: minutes: Input should be a valid number \(got \"ten\"\)"),
    ('[env]\nmax_turns = "3"\n', [], r"bad.toml: env.max_turns: Input should be a valid integer \(got \"3\"\)"),
    ('[services]\ntools = ["websearch"]\n', [], r"services.tools\[0\]: Input should be 'search', 'python' or 'calculator'"),
    ('[orchestrator]\ngroup_sise = 4\n', [], r"orchestrator.group_sise: unknown key; accepted keys here: group_size"),
    ('[learner]\ntokens_per_step = "8192"\n', [], r"learner.tokens_per_step: Input should be a valid integer"),
    ('[learner]\nlrr = 1e-5\n', [], r"learner.lrr: unknown key; accepted keys here: output_dir"),
    ('[learner]\noutput_dir = "x"\n', [], r"learner.output_dir: set by agentrl train for each phase"),
    ('[learner.transport]\ngroup_endpoint = "tcp://127.0.0.1:5555"\n', [],
     r"bad.toml: learner.transport.group_endpoint: set by agentrl train for each phase"),
    ('[sft.learner.transport]\nversion_endpoint = "tcp://127.0.0.1:5556"\n', [],
     r"bad.toml: sft.learner.transport.version_endpoint: set by agentrl train for each phase"),
    ('[learner.trainer]\nmax_row_tokens = 100\n', [], r"learner.trainer.max_row_tokens: 100 cannot hold the longest episode"),
    ('[sft.learner]\ntokens_per_step = -1\n', [], r"bad.toml: sft.learner.tokens_per_step: -1 must be > 0"),
    ('[sft.learner.trainer.optimizer]\nllr = 1\n', [], r"sft.learner.trainer.optimizer.llr: unknown key"),
    ("[learner.trainer]\ntemperature = 0.5\n", [], r"orchestrator.sampling.temperature = 0.7 differs from .*bad.toml: learner.trainer.temperature = 0.5"),
    ('[env]\nmax_total_tokens = 8192\n[learner.trainer]\nmax_row_tokens = 8192\n', [],
     r"env.max_total_tokens: 8192 is longer than the server's services.vllm_server.max_model_len = 4096"),
    ('[tasks]\nloader = "no_such_module:load"\n', [], r"tasks.loader: cannot import 'no_such_module'"),
    ('[tasks]\nloader = "websearch"\n', [], r"tasks.loader: 'websearch' is neither a built-in \(synthetic, datasets, jsonl, hf_datasets\) nor"),
    ('[tasks.options]\nheldout_numm = 3\n', [], r"tasks.options.heldout_numm: unknown key; accepted keys here: seed"),
    ('[tasks.options]\nheldout_hops = [7]\n', [], r"hop counts must be 1-4"),
    ("minutes = [\n", [], r"bad.toml: not valid TOML"),
    # Plug-ins (docs/ENVIRONMENTS.md): each named error, before anything starts.
    ('[env]\nclass = "no_such_module:Env"\n', [], r"bad.toml: env.class: cannot import 'no_such_module'"),
    ('[env]\nclass = "PLUGIN:NotAnEnv"\n', [], r"env.class: '.*plugin.py:NotAnEnv' is not a ToolEnv subclass"),
    ('[env]\nclass = "PLUGIN:Missing"\n', [], r"env.class: '.*plugin.py' has no 'Missing'"),
    ('[env.options]\nnope = 1\n', [], r"env.options.nope: unknown key; accepted keys here: task_metric"),
    ('[[tools]]\nbuiltin = "websearch"\n', [], r"tools\[0\].builtin: Input should be 'search', 'python' or 'calculator'"),
    ('[[tools]]\nfunction = "PLUGIN:untyped"\n', [], r"tools\[0\].function: no usable schema: untyped: parameter 'x' has no type hint"),
    ('[[tools]]\nfunction = "PLUGIN:missing_function"\n', [], r"tools\[0\].function: .*has no 'missing_function'"),
    ('[tasks]\nloader = "jsonl"\n[tasks.options]\ntrain = "TASKS"\nheldout = "TASKS"\n', [],
     r"tasks.jsonl:2 \(task 'a'\): field 'prompt' must be a string, got int"),
    (None, ["--set", "env.max_turns=three"], r"--set env.max_turns=three: env.max_turns: Input should be a valid integer"),
    (None, ["--set", "minutes=0"], r"--set minutes=0: minutes: 0.0 must be > 0"),
    (None, ["--set", "learner.trainer.optimizer.lr=-1"], r"optimizer.lr=-1.0 must be > 0"),
    (None, ["--tool-endpoint", "127.0.0.1:5555"], r"'127.0.0.1:5555' has no scheme; write it as tcp://HOST:PORT"),
    (None, ["--vllm", "localhost:8000"], r"'localhost:8000' is not a base URL; write it as http://HOST:PORT"),
    (None, ["--config", "/no/such/file.toml"], r"/no/such/file.toml: no such config file"),
]


@pytest.mark.parametrize("text, argv, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_values_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys, text, argv, message):
    import re

    def no_child(*args, **kwargs):
        raise AssertionError(f"a child process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    if text is not None:
        (tmp_path / "plugin.py").write_text(PLUGIN)
        (tmp_path / "tasks.jsonl").write_text('{"id": "a", "prompt": "q"}\n{"id": "a", "prompt": 5}\n')
        text = text.replace("PLUGIN", str(tmp_path / "plugin.py")).replace("TASKS", str(tmp_path / "tasks.jsonl"))
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        argv = ["--config", str(bad), *argv]
    t0 = time.perf_counter()
    assert train_main([*argv, "--out", str(tmp_path / "run")]) == 2
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert len(re.findall(message, err)) == 1, f"reported more than once:\n{err}"
    assert not (tmp_path / "run").exists(), "nothing is written for a config that does not check"


def test_bad_config_exits_2_from_the_command_line_in_seconds(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('minutes = "ten"\n')
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "train", "--config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "minutes: Input should be a valid number" in proc.stderr, proc.stderr
    assert time.perf_counter() - t0 < 60  # imports only: no server, no model


def test_a_tool_command_that_exits_at_start_stops_the_run_with_exit_2(tmp_path):
    from agentrl.common.proctable import read_proc
    from agentrl.common.watchdog import RunLock

    config = tmp_path / "c.toml"
    config.write_text(f'[[tools]]\ncommand = ["{sys.executable}", "-c", "import sys; print(\'no\', file=sys.stderr); sys.exit(3)"]\n')
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "train", "--config", str(config), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tools[0].command" in proc.stderr and "did not start" in proc.stderr and "exited with 3" in proc.stderr, proc.stderr
    log = out / "logs" / "tool-command0-0.log"
    assert log.is_file() and "no" in log.read_text()  # the command's own stderr is kept for reading
    # Nothing of the run is left: the watchdog exited and released the run directory.
    holder = int((out / ".lock").read_text())
    assert read_proc(holder) is None
    RunLock(out).acquire().release()


def test_version_and_help(capsys):
    from agentrl import __version__
    from agentrl.cli import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"agentrl {__version__}"
    with pytest.raises(SystemExit) as exit_:
        train_main(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for key in ("env.max_turns: int", "learner.trainer.optimizer.lr: float", "tasks.loader: str", "logging.wandb: bool"):
        assert key in help_text


def test_toml_writer_round_trips():
    import json

    data = {"a": 1, "b": [1, 2], "c": {"d": "x\"y", "e": {"f": True, "g": 0.5}}, "h": None, "odd key": 1}
    assert tomllib.loads(dump_toml(data)) == json.loads(json.dumps({k: v for k, v in data.items() if v is not None}))



def test_a_plugin_path_that_fails_says_how_to_fix_it(tmp_path, monkeypatch):
    """A file named like a module gets the file form; a missing name lists the classes the module
    defines; an absolute path that does not exist gets no note about relative paths."""
    from agentrl.common.config import ConfigError
    from agentrl.engine.plugins import resolve

    (tmp_path / "my_env.py").write_text("class MyEnv:\n    pass\n\nclass Other:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"to load the file my_env.py, write my_env.py:MyEnv"):
        resolve("my_env:MyEnv", "env.class")
    with pytest.raises(ConfigError, match=r"has no 'MyEnvv'; it defines the classes MyEnv, Other"):
        resolve("my_env.py:MyEnvv", "env.class")
    with pytest.raises(ConfigError) as err:
        resolve(f"{tmp_path}/nope.py:MyEnv", "env.class")
    assert "no such file" in str(err.value) and "relative paths" not in str(err.value)
    with pytest.raises(ConfigError, match=r"relative paths are taken from"):
        resolve("nope.py:MyEnv", "env.class")
    assert resolve("my_env.py:MyEnv", "env.class").__name__ == "MyEnv"


def test_relative_paths_in_a_config_file_are_taken_from_its_folder_and_set_values_from_the_working_directory(tmp_path, monkeypatch):
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "arithmetic.py").write_text(Path("examples/arithmetic/arithmetic.py").read_text())
    (env_dir / "tools.py").write_text("")
    (env_dir / "heldout.jsonl").write_text('{"id": "a", "prompt": "1+1", "reference": "2"}\n')
    (env_dir / "config.toml").write_text(
        '[env]\nclass = "arithmetic.py:ArithmeticEnv"\n[tasks]\nloader = "jsonl"\n[tasks.options]\nheldout = "heldout.jsonl"\n'
        '[services]\ntools = []\n[[tools]]\ncommand = ["python", "tools.py", "--bind", "{bind}"]\n'
        '[sft]\nenabled = false\n[learner]\nanchor.coef = 0.0\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_run_config(Path("..") / "env" / "config.toml").config
    assert config.env.env_class == f"{env_dir}/arithmetic.py:ArithmeticEnv"
    assert config.tasks.options["heldout"] == str(env_dir / "heldout.jsonl")
    assert config.tools[0].cwd == str(env_dir) and config.tools[0].command[1] == "tools.py"
    # --set values are the command line's: relative to the working directory.
    config = load_run_config(Path("..") / "env" / "config.toml", ["tasks.options.heldout=mine.jsonl"]).config
    assert config.tasks.options["heldout"] == str(elsewhere / "mine.jsonl")
    # A missing file named relative to the config's folder is reported with that folder.
    (env_dir / "tools.py").unlink()
    with pytest.raises(ConfigError, match=r"tools\[0\]\.command: no such file 'tools.py' in " + str(env_dir)):
        load_run_config(Path("..") / "env" / "config.toml")


def test_only_an_interpreters_script_argument_is_checked_as_a_file(tmp_path):
    from agentrl.engine.services import check_command

    (tmp_path / "tools.py").write_text("")
    check_command(["python", "tools.py", "--out=x.py"], "tools[0].command", str(tmp_path))
    check_command(["bash", "-c", "exec python missing.py"], "tools[0].command", str(tmp_path))
    check_command(["python", "-m", "my_tools.py"], "tools[0].command", str(tmp_path))
    with pytest.raises(ConfigError, match=f"tools\\[0\\].command: no such file 'missing.py' in {tmp_path}"):
        check_command(["python", "missing.py"], "tools[0].command", str(tmp_path))


def test_command_line_options_are_checked_like_a_config_file():
    from agentrl.common.config import ConfigError, from_options
    from agentrl.gateway.config import GatewayConfig

    config = from_options(GatewayConfig, "agentrl gateway", port=0, served_model_name=None, renderer="chatml")
    assert (config.port, config.served_model_name, config.renderer, config.host) == (0, None, "chatml", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"^agentrl gateway: port: needs 0 <= port <= 65535"):
        from_options(GatewayConfig, "agentrl gateway", port=70000)
    with pytest.raises(ConfigError, match=r"agentrl gateway: renderer: .*accepted|agentrl gateway: renderer: Input should be"):
        from_options(GatewayConfig, "agentrl gateway", renderer="jinja")


@pytest.mark.parametrize("table, old, new", [
    ("services", "vllm_dtype", "vllm_server.dtype"), ("services", "max_model_len", "vllm_server.max_model_len"),
    ("services", "kv_cache_gib", "vllm_server.kv_cache_gib"), ("learner", "anchor_coef", "anchor.coef"),
    ("learner", "publish_every", "publish.every"), ("learner", "kv_refresh_every", "publish.kv_refresh_every"),
    ("sft.learner", "checkpoint_every", "checkpoint.every")])
def test_a_key_that_moved_is_refused_naming_where_it_went(tmp_path, table, old, new):
    config = tmp_path / "old.toml"
    config.write_text(f"[{table}]\n{old} = 1\n")
    with pytest.raises(ConfigError, match=rf"old.toml: {table}.{old}: this key moved; write it as {table}.{new}$"):
        load_run_config(config)


def test_a_plugin_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """`from units import ...` in a plug-in file loaded by path finds units.py in the file's folder,
    from any working directory (engine/plugins.py)."""
    from agentrl.engine.plugins import resolve

    folder = tmp_path / "unit_env"
    folder.mkdir()
    (folder / "units_for_plugin_test.py").write_text("FACTORS = {'km': 1000.0}\n")
    (folder / "env.py").write_text("from units_for_plugin_test import FACTORS\n\nclass UnitEnv:\n    factors = FACTORS\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert resolve(f"{folder}/env.py:UnitEnv", "env.class").factors == {"km": 1000.0}
    assert str(folder) == sys.path[-1]

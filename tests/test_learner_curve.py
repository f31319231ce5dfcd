"""CurveZMQ on the learner's sockets: the tool services' rule (agentrl/common/curve.py).

Real parts: the learner's GroupReceiver (ROUTER) and VersionPublisher (PUB), the actor's
GroupSender (DEALER) and VersionSubscriber (SUB), over real TCP on 127.0.0.1, with keys made by
zmq.auth.create_certificates; the configs that carry the keys (LearnerConfig, ActorConfig, the
supervisor's learner and actor TOML files); the last test runs two real `agentrl actor` processes on the
session's vLLM server.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from support.synthetic import make_group

from agentrl.common.config import ConfigError, build, read_toml
from agentrl.common.curve import load_client_keys
from agentrl.common.trajectory import encode_group
from agentrl.common.transport import GROUP, GroupReceiver, GroupSender, VersionPublisher, VersionSubscriber
from agentrl.engine.actor import ActorConfig
from agentrl.engine.services import Services
from agentrl.learner.config import LearnerConfig, LearnerTransportConfig

NOT_RECEIVED_S = 3.0
"""How long a refused peer's group is waited for (an authorized one arrives in a few ms)."""


def endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def keys(tmp_path) -> SimpleNamespace:
    """server/ (the learner's pair), clients/ (the actor's public key is authorized; its secret
    file lives elsewhere, as it would on the actor's host), stranger/ (a pair nobody authorized)."""
    folders = {name: tmp_path / name for name in ("server", "clients", "actor", "stranger")}
    for folder in folders.values():
        folder.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(folders["server"], "learner")
    actor_public, actor_secret = zmq.auth.create_certificates(folders["actor"], "actor")
    Path(actor_public).rename(folders["clients"] / "actor.key")
    _, stranger_secret = zmq.auth.create_certificates(folders["stranger"], "stranger")
    return SimpleNamespace(server_public=server_public, server_secret=server_secret, clients=str(folders["clients"]),
                           actor_secret=actor_secret, stranger_secret=stranger_secret)


def learner_config(keys, **transport) -> LearnerConfig:
    return LearnerConfig(transport=LearnerTransportConfig(curve_secret_key_file=keys.server_secret,
                                                          curve_authorized_clients_dir=keys.clients, **transport))


def client_keys(keys, secret_file: str):
    return load_client_keys(keys.server_public, secret_file)


async def _never_received(receiver: GroupReceiver) -> None:
    with pytest.raises(TimeoutError):
        got = await asyncio.wait_for(receiver.recv(), NOT_RECEIVED_S)
        raise AssertionError(f"a refused peer's group {got.group.group_id} was received")


async def _send_and_ack(sender: GroupSender, receiver: GroupReceiver, group_id: str) -> None:
    await sender.send(make_group(group_id, [1.0, 0.0]))
    received = await asyncio.wait_for(receiver.recv(), 10)
    assert received.group.group_id == group_id
    await receiver.ack(received)
    assert await sender.wait_all_acked(10)


def _handshakes_not_made(sender: GroupSender) -> int:
    """Keys on one side only: libzmq reports the mechanism mismatch as PROTOCOL (refused) when this
    side reads the learner's greeting, and as NO_DETAIL (failed, then a reconnect) when the learner
    drops the connection first; which one depends on timing (a CI machine saw NO_DETAIL)."""
    return sender.num_handshakes_refused + sender.num_handshakes_failed


async def _send_refused(sender: GroupSender, group_id: str) -> asyncio.Task:
    """`send` of a connection the learner refused may block for good (libzmq drops the DEALER's only
    pipe), so it runs as a task the test cancels."""
    send = asyncio.ensure_future(sender.send(make_group(group_id, [1.0, 0.0])))
    await asyncio.sleep(0)
    return send


# --- the sockets -----------------------------------------------------------------------------------


async def test_an_authorized_actor_sends_groups_acked_and_hears_versions_over_curve(keys):
    """The config's keys reach the sockets: a group goes through and is acked, a version arrives."""
    cfg = learner_config(keys, group_endpoint=endpoint(), version_endpoint=endpoint())
    actor = ActorConfig(vllm=[], group_endpoint=cfg.transport.group_endpoint, version_endpoint=cfg.transport.version_endpoint,
                        curve_server_key=keys.server_public, curve_client_key=keys.actor_secret)
    receiver = GroupReceiver(cfg.transport.group_endpoint, curve=cfg.transport.curve_keys())
    publisher = VersionPublisher(cfg.transport.version_endpoint, republish_interval_s=0.1, curve=cfg.transport.curve_keys())
    sender = GroupSender(actor.group_endpoint, curve=actor.curve_keys())
    subscriber = VersionSubscriber(actor.version_endpoint, curve=actor.curve_keys())
    for part in (receiver, publisher, sender, subscriber):
        await part.start()
    try:
        await _send_and_ack(sender, receiver, "g-authorized")
        await publisher.publish(7, 6)
        assert await subscriber.wait_until(lambda v: v == (7, 6), timeout_s=10) == (7, 6)
        assert sender.num_handshakes_refused == subscriber.num_handshakes_refused == 0
        assert receiver.num_malformed == 0
    finally:
        for part in (subscriber, sender, publisher, receiver):
            await part.close()


async def test_an_unknown_client_key_gets_nothing_through_and_the_learner_keeps_serving_the_actor(keys):
    cfg = learner_config(keys, group_endpoint=endpoint(), version_endpoint=endpoint())
    receiver = GroupReceiver(cfg.transport.group_endpoint, curve=cfg.transport.curve_keys())
    publisher = VersionPublisher(cfg.transport.version_endpoint, republish_interval_s=0.1, curve=cfg.transport.curve_keys())
    stranger = GroupSender(cfg.transport.group_endpoint, curve=client_keys(keys, keys.stranger_secret))
    eavesdropper = VersionSubscriber(cfg.transport.version_endpoint, curve=client_keys(keys, keys.stranger_secret))
    sender = GroupSender(cfg.transport.group_endpoint, curve=client_keys(keys, keys.actor_secret))
    subscriber = VersionSubscriber(cfg.transport.version_endpoint, curve=client_keys(keys, keys.actor_secret))
    for part in (receiver, publisher, stranger, eavesdropper):
        await part.start()
    send = await _send_refused(stranger, "g-stranger")
    try:
        await publisher.publish(3, 3)
        await _never_received(receiver)
        assert eavesdropper.latest is None  # 30 republishes went by
        assert stranger.num_handshakes_refused == 1 and eavesdropper.num_handshakes_refused == 1
        assert stranger.num_acked == 0 and receiver.num_malformed == 0
        await sender.start()
        await subscriber.start()
        await _send_and_ack(sender, receiver, "g-after")
        assert await subscriber.wait_until(lambda v: v == (3, 3), timeout_s=10) == (3, 3)
        assert eavesdropper.latest is None
    finally:
        send.cancel()
        for part in (subscriber, sender, eavesdropper, stranger, publisher, receiver):
            await part.close()


async def test_a_plaintext_sender_cannot_talk_to_a_curve_receiver(keys):
    cfg = learner_config(keys, group_endpoint=endpoint())
    receiver = GroupReceiver(cfg.transport.group_endpoint, curve=cfg.transport.curve_keys())
    await receiver.start()
    plain = GroupSender(cfg.transport.group_endpoint)
    await plain.start()
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)  # and no sender of ours: raw frames of a well-formed group
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(cfg.transport.group_endpoint)
    send = await _send_refused(plain, "g-plain")
    try:
        try:
            await raw.send_multipart([GROUP, *encode_group(make_group("g-raw", [1.0, 0.0]))], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # libzmq had already dropped the refused connection's pipe: the frames had nowhere to go
        await _never_received(receiver)
        assert _handshakes_not_made(plain) >= 1 and plain.num_acked == 0
        assert receiver.num_malformed == 0
    finally:
        send.cancel()
        raw.close(linger=0)
        ctx.term()
        await plain.close()
        await receiver.close()


async def test_curve_keys_on_one_side_only_get_nothing_through_from_the_client_side_either(keys):
    """A learner without keys (loopback) and an actor with them: nothing goes through either way."""
    ep = endpoint()
    receiver = GroupReceiver(ep)
    await receiver.start()
    sender = GroupSender(ep, curve=client_keys(keys, keys.actor_secret))
    await sender.start()
    send = await _send_refused(sender, "g-one-sided")
    try:
        await _never_received(receiver)
        assert _handshakes_not_made(sender) >= 1 and sender.num_acked == 0
    finally:
        send.cancel()
        await sender.close()
        await receiver.close()


async def test_a_wrong_server_key_gets_nothing_through_and_is_reported_as_failing_handshakes(keys):
    """The client encrypts to a key that is not the learner's: the learner cannot read its hello, so
    the connection drops mid-handshake and ZeroMQ retries it; nothing reaches the learner."""
    cfg = learner_config(keys, group_endpoint=endpoint())
    receiver = GroupReceiver(cfg.transport.group_endpoint, curve=cfg.transport.curve_keys())
    await receiver.start()
    wrong = load_client_keys(keys.stranger_secret, keys.actor_secret)  # the stranger's public half as server key
    sender = GroupSender(cfg.transport.group_endpoint, curve=wrong)
    await sender.start()
    send = await _send_refused(sender, "g-wrong-server")
    try:
        await _never_received(receiver)
        assert sender.num_handshakes_failed >= 2 and sender.num_handshakes_refused == 0  # retried, every ~130 ms
    finally:
        send.cancel()
        await sender.close()
        await receiver.close()


# --- the configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["group_endpoint", "version_endpoint"])
@pytest.mark.parametrize("public", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://learner:5555"])
def test_a_learner_endpoint_other_hosts_reach_needs_curve_keys(keys, key, public):
    with pytest.raises(ValueError, match=rf"{key}: refusing to bind .*CurveZMQ.*create_certificates.*curve_secret_key_file"):
        LearnerTransportConfig(**{key: public})
    cfg = learner_config(keys, **{key: public})
    assert cfg.transport.curve_keys().authorized_clients_dir == keys.clients


@pytest.mark.parametrize("local", ["tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555",
                                   "ipc:///tmp/learner.sock"])
def test_a_local_learner_endpoint_needs_no_keys_and_may_have_them(keys, local):
    assert LearnerTransportConfig(group_endpoint=local, version_endpoint=local).curve_keys() is None
    assert learner_config(keys, group_endpoint=local).transport.curve_keys() is not None


def test_learner_keys_are_both_or_neither(keys):
    with pytest.raises(ValueError, match="curve_secret_key_file: CurveZMQ needs both"):
        LearnerTransportConfig(curve_secret_key_file=keys.server_secret)
    with pytest.raises(ValueError, match="curve_secret_key_file: CurveZMQ needs both"):
        LearnerTransportConfig(curve_authorized_clients_dir=keys.clients)


def test_bad_learner_keys_are_refused_at_config_time_naming_the_key(keys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (dict(curve_secret_key_file=str(tmp_path / "gone.key_secret")), "curve_secret_key_file: no such certificate file"),
        (dict(curve_secret_key_file=keys.server_public), "curve_secret_key_file: .* holds no secret key"),
        (dict(curve_authorized_clients_dir=str(tmp_path / "nowhere")), "curve_authorized_clients_dir: no such directory"),
        (dict(curve_authorized_clients_dir=str(empty)), "curve_authorized_clients_dir: .* holds no client certificate"),
    ]
    (tmp_path / "junk.key_secret").write_text('curve\n    public-key = "short"\n    secret-key = "short"\n')
    cases.append((dict(curve_secret_key_file=str(tmp_path / "junk.key_secret")), "curve_secret_key_file: .* not a 40-character"))
    for fields, message in cases:
        given = {"curve_secret_key_file": keys.server_secret, "curve_authorized_clients_dir": keys.clients, **fields}
        with pytest.raises(ValueError, match=message):
            LearnerTransportConfig(group_endpoint="tcp://0.0.0.0:5555", **given)
    toml = tmp_path / "learner.toml"  # the same through a config file: a ConfigError naming the file
    toml.write_text(f'[transport]\ngroup_endpoint = "tcp://0.0.0.0:5555"\ncurve_secret_key_file = "{tmp_path / "gone"}"\n'
                    f'curve_authorized_clients_dir = "{keys.clients}"\n')
    with pytest.raises(ConfigError, match="learner.toml.*transport.curve_secret_key_file: no such certificate file"):
        build(LearnerConfig, read_toml(toml), default_source=str(toml))


def test_actor_keys_are_both_or_neither_checked_and_needed_for_a_learner_elsewhere(keys, tmp_path):
    with pytest.raises(ValueError, match="curve_server_key: CurveZMQ needs both"):
        ActorConfig(vllm=[], curve_server_key=keys.server_public)
    with pytest.raises(ValueError, match="curve_client_key: no such certificate file"):
        ActorConfig(vllm=[], curve_server_key=keys.server_public, curve_client_key=str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="curve_client_key: .* holds no secret key"):
        ActorConfig(vllm=[], curve_server_key=keys.server_public, curve_client_key=keys.server_public)
    with pytest.raises(ValueError, match="group_endpoint: tcp://learner-host:5555 is on another host.*curve_server_key"):
        ActorConfig(vllm=[], group_endpoint="tcp://learner-host:5555", version_endpoint="tcp://127.0.0.1:5556")
    ActorConfig(vllm=[], group_endpoint="tcp://learner-host:5555", version_endpoint="tcp://learner-host:5556",
                curve_server_key=keys.server_public, curve_client_key=keys.actor_secret)


# --- the supervisor --------------------------------------------------------------------------------


def _supervisor(tmp_path, learner: LearnerConfig):
    from agentrl.runconfig import TrainConfig
    from agentrl.train import Supervisor

    supervisor = Supervisor(TrainConfig(learner=learner), tmp_path / "run")
    (tmp_path / "run").mkdir()
    supervisor.model_dir = str(tmp_path / "model")
    supervisor.services = Services(vllm_urls=["http://127.0.0.1:9"])
    return supervisor


def test_without_keys_the_supervisor_makes_none_and_passes_none(tmp_path):
    supervisor = _supervisor(tmp_path, LearnerConfig())
    _, path, data = supervisor.learner_config("rl", {})
    learner, actor = read_toml(path), read_toml(supervisor.actor_config(data))
    assert learner["transport"]["group_endpoint"].startswith("tcp://127.0.0.1:")
    assert not any(k.startswith("curve") for k in (*learner, *learner["transport"], *actor))
    assert not (tmp_path / "run" / "curve").exists()


async def test_keys_in_learner_reach_the_actor_and_the_learners_admit_the_run(keys, tmp_path):
    """[learner] keys: the learner TOML keeps the secret file and admits the given clients plus the
    run's own; the actor TOML gets the learner's public half and the run's client key; and those two
    files work against each other over real sockets."""
    supervisor = _supervisor(tmp_path, learner_config(keys))
    _, path, data = supervisor.learner_config("rl", {})
    learner = build(LearnerConfig, read_toml(path), default_source=str(path))
    actor = build(ActorConfig, read_toml(supervisor.actor_config(data)))
    curve = tmp_path / "run" / "curve"
    assert learner.transport.curve_secret_key_file == keys.server_secret
    assert sorted(p.name for p in Path(learner.transport.curve_authorized_clients_dir).iterdir()) == ["actor.key", "agentrl-run.key"]
    assert actor.curve_server_key == str(curve / "learner.key") and actor.curve_client_key == str(curve / "agentrl-run.key_secret")
    assert zmq.auth.load_certificate(actor.curve_server_key) == (zmq.auth.load_certificate(keys.server_public)[0], None)
    assert (curve / "agentrl-run.key_secret").stat().st_mode & 0o077 == 0
    receiver = GroupReceiver(learner.transport.group_endpoint, curve=learner.transport.curve_keys())
    sender = GroupSender(actor.group_endpoint, curve=actor.curve_keys())
    await receiver.start()
    await sender.start()
    try:
        await _send_and_ack(sender, receiver, "g-run")
    finally:
        await sender.close()
        await receiver.close()
    assert supervisor.learner_config("sft", {})[2]["transport"]["curve_authorized_clients_dir"] == learner.transport.curve_authorized_clients_dir


async def test_off_loopback_the_run_provisions_the_learners_keys_and_only_its_clients_get_through(tmp_path):
    """`[network] host` other than loopback, no keys in [learner]: the run makes the learners' server
    certificate (0600 in a 0700 folder), the learners bind that address with it, the actor gets the
    matching client keys, and a sender without them gets nothing through."""
    import stat

    from support.network import routable_address

    from agentrl.runconfig import NetworkConfig, TrainConfig
    from agentrl.train import Supervisor

    host = routable_address()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    supervisor = Supervisor(TrainConfig(network=NetworkConfig(host=host)), tmp_path / "run")
    (tmp_path / "run").mkdir()
    supervisor.model_dir = str(tmp_path / "model")
    supervisor.services = Services(vllm_urls=[f"http://{host}:9"])
    _, path, data = supervisor.learner_config("rl", {})
    learner = build(LearnerConfig, read_toml(path), default_source=str(path))
    actor = build(ActorConfig, read_toml(supervisor.actor_config(data)))
    curve = tmp_path / "run" / "curve"
    assert learner.transport.group_endpoint.startswith(f"tcp://{host}:") and learner.transport.version_endpoint.startswith(f"tcp://{host}:")
    assert learner.transport.curve_secret_key_file == str(curve / "agentrl-run-learner.key_secret")
    assert sorted(p.name for p in Path(learner.transport.curve_authorized_clients_dir).iterdir()) == ["agentrl-run.key"]
    for secret in ("agentrl-run-learner.key_secret", "agentrl-run.key_secret"):
        assert stat.S_IMODE((curve / secret).stat().st_mode) == 0o600
    assert stat.S_IMODE(curve.stat().st_mode) == 0o700
    receiver = GroupReceiver(learner.transport.group_endpoint, curve=learner.transport.curve_keys())
    sender = GroupSender(actor.group_endpoint, curve=actor.curve_keys())
    plain = GroupSender(actor.group_endpoint)
    await receiver.start()
    await sender.start()
    await plain.start()
    send = await _send_refused(plain, "g-plain")
    try:
        await _send_and_ack(sender, receiver, "g-run")
        await _never_received(receiver)
        assert plain.num_acked == 0
    finally:
        send.cancel()
        await plain.close()
        await sender.close()
        await receiver.close()
    # A second call (the SFT phase, a resumed run) keeps the same keys.
    assert supervisor.learner_config("sft", {})[2]["transport"]["curve_secret_key_file"] == learner.transport.curve_secret_key_file


def test_run_config_keys_go_in_learner_not_sft_learner(keys, tmp_path):
    from agentrl.runconfig import load_run_config

    sets = [f'learner.transport.curve_secret_key_file="{keys.server_secret}"', f'learner.transport.curve_authorized_clients_dir="{keys.clients}"']
    assert load_run_config(sets=sets).config.learner.transport.curve_keys() is not None
    with pytest.raises(ConfigError, match="sft.learner.transport.curve_secret_key_file: set it in \\[learner.transport\\]"):
        load_run_config(sets=[f'sft.learner.transport.curve_secret_key_file="{keys.server_secret}"',
                              f'sft.learner.transport.curve_authorized_clients_dir="{keys.clients}"'])


# --- a real learner process ------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_learner_process_with_keys_trains_only_what_authorized_actors_send(keys, tmp_path):
    """`agentrl learner` with curve_* keys in its TOML: its version reaches an authorized subscriber
    and not a stranger's, a stranger's group is never trained, an authorized actor's groups are."""
    import os
    import signal
    import subprocess
    import sys

    from support.synthetic import tiny_llama

    from agentrl.learner.metrics import read_metrics

    vocab = 64
    tiny_llama(vocab_size=vocab).save_pretrained(tmp_path / "model")
    group_ep, version_ep, run_dir = endpoint(), endpoint(), tmp_path / "run"
    config = tmp_path / "learner.toml"
    config.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{tmp_path / 'model'}"
tokens_per_step = 100
max_steps = 1
publish.every = 0
staleness_bound = 100
transport.group_endpoint = "{group_ep}"
transport.version_endpoint = "{version_ep}"
transport.curve_secret_key_file = "{keys.server_secret}"
transport.curve_authorized_clients_dir = "{keys.clients}"
tensorboard = false
progress_bar = false

[trainer]
precision = "fp32"
max_row_tokens = 256
""")

    def group(gid: str, seed: int):  # 2 samples x 25 tokens: two groups fill a 100-token step
        return make_group(gid, [1.0, 0.0], prompt_len=5, turns=[(8, 4), (8, 0)], vocab_size=vocab, seed=seed)

    log_path = tmp_path / "learner.log"
    with open(log_path, "ab") as log:
        learner = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    actor, stranger = client_keys(keys, keys.actor_secret), client_keys(keys, keys.stranger_secret)
    parts = [GroupSender(group_ep, curve=stranger), VersionSubscriber(version_ep, curve=stranger),
             GroupSender(group_ep, curve=actor), VersionSubscriber(version_ep, curve=actor)]
    bad_sender, eavesdropper, sender, subscriber = parts
    send = None
    try:
        for _ in range(600):
            if "READY" in log_path.read_text() or learner.poll() is not None:
                break
            await asyncio.sleep(0.2)
        assert learner.poll() is None, log_path.read_text()
        for part in parts:
            await part.start()
        send = await _send_refused(bad_sender, "stranger-0")
        assert await subscriber.wait_until(lambda v: True, timeout_s=30) == (0, 0)
        await asyncio.sleep(NOT_RECEIVED_S)
        assert eavesdropper.latest is None and bad_sender.num_handshakes_refused == 1
        for i in range(2):
            await asyncio.wait_for(sender.send(group(f"ok-{i}", i)), 60)
        assert await asyncio.to_thread(learner.wait, 120) == 0, log_path.read_text()
    finally:
        if send is not None:
            send.cancel()
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
        for part in parts:
            await part.close()
    assert sender.num_acked == 2 and bad_sender.num_acked == 0
    assert sorted(gid for line in read_metrics(run_dir / "metrics.jsonl") for gid in line["group_ids"]) == ["ok-0", "ok-1"]


# --- a real actor process --------------------------------------------------------------------------


def _actor_toml(path: Path, vllm_url: str, model_dir, group_ep: str, version_ep: str, server_key: str,
                client_key: str) -> Path:
    """The smallest actor: synthetic tasks, no tools, one turn of 16 tokens, groups of 2."""
    path.write_text(f"""
vllm = ["{vllm_url}"]
model_dir = "{model_dir}"
group_endpoint = "{group_ep}"
version_endpoint = "{version_ep}"
curve_server_key = "{server_key}"
curve_client_key = "{client_key}"
out_dir = "{path.parent / 'out'}"

[tasks]
loader = "synthetic"
[tasks.options]
num_companies = 60
heldout_num = 4
num_train = 8
transfer_num = 0

[env]
max_turns = 1
max_action_tokens = 16

[orchestrator]
group_size = 2
max_concurrent_episodes = 4
max_groups_in_flight = 1
""")
    return path


@pytest.mark.slow
async def test_a_real_actor_process_exits_on_a_refused_key_and_an_authorized_one_sends(keys, tmp_path, vllm_server,
                                                                                       model_dir):
    """Two `agentrl actor` processes with one config each, against a CURVE learner's sockets: the
    one whose key the learner does not know exits with an error naming the refusal (libzmq would
    never retry, so waiting on would send nothing, forever); the authorized one sends its groups and
    stops cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    cfg = learner_config(keys, group_endpoint=endpoint(), version_endpoint=endpoint())
    receiver = GroupReceiver(cfg.transport.group_endpoint, curve=cfg.transport.curve_keys())
    publisher = VersionPublisher(cfg.transport.version_endpoint, republish_interval_s=0.1, curve=cfg.transport.curve_keys())
    await receiver.start()
    await publisher.start()
    procs, logs = {}, {}
    try:
        await publisher.publish(0, 0)
        for name, secret in (("actor", keys.actor_secret), ("stranger", keys.stranger_secret)):
            folder = tmp_path / f"run-{name}"
            folder.mkdir()
            config = _actor_toml(folder / "actor.toml", vllm_server.base_url, model_dir, cfg.transport.group_endpoint,
                                 cfg.transport.version_endpoint, keys.server_public, secret)
            logs[name] = folder / "actor.log"
            with open(logs[name], "ab") as log:
                procs[name] = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "actor", "--config", str(config)],
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        received = await asyncio.wait_for(receiver.recv(), 180)
        await receiver.ack(received)
        rc = await asyncio.to_thread(procs["stranger"].wait, 120)
        stranger_log = logs["stranger"].read_text()
        assert rc != 0 and "the learner refused this actor's connection" in stranger_log, stranger_log
        assert "refused this client's CurveZMQ key" in stranger_log
        assert procs["actor"].poll() is None, logs["actor"].read_text()
        procs["actor"].send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(procs["actor"].wait, 60) == 0, logs["actor"].read_text()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        await publisher.close()
        await receiver.close()
    # The group the learner got is the authorized actor's: its run id names that process.
    assert f"-{procs['actor'].pid}-" in received.group.group_id and len(received.group.trajectories) == 2

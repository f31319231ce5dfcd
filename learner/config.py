"""The learner's config (`agentrl learner --config FILE`, `[learner]` of a run): plain data, no torch
(the device it names is resolved by `learner/devices.py`)."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from agentrl.common.config import FilePath, config_dataclass
from agentrl.common.curve import ServerKeys, load_server_keys, require_curve_off_loopback
from agentrl.common.transport import DEFAULT_MAX_GROUP_FRAME_BYTES
from agentrl.learner.rewards import RewardSchedule
from agentrl.learner.trainer_config import TrainerConfig


@config_dataclass
class PublishConfig:
    """How the learner pushes its weights to the inference servers (`[learner.publish]`)."""

    every: int = 1
    """Push every this many optimizer steps (0 = never)."""
    kv_refresh_every: int = 1
    """Every this many pushes the servers drop their KV and prefix caches, so running requests
    recompute their contexts under the new weights; the pushes in between keep the keys and values
    computed so far (far less work for a CPU server; the behavior log-probs still describe what
    sampled, but reused keys may be up to kv_refresh_every - 1 versions older than the version
    labels say). 1 = every push (exact). agentrl/common/weights.py, step 3."""
    transport: Literal["auto", "shm", "stream"] = "auto"
    """How a push reaches each server: "shm" names a file in this host's /dev/shm (the server must
    share the host), "stream" sends the bytes over HTTP, checksummed (any host); "auto": shm for a
    loopback server URL, stream for any other (agentrl/common/weights.py, TRANSPORTS)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every: {self.every} must be >= 0")
        if self.kv_refresh_every < 1:
            raise ValueError(f"kv_refresh_every: {self.kv_refresh_every} must be >= 1 (1 = drop the servers' KV on every push)")


@config_dataclass
class CheckpointConfig:
    """When the learner checkpoints (`[learner.checkpoint]`)."""

    every: int = 10
    """Checkpoint every this many optimizer steps (also on SIGTERM and at the end)."""
    keep: int = 2
    """Number of newest checkpoints kept on disk."""

    def __post_init__(self) -> None:
        if self.every <= 0 or self.keep < 1:
            raise ValueError(f"every: every ({self.every}) must be > 0 and keep ({self.keep}) >= 1")


@config_dataclass
class AnchorConfig:
    """The demonstration anchor of RL steps (`[learner.anchor]`, learner/anchor.py)."""

    coef: float = 0.0
    """Weight of the anchor in each RL step: the mean NLL of gold demonstrations' action tokens (at
    trainer.temperature), added to the policy-gradient loss; 0 = none. Needs the learner's
    anchor_dir; `agentrl train` fills it with the SFT cold start's demonstrations, and turns the
    anchor off in a run without them (`sft.enabled = false`: no demonstration is read)."""
    tokens_per_step: int = 1024
    """Tokens of demonstrations (whole trajectories, at least one) the anchor adds to each RL step."""

    def __post_init__(self) -> None:
        if not self.coef >= 0 or self.tokens_per_step < 1:
            raise ValueError(f"coef: coef={self.coef} must be >= 0 and tokens_per_step={self.tokens_per_step} >= 1")


@config_dataclass
class LearnerTransportConfig:
    """Where the learner receives trajectory groups and publishes its version, and who may connect
    (`[learner.transport]`). `agentrl train` fills in the two endpoints (and, off loopback, the keys
    it makes); a learner started by hand takes them from its config."""

    group_endpoint: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint the learner binds to receive trajectory groups. Loopback (or ipc://) by
    default; an endpoint other hosts can reach needs the two curve_* keys."""
    version_endpoint: str | None = "tcp://127.0.0.1:5556"
    """ZeroMQ endpoint the learner binds to publish its version (None = do not publish); the same
    rule as group_endpoint."""
    curve_secret_key_file: FilePath | None = None
    """zmq.auth secret certificate (`NAME.key_secret`) of the learner: with it both sockets are
    CurveZMQ servers (encrypted, only authorized clients admitted); required off loopback, optional
    on it. Its public half (`NAME.key`) is the actor's curve_server_key."""
    curve_authorized_clients_dir: FilePath | None = None
    """Directory of the zmq.auth public certificates (`*.key`) of the clients allowed to connect
    (the actor, a supervisor streaming SFT groups); given with curve_secret_key_file. Read when the
    learner starts."""
    max_group_frame_bytes: int = DEFAULT_MAX_GROUP_FRAME_BYTES
    """Largest frame of a trajectory group the receiver reads, in bytes (ZeroMQ MAXMSGSIZE on its
    socket): a sender of a larger frame is disconnected before the frame is buffered. A group's
    largest frame is its header or one trajectory's token ids (4 bytes a token); the default, 64 MiB,
    holds a 16M-token trajectory. Senders (the actor) must use the same bound (`agentrl train` passes it)."""

    def __post_init__(self) -> None:
        keys = self.curve_keys()
        for key in ("group_endpoint", "version_endpoint"):
            endpoint = getattr(self, key)
            if endpoint is not None:
                require_curve_off_loopback(
                    endpoint, keys, key=key, why="the learner trains on every group it is sent",
                    how='set curve_secret_key_file = "keys/server.key_secret" and curve_authorized_clients_dir = '
                        '"clients" (the directory of the clients\' NAME.key files) in [learner.transport], and give '
                        'the actor keys/server.key and its clients/NAME.key_secret')
        if self.max_group_frame_bytes < 1 << 10:
            raise ValueError(f"max_group_frame_bytes: {self.max_group_frame_bytes} must be >= 1024 (a group header alone "
                             "is hundreds of bytes)")

    def curve_keys(self) -> ServerKeys | None:
        """The CurveZMQ keys of the learner's sockets, read and checked (ValueError naming the key);
        None without keys."""
        return load_server_keys(self.curve_secret_key_file, self.curve_authorized_clients_dir)


@config_dataclass
class LearnerConfig:
    output_dir: str = ""
    """Folder for metrics.jsonl, tensorboard/, checkpoints/, spool/ and rejected/ (created); required to run a
    learner (`agentrl train` sets it per phase)."""
    model_dir: FilePath | None = None
    """Hugging Face model folder; None = the prepared SmolLM2-135M-Instruct (agentrl.common.model)."""
    mode: Literal["rl", "sft"] = "rl"
    """"rl": the policy-gradient loss; "sft": masked NLL on the action tokens of (gold) trajectories."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tokens_per_step: int = 8192
    """Token budget of one optimizer step (prompt + observation + action tokens of whole groups)."""
    max_steps: int = 100
    """Stop after this many optimizer steps (counted across restarts)."""
    staleness_bound: int | None = 4
    """Drop trajectories with an action token more than this many versions behind; None = keep all."""
    max_rejected_bytes: int = 1 << 30
    """output_dir/rejected/ (refused groups, kept for reading: learner/rejected.py) stops growing at
    this many bytes; later refusals are still logged, counted and nacked."""
    server_urls: list[str] = field(default_factory=list)
    """vLLM server base URLs to push weights to."""
    services_file: str = ""
    """The run's service directory (RUN_DIR/services.json, agentrl.common.directory): a server that
    starts again at another address is followed there. Empty: the servers keep their URLs."""
    reward_schedule: RewardSchedule = field(default_factory=RewardSchedule)
    """Process/task reward weights by optimizer step."""
    publish: PublishConfig = field(default_factory=PublishConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    transport: LearnerTransportConfig = field(default_factory=LearnerTransportConfig)
    init_checkpoint: FilePath | None = None
    """A checkpoints folder (another learner's `output_dir/checkpoints`) whose latest policy weights
    and version this learner starts from when its own output_dir holds no checkpoint yet: the RL
    phase starting from the SFT cold start. Optimizer, scheduler and ledger start fresh."""
    kl_reference: bool = False
    """Load a frozen copy of the initial weights as KL reference (needs trainer.loss.kl_coef > 0):
    those of `init_checkpoint` when it is set (the policy RL starts from), else `model_dir`'s."""
    anchor_dir: FilePath | None = None
    """A spool folder of demonstration groups for the anchor (`anchor`, learner/anchor.py)."""
    seed: int = 0
    """Seed of torch, numpy and Python's generators at start (checkpoints carry their states)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy (and value head, KL reference) trains: "auto" = "cuda" when torch sees a
    GPU, else "cpu". On CUDA each torchrun rank uses cuda:{LOCAL_RANK} (one process per GPU), one
    process cuda:0 of what CUDA_VISIBLE_DEVICES shows. Checkpoints and published weights are CPU
    tensors either way. "cuda" without a GPU fails at start (`resolve_device`)."""
    dist_timeout_s: float = 600.0
    """Under torchrun: the longest any collective may wait for another rank (s); a rank whose peer
    died or hangs fails after at most this. Rank 0 sends a heartbeat every quarter of it while it
    waits for data, so an idle learner does not trip it."""
    tensorboard: bool = True
    """Write every numeric metric to output_dir/tensorboard too."""
    progress_bar: bool = True
    """A tqdm bar on stderr (off when a supervisor owns the terminal)."""

    __moved__ = {"publish_every": "publish.every", "kv_refresh_every": "publish.kv_refresh_every",
                 "weight_transport": "publish.transport", "checkpoint_every": "checkpoint.every",
                 "keep_checkpoints": "checkpoint.keep", "anchor_coef": "anchor.coef",
                 "anchor_tokens_per_step": "anchor.tokens_per_step", "group_endpoint": "transport.group_endpoint",
                 "version_endpoint": "transport.version_endpoint",
                 "curve_secret_key_file": "transport.curve_secret_key_file",
                 "curve_authorized_clients_dir": "transport.curve_authorized_clients_dir",
                 "max_group_frame_bytes": "transport.max_group_frame_bytes"}

    def __post_init__(self) -> None:
        if self.tokens_per_step <= 0:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must be > 0")
        if self.mode not in ("rl", "sft"):
            raise ValueError(f"mode={self.mode!r}: choose 'rl' or 'sft'")
        if self.anchor.coef > 0 and self.mode == "sft":
            raise ValueError("anchor: anchor.coef > 0 is for mode = 'rl' (the SFT loss is the demonstrations' NLL already)")
        if self.trainer.loss.kl_coef > 0 and not self.kl_reference:
            raise ValueError("trainer.loss.kl_coef > 0 needs kl_reference = true")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s={self.dist_timeout_s} must be > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: choose 'auto', 'cpu' or 'cuda' (under torchrun each rank "
                             "takes cuda:{LOCAL_RANK}; pick GPUs with CUDA_VISIBLE_DEVICES)")

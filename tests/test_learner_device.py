"""The learner's device (`LearnerConfig.device`): choice, validation, and training, checkpointing,
resuming and publishing on it.

On a CPU-only host the CUDA cases are skipped (the `gpu` marker and the skip condition are those of
tests/test_kernels_gpu.py); on a CUDA machine `python -m pytest tests/test_learner_device.py` runs
them. The CPU cases run the same code with `device = "cpu"` named explicitly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.synthetic import make_group, tiny_llama

from agentrl.kernels.policy_loss import PolicyLossConfig
from agentrl.learner.advantages import AdvantageConfig
from agentrl.learner.batching import Sample, build_micro_batches
from agentrl.learner.checkpoint import load_latest_checkpoint
from agentrl.learner.config import LearnerConfig
from agentrl.learner.devices import pick_device, resolve_device
from agentrl.learner.rewards import RewardWeights
from agentrl.learner.service import Learner, load_config, main
from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig

VOCAB = 128
NEEDS_CUDA = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run this file on a GPU host)")]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


# ---- choice and validation ----------------------------------------------------------------------
@pytest.mark.parametrize("name, num_gpus, local_rank, expected", [
    ("auto", 0, None, "cpu"), ("auto", 0, 3, "cpu"), ("cpu", 8, 1, "cpu"),
    ("auto", 2, None, "cuda:0"), ("auto", 2, 1, "cuda:1"), ("cuda", 1, None, "cuda:0"), ("cuda", 4, 3, "cuda:3"),
])
def test_device_follows_the_config_and_torchruns_local_rank(name, num_gpus, local_rank, expected):
    assert pick_device(name, num_gpus, local_rank) == torch.device(expected)


def test_cuda_needs_a_gpu_per_rank():
    with pytest.raises(RuntimeError, match="no CUDA device.*device = 'cpu'"):
        pick_device("cuda", 0, None)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but only 2 CUDA device.*--nproc_per_node 2"):
        pick_device("auto", 2, 2)


def test_unknown_device_is_refused_when_the_config_loads(tmp_path):
    path = tmp_path / "learner.toml"
    path.write_text(f'output_dir = "{tmp_path}"\npublish.every = 0\ndevice = "gpu"\n')
    with pytest.raises(ValueError, match=r"learner.toml: device: Input should be 'auto', 'cpu' or 'cuda' \(got \"gpu\"\)"):
        load_config(path)


@NO_CUDA
def test_auto_is_the_cpu_here_and_cuda_fails_at_start_with_the_fix(tmp_path, capsys):
    assert resolve_device("auto") == torch.device("cpu")
    assert Learner(LearnerConfig(output_dir=str(tmp_path / "a"), publish={"every": 0})).ranks.device == torch.device("cpu")
    # The config itself is valid anywhere (a supervisor may read it on another host); the learner refuses at start.
    config = LearnerConfig(output_dir=str(tmp_path / "b"), publish={"every": 0}, device="cuda")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device.*set device = 'cpu'"):
        Learner(config)
    path = tmp_path / "learner.toml"
    path.write_text(f'output_dir = "{tmp_path / "c"}"\npublish.every = 0\ndevice = "cuda"\n')
    assert main(["--config", str(path)]) == 2
    assert "bad config: device = 'cuda' but torch sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before anything was created


# ---- micro-batches --------------------------------------------------------------------------------
def _micro_batch():
    group = make_group("g", [1.0, 0.0], turns=[(5, 3), (4, 0)], vocab_size=VOCAB)
    samples = [Sample("g", t.sample_index, t, t.is_action.astype("float32")) for t in group.trajectories]
    [mb] = build_micro_batches(samples, max_row_tokens=10_000)
    return mb


def _tensor_fields(mb):
    return {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb) if isinstance(getattr(mb, f.name), torch.Tensor)}


def test_micro_batch_on_the_cpu_is_not_copied():
    mb = _micro_batch()
    moved = mb.to(torch.device("cpu"))
    assert len(_tensor_fields(mb)) == 8
    for name, tensor in _tensor_fields(moved).items():
        assert tensor is getattr(mb, name)  # the CPU path trains on the very tensors it built
    assert moved.samples is mb.samples and moved.num_seqs == mb.num_seqs


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=NEEDS_CUDA)])
def test_micro_batch_moves_every_tensor(device):
    mb = _micro_batch()
    moved = mb.to(torch.device(device))
    for name, tensor in _tensor_fields(moved).items():
        assert tensor.device.type == device, name
        torch.testing.assert_close(tensor.cpu(), getattr(mb, name), rtol=0, atol=0)


# ---- the learner on a device: steps, checkpoint, resume, publish ---------------------------------
def _config(tmp_path, model_dir, device: str, estimator: str, precision: str) -> LearnerConfig:
    kl = estimator != "gae"  # the KL reference with GRPO, the value head with GAE: both move with the policy
    trainer = TrainerConfig(precision=precision, max_row_tokens=48, advantage=AdvantageConfig(estimator),
                            optimizer=OptimizerConfig(lr=1e-3, grad_clip=1.0),
                            loss=PolicyLossConfig(kl_coef=0.05 if kl else 0.0))
    return LearnerConfig(output_dir=str(tmp_path), model_dir=str(model_dir), publish={"every": 0}, transport={"version_endpoint": None},
                         kl_reference=kl, trainer=trainer, device=device, tensorboard=False, progress_bar=False)


def _groups():
    return [make_group(f"g{i}", [1.0, 0.0, 0.5, 0.0], turns=[(6 + i, 3), (5, 0)], vocab_size=VOCAB, seed=i)
            for i in range(3)]


def _start(config: LearnerConfig) -> Learner:
    learner = Learner(config)
    learner.start_training()
    return learner


def _steps(learner: Learner, groups, num_steps: int) -> list[float]:
    losses = []
    for _ in range(num_steps):
        batch = learner.prepare(groups, RewardWeights())
        stats, _ = learner.ranks.step(batch.samples)
        learner.step += 1
        losses.append(stats.loss)
    return losses


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def run_learner(tmp_path, device: str, estimator: str, precision: str = "fp32") -> list[float]:
    """Three steps on `device`, a checkpoint after the second, and the third again from that
    checkpoint in a fresh learner; returns the losses of the first run."""
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        tiny_llama(VOCAB, seed=0).save_pretrained(model_dir)
    out = tmp_path / f"{device}-{estimator}-{precision}"
    learner = _start(_config(out, model_dir, device, estimator, precision))
    expected = resolve_device(device)
    assert learner.ranks.trainer.device == expected
    assert all(p.device == expected for p in learner.ranks.trainer.policy.parameters())
    if learner.ranks.trainer.reference is not None:
        assert all(p.device == expected for p in learner.ranks.trainer.reference.parameters())
    losses = _steps(learner, _groups(), 2)
    learner.checkpoint()
    state = load_latest_checkpoint(out / "checkpoints")
    assert all(t.device.type == "cpu" for t in _tensors(state)), "a checkpoint holds CPU tensors only"
    assert ("cuda" in state["rng"]) == (expected.type == "cuda")
    snapshot = learner.ranks.snapshot()
    compute_dtype = learner.ranks.trainer.policy.compute_dtype  # what the server is sent: the learner's compute dtype
    assert all(t.device.type == "cpu" and t.dtype == compute_dtype for t in snapshot.values())
    losses += _steps(learner, _groups(), 1)

    resumed = _start(_config(out, model_dir, device, estimator, precision))
    assert resumed.step == 2
    for group in resumed.ranks.trainer.optimizer.state.values():
        assert group["exp_avg"].device == expected and group["exp_avg_sq"].device == expected
    [again] = _steps(resumed, _groups(), 1)
    # The same step from the same state on the same device: the optimizer state came back where it trains.
    assert again == pytest.approx(losses[2], rel=1e-6, abs=1e-9)
    return losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_learner_trains_checkpoints_and_resumes_on_its_device(tmp_path, device, estimator):
    losses = run_learner(tmp_path, device, estimator)
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
@pytest.mark.parametrize("precision, rel", [("fp32", 1e-3), ("bf16", 3e-2)])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=NEEDS_CUDA)])
def test_cuda_learner_matches_the_cpu_learner(tmp_path, device, estimator, precision, rel):
    """The same three steps on CUDA (Triton kernels) and on the CPU (chunked torch kernels). fp32:
    the kernels agree to ~1e-5 (test_kernels_gpu.py); AdamW's first updates are about lr per
    element whatever the gradient's size, so later losses may differ a little more. bf16 autocast
    rounds differently on the two devices (~1e-2 on log-probs)."""
    on_cpu = run_learner(tmp_path, "cpu", estimator, precision)
    on_cuda = run_learner(tmp_path, device, estimator, precision)
    assert on_cuda == pytest.approx(on_cpu, rel=rel, abs=1e-4)


def test_the_kl_reference_of_a_learner_started_from_a_checkpoint_is_that_checkpoint(tmp_path):
    """RL after SFT (`init_checkpoint`): the KL term must anchor to the SFT policy RL starts from,
    not to the base model (it pulled every step back towards the untrained model before)."""
    model_dir = tmp_path / "model"
    tiny_llama(VOCAB, seed=0).save_pretrained(model_dir)
    first = _start(_config(tmp_path / "sft", model_dir, "cpu", "grpo", "fp32"))
    _steps(first, _groups(), 2)
    first.checkpoint()
    trained = {k: v for k, v in first.ranks.trainer.policy.state_dict().items() if not k.startswith("value_head.")}
    config = dataclasses.replace(_config(tmp_path / "rl", model_dir, "cpu", "grpo", "fp32"),
                                 init_checkpoint=str(tmp_path / "sft" / "checkpoints"))
    for learner in (_start(config), _start(config)):  # fresh, then again (the same on every start)
        reference = learner.ranks.trainer.reference.state_dict()
        assert set(reference) == set(trained)
        for key, value in trained.items():
            torch.testing.assert_close(reference[key], value, rtol=0, atol=0)
    base = _start(_config(tmp_path / "base", model_dir, "cpu", "grpo", "fp32")).ranks.trainer.reference.state_dict()
    assert any(not torch.equal(base[k], trained[k]) for k in trained)  # the steps moved the weights


def test_the_slower_kinds_float32_can_be_chosen_on_a_bf16_cpu(monkeypatch):
    # scripts/slow_kind.sh sets AGENTRL_CPU_BF16=0: "auto" then picks float32 for the server and the
    # learner as it does on a CPU without native bf16; any other value is refused, not guessed.
    from agentrl.common import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.delenv("AGENTRL_CPU_BF16", raising=False)
    assert hardware.cpu_has_fast_bf16()
    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    assert not hardware.cpu_has_fast_bf16() and hardware.auto_dtype_name("cpu") == "float32"
    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    with pytest.raises(ValueError, match="AGENTRL_CPU_BF16='1'"):
        hardware.cpu_has_fast_bf16()

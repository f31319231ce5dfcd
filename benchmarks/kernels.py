"""Fused linear log-prob vs the materialised reference (and torch.compile of it): memory and time;
the policy loss's dual clip: its cost and its effect on synthetic off-policy batches.

    python benchmarks/kernels.py                 # CPU mode here; CUDA mode when a GPU is present
    python benchmarks/kernels.py --device cuda   # what benchmarks/gpu_check.sh runs
    python benchmarks/kernels.py --suite policy_loss   # only the policy-loss part (~1 min on the CPU)

The measured step is what the learner does per micro-batch: logprobs = f(hidden, weight, targets),
loss = (logprobs * g).sum(), loss.backward() into hidden and the LM-head weight (fp32 on the CPU,
no mask, no entropy: the plain log-softmax + gather baseline).

CPU mode: SmolLM2-135M's head (H = 576, V = 49152), N in {2048, 8192}, float32. One process warms
every path up once at N = 2048 (torch.compile(dynamic=True) compiles there; it warms up again at
N = 8192 in case its guards recompile), then
times 3 rounds at N = 2048 and 2 at N = 8192, each round running every path once in a rotating
order: the machine is shared (2 cores, other jobs' load comes and goes), and interleaving makes a
load change hit every path instead of biasing the ratio. An N = 8192 run of the reference is ~17 s
of float32 matmul on 2 idle cores; more rounds would push the default run far past 3 minutes.
Peak extra memory: torch's CPU allocations are invisible to tracemalloc and the CPU allocator keeps
no statistics, so the benchmark reads the kernel's own accounting: before every timed run it frees
garbage, returns all free heap pages to the OS (glibc malloc_trim, which also releases free pages
inside the heap, so memory an earlier run freed cannot hide this run's use), reads VmRSS, resets the
high-water mark (writing 5 to /proc/self/clear_refs), runs once and reads VmHWM. Peak extra =
VmHWM - VmRSS before: every page the step touched at its peak, the weight and hidden gradients
(113 MiB + O(N H), the same for every path) included. Linux only.

CUDA mode: Qwen2.5-3B's head (H = 2048, V = 151936), N in {8192, 32768}, bf16. Times (CUDA events,
median of 5 after 2 warm-ups) the forward alone and forward + backward for: the Triton path, the
materialised reference, torch.compile of it, and the fused path with the policy loss against
Liger-Kernel's LigerFusedLinearGRPOLoss on the same tokens; peak extra memory from
torch.cuda.max_memory_allocated. Achieved TFLOP/s use 2NHV for the forward and 8NHV for training
(forward 2NHV; backward: recompute 2NHV + grad_hidden 2NHV + grad_weight 2NHV).

Policy loss (`--suite policy_loss`, keys pl_*; both modes): the per-token kernel of `policy_loss`
(torch on the CPU, Triton on CUDA) with the dual clip off (clip_ratio_c = None) and on (3.0), with
kl_coef = 0.05 and is_cap = 2, token_mean, float32, on N in {32768, 131072} tokens (sequences of 256,
a GRPO advantage N(0, 1) per sequence). Timed step: loss and stats forward + backward into the
log-probs; rounds interleave the two configs (one run each, order rotating) after warm-up; median
and spread; overhead = median(on) / median(off) - 1. Effect, at N = 32768: the proximal log-ratio
logp - prox drawn from N(0, s) for s in {0, 0.1, 0.3, 1} nats (s = 0 is the trainer as wired: it
evaluates the proximal policy in the update's own forward, so r = 1) and from a heavy-tailed
Student-t (2 degrees of freedom, scale 0.1); for each, the dual-clipped share of tokens, the loss,
the gradient's L2 norm and its largest entry with and without the dual clip.

Prints progress on stderr and one JSON line last (flat keys) on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

CPU_HIDDEN, CPU_VOCAB, CPU_SIZES = 576, 49152, (2048, 8192)
CPU_REPEATS = {2048: 3, 8192: 2}
CUDA_HIDDEN, CUDA_VOCAB, CUDA_SIZES = 2048, 151936, (8192, 32768)
CUDA_WARMUP, CUDA_REPEATS = 2, 5
# Targets from the issue: fused peak extra memory <= 5% of the materialised path at N = 8192, time <= 1.5x.
MEM_TARGET, TIME_TARGET = 0.05, 1.5


def log(msg: str) -> None:
    print(f"[kernels-bench] {msg}", file=sys.stderr, flush=True)


def git_commit() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"unknown ({proc.stderr.strip()[:80]})"


def machine_info() -> dict:
    import torch

    info = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    try:
        import triton

        info["triton_version"] = triton.__version__
    except ImportError as exc:
        info["triton_version"] = f"not importable: {exc}"
    return info


def spread(values: list[float]) -> float:
    return max(values) - min(values)


# ----------------------------------------------------------------------------- CPU mode


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_one_size(num_tokens: int, paths: dict, results: dict, libc) -> None:
    """Warm-up (first size only) and the timed rounds at one N; appends to `results`."""
    import torch

    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, CPU_HIDDEN, generator=gen).requires_grad_()
    weight = (torch.randn(CPU_VOCAB, CPU_HIDDEN, generator=gen) * 0.04).requires_grad_()
    targets = torch.randint(0, CPU_VOCAB, (num_tokens,), generator=gen)
    grad_N = torch.randn(num_tokens, generator=gen)

    def step(fn):
        hidden.grad = None
        weight.grad = None
        (fn(hidden, weight, targets) * grad_N).sum().backward()

    for path, fn in paths.items():
        results[path][str(num_tokens)] = {"peak_extra_bytes": [], "times_s": []}
        # Every path warms up at the first N; the compiled one again at each N in case its guards
        # recompile for the new size (a compile inside a timed run would be charged to it).
        if num_tokens == CPU_SIZES[0] or path == "compiled":
            t0 = time.perf_counter()
            try:
                step(fn)
            except Exception as exc:  # torch.compile "where it compiles": reported, not hidden
                if path != "compiled":
                    raise
                results["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                log(f"torch.compile failed: {traceback.format_exc()}")
                del paths["compiled"], results["compiled"]
                break
            log(f"{path}: warm-up at N={num_tokens} took {time.perf_counter() - t0:.1f} s")
    for r in range(CPU_REPEATS[num_tokens]):
        # Rotate the order each round so a load change on this shared machine hits every path.
        order = list(paths)[r % len(paths):] + list(paths)[: r % len(paths)]
        for path in order:
            hidden.grad = None
            weight.grad = None
            gc.collect()
            libc.malloc_trim(0)
            rss_before = _proc_status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            t0 = time.perf_counter()
            step(paths[path])
            elapsed = time.perf_counter() - t0
            entry = results[path][str(num_tokens)]
            entry["times_s"].append(elapsed)
            entry["peak_extra_bytes"].append(_proc_status_bytes("VmHWM") - rss_before)
            log(f"{path}: N={num_tokens} run {r}: {elapsed:.2f} s, peak extra "
                f"{entry['peak_extra_bytes'][-1] / 2**20:.0f} MiB")


def _cpu_measure() -> dict:
    """All paths, both sizes, interleaved in this process. Returns {path: {n: {peaks, times}}}."""
    import torch

    from agentrl.kernels.linear_logprob import linear_logprob
    from agentrl.kernels.reference import linear_logprob_reference

    libc = ctypes.CDLL("libc.so.6")
    paths = {
        "fused": linear_logprob,
        "reference": linear_logprob_reference,
        # dynamic=True: one compilation serves both N, so the N = 2048 warm-up covers N = 8192.
        "compiled": torch.compile(linear_logprob_reference, dynamic=True),
    }
    results: dict = {path: {} for path in paths}
    for num_tokens in CPU_SIZES:
        _cpu_one_size(num_tokens, paths, results, libc)
    return results


def run_cpu() -> dict:
    out = {"mode": "cpu", "hidden": CPU_HIDDEN, "vocab": CPU_VOCAB, "dtype": "float32"}
    per_path = _cpu_measure()
    if "compile_error" in per_path:
        out["cpu_compiled_error"] = per_path.pop("compile_error")
    for path, results in per_path.items():
        for n, r in results.items():
            out[f"cpu_{path}_time_s_n{n}"] = round(statistics.median(r["times_s"]), 3)
            out[f"cpu_{path}_time_spread_s_n{n}"] = round(spread(r["times_s"]), 3)
            out[f"cpu_{path}_runs_n{n}"] = len(r["times_s"])
            out[f"cpu_{path}_peak_extra_mib_n{n}"] = round(statistics.median(r["peak_extra_bytes"]) / 2**20, 1)
            out[f"cpu_{path}_peak_extra_spread_mib_n{n}"] = round(spread(r["peak_extra_bytes"]) / 2**20, 1)

    def median_of(path: str, n: str, key: str) -> float:
        return statistics.median(per_path[path][n][key])

    for n in map(str, CPU_SIZES):
        for prefix, path in (("cpu", "fused"), ("cpu_compiled", "compiled")):
            if path not in per_path:
                continue
            out[f"{prefix}_mem_ratio_n{n}"] = round(
                median_of(path, n, "peak_extra_bytes") / median_of("reference", n, "peak_extra_bytes"), 4
            )
            out[f"{prefix}_time_ratio_n{n}"] = round(median_of(path, n, "times_s") / median_of("reference", n, "times_s"), 3)
    out["cpu_mem_target_met_n8192"] = out["cpu_mem_ratio_n8192"] <= MEM_TARGET
    out["cpu_time_target_met_n8192"] = out["cpu_time_ratio_n8192"] <= TIME_TARGET
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return out


# ----------------------------------------------------------------------------- CUDA mode


def _cuda_time(fn, warmup: int, repeats: int) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _cuda_peak_extra(fn) -> int:
    import torch

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _cuda_one_size(n: int, out: dict, compiled_ref, liger_loss) -> None:
    """All CUDA paths at one N; adds its keys to `out`. Tensors die with the frame."""
    import torch

    from agentrl.kernels.linear_logprob import linear_logprob
    from agentrl.kernels.policy_loss import policy_loss
    from agentrl.kernels.policy_loss_config import PolicyLossConfig
    from agentrl.kernels.reference import linear_logprob_reference

    device = torch.device("cuda")
    # Liger's GRPO loss has no dual clip: compare like with like.
    config = PolicyLossConfig(eps_low=0.2, eps_high=0.28, is_cap=None, agg="token_mean", clip_ratio_c=None)
    seq_len = 1024
    gen = torch.Generator(device=device).manual_seed(n)
    hidden = (torch.randn(n, CUDA_HIDDEN, generator=gen, device=device) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(CUDA_VOCAB, CUDA_HIDDEN, generator=gen, device=device) * 0.02).bfloat16()
    weight.requires_grad_()
    targets = torch.randint(0, CUDA_VOCAB, (n,), generator=gen, device=device)
    grad_N = torch.randn(n, generator=gen, device=device)
    num_seqs = n // seq_len
    seq_ids = torch.arange(n, device=device) // seq_len
    mask = torch.ones(n, dtype=torch.bool, device=device)
    with torch.no_grad():
        old_lp = linear_logprob(hidden, weight, targets) + 0.05 * torch.randn(n, generator=gen, device=device)
    adv_S = torch.randn(num_seqs, generator=gen, device=device)
    fwd_flop, train_flop = 2 * n * CUDA_HIDDEN * CUDA_VOCAB, 8 * n * CUDA_HIDDEN * CUDA_VOCAB

    def zero_grads():
        hidden.grad = None
        weight.grad = None

    def logprob_paths():
        yield "fused", linear_logprob
        yield "reference", linear_logprob_reference
        yield "compiled", compiled_ref

    for name, fn in logprob_paths():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(hidden, weight, targets)

        def train(fn=fn):
            zero_grads()
            (fn(hidden, weight, targets) * grad_N).sum().backward()

        key = f"cuda_{name}"
        try:
            t_fwd = _cuda_time(fwd, CUDA_WARMUP, CUDA_REPEATS)
            t_train = _cuda_time(train, CUDA_WARMUP, CUDA_REPEATS)
            peak = _cuda_peak_extra(train)
        except torch.cuda.OutOfMemoryError as exc:
            out[f"{key}_error_n{n}"] = f"out of memory: {str(exc).splitlines()[0][:200]}"
            zero_grads()
            gc.collect()
            torch.cuda.empty_cache()
            log(f"{name} N={n}: out of memory")
            continue
        except Exception as exc:  # torch.compile failures surface here; reported, not hidden
            out[f"{key}_error_n{n}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log(traceback.format_exc())
            continue
        out[f"{key}_fwd_ms_n{n}"] = round(1e3 * statistics.median(t_fwd), 3)
        out[f"{key}_fwd_spread_ms_n{n}"] = round(1e3 * spread(t_fwd), 3)
        out[f"{key}_train_ms_n{n}"] = round(1e3 * statistics.median(t_train), 3)
        out[f"{key}_train_spread_ms_n{n}"] = round(1e3 * spread(t_train), 3)
        out[f"{key}_fwd_tflops_n{n}"] = round(fwd_flop / statistics.median(t_fwd) / 1e12, 1)
        out[f"{key}_train_tflops_n{n}"] = round(train_flop / statistics.median(t_train) / 1e12, 1)
        out[f"{key}_peak_extra_mib_n{n}"] = round(peak / 2**20, 1)
        log(f"{name} N={n}: fwd {out[f'{key}_fwd_ms_n{n}']} ms, train {out[f'{key}_train_ms_n{n}']} ms")

    def ours_grpo():
        zero_grads()
        lp = linear_logprob(hidden, weight, targets)
        loss, _ = policy_loss(lp, old_lp, None, adv_S[seq_ids], mask, seq_ids, num_seqs=num_seqs, config=config)
        loss.backward()

    def liger_grpo():
        zero_grads()
        result = liger_loss(
            hidden.view(num_seqs, seq_len, CUDA_HIDDEN), weight, targets.view(num_seqs, seq_len),
            mask.view(num_seqs, seq_len).long(), adv_S, old_per_token_logps=old_lp.view(num_seqs, seq_len),
        )
        (result[0] if isinstance(result, tuple) else result).backward()

    grpo_paths = [("fused_grpo", ours_grpo)] + ([("liger_grpo", liger_grpo)] if liger_loss is not None else [])
    for name, fn in grpo_paths:
        key = f"cuda_{name}"
        try:
            t_train = _cuda_time(fn, CUDA_WARMUP, CUDA_REPEATS)
            peak = _cuda_peak_extra(fn)
        except Exception as exc:  # an API mismatch in a third-party loss is reported, not hidden
            out[f"{key}_error_n{n}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log(traceback.format_exc())
            continue
        out[f"{key}_train_ms_n{n}"] = round(1e3 * statistics.median(t_train), 3)
        out[f"{key}_train_spread_ms_n{n}"] = round(1e3 * spread(t_train), 3)
        out[f"{key}_train_tflops_n{n}"] = round(train_flop / statistics.median(t_train) / 1e12, 1)
        out[f"{key}_peak_extra_mib_n{n}"] = round(peak / 2**20, 1)
        log(f"{name} N={n}: train {out[f'{key}_train_ms_n{n}']} ms")
    if f"cuda_fused_train_ms_n{n}" in out and f"cuda_reference_train_ms_n{n}" in out:
        out[f"cuda_time_ratio_n{n}"] = round(out[f"cuda_fused_train_ms_n{n}"] / out[f"cuda_reference_train_ms_n{n}"], 3)
        out[f"cuda_mem_ratio_n{n}"] = round(
            out[f"cuda_fused_peak_extra_mib_n{n}"] / out[f"cuda_reference_peak_extra_mib_n{n}"], 4
        )
    if f"cuda_fused_grpo_train_ms_n{n}" in out and f"cuda_liger_grpo_train_ms_n{n}" in out:
        out[f"cuda_vs_liger_time_ratio_n{n}"] = round(
            out[f"cuda_fused_grpo_train_ms_n{n}"] / out[f"cuda_liger_grpo_train_ms_n{n}"], 3
        )


def run_cuda() -> dict:
    import torch

    from agentrl.kernels.reference import linear_logprob_reference

    device = torch.device("cuda")
    out = {
        "mode": "cuda", "gpu": torch.cuda.get_device_name(device), "hidden": CUDA_HIDDEN, "vocab": CUDA_VOCAB,
        "dtype": "bfloat16",
    }
    compiled_ref = torch.compile(linear_logprob_reference, dynamic=False)
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo"
        )
    except ImportError as exc:
        liger_loss = None
        out["liger_error"] = f"liger-kernel not importable: {exc}"

    for n in CUDA_SIZES:
        _cuda_one_size(n, out, compiled_ref, liger_loss)
        gc.collect()
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- policy loss (dual clip)

PL_SIZES = (32768, 131072)
# ~4 ms and ~11 ms per step on 2 cores: 300 / 100 interleaved rounds take ~5 s and tame this machine's
# load swings (a 30-round run had spreads above the medians).
PL_WARMUP, PL_ROUNDS = 5, {32768: 300, 131072: 100}
PL_SEQ_LEN, PL_DUAL_C = 256, 3.0
# Proximal log-ratio distributions for the effect table: (name, kind, scale in nats).
PL_STALENESS = (("s0", "normal", 0.0), ("s0.1", "normal", 0.1), ("s0.3", "normal", 0.3),
                ("s1", "normal", 1.0), ("t2_0.1", "student_t2", 0.1))


def _pl_batch(num_tokens: int, device, kind: str, scale: float, seed: int) -> dict:
    """A packed batch for `policy_loss`: logprobs [N] (a leaf that requires grad) and its constants."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    num_seqs = num_tokens // PL_SEQ_LEN
    logprobs_N = -torch.rand(num_tokens, generator=gen) * 3
    if kind == "normal":
        step_N = torch.randn(num_tokens, generator=gen) * scale
    else:  # Student-t with 2 degrees of freedom: z / sqrt(chi2_2 / 2), chi2_2 = -2 log U
        chi2_N = -2 * torch.rand(num_tokens, generator=gen).clamp(min=1e-12).log()
        step_N = torch.randn(num_tokens, generator=gen) / (chi2_N / 2).sqrt() * scale
    proximal_N = logprobs_N - step_N
    seq_ids_N = torch.arange(num_tokens) // PL_SEQ_LEN
    batch = {
        "logprobs": logprobs_N,
        "proximal_logprobs": proximal_N,
        "behavior_logprobs": proximal_N + 0.1 * torch.randn(num_tokens, generator=gen),
        "advantages": torch.randn(num_seqs, generator=gen)[seq_ids_N],
        "mask": torch.ones(num_tokens, dtype=torch.bool),
        "seq_ids": seq_ids_N,
        "ref_logprobs": proximal_N + 0.3 * torch.randn(num_tokens, generator=gen),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["logprobs"].requires_grad_()
    return batch | {"num_seqs": num_seqs}


def _pl_step(batch: dict, config) -> tuple:
    """(loss, stats, grad of the log-probs) of one forward + backward."""
    from agentrl.kernels.policy_loss import policy_loss

    batch["logprobs"].grad = None
    args = [batch[k] for k in ("logprobs", "proximal_logprobs", "behavior_logprobs", "advantages", "mask", "seq_ids")]
    loss, stats = policy_loss(*args, num_seqs=batch["num_seqs"], config=config, ref_logprobs=batch["ref_logprobs"])
    loss.backward()
    return loss, stats, batch["logprobs"].grad


def _pl_configs() -> dict:
    from agentrl.kernels.policy_loss_config import PolicyLossConfig

    return {
        "off": PolicyLossConfig(kl_coef=0.05, is_cap=2.0, clip_ratio_c=None),
        "dual": PolicyLossConfig(kl_coef=0.05, is_cap=2.0, clip_ratio_c=PL_DUAL_C),
    }


def _pl_timed_run(fn, device) -> float:
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_policy_loss(device) -> dict:
    """The pl_* keys (module docstring): dual-clip overhead per N, then its effect per staleness."""
    out: dict = {}
    prefix = f"pl_{device.type}"
    configs = _pl_configs()
    for n in PL_SIZES:
        batch = _pl_batch(n, device, "normal", 0.3, seed=n)
        times: dict[str, list[float]] = {name: [] for name in configs}
        for config in configs.values():
            for _ in range(PL_WARMUP):
                _pl_step(batch, config)
        for r in range(PL_ROUNDS[n]):
            order = list(configs)[r % len(configs):] + list(configs)[: r % len(configs)]
            for name in order:
                times[name].append(_pl_timed_run(lambda b=batch, c=configs[name]: _pl_step(b, c), device))
        for name, runs in times.items():
            out[f"{prefix}_{name}_ms_n{n}"] = round(1e3 * statistics.median(runs), 3)
            out[f"{prefix}_{name}_spread_ms_n{n}"] = round(1e3 * spread(runs), 3)
        out[f"{prefix}_dual_overhead_n{n}"] = round(statistics.median(times["dual"]) / statistics.median(times["off"]) - 1, 4)
        log(f"policy loss N={n}: off {out[f'{prefix}_off_ms_n{n}']} ms, dual {out[f'{prefix}_dual_ms_n{n}']} ms")

    n = PL_SIZES[0]
    for name, kind, scale in PL_STALENESS:
        batch = _pl_batch(n, device, kind, scale, seed=1)
        results = {}
        for config_name, config in configs.items():
            loss, stats, grad_N = _pl_step(batch, config)
            results[config_name] = (float(loss.detach()), stats, float(grad_N.norm()), float(grad_N.abs().max()))
        (loss_off, stats_off, norm_off, max_off), (loss_on, stats_on, norm_on, max_on) = results["off"], results["dual"]
        key = f"{prefix}_effect_{name}"
        out[f"{key}_dual_clip_frac"] = round(float(stats_on["dual_clip_frac"]), 6)
        out[f"{key}_clip_frac_low"] = round(float(stats_off["clip_frac_low"]), 6)
        out[f"{key}_ratio_max"] = round(float((batch["logprobs"].detach() - batch["proximal_logprobs"]).exp().max()), 3)
        out[f"{key}_loss_off"] = round(loss_off, 6)
        out[f"{key}_loss_dual"] = round(loss_on, 6)
        out[f"{key}_grad_norm_off"] = round(norm_off, 6)
        out[f"{key}_grad_norm_dual"] = round(norm_on, 6)
        out[f"{key}_grad_max_off"] = round(max_off, 6)
        out[f"{key}_grad_max_dual"] = round(max_on, 6)
        log(f"effect {name}: dual-clipped {out[f'{key}_dual_clip_frac']:.4%}, loss {loss_off:.4f} -> {loss_on:.4f}, "
            f"grad norm {norm_off:.4g} -> {norm_on:.4g}, max {max_off:.3g} -> {max_on:.3g}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when available, else cpu")
    parser.add_argument("--suite", choices=("all", "logprob", "policy_loss"), default="all",
                        help="logprob: the linear log-prob paths; policy_loss: the dual clip's cost and effect")
    args = parser.parse_args(argv)

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    started = time.perf_counter()
    result = machine_info()
    result["suite"] = args.suite
    if args.suite in ("all", "logprob"):
        result.update(run_cuda() if device == "cuda" else run_cpu())
    if args.suite in ("all", "policy_loss"):
        result.update(run_policy_loss(torch.device(device)))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The device check, on one CUDA GPU in about 5 minutes: the GPU figures the README reports, and the exactness
properties on the GPU. It prints one table and, with $OUT set, writes gpu_check.json (every figure, as it is
measured) and gpu_check.txt (the table) under it.

    python .ci/gpu_check.py                        # Ouro-1.4B's shapes, random weights, bfloat16, on cuda
    python .ci/gpu_check.py --device cpu --small   # this script's own check: bench.json's shapes, on the CPU

Each row: what is measured, the figure, the bar (from the round's GPU issue), and whether it holds. The model is
random (Ouro-1.4B's shapes: no download, no checkpoint), its exit gate's bias set so that the mean exit loop on
the prompts is near 2.5. Rollouts run with `numerics="static"` and CUDA graphs (`CallGraphs`), as `train`,
`rollout` and `bench` do with `--numerics static` on CUDA; the first run of each shape captures, and is not timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import scalerlt_ref as S  # noqa: E402

OURO_1_4B = dict(
    vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, head_dim=128, total_ut_steps=4, early_exit_threshold=0.9, rope_theta=1e6,
    max_position_embeddings=4096,
)  # fmt: skip


class Report:
    """The table, printed row by row and written under $OUT as it grows."""

    def __init__(self, out: str | None):
        self.rows, self.figures, self.out = [], {}, Path(out) if out else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)

    def row(self, what: str, figure: str, bar: str = "", ok: bool | None = None, **figures) -> None:
        verdict = "" if ok is None else ("yes" if ok else "NO")
        self.rows.append((what, figure, bar, verdict))
        self.figures |= figures
        print(f"{what:<44} {figure:<54} {bar:<22} {verdict}", flush=True)
        if self.out:
            (self.out / "gpu_check.json").write_text(json.dumps(self.figures, indent=1))
            (self.out / "gpu_check.txt").write_text(self.table())

    def table(self) -> str:
        lines = ["| measured | figure | bar | holds |", "|---|---|---|---|"]
        return "\n".join(lines + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in self.rows]) + "\n"


def random_model(cfg: S.Config, device: torch.device) -> S.LoopedLM:
    """Random weights drawn on the device (seconds, where the CPU's init of 1.4 B weights takes a minute)."""
    model = S.empty_model(cfg, torch.bfloat16, device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() > 1:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
            else:
                p.zero_()
    return model


def set_mean_exit(model: S.LoopedLM, prompts: list[list[int]], target: float = 2.5) -> tuple[float, float]:
    """The gate bias whose mean exit loop over the prompts' positions (teacher-forced) is nearest `target`: the
    gates' logits without the bias are computed once; the bias only shifts them."""
    gate = model.model.early_exit_gate
    with torch.no_grad():
        gate.bias.zero_()
        g = S.loop_outputs(model, torch.tensor(prompts, device=model.device)).gate_logits  # (R, B, T)
    g = g.float().permute(1, 2, 0).reshape(-1, g.shape[0]).cpu()  # (positions, R)
    R, tau = model.config.total_ut_steps, model.config.early_exit_threshold
    best = min(
        (abs(float(S.exit_loops(g + b, R, tau).float().mean()) - target), b) for b in [x / 8 for x in range(-64, 65)]
    )
    with torch.no_grad():
        gate.bias.fill_(best[1])
    return best[1], float(S.exit_loops(g + best[1], R, tau).float().mean())


def kernels_per_layer_call(model: S.LoopedLM, prompt: list[int], numerics: str) -> tuple[float, float]:
    """Device kernels (eager: CUDA graphs off) and host launches (graphs on) per layer call, from the profiler, over a
    short deferred rollout after its shapes are captured."""
    from torch.profiler import ProfilerActivity, profile

    graphs, L, out = model.call_graphs, model.config.num_hidden_layers, []
    for model.call_graphs in (None, graphs):
        policy = S.Policy("deferred", numerics)
        S.rollout(model, [prompt], policy, max_new_tokens=8)  # captures
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            ro = S.rollout(model, [prompt], policy, max_new_tokens=8)
        events = prof.events()
        if model.device.type == "cuda":
            kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            launches = sum(1 for e in events if e.name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch")))
        else:
            kernels = launches = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
        out.append((kernels if model.call_graphs is None else launches) / (len(ro.schedule.calls) * L))
    model.call_graphs = graphs
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="bench.json's shapes and fewer sequences: the script's check")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager static calls (the graphs' comparison)")
    ap.add_argument("--suite-timeout", type=int, default=150, help="seconds for the CUDA run of the suite")
    args = ap.parse_args()
    device, start = torch.device(args.device), time.perf_counter()
    rep = Report(os.environ.get("OUT"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rep.row("device", f"{name}, torch {torch.__version__}", device=name, torch=torch.__version__)
    small = args.small
    section(rep, "suite", lambda: run_suite(rep, device, args.suite_timeout))
    cfg = S.load_config(HERE / "tiny_configs" / "bench.json") if small else S.Config(**OURO_1_4B)
    if small:
        cfg.early_exit_threshold = 0.9
    model = S.use_cuda_graphs(random_model(cfg, device), not args.no_cuda_graphs)
    gen = torch.Generator().manual_seed(0)
    V, (lo, hi) = min(cfg.vocab_size, 32000), (8, 16) if small else (100, 140)  # prompt lengths
    lengths = torch.randint(lo, hi + 1, (256,), generator=gen).tolist()
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lengths]
    bias, mean_exit = set_mean_exit(model, [p[:lo] for p in prompts[:4]])
    rep.row("gate bias (mean exit loop, prompts)", f"{bias:+.3f} ({mean_exit:.2f})", "near 2.5", gate_bias=bias)
    new, (B, K) = (32, (32, 8)) if small else (128, (256, 64))
    section(rep, "one sequence", lambda: one_sequence(rep, model, prompts[0], new, device))
    section(rep, f"{B} sequences", lambda: many_sequences(rep, model, prompts[:B], new, K, device))
    section(rep, "kernels", lambda: kernels(rep, model, prompts[0]))
    section(rep, "KV cache", lambda: cache_vs_recompute(rep, prompts[0], 32 if small else 128, args, device))
    steps = ((16, 8, 0, False), (16, 8, 2, True)) if small else ((16, 64, 0, False), (64, 256, 2, True))
    model = None  # the GRPO steps measure memory from a fresh model: nothing of the sections above is left
    for seqs, new_tokens, mb, ckpt in steps:  # the plan against the allocator's peak; a step's parts; exactness
        section(rep, f"GRPO step {seqs}",
                lambda: grpo_step(rep, cfg, bias, prompts[:seqs], new_tokens, mb, ckpt, K, device, args))  # fmt: skip
    rep.row("wall time", f"{time.perf_counter() - start:.0f} s", "<= 300 s", time.perf_counter() - start <= 300)
    print("\n" + rep.table())
    return 0


def one_sequence(rep: Report, model: S.LoopedLM, prompt: list[int], new: int, device) -> None:
    """One sequence: dense decode's tokens/s, and deferred against dense beside the calls' ratio (medians of 2)."""
    runs = {}
    for mode in ("dense", "deferred"):
        S.rollout(model, [prompt], S.Policy(mode, "static"), max_new_tokens=new)  # captures
    for _ in range(2):
        for mode in ("dense", "deferred"):
            runs.setdefault(mode, []).append(
                S._timed(device, lambda: S.rollout(model, [prompt], S.Policy(mode, "static"), max_new_tokens=new))
            )
    tok = {m: int(r[0][1].mask.sum()) / statistics.median(dt for dt, _ in r) for m, r in runs.items()}
    calls = {m: len(r[0][1].schedule.calls) for m, r in runs.items()}
    speedup, ideal = tok["deferred"] / tok["dense"], calls["dense"] / calls["deferred"]
    rep.row("dense decode, 1 sequence", f"{tok['dense']:.0f} tok/s", ">= 150 tok/s", tok["dense"] >= 150,
            dense_tok_s_b1=tok["dense"])  # fmt: skip
    figure = f"x{speedup:.2f} (calls x{ideal:.2f}: {speedup / ideal:.2f} of it)"
    rep.row("deferred / dense, 1 sequence", figure, ">= 0.85 of the calls'", speedup >= 0.85 * ideal,
            deferred_tok_s_b1=tok["deferred"], calls_ratio_b1=ideal)  # fmt: skip


def many_sequences(rep: Report, model: S.LoopedLM, prompts: list, new: int, K: int, device) -> None:
    """B sequences in K slots: deferred tokens/s (and dense's, if the deferred run took under 30 s), then the
    replay's time and bits."""
    run = lambda mode: S.rollout(model, prompts, S.Policy(mode, "static"), max_new_tokens=new, max_num_seqs=K)  # noqa: E731
    run("deferred")  # captures
    t_def, ro = S._timed(device, lambda: run("deferred"))
    tokens, dense = int(ro.mask.sum()), ""
    if t_def < 30:
        t_dense, _ = S._timed(device, lambda: run("dense"))
        dense = f"; dense {tokens / t_dense:.0f} (deferred x{t_dense / t_def:.2f})"
    rep.row(f"deferred, {len(prompts)} sequences in {K} slots", f"{tokens / t_def:.0f} tok/s{dense}",
            ">= 5,000 tok/s", tokens / t_def >= 5000, deferred_tok_s_many=tokens / t_def)  # fmt: skip
    t_replay, replay = S._timed(device, lambda: S.replay_logprobs(model, ro))
    same = torch.equal(replay, ro.logprobs)
    rep.row("replay / rollout time (and bits)", f"{t_replay / t_def:.2f} (bitwise: {same})", "<= 1, bitwise",
            t_replay <= t_def and same, replay_over_rollout=t_replay / t_def, replay_bitwise=same)  # fmt: skip
    if model.call_graphs is not None:
        g = model.call_graphs
        rep.row("CUDA graphs captured so far", f"{g.captures} shapes in {g.capture_seconds:.1f} s", captures=g.captures)


def kernels(rep: Report, model: S.LoopedLM, prompt: list[int]) -> None:
    eager, launches = kernels_per_layer_call(model, prompt, "static")
    rep.row("kernels a layer call (eager; launches, graphs)", f"{eager:.1f}; {launches:.2f}", "<= 25 kernels",
            eager <= 25, kernels_per_layer_call=eager, launches_per_layer_call=launches)  # fmt: skip


def cache_vs_recompute(rep: Report, prompt: list[int], n: int, args, device) -> None:
    """bench.json's model: the KV cache against recomputing every token, 128 + n, greedy, dense."""
    cfg = S.load_config(HERE / "tiny_configs" / "bench.json")
    toy = S.use_cuda_graphs(random_model(cfg, device), not args.no_cuda_graphs)
    p128, greedy = [t % cfg.vocab_size for t in prompt * 2][:128], S.Policy("dense", "static", temperature=0.0)
    S.rollout(toy, [p128], greedy, max_new_tokens=n)  # captures
    t_cached, ro = S._timed(device, lambda: S.rollout(toy, [p128], greedy, max_new_tokens=n))
    t_rec, ids = S._timed(device, lambda: S.recompute_rollout(toy, p128, n, cfg.early_exit_threshold))
    figure = f"x{t_rec / t_cached:.1f} (same tokens: {ids == ro.completions[0]})"
    rep.row(f"bench.json: KV cache vs recompute, 128 + {n}", figure, ">= 5x", t_rec >= 5 * t_cached,
            cache_speedup=t_rec / t_cached)  # fmt: skip


def section(rep: Report, what: str, fn) -> None:
    """One part of the check; an error is a row of the table (its traceback printed), and the check goes on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001  the other parts still measure
        import traceback

        traceback.print_exc()
        rep.row(f"{what}: failed", f"{type(e).__name__}: {str(e)[:120]}", "", False)


def run_suite(rep: Report, device: torch.device, timeout: int) -> None:
    """The suite's exactness properties (`-m device`) with their models on this device, graphs against eager too."""
    env = os.environ | {"SCALERLT_TEST_DEVICE": str(device)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "device", "-p", "no:cacheprovider", "test_ref.py"]
    try:
        done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
        summary, ok = (done.stdout.strip().splitlines() or ["(no output)"])[-1], done.returncode == 0
        if not ok:
            print(done.stdout[-6000:], done.stderr[-3000:])
    except subprocess.TimeoutExpired:
        summary, ok = f"timed out after {timeout} s", False
    rep.row(f"suite on {device} (-m device)", summary, "green", ok, suite_ok=ok)


def free(device: torch.device) -> None:
    """Whatever the sections before left: collected, and the allocator's cache returned."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def grpo_step(rep: Report, cfg, bias: float, prompts, new_tokens: int, mb: int, ckpt: bool, K: int, device, args):
    """One GRPO step on a fresh model (groups of 8, AdamW on float32 masters as `train` does in bfloat16): its parts'
    times, the audit and iteration 1's ratios (exact), and the memory plan's peak against `max_memory_allocated`
    from the model's creation on."""
    free(device)
    G, B = 8, len(prompts)
    prompts = [p for p in prompts[: B // G] for _ in range(G)]
    model = S.use_cuda_graphs(random_model(cfg, device), not args.no_cuda_graphs)
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(bias)
    opt = S.MasterWeights(model, "stochastic", 0, lr=1e-6, weight_decay=0.0, eps=1e-8)
    grpo = S.GRPOConfig(group_size=G, micro_batch=mb, grad_checkpoint=ckpt)
    plan = S.memory_plan(
        model.config, model.dtype, sequences=B, prompt_len=max(map(len, prompts)), new_tokens=new_tokens,
        max_num_seqs=K, micro_batch=mb, grad_checkpoint=ckpt, device=str(device), numerics="static",
        cuda_graphs=model.call_graphs is not None,
    )  # fmt: skip
    policy, times = S.Policy("deferred", "static"), {"audit": [], "optimizer": []}
    t_roll, ro = S._timed(device, lambda: S.rollout(model, prompts, policy, max_new_tokens=new_tokens, max_num_seqs=K))
    rewards = torch.arange(B, dtype=torch.float32) % 2
    audit, step = S._audit_first_iteration, opt.step
    opt.step = lambda: times["optimizer"].append(S._timed(device, step)[0])  # noqa: E731

    def timed_audit(*a):
        dt, metrics = S._timed(device, lambda: audit(*a))
        times["audit"].append(dt)
        return metrics

    S._audit_first_iteration = timed_audit
    try:
        t_update, m = S._timed(device, lambda: S.grpo_update(model, opt, ro, rewards, grpo, "static"))
    finally:
        S._audit_first_iteration = audit
        del opt.step  # the wrapper held opt: a cycle
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    t_audit, t_opt = times["audit"][0], sum(times["optimizer"])
    lengths = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
    what = f"GRPO step {B} x ({lengths} + {new_tokens}), micro-batch {mb or 'whole'}{', ckpt' if ckpt else ''}"
    parts = (
        f"rollout {t_roll:.1f} s, replay audit {t_audit:.1f} s, teacher forcing + backward "
        f"{t_update - t_audit - t_opt:.1f} s, optimizer {t_opt:.1f} s"
    )
    rep.row(what, parts, **{f"step_{B}_{mb}": dict(rollout=t_roll, audit=t_audit, update=t_update, opt=t_opt)})
    exact = m["exact/mismatched_tokens"] == 0 and m["ratio_max"] == m["ratio_min"] == 1.0
    figure = f"mismatched {m['exact/mismatched_tokens']}, ratios {m['ratio_min']!r}..{m['ratio_max']!r}"
    rep.row("  audit, iteration-1 ratios", figure, "0, exactly 1", exact, **{f"exact_{B}_{mb}": exact})
    if peak is not None:
        ratio = plan["peak"] / peak
        figure = f"{S._fmt_bytes(plan['peak'])} / {S._fmt_bytes(peak)} = {ratio:.2f}"
        rep.row(f"  memory plan / measured ({what[10:]})", figure, "within 15%", abs(ratio - 1) <= 0.15,
                **{f"plan_over_measured_{B}_{mb}": ratio})  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

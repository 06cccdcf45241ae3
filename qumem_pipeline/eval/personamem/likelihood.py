"""Options scored by their log-likelihood as the assistant's reply, through the record.

Live: the served model's own tokenizer renders the prefix with its chat template, each option's
tokens are appended, and vLLM's ``/v1/completions`` returns the prompt tokens' log-probabilities
(``prompt_logprobs``, one token generated). Every scored set goes into the evaluation record under
its own key (model, prompt digest, options digest), so ``--replay-only`` needs neither the model
nor its tokenizer. Why not through the chat backends: they return text, not prompt log-probabilities.

Cost: vLLM skips its prefix cache for a request that asks for prompt log-probabilities
(``SamplingParams.skip_reading_prefix_cache``), so each option pays for the whole prefix again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from qumem_pipeline.eval.record import EvalRecord, digest

STAGE = "option_loglik"


def score_key(identity: dict, messages: list[dict], options: Sequence[str]) -> tuple[str, dict]:
    fields = {"kind": STAGE, "model": identity["model"], "prompt_digest": digest(messages),
              "options_digest": digest(list(options))}
    return digest(fields), fields


def pick(scores: list[dict] | None) -> int | None:
    """The option with the highest mean log-probability per token (ties: the first)."""
    if not scores:
        return None
    means = [s["logprob_sum"] / max(1, s["tokens"]) for s in scores]
    return max(range(len(means)), key=lambda i: (means[i], -i))


def chat_prefix_ids(rendered) -> list[int]:
    """Token ids of ``apply_chat_template(..., tokenize=True)``: a list in older transformers, a BatchEncoding
    (a mapping, not a dict) in the one vLLM's venv and this project install, whose list() is its keys."""
    if hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


class OptionScorer:
    """``score(items)`` -> per item the options' ``{"logprob_sum", "tokens"}`` (None where unavailable).

    ``server``: ``(base_url, served model name, tokenizer directory)`` to score live; None replays only."""

    def __init__(self, record: EvalRecord | None, identity: dict, server: tuple[str, str, str] | None = None,
                 workers: int = 4, timeout_s: float = 1800.0) -> None:
        self.record, self.identity, self.server = record, identity, server
        self.workers, self.timeout_s = workers, timeout_s
        self.hits = self.sent = self.missing = 0
        self.prompt_tokens = 0
        self._tok = None

    def score(self, items: Sequence[tuple[list[dict], Sequence[str]]]) -> list[list[dict] | None]:
        out: list[list[dict] | None] = [None] * len(items)
        todo = []
        for i, (messages, options) in enumerate(items):
            key, fields = score_key(self.identity, messages, options)
            e = self.record.get(key) if self.record is not None else None
            if e is not None:
                self.hits += 1
                out[i] = json.loads(e["output"])
            elif self.server is None:
                self.missing += 1
            else:
                todo.append((i, key, fields, messages, options))
        if todo:
            with ThreadPoolExecutor(self.workers) as ex:
                for (i, key, fields, _, _), (scores, n_prompt) in zip(
                        todo, ex.map(lambda t: self._score_live(t[3], t[4]), todo)):
                    out[i] = scores
                    self.sent += 1
                    self.prompt_tokens += n_prompt
                    if self.record is not None:
                        self.record.put({**fields, "key": key, "stage": STAGE, "output": json.dumps(scores),
                                         "finish_reason": "length", "prompt_tokens": n_prompt, "completion_tokens": 0})
        return out

    def _tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.server[2])
        return self._tok

    def _score_live(self, messages: list[dict], options: Sequence[str]) -> tuple[list[dict], int]:
        import httpx

        base_url, served, _ = self.server
        tok = self._tokenizer()
        prefix = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prefix = chat_prefix_ids(prefix)
        scores, n_prompt = [], 0
        for opt in options:
            ids = tok(opt, add_special_tokens=False)["input_ids"]
            prompt = prefix + list(ids)
            r = httpx.post(f"{base_url.rstrip('/')}/completions", timeout=self.timeout_s,
                           json={"model": served, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                 "prompt_logprobs": 0})
            if r.status_code != 200:  # the server says why (a window too small, logprobs refused): keep it
                raise RuntimeError(f"option scoring at {base_url}: HTTP {r.status_code}: {r.text[:500]}")
            plp = r.json()["choices"][0]["prompt_logprobs"]
            total = 0.0
            for j in range(len(prefix), len(prompt)):
                entry = plp[j] or {}
                total += float(entry[str(prompt[j])]["logprob"])
            scores.append({"logprob_sum": round(total, 5), "tokens": len(ids)})
            n_prompt += len(prompt)
        return scores, n_prompt

"""One retry for unparseable output, shared by every stage that asks an LLM for structured JSON.

At temperature 0 a second identical request usually answers the same, but a backend that hit a
transient problem (a cut stream, a length stop under load) often recovers; a second failure is the
caller's to quarantine. Tokens and attempts of both tries are summed, so accounting stays honest.
"""

from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMBackend


def generate_with_retry(llm: LLMBackend, reqs: list[ChatRequest]) -> list[ChatResult]:
    """``llm.generate(reqs)``, then the failed ones once more in one batch; results in request order."""
    results = llm.generate(reqs) if reqs else []
    bad = [i for i, r in enumerate(results) if not r.ok]
    if bad:
        again = llm.generate([reqs[i] for i in bad])
        for i, r in zip(bad, again):
            r.attempts += results[i].attempts
            r.prompt_tokens += results[i].prompt_tokens
            r.completion_tokens += results[i].completion_tokens
            results[i] = r
    return results

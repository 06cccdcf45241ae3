"""One retry for unusable output, shared by every stage that asks an LLM for structured JSON.

At temperature 0 a second identical request usually answers the same, but a backend that hit a
transient problem (a cut stream, a malformed reply) often recovers; a second failure is the
caller's to quarantine. A call cut at its token budget is different: greedy decoding writes the same
tokens again, so the retry goes out at twice the budget (room to finish), and a cut in a whitespace
run, which a larger budget only fills with more whitespace, is not retried at all (issue 18; what came
before the run is read by `llm.salvage` where it can be). Tokens and attempts of both tries are
summed, so accounting stays honest.
"""

from dataclasses import replace

from qumem_pipeline.llm.base import ERROR_LENGTH, ChatRequest, ChatResult, LLMBackend
from qumem_pipeline.llm.salvage import ends_in_whitespace_run

LENGTH_RETRY_FACTOR = 2


def retry_request(req: ChatRequest, res: ChatResult) -> ChatRequest | None:
    """The request to send again for the failed `res`, or None when sending it again cannot help."""
    if res.error_kind != ERROR_LENGTH:
        return req
    if ends_in_whitespace_run(res.raw_text):
        return None
    return replace(req, max_tokens=int(req.max_tokens) * LENGTH_RETRY_FACTOR)


def generate_with_retry(llm: LLMBackend, reqs: list[ChatRequest]) -> list[ChatResult]:
    """``llm.generate(reqs)``, then the failed ones once more in one batch; results in request order."""
    results = llm.generate(reqs) if reqs else []
    again = [(i, retry_request(reqs[i], r)) for i, r in enumerate(results) if not r.ok]
    again = [(i, q) for i, q in again if q is not None]
    if again:
        for (i, _), r in zip(again, llm.generate([q for _, q in again])):
            r.attempts += results[i].attempts
            r.prompt_tokens += results[i].prompt_tokens
            r.completion_tokens += results[i].completion_tokens
            results[i] = r
    return results

"""The embedded default backend with the real small model (slow: loads ~135M params on CPU)."""

from datetime import datetime, timezone

import jsonschema
import pytest

from qumem_pipeline.memories.decompose import MEMORY_SCHEMA, decompose_episodes, memory_schema
from qumem_pipeline.llm import ChatRequest, make_backend
from qumem_pipeline.llm.model_store import DEFAULT_MODEL, cache_dir
from tests.conftest import SWIM_EPISODE as EPISODE

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def local():
    with make_backend("local") as be:
        yield be


def test_weights_are_pinned(local):
    marker = cache_dir() / "models" / DEFAULT_MODEL.name / "qumem_source.json"
    assert marker.exists() and DEFAULT_MODEL.gguf_sha256 in marker.read_text()
    assert local.model_name == DEFAULT_MODEL.name and local.backend_name == "local"


def test_local_decomposes_episode_into_schema_valid_rows(local):
    created = datetime(2024, 6, 1, tzinfo=timezone.utc)
    out = decompose_episodes([EPISODE], local, created_at=created, max_tokens=160)
    assert out.ledger.height >= 3 and set(out.ledger["type"]) == {"fact", "preference", "insight"}
    assert out.memories.schema == MEMORY_SCHEMA
    # constrained decoding: nothing is invalid JSON or off-schema (only a max_tokens cut could be)
    assert all(r.startswith("length") for r in out.quarantine["reason"].to_list())
    ids = {4, 5, 6}
    for row in out.memories.iter_rows(named=True):
        assert row["content"] and set(row["evidence_turn_ids"]) <= ids
        assert row["position"] == max(row["evidence_turn_ids"])
        assert row["valid_from"] == datetime(2024, 1, 1, 9, row["position"] - 4, tzinfo=timezone.utc)
        assert row["model"] == DEFAULT_MODEL.name
    assert out.memories.height >= 1
    led = out.ledger
    assert (led["prompt_tokens"] > 0).all() and (led["completion_tokens"] > 0).all()
    assert (led["shared_prefix_tokens"] > 0).all() and (led["shared_prefix_tokens"] < led["prompt_tokens"]).all()
    assert out.summary["computed_prefill_tokens"] < out.summary["prompt_tokens"]
    # the episode's three calls share system text + transcript: the later ones reuse its KV
    assert (led["cached_tokens"] > 0).sum() >= 2 and (led["cached_tokens"] < led["prompt_tokens"]).all()
    # a rerun gives the same rows (greedy decoding, stable ids)
    again = decompose_episodes([EPISODE], local, created_at=created, max_tokens=160)
    assert again.memories.equals(out.memories)


def test_batched_and_one_at_a_time_always_parse(local):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "n": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["city", "n"], "additionalProperties": False}
    reqs = [
        ChatRequest(f"q{i}", [{"role": "user", "content": q}], json_schema=schema, max_tokens=40)
        for i, q in enumerate(["Capital of France and a number?", "Where is Rome? Any number.", "hi"])
    ]
    batched = local.generate(reqs)
    single = [local.generate([r])[0] for r in reqs]
    for b in batched:
        assert b.ok, b.error
        jsonschema.validate(b.parsed, schema)
    assert [r.request_id for r in batched] == ["q0", "q1", "q2"]
    for s in single:
        assert s.ok, s.error
    # continuous batching evicts finished rows and prefills each row alone: same greedy tokens
    assert [s.raw_text for s in single] == [b.raw_text for b in batched]
    assert [s.completion_tokens for s in single] == [b.completion_tokens for b in batched]


def test_max_tokens_cut_is_a_length_error(local):
    (res,) = local.generate([ChatRequest("cut", [{"role": "user", "content": "List facts."}], json_schema=memory_schema(), max_tokens=4)])
    assert res.parsed is None and res.error_kind == "length" and res.finish_reason == "length"


def test_engine_greedy_matches_transformers(local):
    """The engine's own decoder (prefix groups, shared-prefix attention, continuous batching) against
    transformers' forward of the same model: every token the engine chose is transformers' grammar-masked
    argmax at that position (or within float rounding of it)."""
    import torch
    import xgrammar as xgr

    from qumem_pipeline.llm.model_profiles import tighten_schema
    from qumem_pipeline.memories.decompose import decompose_requests

    other = {**EPISODE, "episode_id": "alice-e1",
             "turns": [{**EPISODE["turns"][0], "turn_index": 9, "text": "I am learning Spanish on weekday evenings."}]}
    reqs = decompose_requests([EPISODE, other], max_tokens=12)  # two groups of three sharing a prefix
    rows = local._rows(reqs)
    finished = []
    local._run(rows, finished.append)
    assert len(finished) == 6 and sum(r.cached > 0 for r in finished) >= 4  # each episode's later calls
    for r in finished:
        with torch.inference_mode():
            logits = local.model(torch.tensor([r.prompt + r.tokens])).logits[0, len(r.prompt) - 1:]
        matcher = xgr.GrammarMatcher(local._compile(tighten_schema(r.req.decoding_schema, local.output_bounds)))
        mask = xgr.allocate_token_bitmask(1, local.vocab_size)
        for i, tok in enumerate(r.tokens):
            row = logits[i: i + 1, : local.vocab_size].float().clone()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(row, mask)
            assert row[0, tok] >= row.max() - 1e-3, (r.req.request_id, i)
            assert matcher.accept_token(tok)


def test_drafted_tokens_change_nothing(local):
    """Prompt-lookup drafts verified in a step keep exactly plain greedy decoding's tokens, in fewer steps."""
    from qumem_pipeline.memories.decompose import decompose_requests

    reqs = decompose_requests([EPISODE], max_tokens=48)
    was = local.speculate
    try:
        outs, stats = {}, {}
        for k in (0, 4):
            local.speculate = k
            local.reset_stats()
            outs[k] = local.generate(reqs)
            stats[k] = dict(local.stats)
    finally:
        local.speculate = was
    assert [r.raw_text for r in outs[4]] == [r.raw_text for r in outs[0]]
    assert [r.finish_reason for r in outs[4]] == [r.finish_reason for r in outs[0]]
    assert stats[0]["decode_fed_tokens"] == stats[0]["decode_tokens"]  # no drafts: one token a row and step
    assert stats[4]["decode_tokens"] == stats[0]["decode_tokens"]
    assert stats[4]["decode_steps"] < stats[0]["decode_steps"]  # drafts were kept
    assert stats[4]["decode_fed_tokens"] >= stats[4]["decode_tokens"]  # a step keeps at most what it fed


def test_decode_step_matches_each_row_decoded_alone(local):
    """A decode step's attention over rows of several prefix slots (prefixes of different lengths, a freed slot
    among them, one row per slot and two in one, drafted tokens) gives every token the logits its row gets
    decoded alone, one token at a time (each prefix slot attended over its own length only)."""
    import torch

    from qumem_pipeline.llm.local_backend import _LeanLM

    eng = _LeanLM(local.model)
    tokens = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    positions = [40, 33, 50, 45]
    splits = [30, 30, 20, 41]  # own positions so far: 10, 3, 30, 4
    pslots = [1, 1, 3, 0]  # prefix slot 2 free
    prefix_len = {0: 41, 1: 30, 3: 20}
    eng.reserve(4, 64, 4, 64)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for k, v in eng.kv + eng.pkv:
            k.normal_(generator=g).mul_(0.5)
            v.normal_(generator=g)
        own = [(k.clone(), v.clone()) for k, v in eng.kv]
        batch = eng.decode(tokens, positions, splits, pslots, prefix_len)
        at = 0
        for r, toks in enumerate(tokens):
            for (k, v), (k0, v0) in zip(eng.kv, own):
                k.copy_(k0)
                v.copy_(v0)
            eng.move(r, 0, positions[r] - splits[r])  # the row alone, in own slot 0
            for j, t in enumerate(toks):
                alone = eng.decode([[t]], [positions[r] + j], [splits[r]], [pslots[r]], prefix_len)
                assert torch.allclose(batch[at], alone[0], atol=5e-3, rtol=1e-4), (r, j, (batch[at] - alone[0]).abs().max())
                at += 1
    eng.release()


def test_reordered_weights_decode_as_the_plain_matmul(local):
    """The engine's matmuls on oneDNN-reordered weights (where this torch has them) choose the tokens the
    plain torch.mm path chooses."""
    from qumem_pipeline.llm.local_backend import _LeanLM
    from qumem_pipeline.memories.decompose import decompose_requests

    if not local.engine.packed:
        pytest.skip("this torch has no oneDNN linear: the engine runs torch.mm")
    reqs = decompose_requests([EPISODE], max_tokens=48)
    was = local.engine
    try:
        local._cut.clear()
        packed = local.generate(reqs)
        local.engine = _LeanLM(local.model, packed=False)
        local._cut.clear()
        plain = local.generate(reqs)
    finally:
        local.engine = was
        local._cut.clear()
    assert [(r.raw_text, r.finish_reason) for r in packed] == [(r.raw_text, r.finish_reason) for r in plain]


def test_length_retry_goes_on_from_the_cut_tokens(local):
    """A call cut at max_tokens and sent again with a larger budget (the retry) is not decoded from the
    start: the engine goes on from the cut tokens, and the answer is the one a fresh call gives."""
    from dataclasses import replace

    req = ChatRequest("cut", [{"role": "user", "content": "List every fact about my swimming."}],
                      json_schema=memory_schema(), max_tokens=24)
    local._cut.clear()
    (cut,) = local.generate([req])
    assert cut.finish_reason == "length"
    local.reset_stats()
    (more,) = local.generate([replace(req, max_tokens=80)])
    resumed = dict(local.stats)
    local._cut.clear()
    local.reset_stats()
    (fresh,) = local.generate([replace(req, max_tokens=80)])
    assert (more.raw_text, more.completion_tokens, more.prompt_tokens, more.finish_reason) == (
        fresh.raw_text, fresh.completion_tokens, fresh.prompt_tokens, fresh.finish_reason)
    assert more.raw_text.startswith(cut.raw_text[:20])
    assert resumed["decode_tokens"] <= local.stats["decode_tokens"] - 23  # the cut's tokens were not decoded again


def test_embedded_model_decodes_against_its_cut_bounds(local):
    """SmolLM2's profile: the engine decodes against a third of every maxItems, and the bounds are part of the
    decoding identity the record and the checkpoints key on, so outputs under other bounds are not served."""
    from qumem_pipeline.eval.record import model_identity
    from qumem_pipeline.memories.call_ledger import CheckpointedLLM
    from qumem_pipeline.memories.decompose import decompose_requests

    assert local.output_bounds == "items/3,chars/2,plain"
    reqs = decompose_requests([EPISODE], max_tokens=160)
    ok = [r for r in local.generate(reqs) if r.ok]
    assert ok, "no generation succeeded: the bounds were checked on nothing"
    for r in ok:  # 3 turns: at most ceil(3 / 3) = 1 memory citing at most 1 turn
        assert len(r.parsed["memories"]) <= 1 and all(len(m["evidence_turn_ids"]) <= 1 for m in r.parsed["memories"])
        # ",plain": free text holds no bracket or quote, so no "[user_name]" slot
        assert not any(set(m["content"]) & set('[]{}<>"') for m in r.parsed["memories"]), r.parsed
    assert model_identity(local)["decoding"]["output_bounds"] == "items/3,chars/2,plain"
    assert CheckpointedLLM(local, None, code_version="t").decoding["output_bounds"] == "items/3,chars/2,plain"

"""The hand-written BM25 that ``adamem/lexical.py`` used before it moved to ``bm25s``: kept verbatim as the
test oracle (tests/test_adamem_lexical.py) and the baseline of bench/bm25_lexical.py.

BM25 lexical index over turns and memories (AdaMem's keyword backoff).

Dense retrieval with a small embedder blurs rare, exact words (a pet's name, a place, a product);
BM25 weighs them by their rarity, so it recovers messages that are lexically salient but weakly
covered by the embedding. DuckDB's FTS extension is not installable offline, so this is a small
numpy implementation (Okapi BM25, k1=1.2, b=0.75, Lucene's non-negative idf), built per user per
query batch, which is cheap at per-user sizes.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qumem_pipeline.query.strategies.adamem.text import tokens

K1, B = 1.2, 0.75


@dataclass
class BM25Index:
    doc_ids: list[str]
    positions: np.ndarray  # int64 per document: the as_of filter key
    vocab: dict[str, int]
    tf: list[dict[int, int]]
    idf: np.ndarray
    lengths: np.ndarray
    avg_len: float

    @classmethod
    def build(cls, doc_ids: Sequence[str], texts: Sequence[str], positions: Sequence[int]) -> "BM25Index":
        if not (len(doc_ids) == len(texts) == len(positions)):
            raise ValueError("doc_ids, texts and positions must have the same length")
        vocab: dict[str, int] = {}
        tf: list[dict[int, int]] = []
        df: Counter = Counter()
        for t in texts:
            counts = Counter(vocab.setdefault(w, len(vocab)) for w in tokens(t))
            tf.append(dict(counts))
            df.update(counts.keys())
        n = len(texts)
        dfa = np.zeros(len(vocab), dtype=np.float64)
        for w, c in df.items():
            dfa[w] = c
        idf = np.log1p((n - dfa + 0.5) / (dfa + 0.5))
        lengths = np.array([sum(d.values()) for d in tf], dtype=np.float64)
        return cls(list(doc_ids), np.asarray(positions, dtype=np.int64), vocab, tf, idf, lengths,
                   float(lengths.mean()) if n else 0.0)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for the query (0 where no query word occurs)."""
        out = np.zeros(len(self.doc_ids), dtype=np.float64)
        q = [self.vocab[w] for w in dict.fromkeys(tokens(query)) if w in self.vocab]
        if not q or not self.doc_ids:
            return out
        norm = K1 * (1 - B + B * self.lengths / max(self.avg_len, 1e-9))
        for j, d in enumerate(self.tf):
            s = 0.0
            for w in q:
                f = d.get(w)
                if f:
                    s += self.idf[w] * f * (K1 + 1) / (f + norm[j])
            out[j] = s
        return out

    def search(self, query: str, k: int, as_of_position: int | None = None) -> list[tuple[str, float, int]]:
        """Top-k (doc_id, score, position) with score > 0, never after as_of."""
        s = self.scores(query)
        if as_of_position is not None:
            s = np.where(self.positions <= as_of_position, s, 0.0)
        order = np.argsort(-s, kind="stable")[:k]
        return [(self.doc_ids[i], float(s[i]), int(self.positions[i])) for i in order if s[i] > 0]

    def salient_terms(self, query: str, slack: float = 0.9) -> list[str]:
        """The query's rarest indexed words (idf within ``slack`` of the rarest): the backoff keywords."""
        q = [w for w in dict.fromkeys(tokens(query)) if w in self.vocab]
        if not q:
            return []
        top = max(self.idf[self.vocab[w]] for w in q)
        return [w for w in q if self.idf[self.vocab[w]] >= slack * top]

    def backoff(self, query: str, k: int, as_of_position: int | None = None) -> list[tuple[str, float, int]]:
        """Keyword backoff: BM25 on the query's salient words only, so one rare exact word is not
        outvoted by common words that dense retrieval already covers."""
        terms = self.salient_terms(query)
        return self.search(" ".join(terms), k, as_of_position) if terms else []

"""The sentence embedder shared by the episodes stage (continuity similarity) and the index stage (memory
embeddings): all-MiniLM-L6-v2 from its wheel (`minilm`), the frozen base encoder loader (`base_model`) and
the embedder's version input (`version`). Below both stages; imports none."""

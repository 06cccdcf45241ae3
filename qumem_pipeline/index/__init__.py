"""Stage 4: memories in, per-type vector stores out (embeddings + FAISS indexes per user)."""

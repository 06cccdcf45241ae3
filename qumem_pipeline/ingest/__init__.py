"""Stage 1 (QUMem §3.1 input): archives in, one canonical validated turn table out.

Enters: archive files (canonical JSONL/Parquet, LoCoMo, ChatGPT export). Leaves: `turns`, `quarantine`
(row, field, reason for every rejected row) and per-user content fingerprints (`incremental`).
`sync` ingests per archive file, each file once (manifest), read in bounded batches (`stream`);
`archive.load_archive` is the whole-archive in-memory path it is tested against.
"""

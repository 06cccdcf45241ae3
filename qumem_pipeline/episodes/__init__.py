"""Stage 2 (QUMem §3.2, episode segmentation): turns in, variable-length episodes out.

Enters: the `turns` table. Leaves: `episodes` (every turn in exactly one episode). The continuity
classifier (`continuity/`) scores adjacent user utterances; `segmentation` turns its scores into
episodes; `metrics` (Pk, WindowDiff, boundary F1) and `dialogues` (segmentation data readers)
serve training and the evaluation.
"""

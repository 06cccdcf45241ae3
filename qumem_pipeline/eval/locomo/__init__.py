"""LoCoMo evaluation: retrieval units (turns, windows, sessions, episodes, memories) and the
query strategies scored by evidence recall at word budgets."""

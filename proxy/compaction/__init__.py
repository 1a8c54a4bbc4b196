"""Compaction: old turns replaced by a summary near the context limit (docs/compaction.md)."""

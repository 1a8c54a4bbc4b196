"""Compaction: old turns replaced by a summary near the context limit (SPEC section 5)."""

"""The people-facing ``/files`` pages and their JSON twins (SPEC section 8)."""

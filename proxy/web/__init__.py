"""The people-facing ``/files`` pages and their JSON twins (docs/dashboard.md)."""

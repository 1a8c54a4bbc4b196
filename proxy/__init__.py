"""ctxproxy: an OpenAI-compatible proxy that keeps agent conversations inside the context window."""

__version__ = "0.1.0"

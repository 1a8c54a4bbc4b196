"""The pre-reasoning pipeline: :mod:`.runner` runs the pure stages over the message model
(:mod:`proxy.model`) for a request and carries out their effects through the services."""

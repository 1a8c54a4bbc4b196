"""What is known per model: its capabilities on the provider's API (data, no network)."""

from proxy.catalog.capabilities import Capabilities, ModelFacts

__all__ = ["Capabilities", "ModelFacts"]

"""Resources owned by the app's lifespan and handed to every request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import Config
from .pipeline import Stage
from .upstream.http import Upstream
from .upstream.litellm_route import LitellmRouter


@dataclass(slots=True)
class Runtime:
    config: Config
    upstream: Upstream
    router: LitellmRouter
    stages: Sequence[Stage]
    max_body: int

"""The base of every configuration section: frozen, and an unknown key is an error
(``extra="forbid"``: a misspelt option fails at start-up instead of being ignored).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

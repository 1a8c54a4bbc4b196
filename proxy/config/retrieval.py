"""``retrieval``: how the model reads offloaded content back (the proxy's read tool, the
client's own, or the ``/files`` URL).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config.offload import ReadTool
from proxy.config.section import _Section

__all__ = [
    "RetrievalConfig",
]


class RetrievalConfig(_Section):
    mode: Literal["proxy", "client", "none"] = Field(
        "proxy",
        description="proxy: the proxy runs the read tool; client: notices name the client's "
        "own read tool; none: notices give the /files URL.",
    )
    tool_name: str = Field("read_offloaded", description="Name of the proxy's read tool.")
    max_rounds: int = Field(5, ge=0, description="Most read-tool rounds per client request.")
    client_tool: ReadTool = Field(
        default_factory=lambda: ReadTool(path_arg="file_path", line_arg="start_line"),
        description="mode client: the argument names of the client's read tool.",
    )
    client_tool_name: str = Field(
        "read_file", description="mode client: the name of the client's own read tool."
    )

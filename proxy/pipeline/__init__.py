"""The pre-reasoning pipeline: pure stages over the pipeline's message model.

:mod:`.model` defines the values (Message, RequestView, StageOutcome, FileWrite); the stages
are :mod:`.offload` (with :mod:`.ageing`), :mod:`.replay` (the proxy's read rounds put back),
:mod:`.validate` and :mod:`.count`, with compaction's
pure planner in :mod:`proxy.compaction.planner`; :mod:`.runner` runs them for a request and
carries out their effects through the services.
"""

from proxy.pipeline.model import (
    FileWrite,
    Message,
    PipelineResult,
    RequestView,
    Stage,
    StageOutcome,
)

__all__ = ["FileWrite", "Message", "PipelineResult", "RequestView", "Stage", "StageOutcome"]

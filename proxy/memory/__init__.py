"""Long-term memory (docs/memory.md): facts recorded at compaction time, folded daily into
MEMORY.md, injected after the leading system messages. Pure parts in :mod:`.inject` and
:mod:`.fold`; the service (pins, folds, the facts sink) in :mod:`.service`."""

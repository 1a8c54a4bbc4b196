"""The cost ledger: what every call cost, from the provider's own usage, and what it would have
cost without ctxproxy (docs/ledger.md).

    usage.py     the provider's ``usage`` in any wire format -> :class:`Usage` (pure)
    prices.py    USD per token per model: config, then litellm's bundled map (data)
    entry.py     :class:`LedgerEntry` (one per billed call), :class:`LedgerTotals` (per session)
    calls.py     calls made on a session's behalf (summarizer, memory fold) -> the ledger
"""

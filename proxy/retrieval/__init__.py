"""Reading offloaded content: the proxy's own read tool and the loop that runs it.

See docs/retrieval.md.
"""

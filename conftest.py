"""Loaded by pytest before the suite's own conftest: bytecode caches stay on for the test run.

With ``PYTHONDONTWRITEBYTECODE`` set (as on these machines), every xdist worker would rewrite
every test module's assertions again (~7 s of CPU a worker) and every ``ctxproxy serve`` the
tests start (replicas, restarts after kill -9, signals) would compile the package from source.
The caches live in ``__pycache__`` (ignored by git).
"""

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

"""Suite-wide set-up: one fresh cost-table cache for the whole run.

Set before any test runs, so the in-process passes and the CLI/torchrun subprocesses share it (a
model is traced once per run) and nothing is read from, or written to, the user's ~/.cache.
"""

import os
import tempfile

_CACHE = tempfile.mkdtemp(prefix="autoshard-test-cache-")
os.environ["AUTOSHARD_CACHE_DIR"] = _CACHE

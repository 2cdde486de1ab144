"""`mooncake-audit`'s commands, one module each, and what they share (options.py, common.py); cli.py
registers them, and nothing else in audit imports them."""

import time

# The CLI's earliest timestamp (cli.py imports this package before anything else): --verbose counts
# the imports from here.
STARTED = time.perf_counter()

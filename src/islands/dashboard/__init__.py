"""The live dashboard: a read-only page on 127.0.0.1 that draws a run directory while the run goes.

    islands dashboard RUN_DIR [--port P] [--host H]     a running or finished run
    islands train ... --dashboard [PORT]               served by the launcher while the job runs

`state` reads the run directory (live/*.jsonl, run.json, elastic/*.json) into one JSON-able state; `server`
serves the page, its assets, Plotly's JS bundle and that state; `cli` holds the two commands. docs/dashboard.md.
"""

from islands.dashboard.server import DEFAULT_PORT, DashboardError, DashboardServer
from islands.dashboard.state import RunReader, build_state

__all__ = ["DEFAULT_PORT", "DashboardError", "DashboardServer", "RunReader", "build_state"]

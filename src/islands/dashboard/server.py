"""The dashboard's HTTP server: the page, its assets, the chart library and /api/state. Nothing else.

Read-only by construction: GET and HEAD only (any other method is 405), a fixed set of paths (anything else
is 404; no file of the run directory is served, only the state islands.dashboard.state builds from it),
bound to 127.0.0.1 unless a host is given. Bound to loopback, it also refuses a request whose Host header
names another host (a web page in the browser cannot reach it through DNS rebinding).

    server = DashboardServer("runs/job1", port=0)   # 0: a free port
    server.start()                                  # background thread; server.url
    ...
    server.stop()

The charts are Plotly's; its JS bundle is the one the `plotly` Python package ships, served from here (no
CDN, nothing from the network).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import urlsplit

from islands.dashboard.state import RunReader

DEFAULT_PORT = 8765
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ASSETS = {  # path -> (package file, content type)
    "/": ("page.html", "text/html; charset=utf-8"),
    "/index.html": ("page.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
PLOTLY_PATH = "/plotly.min.js"
STATE_PATH = "/api/state"
# the page's own scripts and styles, the plotly bundle from here; plotly sets inline styles on its charts
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class DashboardError(Exception):
    """The dashboard cannot start: a port in use, plotly missing, a bad host. The message says what to do."""


def plotly_bundle() -> Path:
    """The plotly.min.js inside the installed `plotly` package."""
    spec = find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise DashboardError(
            "the dashboard draws its charts with plotly, which is not installed: "
            "pip install 'islands[dashboard]' (or pip install plotly)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    raise DashboardError(
        f"the installed plotly has no package_data/plotly.min.js (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall it: "
        f"pip install --force-reinstall plotly"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_for(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host.strip("[]"))
    return f"http://[{shown}]:{port}/" if ":" in shown else f"http://{shown}:{port}/"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # POSIX: reuse a port whose old connections linger in TIME_WAIT (another listener is still refused);
    # Windows' SO_REUSEADDR would share a port another server listens on
    allow_reuse_address = os.name != "nt"

    def __init__(self, address, handler, reader: RunReader, plotly: Path, loopback: bool):
        self.reader, self.plotly, self.loopback = reader, plotly, loopback
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # a browser tab closed mid-answer
        print(f"islands: dashboard: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "islands-dashboard"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # `format`: the stdlib's name
        pass  # quiet: a page polling every 2 s would fill the terminal

    def __getattr__(self, name: str):
        # every method but GET and HEAD (POST, PUT, DELETE, PATCH, OPTIONS, anything): 405
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self.close_connection = True  # its body (if any) is not read
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED,
            b"read-only: GET and HEAD only\n",
            "text/plain; charset=utf-8",
            extra={"Allow": "GET, HEAD"},
        )

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _host_ok(self) -> bool:
        if not self.server.loopback:
            return True
        host = self.headers.get("Host", "")
        if not host:  # an HTTP/1.0 client; a browser always names the host it thinks it reaches
            return True
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
        return name.strip("[]").lower() in LOOPBACK_NAMES or is_loopback(name.strip("[]"))

    def _serve(self, body: bool) -> None:
        if not self._host_ok():
            self._send(
                HTTPStatus.FORBIDDEN,
                b"this dashboard answers to localhost only\n",
                "text/plain; charset=utf-8",
                body=body,
            )
            return
        path = urlsplit(self.path).path
        if path == STATE_PATH:
            try:
                data, status = json.dumps(self.server.reader.state(), allow_nan=False, separators=(",", ":")), 200
            except Exception as e:  # noqa: BLE001 (the page shows the reason; the server keeps serving)
                data, status = json.dumps({"error": f"{type(e).__name__}: {e}"}), 500
            self._send(
                HTTPStatus(status), data.encode(), "application/json", body=body, extra={"Cache-Control": "no-store"}
            )
        elif path == PLOTLY_PATH:
            self._send(
                HTTPStatus.OK,
                self.server.plotly.read_bytes(),
                "text/javascript; charset=utf-8",
                body=body,
                extra={"Cache-Control": "max-age=86400"},
            )
        elif path in ASSETS:
            name, ctype = ASSETS[path]
            asset = resources.files("islands.dashboard").joinpath(name).read_bytes()
            self._send(HTTPStatus.OK, asset, ctype, body=body, extra={"Cache-Control": "no-cache"})
        else:
            self._send(
                HTTPStatus.NOT_FOUND,
                b"not found: the dashboard serves /, its assets and /api/state\n",
                "text/plain; charset=utf-8",
                body=body,
            )

    def _send(self, status: HTTPStatus, data: bytes, ctype: str, body: bool = True, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", CSP)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(data)


class DashboardServer:
    """The dashboard of one run directory, served on host:port (port 0: a free one)."""

    def __init__(self, run_dir: str | Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT, flag: str = "--port"):
        """`flag`: the option that sets the port, named in the message about a port in use."""
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise DashboardError(f"dashboard port must be in 0..65535 (0 picks a free one); got {port}")
        self.run_dir, self.host, self.port, self.flag = Path(run_dir), host, port, flag
        self.plotly = plotly_bundle()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def url(self) -> str:
        return url_for(self.host, self.port)

    def bind(self) -> None:
        """Take the port now (a busy port raises DashboardError, nothing started)."""
        try:
            self._server = _Server(
                (self.host.strip("[]"), self.port), _Handler, RunReader(self.run_dir), self.plotly, self.loopback
            )
        except OSError as e:
            raise DashboardError(self._bind_message(e)) from None
        self.port = self._server.server_address[1]

    def _bind_message(self, e: OSError) -> str:
        if e.errno == errno.EADDRINUSE:
            return (
                f"dashboard port {self.port} on {self.host} is already in use; pick another with "
                f"{self.flag} PORT, or {self.flag} 0 for a free one"
            )
        if e.errno == errno.EACCES:
            return (
                f"dashboard port {self.port} needs privileges on this machine; pick one above 1023 with "
                f"{self.flag} PORT, or {self.flag} 0 for a free one"
            )
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            return f"dashboard host {self.host!r} is not an address of this machine: {e.strerror or e}"
        return f"dashboard cannot listen on {self.host}:{self.port}: {e.strerror or e}"

    def _bound(self) -> _Server:
        if self._server is None:
            self.bind()
        assert self._server is not None  # bind() sets it or raises
        return self._server

    def start(self) -> DashboardServer:
        """Bind (if not yet) and serve in a daemon thread."""
        self._thread = threading.Thread(
            target=self._bound().serve_forever, kwargs={"poll_interval": 0.2}, name="islands-dashboard", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Bind (if not yet) and serve in this thread until KeyboardInterrupt or stop()."""
        server = self._bound()
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()

    def stop(self) -> None:
        if self._server is None:
            return
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()
        self._server = None

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

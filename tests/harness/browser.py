"""A real headless browser for the dashboard and report tests: Debian's chromium (`.ci/run` installs it).

`render(url)` returns the DOM after the page's scripts ran; `screenshot(url, name)` keeps a PNG under
ARTIFACTS (a test artifact, not committed). Tests that need it skip only where no chromium is installed,
and `.ci/run` makes sure CI has one, so in CI they always run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str | None:
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


needs_browser = pytest.mark.skipif(
    chromium() is None and not os.environ.get("CI"),
    reason="no chromium installed (apt-get install -y chromium; .ci/run does)",
)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium is not installed: apt-get install -y chromium (.ci/run does this)")
    with tempfile.TemporaryDirectory(prefix="islands-chromium-") as profile:
        cmd = [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            f"--user-data-dir={profile}",
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def render(url: str, wait_ms: int = 4000, timeout: float = 90.0) -> str:
    """The page's DOM after `wait_ms` of (virtual) time for its scripts and fetches."""
    proc = _run([f"--virtual-time-budget={wait_ms}", "--dump-dom", url], timeout)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(f"chromium could not render {url}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return proc.stdout


def screenshot(url: str, name: str, wait_ms: int = 4000, size: str = "1280,1600", timeout: float = 90.0) -> Path:
    """A PNG of the rendered page, kept at ARTIFACTS/name."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / name
    out.unlink(missing_ok=True)
    proc = _run(
        [f"--virtual-time-budget={wait_ms}", f"--window-size={size}", f"--screenshot={out}", "--hide-scrollbars", url],
        timeout,
    )
    if proc.returncode != 0 or not out.exists() or out.stat().st_size == 0:
        raise AssertionError(f"chromium made no screenshot of {url}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return out

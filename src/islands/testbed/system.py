"""Thin, checked wrappers over the `ip` and `tc` commands (iproute2). No policy lives here."""

from __future__ import annotations

import os
import shutil
import subprocess

# Root's PATH usually has these, but a venv or sudo -E can drop them.
_SBIN_PATH = os.pathsep.join(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
COMMAND_TIMEOUT_S = 20.0


class TestbedError(RuntimeError):
    """A system command for the testbed failed; the message names the command and its stderr."""

    __test__ = False  # not a pytest test class, despite the name


def tool(name: str) -> str:
    """Absolute path of `ip` or `tc`, or a clear error naming the package that provides it."""
    found = shutil.which(name) or shutil.which(name, path=_SBIN_PATH)
    if found is None:
        raise TestbedError(f"the '{name}' command is missing; the testbed needs iproute2 (apt-get install iproute2)")
    return found


def require_tools() -> None:
    tool("ip")
    tool("tc")


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError(
            "the network testbed needs root (it creates network namespaces, veth links and tc "
            f"qdiscs); this process runs as uid {os.geteuid()}. Run it as root, e.g. with sudo."
        )


def run(argv: list[str], check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"command timed out after {timeout:.0f} s: {' '.join(argv)}") from None
    if check and done.returncode != 0:
        raise TestbedError(f"command failed ({done.returncode}): {' '.join(argv)}: {done.stderr.strip()}")
    return done


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    prefix = [tool("ip")] + (["-n", netns] if netns else [])
    return run(prefix + list(args), check=check)


def tc(*args: str, netns: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([tool("tc"), "-n", netns] + list(args), check=check)


def netns_exec_prefix(netns: str) -> list[str]:
    return [tool("ip"), "netns", "exec", netns]


def in_netns(netns: str, argv: list[str], check: bool = True, timeout: float = COMMAND_TIMEOUT_S):
    return run(netns_exec_prefix(netns) + list(argv), check=check, timeout=timeout)


def list_netns() -> list[str]:
    out = ip("netns", "list").stdout
    # Lines look like "isl-a-h0 (id: 3)" or just "isl-a-h0".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_netns(netns: str) -> bool:
    """Delete one namespace; False when it was already gone (idempotent clean-up)."""
    done = ip("netns", "delete", netns, check=False)
    if done.returncode == 0:
        return True
    if netns not in list_netns():
        return False
    raise TestbedError(f"could not delete network namespace {netns}: {done.stderr.strip()}")


def netns_pids(netns: str) -> list[int]:
    done = ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def root_link_names() -> list[str]:
    out = ip("-o", "link", "show").stdout
    # "-o" lines: "4: eth0@if5: <...>" -> "eth0"
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]

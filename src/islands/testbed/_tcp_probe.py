"""One TCP stream between two testbed hosts; run inside a namespace with `ip netns exec`.

Standard library only and no islands import, so it starts fast with `python -I -S`.
    receiver ADDR        binds ADDR:0, prints the port, counts bytes until EOF, prints JSON
    sender ADDR PORT S   sends for S seconds, then closes
The receiver times from the first byte to EOF, so set-up and the sender's buffered tail are
measured where they arrive, which is what the link really carried.
"""

import json
import socket
import sys
import time

CHUNK = 1 << 16
ACCEPT_TIMEOUT_S = 15.0


def receiver(addr: str) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((addr, 0))
    server.listen(1)
    server.settimeout(ACCEPT_TIMEOUT_S)
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.settimeout(ACCEPT_TIMEOUT_S)
    received, first, last = 0, None, None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        last = time.perf_counter()
        if first is None:
            first = last
        received += len(data)
    seconds = (last - first) if first is not None and last is not None else 0.0  # both set by the first read
    print(json.dumps({"bytes": received, "seconds": seconds}), flush=True)


def sender(addr: str, port: int, seconds: float) -> None:
    payload = b"\0" * CHUNK
    with socket.create_connection((addr, port), timeout=ACCEPT_TIMEOUT_S) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


if __name__ == "__main__":
    if sys.argv[1] == "receiver":
        receiver(sys.argv[2])
    else:
        sender(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))

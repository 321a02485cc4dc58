"""A real network testbed: hosts as network namespaces behind a bridge, every link shaped with tc.

    tb = up("wan", hosts=2, rate="100mbit")
    argv = tb.wrap(tb.host_for_rank(rank), [sys.executable, "worker.py"])
    env = {**os.environ, **tb.env(tb.host_for_rank(rank))}
    measure_rate(tb)            # achieved Mbit/s, kept in tb.record() for run.json
    down("wan")

Only bandwidth is shaped (tbf); netem is unavailable, so latency is not emulated.
"""

from islands.testbed.etcd import EtcdCluster
from islands.testbed.lifecycle import down, down_all, status, up
from islands.testbed.measure import (
    GOODPUT_PER_WIRE_BYTE,
    RATE_TOLERANCE,
    interface_bytes,
    measure_rate,
    rate_within,
    wire_bytes,
)
from islands.testbed.model import Host, Testbed, TestbedNotFound
from islands.testbed.spec import parse_rate
from islands.testbed.system import TestbedError

__all__ = [
    "EtcdCluster",
    "GOODPUT_PER_WIRE_BYTE",
    "Host",
    "RATE_TOLERANCE",
    "Testbed",
    "TestbedError",
    "TestbedNotFound",
    "down",
    "down_all",
    "interface_bytes",
    "measure_rate",
    "parse_rate",
    "rate_within",
    "status",
    "up",
    "wire_bytes",
]

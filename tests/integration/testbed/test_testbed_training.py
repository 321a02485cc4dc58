"""A ddp run carried by a real rate-limited testbed records the link rate it really had."""

import json
import os
import shutil
import subprocess

import pytest

from harness.cli import islands_cli
from harness.flags import tiny
from islands import testbed

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the testbed needs root and iproute2 (ip, tc); CI runs as root",
)


@needs_root
@pytest.mark.slow
def test_ddp_run_over_testbed_records_rate_and_leaves_nothing(tmp_path, capfd):
    name = "tt" + str(os.getpid() % 10000)
    testbed.up(name, hosts=2, rate="100mbit")
    try:
        run = tmp_path / "run"
        code = islands_cli(  # the CLI in this process (harness.cli); its workers run inside the testbed's hosts
            "train",
            "--workers",
            "2",
            "--testbed",
            name,
            "--steps",
            "3",
            "--eval-every",
            "0",
            *tiny(),
            "--run-dir",
            str(run),
            "--no-progress",
            timeout=240,
        )
        assert code == 0, capfd.readouterr().err
        rec = json.loads((run / "run.json").read_text())
        measured = rec["interconnect"]["p2p"]["bandwidth_gbit_s"] * 1000  # Mbit/s between the hosts
        assert 90 <= measured <= 110, f"recorded link rate {measured:.1f} Mbit/s is not within 10% of 100"
        assert rec["interconnect"]["testbed"]["rate"] == "100mbit"
        assert rec["interconnect"]["testbed"]["latency_emulated"] is False
        wire = rec["interconnect"]["wire_bytes_per_host"]
        payload = rec["comm"]["per_rank"][0]["total_sent"]
        assert all(h["tx"] >= payload for h in wire)  # the links carried at least the payload
    finally:
        testbed.down(name)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"isl-{name}-" not in listing
    assert not any(r["name"] == name for r in testbed.status())

"""Testbed input checks and launcher helpers: pure, no root, no namespaces."""

from __future__ import annotations

import re

import pytest

from islands.testbed import model, spec, state, system
from islands.testbed.lifecycle import down, up
from islands.testbed.measure import GOODPUT_PER_WIRE_BYTE, rate_within
from islands.testbed.model import Host, Testbed, TestbedNotFound


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(state.STATE_DIR_ENV, str(tmp_path / "testbeds"))
    return tmp_path / "testbeds"


@pytest.fixture
def fake_tools(monkeypatch):
    monkeypatch.setattr(system, "tool", lambda name: f"/usr/sbin/{name}")


def _testbed(hosts: int = 3) -> Testbed:
    return Testbed(
        name="wan",
        rate_bps=100_000_000,
        subnet="10.77.4.0/24",
        hub="isl-wan-hub",
        hosts=[Host(i, f"isl-wan-h{i}", f"10.77.4.{i + 1}", f"isl-h{i}", f"port{i}") for i in range(hosts)],
    )


@pytest.mark.parametrize("name", ["a", "wan", "tb-1", "abcdefghijkl", "0-0"])
def test_valid_names(name):
    assert spec.validate_name(name) == name


@pytest.mark.parametrize("name", ["", "WAN", "a_b", "abcdefghijklm", "a b", "é", None, 3])
def test_invalid_names_say_what_is_allowed(name):
    with pytest.raises(ValueError, match=r"1 to 12 characters from a-z, 0-9 and '-'"):
        spec.validate_name(name)


def test_hosts_bounds_and_type():
    assert spec.validate_hosts(2) == 2 and spec.validate_hosts(64) == 64
    for bad in (1, 65, 0, -3):
        with pytest.raises(ValueError, match="between 2 and 64"):
            spec.validate_hosts(bad)
    for bad in (True, "2", 2.0):
        with pytest.raises(TypeError, match="int"):
            spec.validate_hosts(bad)


@pytest.mark.parametrize(
    "text,bps",
    [
        ("100mbit", 10**8),
        ("1gbit", 10**9),
        ("500kbit", 5 * 10**5),
        ("1.5mbit", 1_500_000),
        (" 200MBIT ", 2 * 10**8),
        ("10gbit", 10**10),
    ],
)
def test_rates_parse_in_si_units_like_tc(text, bps):
    assert spec.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["100", "100mb", "100 mbit", "fast", "-5mbit", "mbit", "1e3kbit"])
def test_unparseable_rates_show_examples(text):
    with pytest.raises(ValueError, match="'100mbit', '1gbit' or '500kbit'"):
        spec.parse_rate(text)


@pytest.mark.parametrize("text", ["50kbit", "20gbit", "0mbit"])
def test_out_of_range_rates(text):
    with pytest.raises(ValueError, match="between 100kbit and 10gbit"):
        spec.parse_rate(text)


def test_rate_type_error():
    with pytest.raises(TypeError, match="string like '100mbit'"):
        spec.parse_rate(100)


def test_format_rate_round_trips():
    for text in ("100mbit", "1gbit", "500kbit", "1500kbit"):
        assert spec.format_rate(spec.parse_rate(text)) == text
    assert spec.format_rate(123_456_789) == "123456789bit"


def test_tbf_shape_at_100mbit_is_the_measured_one():
    # FACTS.md: "tbf rate 100mbit burst 64kb latency 100ms"; latency 100 ms == limit burst + 100 ms of rate.
    assert spec.tbf_args(10**8) == ["tbf", "rate", "100mbit", "burst", "65536", "limit", str(65536 + 1_250_000)]


def test_tbf_burst_scales_and_never_drops_below_a_few_frames():
    assert spec.tbf_burst_bytes(10**9) == 655_360
    assert spec.tbf_burst_bytes(10**5) == 4 * 1514
    assert spec.tbf_limit_bytes(10**5) >= spec.tbf_burst_bytes(10**5) + 64 * 1514


def test_default_subnet_skips_taken_ones():
    assert str(spec.choose_subnet(None, 4, [])) == "10.77.0.0/24"
    assert str(spec.choose_subnet(None, 4, ["10.77.0.0/24", "10.77.1.0/24"])) == "10.77.2.0/24"


def test_explicit_subnet_checks():
    assert str(spec.choose_subnet("192.168.50.0/29", 5, [])) == "192.168.50.0/29"  # 6 usable: 5 hosts and the hub
    assert spec.hub_address(spec.choose_subnet("192.168.50.0/29", 5, [])) == "192.168.50.6"
    with pytest.raises(ValueError, match="room for 5 hosts and the hub, 6 hosts asked"):
        spec.choose_subnet("192.168.50.0/29", 6, [])
    with pytest.raises(ValueError, match="private IPv4"):
        spec.choose_subnet("8.8.8.0/24", 2, [])
    with pytest.raises(ValueError, match="private IPv4"):
        spec.choose_subnet("127.0.0.0/8", 2, [])
    with pytest.raises(ValueError, match="not an IPv4 network"):
        spec.choose_subnet("10.77.5.1/24", 2, [])  # host bits set
    with pytest.raises(ValueError, match="room for 1 hosts and the hub, 3 hosts asked"):
        spec.choose_subnet("10.1.0.0/30", 3, [])
    with pytest.raises(ValueError, match=re.escape("overlaps another testbed's subnet 10.77.0.0/24")):
        spec.choose_subnet("10.77.0.0/16", 2, ["10.77.0.0/24"])
    with pytest.raises(TypeError):
        spec.choose_subnet(42, 2, [])


def test_netns_names_map_back_to_their_testbed_without_ambiguity():
    assert model.testbed_of_netns("isl-wan-h3") == "wan"
    assert model.testbed_of_netns("isl-wan-hub") == "wan"
    assert model.testbed_of_netns("isl-a-h0-h1") == "a-h0"  # host 1 of 'a-h0', not a host of 'a'
    assert model.testbed_of_netns("isl-a-h0-hub") == "a-h0"
    for foreign in ("isl-wan", "cni-123", "isl-wan-hx", "isl-WAN-h1", "xisl-wan-h1"):
        assert model.testbed_of_netns(foreign) is None


def test_launcher_helpers(fake_tools):
    tb = _testbed(3)
    assert tb.master_addr == "10.77.4.1"
    assert tb.wrap(2, ["python", "w.py"]) == ["/usr/sbin/ip", "netns", "exec", "isl-wan-h2", "python", "w.py"]
    assert [tb.host_for_rank(r) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    env = tb.env(1)
    assert env["GLOO_SOCKET_IFNAME"] == "isl-h1" and env["MASTER_ADDR"] == "10.77.4.1"
    assert env["http_proxy"] == "" and "10.77.4.0/24" in env["NO_PROXY"]
    with pytest.raises(ValueError, match=re.escape("outside 0..2")):
        tb.env(3)
    with pytest.raises(ValueError, match="non-negative"):
        tb.host_for_rank(-1)
    with pytest.raises(TypeError, match="list of strings"):
        tb.wrap(0, "python w.py")


def test_record_says_latency_is_not_emulated():
    tb = _testbed(2)
    rec = tb.record()
    assert rec["latency_emulated"] is False and "netem" in rec["latency_note"]
    assert rec["rate"] == "100mbit" and rec["rate_mbit"] == 100.0 and rec["hosts"] == 2
    assert rec["qdisc"].startswith("tbf rate 100mbit") and rec["measured_goodput_mbit"] is None
    tb.measured = {"goodput_mbit": 95.0, "wire_mbit": 99.5}
    assert tb.record()["measured_goodput_mbit"] == 95.0


def test_state_round_trip_and_unknown_name(state_dir):
    tb = _testbed(2)
    tb.measured = {"goodput_mbit": 93.0}
    tb.save()
    assert Testbed.load("wan") == tb
    with pytest.raises(TestbedNotFound, match="known: wan"):
        Testbed.load("lan")


def test_rate_criterion():
    ideal = {"wire_ratio": 1.0, "goodput_ratio": GOODPUT_PER_WIRE_BYTE}
    assert rate_within(ideal)
    assert rate_within({"wire_ratio": 0.91, "goodput_ratio": 0.905})
    assert not rate_within({"wire_ratio": 0.85, "goodput_ratio": 0.82})  # link too slow
    assert not rate_within({"wire_ratio": 1.2, "goodput_ratio": 1.15})  # shaping not applied
    assert not rate_within({"wire_ratio": 1.0, "goodput_ratio": 0.8})  # wire fine, TCP starved


def test_not_root_is_a_clear_error(monkeypatch, state_dir, fake_tools):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match=r"needs root.*uid 1000"):
        up("wan", 2, "100mbit")
    with pytest.raises(PermissionError, match="needs root"):
        down("wan")


def test_missing_tools_is_a_clear_error(monkeypatch, state_dir):
    monkeypatch.setattr("shutil.which", lambda *a, **k: None)
    with pytest.raises(system.TestbedError, match=r"'ip' command is missing.*iproute2"):
        up("wan", 2, "100mbit")


def test_bad_input_fails_before_any_system_call(monkeypatch, state_dir):
    def forbidden(*args, **kwargs):
        raise AssertionError("a system command ran before input was validated")

    monkeypatch.setattr(system, "run", forbidden)
    with pytest.raises(ValueError, match="between 2 and 64"):
        up("wan", 1, "100mbit")
    with pytest.raises(ValueError, match="rate"):
        up("wan", 2, "100")
    with pytest.raises(ValueError, match="name"):
        up("Wan", 2, "100mbit")
    with pytest.raises(ValueError, match="private IPv4"):
        up("wan", 2, "100mbit", subnet="1.2.3.0/24")


def test_an_elastic_job_on_a_testbed_without_a_hub_address_says_to_rebuild_it(tmp_path):
    """Testbeds recorded before hubs had an address load with hub_ip "" and are refused before anything starts."""
    from islands.runtime.elastic.membership import JobSpec
    from islands.runtime.launch.elastic import launch_elastic_workers
    from islands.runtime.launch.ranks import LaunchError
    from islands.testbed import Host, Testbed

    old = Testbed.from_dict(
        {
            "name": "old",
            "rate_bps": 10**8,
            "subnet": "10.77.9.0/24",
            "hub": "isl-old-hub",
            "hosts": [Host(0, "isl-old-h0", "10.77.9.1", "isl-h0", "port0").__dict__],
        }
    )
    assert old.hub_ip == ""
    with pytest.raises(LaunchError, match="rebuild it with `islands testbed up --name old"):
        launch_elastic_workers(lambda a: ["true"], JobSpec(workers=1), tmp_path / "run", testbed=old)
    assert not (tmp_path / "run").exists()

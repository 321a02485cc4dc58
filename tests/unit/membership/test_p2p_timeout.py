"""An elastic job's point-to-point messages (gossip's exchange_planned) wait with the operation's timeout, not the
group's connect timeout: gloo's send and receive keep the timeout the group was made with (ProcessGroupGloo's
set_timeout does not reach them), and the epoch's group is made with a short one, which a large message on a slow
link outlasts."""

from __future__ import annotations

import datetime as _dt
import threading
import time

import pytest
import torch
import torch.distributed as dist

from islands.runtime.elastic.commit import Waited

CONNECT = 3.0  # s: short, as an epoch's, but not so short that a loaded machine misses the connect itself


@pytest.mark.slow  # two waits past CONNECT
def test_a_receive_waits_past_the_groups_connect_timeout_when_told_to():
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_dt.timedelta(seconds=30))
    groups: dict = {}

    def make(rank: int) -> None:  # the epoch's way: a short connect timeout, then set_timeout (which p2p ignores)
        client = dist.TCPStore("127.0.0.1", raw.port, is_master=False, timeout=_dt.timedelta(seconds=30))  # one
        # each: gloo's connect blocks in its store, and one TCPStore client serves one request at a time
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/0", client), rank, 2, _dt.timedelta(seconds=CONNECT))
        pg.set_timeout(_dt.timedelta(seconds=30))
        groups[rank] = pg

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    def late_send(tag: int) -> None:
        time.sleep(CONNECT + 1.5)  # the message arrives after the connect timeout
        try:
            groups[0].send([torch.full((4,), float(tag))], 1, tag).wait()
        except RuntimeError:  # the unbounded receiver below has given up by then; its send may fail with it
            pass

    got = torch.zeros(4)
    sender = threading.Thread(target=late_send, args=(0,))
    sender.start()
    Waited([groups[1].recv([got], 0, 0)], keep=got, timeout_s=30.0).wait()
    sender.join(30)
    assert torch.equal(got, torch.zeros(4))  # tag 0 sent zeros: received whole, no error

    # without a bound of its own the same wait fails at the connect timeout (what the elastic job did before)
    sender = threading.Thread(target=late_send, args=(1,))
    sender.start()
    unbounded = Waited([groups[1].recv([got], 0, 1)], keep=got)
    try:
        unbounded.wait()
        failed = False
    except RuntimeError:
        failed = True
    sender.join(30)
    assert failed
    for pg in groups.values():
        pg.abort()

"""Addresses and groups under torch on one host: the address each rank publishes under every
init method (with MASTER_ADDR unset for tcp:// and file://), the interface setting, and
subgroups beside the default group. The same across real hosts: tests/collective/test_netns.py."""

import socket

import pytest

from harness import free_port, run


def host_ip() -> str:
    """This machine's address on its default route (what another host would reach it at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]


def ips(addresses):
    return {a.rsplit(":", 1)[0] for a in addresses}


@pytest.mark.parametrize("method", ["tcp", "file", "env"])
def test_every_init_method_publishes_an_address_the_other_ranks_reach(method, tmp_path):
    me = host_ip()
    assert me != "127.0.0.1", "this test needs a host with a non-loopback address"
    env = {}
    if method == "tcp":
        # torch's store on the host's own address, MASTER_ADDR unset: the route to the store
        # is the host's address, not loopback.
        args, env = {"init_method": f"tcp://{me}:{free_port()}"}, {"MASTER_ADDR": "", "MASTER_PORT": ""}
        want = {me}
    elif method == "file":
        # No store host at all: the default route's interface.
        args, env = {"init_method": f"file://{tmp_path}/store"}, {"MASTER_ADDR": "", "MASTER_PORT": ""}
        want = {me}
    else:
        # env:// with MASTER_ADDR=127.0.0.1: a single-host group stays on loopback.
        args, want = {}, {"127.0.0.1"}
    res = run("torch_init", 2, tmp_path / "out", args, env=env, script="worker_hosts.py")
    for r, out in res.items():
        assert out["ok"], (r, out)
        assert ips(out["addresses"]) == want, (r, out["addresses"])


def test_the_interface_setting_chooses_the_published_address(tmp_path):
    me = host_ip()
    env = {"MASTER_ADDR": "", "MASTER_PORT": "", "MOBIUS_SOCKET_IFNAME": "lo"}
    res = run("torch_init", 2, tmp_path, {"init_method": f"tcp://{me}:{free_port()}"}, env=env,
              script="worker_hosts.py")
    for r, out in res.items():
        assert out["ok"] and ips(out["addresses"]) == {"127.0.0.1"}, (r, out)


def test_two_subgroups_reduce_at_once_beside_the_default_and_an_overlapping_group(tmp_path):
    res = run("subgroups", 4, tmp_path, {"rounds": 20}, script="worker_hosts.py")
    for r, out in res.items():
        failed = [k for k, ok in out.items() if not ok]
        assert not failed, (r, out)
        assert set(out) == {"subgroup", "default"} | ({"overlapping"} if r in (0, 2) else set()), out


def test_the_cost_model_measures_every_link_the_algorithms_use_and_takes_the_worst(tmp_path):
    res = run("links", 4, tmp_path, env={"MOBIUS_TUNE": "on"}, script="worker_hosts.py")
    links = res[0]["links"]
    # Four ranks: the ring and the recursive-doubling partners are all six pairs.
    assert sorted((a, b) for a, b, *_ in links) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)], links
    m = res[0]["model"]
    assert m["alpha"] == max(l[2] for l in links) and m["beta"] == max(l[3] for l in links), (m, links)
    for r, out in res.items():
        assert out["ok"] and out["model"] == m, (r, out["model"], m)
        assert r == 0 or out["links"] == [], out

"""How the launcher describes the group to MLX, without starting anything: hosts and
hostfiles, the ring hostfile, NCCL and JACCL variables, and the script ssh runs."""

from __future__ import annotations

import json
import shlex
import socket

import pytest

from engine.errors import EngineError
from engine.runtime import shard_group
from engine.runtime.shard_group import RING_PORT, RankGroup, parse_hosts, remote_script


def test_hosts_from_a_list_or_an_mlx_hostfile(tmp_path):
    assert parse_hosts("127.0.0.1,127.0.0.1") == (["127.0.0.1", "127.0.0.1"], None)
    assert parse_hosts("studio-1.local") == (["studio-1.local"], None)  # a group of one
    with pytest.raises(EngineError, match="one host or more"):
        parse_hosts(" , ")
    hostfile = tmp_path / "hosts.json"
    data = {"backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
                                          {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]}]}  # fmt: skip
    hostfile.write_text(json.dumps(data))
    hosts, parsed = parse_hosts(str(hostfile))
    assert hosts == ["a", "b"] and parsed == data


def test_local_ring_ranks_get_distinct_loopback_ports():
    env, files = RankGroup(["127.0.0.1", "localhost", "127.0.0.1"], [])._env()
    ring = json.loads(files["MLX_HOSTFILE"])
    assert [entry[0].split(":")[0] for entry in ring] == ["127.0.0.1"] * 3
    assert len({entry[0] for entry in ring}) == 3


def test_local_ports_come_from_below_the_ephemeral_range_and_skip_one_in_use(monkeypatch):
    """A port handed out for bind(0) is one outgoing connections draw from too; ours are
    chosen below that range, none that something listens on, none twice."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(shard_group, "LOCAL_PORTS", range(taken, taken + 1))
        with pytest.raises(EngineError, match="no 1 free local ports"):
            shard_group._free_ports(1)
    monkeypatch.undo()
    ports = shard_group._free_ports(4)
    assert len(set(ports)) == 4 and all(p in shard_group.LOCAL_PORTS for p in ports)
    assert max(shard_group.LOCAL_PORTS) < 32768  # Linux's first ephemeral port
    for port in ports:  # each free for a rank to bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_remote_ranks_use_their_addresses_and_mlx_launch_ports():
    group = RankGroup(["10.0.0.1", "10.0.0.2"], [], backend="ring")
    _, files = group._env()
    assert json.loads(files["MLX_HOSTFILE"]) == [[f"10.0.0.1:{RING_PORT}"], [f"10.0.0.2:{RING_PORT + 1}"]]
    with pytest.raises(EngineError, match="mixing 127.0.0.1"):
        RankGroup(["127.0.0.1", "10.0.0.2"], [])


def test_nccl_and_jaccl_variables(tmp_path):
    env, files = RankGroup(["10.0.0.1", "10.0.0.2"], [], backend="nccl")._env()
    assert env["NCCL_HOST_IP"] == "10.0.0.1" and env["MLX_WORLD_SIZE"] == "2" and "MLX_HOSTFILE" not in files
    # NVLink multicast stays off in every NCCL rank's environment.
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    env, _ = RankGroup(["127.0.0.1"], [], backend="nccl")._env()
    assert env["MLX_WORLD_SIZE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert "NCCL_NVLS_ENABLE" not in RankGroup(["10.0.0.1", "10.0.0.2"], [], backend="ring")._env()[0]
    with pytest.raises(EngineError, match="rdma devices"):
        RankGroup(["10.0.0.1", "10.0.0.2"], [], backend="jaccl")._env()
    hostfile = tmp_path / "hosts.json"
    hosts = [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]}, {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]}]  # fmt: skip
    hostfile.write_text(json.dumps({"hosts": hosts, "envs": ["MLX_METAL_FAST_SYNCH=1"]}))
    env, files = RankGroup(str(hostfile), [], backend="jaccl")._env()
    assert env["MLX_JACCL_COORDINATOR"] == f"10.0.0.1:{RING_PORT}" and env["MLX_METAL_FAST_SYNCH"] == "1"
    assert json.loads(files["MLX_IBV_DEVICES"]) == [[None, "rdma_en3"], ["rdma_en3", None]]


def test_the_script_ssh_runs_for_a_remote_rank():
    script = remote_script(1, {"A": "x y"}, {"MLX_HOSTFILE": '[["10.0.0.1:1"]]'}, ["python", "-m", "engine", "node"])
    parts = [p.strip() for p in script.split(";")]
    assert "export A='x y'" in parts and "export MLX_RANK=1" in parts
    assert parts[-1] == "exec python -m engine node"
    written = next(p for p in parts if p.startswith("echo"))
    assert shlex.split(written)[1] == '[["10.0.0.1:1"]]'

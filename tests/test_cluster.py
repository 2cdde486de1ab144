"""The embedded cluster itself (real daemons): a master that loses a port it was given, and the
logs of a cluster that made its own directory for them."""

from __future__ import annotations

import shutil
import socket

import pytest

from audit.cluster import ClusterError, LocalCluster


def test_a_master_whose_admin_port_was_taken_starts_again_on_fresh_ports():
    # Another process binds the admin port between free_port's probe and the master's bind,
    # as a busy CI host's ephemeral ports did: the master exits with "Address already in use".
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with LocalCluster(holders=1, segment_mb=64, admin_port=port) as cluster:
            assert cluster.admin_port != port
            assert len(cluster.segments()) == 1
            lost = (cluster.log_dir / "master-lost-a-port-1.log").read_text(errors="replace")
            assert f"127.0.0.1:{port}: Address already in use" in lost
    assert not cluster.log_dir.exists()  # a directory of its own, removed: nothing failed in the end


def test_a_clusters_own_log_directory_is_kept_when_it_failed_and_removed_when_it_did_not(monkeypatch):
    import audit.cluster as module

    with LocalCluster(holders=1, segment_mb=64, offload=True) as cluster:
        offload_dir = cluster.running_holders[0].offload_dir
        assert offload_dir.is_dir() and offload_dir.parent == cluster.log_dir
    assert not cluster.log_dir.exists()  # the holders' SSD tiers with it

    monkeypatch.setattr(module, "MASTER_PORT_TRIES", 1)
    with socket.socket() as taken:  # a master that cannot start: the error names its logs, which stay
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        failing = LocalCluster(holders=0, admin_port=taken.getsockname()[1])
        with pytest.raises(ClusterError, match="exited .* logs in "):
            failing.start()
        failing.stop()  # (as the context manager does after a failed start)
    try:
        assert (failing.log_dir / "master.log").is_file()
    finally:
        shutil.rmtree(failing.log_dir)

"""The embedded cluster itself: a real `mooncake_master` that loses a port it was given."""

from __future__ import annotations

import socket

from audit.cluster import LocalCluster


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

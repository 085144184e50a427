"""One node's torchrun command from the topology and the rendezvous environment (app/pipeline/launch.py):
the options each rendezvous gives, every partial or mixed environment refused in one line, and a
joining node waiting for the endpoint with real sockets. The entrypoint and the pipeline benchmark
run this same code (tests/test_entrypoint.py, tests/test_bench_pipeline.py)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from app.config.schema import TopologyConfig
from app.errors import UserError
from app.pipeline.launch import Endpoint, rendezvous, torchrun_options, wait_until_reachable
from tests.datagen_server import free_port

TWO_NODES = TopologyConfig(target_ranks=2, drafter_ranks=2, nnodes=2, nproc_per_node=2)
ONE_NODE = TopologyConfig(target_ranks=2, drafter_ranks=2, nproc_per_node=4)
# a short wait: a case that wrongly reaches the probe fails in a second, not after the default 300 s
STATIC = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "DFLASH_RENDEZVOUS_WAIT_S": "1"}


def test_one_node_is_standalone() -> None:
    assert torchrun_options(ONE_NODE, {}) == ["--nnodes", "1", "--nproc-per-node", "4", "--standalone"]
    assert torchrun_options(ONE_NODE, {"NNODES": "1", "RDZV_ENDPOINT": ""}) == rendezvous(ONE_NODE, {})[0]


def test_c10d_on_the_host_node_and_static_on_node_0_wait_for_nothing() -> None:
    options, endpoint = rendezvous(
        TWO_NODES, {"NNODES": "2", "RDZV_ENDPOINT": "localhost:29400", "RDZV_ID": "job7"}
    )
    assert options == [
        *("--nnodes", "2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400", "--rdzv-id", "job7"),
    ]
    assert endpoint is None  # this machine serves localhost: torchrun here starts the store
    options, endpoint = rendezvous(TWO_NODES, {**STATIC, "NODE_RANK": "0"})
    assert options[4:] == ["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29500"]
    assert endpoint is None
    _, endpoint = rendezvous(TWO_NODES, {**STATIC, "NODE_RANK": "1"})
    assert endpoint == Endpoint("127.0.0.1", 29500, "MASTER_ADDR:MASTER_PORT")


@pytest.mark.parametrize(
    ("topology", "environ", "message"),
    [
        (TWO_NODES, {"NNODES": "2"},
         "topology.nnodes is 2: set RDZV_ENDPOINT=host:port (or MASTER_ADDR, MASTER_PORT and NODE_RANK) on every node"),
        (TWO_NODES, {"NNODES": "2", "MASTER_ADDR": "127.0.0.1"},
         "static rendezvous: MASTER_PORT, NODE_RANK not set; set MASTER_ADDR, MASTER_PORT and NODE_RANK on every "
         "node (NODE_RANK 0 on the node at MASTER_ADDR, 1..N-1 on the others), or RDZV_ENDPOINT alone"),
        (TWO_NODES, {"NNODES": "2", "NODE_RANK": "1"},
         "static rendezvous: MASTER_ADDR, MASTER_PORT not set; set MASTER_ADDR, MASTER_PORT and NODE_RANK on every "
         "node (NODE_RANK 0 on the node at MASTER_ADDR, 1..N-1 on the others), or RDZV_ENDPOINT alone"),
        (TWO_NODES, {**STATIC, "NODE_RANK": "2"}, "NODE_RANK=2: expected one of 0..1 (topology.nnodes 2)"),
        (TWO_NODES, {**STATIC, "NODE_RANK": "-1"}, "NODE_RANK=-1: expected one of 0..1 (topology.nnodes 2)"),
        (TWO_NODES, {**STATIC, "NODE_RANK": "0", "MASTER_PORT": "http"},
         "MASTER_PORT=http: expected a port number, 1-65535"),
        (TWO_NODES, {"NNODES": "2", "RDZV_ID": "job7"},
         "RDZV_ID is set without RDZV_ENDPOINT: set RDZV_ENDPOINT=host:port on every node"),
        (TWO_NODES, {"NNODES": "2", "RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT=node0: expected host:port, e.g. node0:29400"),
        (TWO_NODES, {"NNODES": "2", "RDZV_ENDPOINT": "node0:99999"},
         "RDZV_ENDPOINT=node0:99999: expected host:port, e.g. node0:29400"),
        (TWO_NODES, {"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:29400", "NODE_RANK": "1"},
         "RDZV_ENDPOINT (c10d rendezvous) and NODE_RANK (static rendezvous) are both set: set either RDZV_ENDPOINT "
         "(and RDZV_ID), or MASTER_ADDR, MASTER_PORT and NODE_RANK"),
        (TWO_NODES, {"NNODES": "2", "RDZV_ENDPOINT": "no-such-node.invalid:29400"},
         "RDZV_ENDPOINT: host no-such-node.invalid does not resolve on this node: check the name, or give the "
         "host node's IP address"),
        (TWO_NODES, {"NNODES": "3", "RDZV_ENDPOINT": "127.0.0.1:29400"},
         "NNODES=3 but topology.nnodes is 2: the job's node count must be the same in both (entrypoint.sh passes "
         "NNODES as topology.nnodes; elsewhere add topology.nnodes=3)"),
        (ONE_NODE, {"RDZV_ENDPOINT": "127.0.0.1:29400"},
         "RDZV_ENDPOINT set but topology.nnodes is 1: set NNODES to the job's node count on every node, or unset "
         "RDZV_ENDPOINT for a one-node job"),
        (ONE_NODE, {"MASTER_ADDR": "10.0.0.7", "NODE_RANK": "0"},
         "MASTER_ADDR, NODE_RANK set but topology.nnodes is 1: set NNODES to the job's node count on every node, "
         "or unset MASTER_ADDR, NODE_RANK for a one-node job"),
        (TWO_NODES, {**STATIC, "NODE_RANK": "1", "DFLASH_RENDEZVOUS_WAIT_S": "soon"},
         "DFLASH_RENDEZVOUS_WAIT_S=soon: expected seconds > 0"),
    ],
)  # fmt: skip
def test_a_bad_or_partial_rendezvous_is_one_line_naming_the_variable(topology, environ, message) -> None:
    with pytest.raises(UserError) as refused:
        torchrun_options(topology, environ)
    assert str(refused.value) == message


def test_a_joining_node_waits_for_the_host_node_then_starts() -> None:
    port = free_port()
    listener = socket.socket()

    def host_node_starts_late() -> None:
        time.sleep(1.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=host_node_starts_late, daemon=True).start()
    started = time.monotonic()
    try:
        environ = {**STATIC, "MASTER_PORT": str(port), "NODE_RANK": "1", "DFLASH_RENDEZVOUS_WAIT_S": "30"}
        assert torchrun_options(TWO_NODES, environ)[4:6] == ["--node-rank", "1"]
    finally:
        listener.close()
    assert 1.4 < time.monotonic() - started < 20


def test_an_endpoint_that_never_answers_is_one_line_after_the_wait() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(UserError) as refused:
        wait_until_reachable(Endpoint("127.0.0.1", port, "MASTER_ADDR:MASTER_PORT"), wait_s=2)
    assert 2 <= time.monotonic() - started < 10
    assert str(refused.value) == (
        f"rendezvous 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) did not answer within 2s (Connection refused): "
        "start the node that hosts it first, check the address, and that the port is open between the nodes "
        "(DFLASH_RENDEZVOUS_WAIT_S sets the wait)"
    )

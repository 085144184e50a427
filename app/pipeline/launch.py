"""One node's torchrun command line: the config's topology and this node's rendezvous environment.

The one implementation behind `entrypoint.sh train` (through `dflash config torchrun`) and
`dflash bench pipeline`. The rendezvous comes from the environment, the same on every node except
NODE_RANK (docs/architecture.md, Process topology):

- one node (`topology.nnodes` 1): `--standalone`; a rendezvous variable set anyway is refused (a node
  meant to join a larger job would otherwise train alone);
- c10d: `RDZV_ENDPOINT=host:port` (`RDZV_ID` names the job, default `dflash`); the rendezvous assigns
  the node ranks;
- static: `MASTER_ADDR`, `MASTER_PORT` and `NODE_RANK` (0 on the node at MASTER_ADDR, which hosts it).

A partial or mixed set is refused, naming what is missing, rather than guessed at. A node that does
not host the endpoint then waits for it to answer (`DFLASH_RENDEZVOUS_WAIT_S`, default 300 s: the
host node may start later): an endpoint that does not resolve or never answers is one line here, not
torchrun's traceback after its own join timeout.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from app.config.schema import TopologyConfig
from app.errors import UserError

C10D = ("RDZV_ENDPOINT", "RDZV_ID")
STATIC = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
WAIT_VARIABLE = "DFLASH_RENDEZVOUS_WAIT_S"
DEFAULT_WAIT_S = 300.0
PROBE_INTERVAL_S = 1.0
NOTE_AFTER_S = 10.0
"""A wait longer than this is announced (once) on stderr; a shorter one stays silent."""


@dataclass(frozen=True)
class Endpoint:
    """A rendezvous this node joins but does not host: it must answer before torchrun starts."""

    host: str
    port: int
    source: str
    """The variables that named it, for the error line."""


def torchrun_options(topology: TopologyConfig, environ: Mapping[str, str]) -> list[str]:
    """torchrun's options for this node (`--nnodes N --nproc-per-node P` and the rendezvous), once the
    rendezvous answers; every bad or partial variable is a `UserError` naming it."""
    options, endpoint = rendezvous(topology, environ)
    if endpoint is not None:
        wait_until_reachable(endpoint, _wait_seconds(environ))
    return options


def rendezvous(topology: TopologyConfig, environ: Mapping[str, str]) -> tuple[list[str], Endpoint | None]:
    """The options and the endpoint to wait for (None: standalone, or this node hosts it)."""
    value = {name: environ[name] for name in (*C10D, *STATIC, "NNODES") if environ.get(name)}
    nnodes = topology.nnodes
    if "NNODES" in value and value["NNODES"] != str(nnodes):
        raise UserError(
            f"NNODES={value['NNODES']} but topology.nnodes is {nnodes}: the job's node count must be the "
            f"same in both (entrypoint.sh passes NNODES as topology.nnodes; elsewhere add topology.nnodes="
            f"{value['NNODES']})"
        )
    options = ["--nnodes", str(nnodes), "--nproc-per-node", str(topology.nproc_per_node)]
    c10d = [name for name in C10D if name in value]
    static = [name for name in STATIC if name in value]
    if nnodes == 1:
        if c10d or static:
            names = ", ".join(c10d + static)
            raise UserError(
                f"{names} set but topology.nnodes is 1: set NNODES to the job's node count on every node, "
                f"or unset {names} for a one-node job"
            )
        return [*options, "--standalone"], None
    if not c10d and not static:
        raise UserError(
            f"topology.nnodes is {nnodes}: set RDZV_ENDPOINT=host:port (or MASTER_ADDR, MASTER_PORT and "
            "NODE_RANK) on every node"
        )
    if c10d and static:
        raise UserError(
            f"{', '.join(c10d)} (c10d rendezvous) and {', '.join(static)} (static rendezvous) are both set: "
            "set either RDZV_ENDPOINT (and RDZV_ID), or MASTER_ADDR, MASTER_PORT and NODE_RANK"
        )
    if c10d:
        return _c10d(options, value)
    return _static(options, value, nnodes)


def _c10d(options: list[str], value: dict[str, str]) -> tuple[list[str], Endpoint | None]:
    if "RDZV_ENDPOINT" not in value:
        raise UserError("RDZV_ID is set without RDZV_ENDPOINT: set RDZV_ENDPOINT=host:port on every node")
    endpoint = value["RDZV_ENDPOINT"]
    host, _, port = endpoint.rpartition(":")
    if not host or not _is_port(port):
        raise UserError(f"RDZV_ENDPOINT={endpoint}: expected host:port, e.g. node0:29400")
    rdzv_id = value.get("RDZV_ID", "dflash")
    options = [*options, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    _resolve(host, "RDZV_ENDPOINT")
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    # torchrun's own test of whether this node serves the endpoint (it then starts the store)
    hosted = _matches_machine_hostname(host.strip("[]"))
    return options, None if hosted else Endpoint(host.strip("[]"), int(port), "RDZV_ENDPOINT")


def _static(options: list[str], value: dict[str, str], nnodes: int) -> tuple[list[str], Endpoint | None]:
    missing = [name for name in STATIC if name not in value]
    if missing:
        raise UserError(
            f"static rendezvous: {', '.join(missing)} not set; set MASTER_ADDR, MASTER_PORT and NODE_RANK on "
            "every node (NODE_RANK 0 on the node at MASTER_ADDR, 1..N-1 on the others), or RDZV_ENDPOINT alone"
        )
    host, port, node_rank = value["MASTER_ADDR"], value["MASTER_PORT"], value["NODE_RANK"]
    if not _is_port(port):
        raise UserError(f"MASTER_PORT={port}: expected a port number, 1-65535")
    if not node_rank.isdigit() or int(node_rank) >= nnodes:
        raise UserError(f"NODE_RANK={node_rank}: expected one of 0..{nnodes - 1} (topology.nnodes {nnodes})")
    options = [*options, "--node-rank", node_rank, "--master-addr", host, "--master-port", port]
    _resolve(host, "MASTER_ADDR")
    return options, None if node_rank == "0" else Endpoint(host, int(port), "MASTER_ADDR:MASTER_PORT")


def wait_until_reachable(endpoint: Endpoint, wait_s: float) -> None:
    """Return once `endpoint` accepts a TCP connection; a `UserError` after `wait_s` without one."""
    started = time.monotonic()
    noted = False
    while True:
        try:
            with socket.create_connection((endpoint.host, endpoint.port), timeout=PROBE_INTERVAL_S):
                return
        except OSError as error:
            reason = error.strerror or type(error).__name__
        waited = time.monotonic() - started
        if waited >= wait_s:
            raise UserError(
                f"rendezvous {endpoint.host}:{endpoint.port} ({endpoint.source}) did not answer within "
                f"{wait_s:g}s ({reason}): start the node that hosts it first, check the address, and that "
                f"the port is open between the nodes ({WAIT_VARIABLE} sets the wait)"
            )
        if waited >= NOTE_AFTER_S and not noted:  # a node started well before the host node says why it waits
            noted = True
            print(
                f"dflash: waiting up to {wait_s:g}s for the rendezvous at {endpoint.host}:{endpoint.port} "
                f"({endpoint.source}) to answer",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(PROBE_INTERVAL_S)


def _resolve(host: str, variable: str) -> None:
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (socket.gaierror, UnicodeError):
        raise UserError(
            f"{variable}: host {host} does not resolve on this node: check the name, or give the host "
            "node's IP address"
        ) from None


def _is_port(text: str) -> bool:
    return text.isdigit() and 1 <= int(text) <= 65535


def _wait_seconds(environ: Mapping[str, str]) -> float:
    text = environ.get(WAIT_VARIABLE) or str(DEFAULT_WAIT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UserError(f"{WAIT_VARIABLE}={text}: expected seconds > 0")
    return seconds

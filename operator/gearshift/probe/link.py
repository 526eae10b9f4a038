"""Pairwise link probe: bandwidth and latency between two nodes over TCP, and which pairs to measure.

Two pods run it: ``gearshift-probe link-server`` listens on its pod IP, ``gearshift-probe link-client
--peer-address IP:PORT`` connects, measures, and prints one link document (:mod:`gearshift.api.probedoc`).

Wire protocol (client → server frames, network byte order): a 9-byte header ``op (1 byte) + length
(uint64)``, then ``length`` payload bytes.
  - ``P`` ping (length ≤ 64 KiB): the server echoes the frame; the client times the round trip.
  - ``D`` data (length ≤ 64 MiB): the server reads it all and answers ``A`` + the byte count.
  - ``Q`` quit: the server ends the session.
Latency is half the median round trip of small pings (µs); bandwidth is the bytes of the data frames
over the time from the first byte sent to the last acknowledgement (GB/s, and Gb/s = 8 × GB/s, the
unit of ``GPUProfile.status.interconnect``). It measures the TCP path between the pods (the NIC and
the fabric), not RDMA: a lower bound for engines using RDMA (NIXL, NCCL). Both sides are bounded in
bytes and in time; the server refuses oversized frames and exits after its sessions or when idle.

Which pairs (:func:`pairs_to_measure`), not all N²: nodes are grouped by (compute class, zone);
  1. one representative pair for every combination of groups (and within a group of two or more),
     since the planner's link constraint needs the bandwidth between the kinds of node it may make
     neighbours, and nodes of one kind in one zone share a NIC type and fabric;
  2. each node with its ``nearest`` nearest peers (same zone first, then closest compute score, then
     the next names after it, cyclically), so every node has at least one measured link of its own
     and a node with a bad NIC or cable shows up; ties rotate so that no node becomes everyone's peer.
That is at most ``G·(G+1)/2 + nearest·N`` pairs for G groups and N nodes. :func:`schedule_rounds` puts
them into rounds where no node is in two pairs at once, so measurements do not share a NIC.
"""

from __future__ import annotations

import contextlib
import heapq
import socket
import statistics
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gearshift.api.probedoc import SCHEMA_VERSION

HEADER = struct.Struct("!cQ")
OP_PING, OP_DATA, OP_ACK, OP_QUIT = b"P", b"D", b"A", b"Q"
MAX_PING_BYTES = 64 * 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
DEFAULT_PORT = 7070


class LinkProbeError(RuntimeError):
    """The link probe could not measure: connection refused or lost, a protocol violation, a timeout."""


def _recv_exact(sock: socket.socket, n: int, buf: bytearray | None = None) -> bytes | bytearray:
    """Read exactly ``n`` bytes (into ``buf`` when given, reusing it). Raises LinkProbeError on EOF."""
    view = memoryview(buf if buf is not None else bytearray(n))[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkProbeError(f"connection closed after {got} of {n} bytes")
        got += k
    return view.obj if buf is None else buf  # type: ignore[return-value]


# --- server -------------------------------------------------------------------------------------------


class LinkServer:
    """The server side: bind, then :meth:`serve` sessions one at a time.

    Bounded: at most ``max_sessions`` sessions (None: until idle), each session at most
    ``max_session_bytes`` bytes, and it stops when no client connects for ``idle_timeout_s``.
    """

    def __init__(
        self,
        host: str,
        port: int = DEFAULT_PORT,
        *,
        max_sessions: int | None = 1,
        idle_timeout_s: float = 120.0,
        max_session_bytes: int = 8 * 1024**3,
    ) -> None:
        self.host, self.requested_port = host, port
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_session_bytes = max_session_bytes
        self._sock: socket.socket | None = None
        self.sessions = 0
        self.bytes_received = 0
        self.errors: list[str] = []

    def bind(self) -> int:
        """Bind and listen; returns the port (useful with port 0). Raises OSError if the address is taken."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.requested_port))
            sock.listen(4)
        except OSError:
            sock.close()
            raise
        sock.settimeout(self.idle_timeout_s)
        self._sock = sock
        return int(sock.getsockname()[1])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def serve(self) -> dict[str, Any]:
        """Serve sessions until ``max_sessions`` or idle; returns ``{sessions, bytesReceived, errors}``."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        try:
            while self.max_sessions is None or self.sessions < self.max_sessions:
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    break
                with conn:
                    self.sessions += 1
                    try:
                        self._session(conn)
                    except (LinkProbeError, OSError) as exc:
                        # One broken client must not stop the server from serving the next.
                        self.errors.append(str(exc))
        finally:
            self.close()
        return {"sessions": self.sessions, "bytesReceived": self.bytes_received, "errors": self.errors}

    def _session(self, conn: socket.socket) -> None:
        conn.settimeout(self.idle_timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(0)
        total = 0
        while True:
            op, n = HEADER.unpack(_recv_exact(conn, HEADER.size))
            if op == OP_QUIT:
                return
            if op == OP_PING:
                if n > MAX_PING_BYTES:
                    raise LinkProbeError(f"ping of {n} bytes exceeds {MAX_PING_BYTES}")
                payload = _recv_exact(conn, n)
                conn.sendall(HEADER.pack(OP_PING, n) + payload)
            elif op == OP_DATA:
                if n > MAX_FRAME_BYTES:
                    raise LinkProbeError(f"data frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
                total += n
                if total > self.max_session_bytes:
                    raise LinkProbeError(f"session exceeded {self.max_session_bytes} bytes")
                if len(buf) < n:
                    buf = bytearray(n)
                _recv_exact(conn, n, buf)
                self.bytes_received += n
                conn.sendall(HEADER.pack(OP_ACK, n))
            else:
                raise LinkProbeError(f"unknown op {op!r}")


# --- client -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkBudget:
    """Bounds of one client measurement."""

    pings: int = 50
    ping_bytes: int = 64
    frame_bytes: int = 16 * 1024 * 1024
    max_bytes: int = 1024**3
    min_frames: int = 2
    max_seconds: float = 10.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.ping_bytes <= MAX_PING_BYTES:
            raise ValueError(f"ping bytes must be in 1..{MAX_PING_BYTES}, got {self.ping_bytes}")
        if not 1 <= self.frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"frame bytes must be in 1..{MAX_FRAME_BYTES}, got {self.frame_bytes}")
        if self.pings < 1 or self.min_frames < 1 or self.max_bytes < self.frame_bytes:
            raise ValueError("need pings >= 1, min_frames >= 1 and max_bytes >= frame_bytes")
        if self.max_seconds <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("max_seconds and connect_timeout_s must be > 0")


def measure_link(
    address: str,
    port: int,
    budget: LinkBudget = LinkBudget(),
    *,
    node: str | None = None,
    peer: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Measure latency and bandwidth to a :class:`LinkServer` at ``address:port``; a link document.

    Sends ``budget.pings`` pings, then data frames until ``max_bytes`` are sent or ``max_seconds`` have
    passed (at least ``min_frames``). Returns ``{schemaVersion, probe: link, kind: tcp, node, peer,
    peerAddress, bandwidthGBps, bandwidthGbps, latencyUs, rttUs: {medianUs, minUs, maxUs}, bytes, frames,
    durationS, direction, startedAt}``.

    Raises:
        LinkProbeError: cannot connect, the connection breaks, or the server misbehaves.
    """
    started = now or datetime.now(UTC)
    t_start = time.perf_counter()
    sock = _connect(address, port, budget.connect_timeout_s)
    try:
        sock.settimeout(budget.max_seconds + budget.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = _pings(sock, budget)
        sent, frames, elapsed = _stream(sock, budget)
        with contextlib.suppress(OSError):
            sock.sendall(HEADER.pack(OP_QUIT, 0))
    except (OSError, struct.error) as exc:
        raise LinkProbeError(f"link to {address}:{port} failed: {exc}") from None
    finally:
        sock.close()
    gbytes = sent / elapsed / 1e9
    rtt_med = statistics.median(rtts)
    return {
        "schemaVersion": SCHEMA_VERSION,
        "probe": "link",
        "kind": "tcp",
        "node": node,
        "peer": peer or address,
        "peerAddress": f"{address}:{port}",
        "direction": "node-to-peer",
        "bandwidthGBps": gbytes,
        "bandwidthGbps": 8 * gbytes,
        "latencyUs": rtt_med / 2,
        "rttUs": {"medianUs": rtt_med, "minUs": min(rtts), "maxUs": max(rtts), "pings": len(rtts)},
        "bytes": sent,
        "frames": frames,
        "durationS": round(time.perf_counter() - t_start, 3),
        "startedAt": started.isoformat().replace("+00:00", "Z"),
    }


def _connect(address: str, port: int, timeout_s: float) -> socket.socket:
    """Connect, retrying while refused for up to ``timeout_s`` (the server pod may still be starting)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((address, port), timeout=max(0.1, end - time.monotonic()))
        except OSError as exc:
            if time.monotonic() + 0.2 >= end:
                raise LinkProbeError(
                    f"cannot connect to link server {address}:{port} within {timeout_s:g} s: {exc}"
                ) from None
            time.sleep(0.2)


def _pings(sock: socket.socket, budget: LinkBudget) -> list[float]:
    payload = bytes(budget.ping_bytes)
    frame = HEADER.pack(OP_PING, len(payload)) + payload
    rtts: list[float] = []
    for _ in range(budget.pings):
        t0 = time.perf_counter()
        sock.sendall(frame)
        reply = _recv_exact(sock, len(frame))
        rtts.append((time.perf_counter() - t0) * 1e6)
        if bytes(reply[:1]) != OP_PING:
            raise LinkProbeError(f"server answered a ping with op {bytes(reply[:1])!r}")
    return rtts


def _stream(sock: socket.socket, budget: LinkBudget) -> tuple[int, int, float]:
    payload = memoryview(bytearray(b"\xa5" * budget.frame_bytes))
    header = HEADER.pack(OP_DATA, budget.frame_bytes)
    sent = frames = 0
    t0 = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t0
        if frames >= budget.min_frames and (
            sent + budget.frame_bytes > budget.max_bytes or elapsed >= budget.max_seconds
        ):
            break
        sock.sendall(header)
        sock.sendall(payload)
        op, n = HEADER.unpack(_recv_exact(sock, HEADER.size))
        if op != OP_ACK or n != budget.frame_bytes:
            raise LinkProbeError(f"bad acknowledgement {op!r} for {n} bytes (sent {budget.frame_bytes})")
        sent += n
        frames += 1
    return sent, frames, time.perf_counter() - t0


# --- which pairs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkNode:
    """A node as pair selection sees it."""

    name: str
    gpu_class: str
    """Compute class (``high``, ``mid``, ``low``) or GPU model: nodes of one class are interchangeable."""
    score: float = 0.0
    """Compute score, for "nearest" among nodes of one zone."""
    zone: str = ""
    """Topology domain (``topology.kubernetes.io/zone`` or a rack label); empty when unknown."""


Pair = tuple[str, str]


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a < b else (b, a)


def pairs_to_measure(nodes: Sequence[LinkNode], nearest: int = 1) -> list[Pair]:
    """The node pairs to measure (rule in the module docstring), sorted, each as ``(a, b)`` with a < b.

    Raises:
        ValueError: duplicate node names, or ``nearest`` < 0.
    """
    if nearest < 0:
        raise ValueError(f"nearest must be >= 0, got {nearest}")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        dup = sorted({x for x in names if names.count(x) > 1})
        raise ValueError(f"duplicate node names: {dup}")
    groups: dict[tuple[str, str], list[LinkNode]] = {}
    for n in sorted(nodes, key=lambda n: n.name):
        groups.setdefault((n.gpu_class, n.zone), []).append(n)
    keys = sorted(groups)
    pairs: set[Pair] = set()
    for i, ka in enumerate(keys):
        ga = groups[ka]
        if len(ga) >= 2:
            pairs.add(_pair(ga[0].name, ga[1].name))
        for kb in keys[i + 1 :]:
            # Representatives rotate through each group so one node does not carry every class pair.
            gb = groups[kb]
            j = keys.index(kb)
            pairs.add(_pair(ga[j % len(ga)].name, gb[i % len(gb)].name))
    order = {name: i for i, name in enumerate(sorted(names))}
    for n in nodes:
        # Ties go to the next node after n in name order (a ring), not to the first name: otherwise
        # every node of a group would pick the same peer and that node would be in every round.
        others = heapq.nsmallest(
            nearest,
            (m for m in nodes if m.name != n.name),
            key=lambda m: (
                m.zone != n.zone,
                abs(m.score - n.score),
                (order[m.name] - order[n.name]) % len(names),
            ),
        )
        for m in others:
            pairs.add(_pair(n.name, m.name))
    return sorted(pairs)


def schedule_rounds(pairs: Iterable[Pair]) -> list[list[Pair]]:
    """Greedy rounds of pairs in which no node appears twice (so no NIC is shared within a round)."""
    rounds: list[tuple[list[Pair], set[str]]] = []
    for a, b in pairs:
        for members, busy in rounds:
            if a not in busy and b not in busy:
                members.append((a, b))
                busy.update((a, b))
                break
        else:
            rounds.append(([(a, b)], {a, b}))
    return [members for members, _ in rounds]


def link_between(
    a: str, b: str, nodes: Sequence[LinkNode], measured: dict[Pair, dict[str, Any]]
) -> dict[str, Any] | None:
    """The link document for ``a ↔ b``: measured directly, else a measured pair of the same groups.

    ``measured`` maps :func:`pairs_to_measure`'s pairs to link documents. Returns None when neither
    exists (a group combination not measured yet).
    """
    direct = measured.get(_pair(a, b))
    if direct is not None:
        return direct
    key = {n.name: (n.gpu_class, n.zone) for n in nodes}
    if a not in key or b not in key:
        return None
    want = sorted([key[a], key[b]])
    for (x, y), doc in sorted(measured.items()):
        if x in key and y in key and sorted([key[x], key[y]]) == want:
            return doc
    return None

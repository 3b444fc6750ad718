"""End-to-end prepare benchmark: the whole agent process as the kubelet sees it, all in one run.

Starts the API emulator (``python -m agent.emulator``) and ``dra-agent run --kube kubeconfig``
(fake backend, ``nvidia-a100-8x``) as real processes, creates ResourceClaims over HTTP on
loopback as the scheduler would, and drives the agent's DRA socket with the official grpcio
client (the kubelet is grpc-go; grpcio is the same C core family). Measured in the same run:

- the empty ``NodePrepareResources`` round trip (no claims: gRPC + event loop only), the
  reference the prepare targets are ratios of;
- prepare of a 1-device claim (claim GET, backend, CDI spec on a tmpfs as ``/var/run/cdi`` is,
  checkpoint on the disk with fsync) p50/p99,
  unprepare p50/p99;
- 100 concurrent 1-claim prepares, then their 100 concurrent 1-claim unprepares: wall time, each
  call's own answer time from its send (p50, p90, max; p50 / wall near 1 means the answers all
  arrive together at the end), errors, and the most TCP connections from the agent to the API
  server seen at once (sampled from /proc every millisecond); the same bursts again written at
  once on one HTTP/2 connection (`RawBurst`, "raw burst"), whose answer times are the agent's
  alone (the grpcio client runs its callbacks late: even empty calls seem to arrive together);
- RSS idle (after start-up settled) and after 1,000 prepares and the burst;
- process start to registration socket, and after ``kill -9`` of the agent, the time from the
  restart to the answer of the kubelet's next prepare of an already prepared claim.

The agent runs from compiled bytecode, as pip installs it in the image (`compile_agent`).
The floors of a prepare and an unprepare (the kubelet's empty round trip, a claim GET, an
fsync'd checkpoint append, a worker-thread hop, the fake backend's device file) are measured in
the same run and printed with what the agent adds above them. The burst's connections are
counted during a third burst: sampling /proc every millisecond slows the client and the agent on
this 2-core machine.

Run: ``python -m benchmarks.kubelet_e2e_bench`` (``--quick``: 200 prepares instead of 1,000;
``--pod-uid UID``: as the chart runs it, with the file lock of rolling updates;
``--no-device-files``: the fake backend without its per-claim device files, as the hardware
backends and the fake backend when issue 14 was filed).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import grpc
import h2.config
import h2.connection
import h2.events
import yaml

from agent.core.atomicfile import write_atomic
from backends.fake.devicefile import write_device_file
from benchmarks import prepare_timeline
from tests.kubelet.grpc_support import GrpcioProtos, generate_grpcio_protos

NODE = "bench-node"
NAMESPACE = "default"
DRIVER = "gpu.nvidia.com"
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
BURST = 100
# As on a node: the checkpoint on a disk (fsync costs), the CDI root (/var/run/cdi) on a tmpfs.
CDI_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"

# Targets of issue 14, as (figure name, limit, unit); ratios are to the empty round trip p50.
TARGETS = {
    "prepare p50 / empty p50": 3.0,
    "prepare p99 / empty p99": 6.0,
    "unprepare p50 / empty p50": 2.0,
    "burst wall (ms)": 150.0,
    "burst errors": 0.0,
    "burst TCP connections to the API server (max)": 4.0,
    "RSS idle (MiB)": 60.0,
    "RSS after prepares + burst (MiB)": 64.0,
    "start to registration socket (ms)": 400.0,
    "kill -9, restart to next prepare answered (ms)": 500.0,
}


class Api:
    """A keep-alive HTTP client of the emulator for the scheduler's part (creating claims)."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=10)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        payload = json.dumps(body).encode() if body is not None else None
        self.connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        data = json.loads(response.read() or b"{}")
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: {response.status} {data}")
        return data

    def allocated_claim(self, name: str, device: str) -> dict[str, str]:
        """Create a claim allocated to `device` of our node; returns the kubelet's claim reference."""
        spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
        created = self.call("POST", CLAIMS, {"metadata": {"name": name}, "spec": spec})
        result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
        created["status"] = {"allocation": {"devices": {"results": [result]}}}
        self.call("PUT", f"{CLAIMS}/{name}/status", created)
        return {"namespace": NAMESPACE, "name": name, "uid": created["metadata"]["uid"]}

    def devices(self) -> list[str]:
        """Our node's published devices (waits until the agent has published)."""
        while True:
            data = self.call("GET", "/apis/resource.k8s.io/v1/resourceslices")
            names = [
                d["name"]
                for s in data["items"]
                if s["spec"]["driver"] == DRIVER
                for d in s["spec"]["devices"]
            ]
            if names:
                return names
            time.sleep(0.05)


class Kubelet:
    """The kubelet's side of the DRA socket: grpcio v1 calls."""

    def __init__(self, protos: GrpcioProtos, socket: Path) -> None:
        self.pb = protos.v1
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        serialize: Callable[[Any], bytes] = lambda m: m.SerializeToString()  # noqa: E731
        self.prepare_call = self.channel.unary_unary(
            PREPARE,
            request_serializer=serialize,
            response_deserializer=self.pb.NodePrepareResourcesResponse.FromString,
        )
        self.unprepare_call = self.channel.unary_unary(
            UNPREPARE,
            request_serializer=serialize,
            response_deserializer=self.pb.NodeUnprepareResourcesResponse.FromString,
        )

    def _claims(self, claims: Sequence[Mapping[str, str]]) -> list[Any]:
        return [self.pb.Claim(**c) for c in claims]

    def prepare(self, claims: Sequence[Mapping[str, str]], timeout: float = 10.0) -> Any:
        return self.prepare_call(
            self.pb.NodePrepareResourcesRequest(claims=self._claims(claims)), timeout=timeout
        )

    def prepare_request(self, claims: Sequence[Mapping[str, str]]) -> bytes:
        return bytes(self.pb.NodePrepareResourcesRequest(claims=self._claims(claims)).SerializeToString())

    def unprepare_request(self, claims: Sequence[Mapping[str, str]]) -> bytes:
        return bytes(self.pb.NodeUnprepareResourcesRequest(claims=self._claims(claims)).SerializeToString())

    def prepare_future(self, claims: Sequence[Mapping[str, str]]) -> Any:
        request = self.pb.NodePrepareResourcesRequest(claims=self._claims(claims))
        return self.prepare_call.future(request, timeout=30)

    def unprepare(self, claims: Sequence[Mapping[str, str]]) -> Any:
        return self.unprepare_call(
            self.pb.NodeUnprepareResourcesRequest(claims=self._claims(claims)), timeout=10
        )

    def unprepare_future(self, claims: Sequence[Mapping[str, str]]) -> Any:
        request = self.pb.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        return self.unprepare_call.future(request, timeout=30)

    def close(self) -> None:
        self.channel.close()


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) / 1024
    raise RuntimeError(f"{key} not in /proc/{pid}/status")


def cpu_ms(pid: int) -> float:
    """CPU time (user + system, all threads) the process used so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def api_connections(pid: int, port: int) -> int:
    """TCP connections of process `pid` to local port `port` (from /proc/<pid>/fd and /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            # state 01 = ESTABLISHED
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


@contextmanager
def sampling(read: Callable[[], int], *, enabled: bool = True) -> Iterator[list[int]]:
    """Sample `read()` every millisecond in a thread while the block runs; yields the samples."""
    samples: list[int] = []
    if not enabled:
        yield samples
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with suppress(OSError):
                samples.append(read())
            time.sleep(0.001)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


class Burst:
    """Calls sent at once, each one's answer time taken when its own answer arrives.

    `latencies`: each call's time from its own send to its answer; `arrivals`: from the first
    send to each answer. Answers that all arrive together at the end show as p50 close to `wall`.
    """

    def __init__(self, send: Callable[[Mapping[str, str]], Any], claims: Sequence[Mapping[str, str]]) -> None:
        count = len(claims)
        sent = [0.0] * count
        answered = [0.0] * count
        remaining = [count]
        lock = threading.Lock()
        all_answered = threading.Event()

        def on_done(index: int) -> None:
            answered[index] = time.perf_counter()
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    all_answered.set()

        self.start = time.perf_counter()
        futures = []
        for index, claim in enumerate(claims):
            sent[index] = time.perf_counter()
            future = send(claim)
            # Run by grpcio's thread when the answer arrives (at once if it already has).
            future.add_done_callback(lambda _f, i=index: on_done(i))
            futures.append(future)
        self.answers = [f.result() for f in futures]
        self.wall = time.perf_counter() - self.start
        all_answered.wait(timeout=30)
        self.latencies = [a - s for a, s in zip(answered, sent, strict=True)]
        self.arrivals = [a - self.start for a in answered]

    def figures(self, name: str) -> dict[str, float]:
        return {
            f"{name} wall (ms)": self.wall * 1000,
            f"{name} per call p50 (ms)": pct(self.latencies, 0.5),
            f"{name} per call p90 (ms)": pct(self.latencies, 0.9),
            f"{name} per call max (ms)": max(self.latencies) * 1000,
            f"{name} per call p50 / wall": pct(self.latencies, 0.5) / (self.wall * 1000),
        }


class RawBurst:
    """A burst written at once on one HTTP/2 connection, each answer timed as its stream ends.

    The grpcio client sends its calls one by one from Python and runs their callbacks only when
    its main thread lets them: even calls without claims (which the agent answers in well under
    a millisecond each) then seem to be answered together at the end. Here every request of the
    burst leaves in one write, as a kubelet's pod workers would send them, and a single thread
    reads the answers as they come, so the times are the agent's.
    """

    def __init__(self, path: Path, method: str, requests: Sequence[bytes]) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)  # an agent that never answers fails the benchmark, not hangs it
            sock.connect(str(path))
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.increment_flow_control_window(1 << 24)
            sock.sendall(conn.data_to_send())
            headers = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
            streams: dict[int, int] = {}
            for index, request in enumerate(requests):
                stream = conn.get_next_available_stream_id()
                streams[stream] = index
                conn.send_headers(stream, headers)
                conn.send_data(stream, struct.pack(">BI", 0, len(request)) + request, end_stream=True)
            bodies: dict[int, bytearray] = {stream: bytearray() for stream in streams}
            answered = [0.0] * len(requests)
            self.statuses = [""] * len(requests)
            left = len(requests)
            self.start = time.perf_counter()
            sock.sendall(conn.data_to_send())
            while left:
                data = sock.recv(1 << 16)
                now = time.perf_counter()
                if not data:
                    raise RuntimeError("the agent closed the connection during a burst")
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] += event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                        status = dict(event.headers).get(b"grpc-status")
                        if status is not None:
                            index = streams[event.stream_id]
                            self.statuses[index] = status.decode()
                            answered[index] = now
                            left -= 1
                sock.sendall(conn.data_to_send())
        self.wall = max(answered) - self.start
        self.latencies = [a - self.start for a in answered]
        self.replies = [bytes(bodies[stream][5:]) for stream in streams]

    def figures(self, name: str) -> dict[str, float]:
        return {
            f"{name} wall (ms)": self.wall * 1000,
            f"{name} per call p50 (ms)": pct(self.latencies, 0.5),
            f"{name} per call p90 (ms)": pct(self.latencies, 0.9),
            f"{name} per call p50 / wall": pct(self.latencies, 0.5) / (self.wall * 1000),
        }


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def get_all(url: str, claims: Sequence[Mapping[str, str]], in_flight: int) -> float:
    """Seconds to GET every claim with `in_flight` keep-alive connections (the emulator's part of a burst)."""
    clients = [Api(url) for _ in range(in_flight)]
    for client in clients:  # connect before the clock starts
        client.call("GET", f"{CLAIMS}/{claims[0]['name']}")
    todo = list(claims)
    lock = threading.Lock()

    def worker(client: Api) -> None:
        while True:
            with lock:
                if not todo:
                    return
                claim = todo.pop()
            client.call("GET", f"{CLAIMS}/{claim['name']}")

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.perf_counter() - start
    for client in clients:
        client.connection.close()
    return took


def claim_get_round_trips(url: str, claim: Mapping[str, str], count: int, pause: float = 0.0) -> list[float]:
    """One claim GET after another on one keep-alive connection: the emulator's part of a prepare.

    `pause` seconds between them: the API server then waits idle between requests, as between
    the prepares of the sequence (an idle process answers later: it is woken, its caches are cold).
    """
    client = Api(url)
    path = f"{CLAIMS}/{claim['name']}"
    client.call("GET", path)
    took = [paced(lambda: client.call("GET", path), pause) for _ in range(count)]
    client.connection.close()
    return took


def durable_appends(directory: Path, count: int, pause: float = 0.0) -> list[float]:
    """The agent's durable checkpoint write since the journal: one record appended and fsynced, in
    the checkpoint's directory (a 1-claim record's size): the disk's part of a prepare."""
    target = directory / "floor-probe.journal"
    record = json.dumps({"entry": {"devices": [{"device": "gpu-0"}] * 4}, "uid": "x" * 36}).encode() + b"\n"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def append() -> None:
        os.write(fd, record)
        os.fsync(fd)

    try:
        took = [paced(append, pause) for _ in range(count)]
    finally:
        os.close(fd)
        target.unlink()
    return took


def durable_replacements(directory: Path, count: int) -> list[float]:
    """The durable write before the journal (temp file, fsync, rename, fsync of the directory) of a
    1-claim checkpoint's size: what a compaction costs, and every change cost until the fifth pass."""
    target = directory / "floor-probe.json"
    data = json.dumps({"entries": {"x" * 36: {"devices": [{"device": "gpu-0"}] * 4}}}).encode() * 2
    took = [timed(lambda: write_atomic(target, data))[0] for _ in range(count)]
    target.unlink()
    return took


def device_file_writes(directory: Path, count: int, pause: float = 0.0) -> tuple[list[float], list[float]]:
    """The fake backend's device file as it writes and removes one per claim (`backends.fake.devicefile`),
    in the directory it uses by default (``<state dir>/fake-devices``): (writes, removals)."""
    folder = directory / "fake-devices-probe"
    folder.mkdir()
    document = {"device": "gpu-0", "attributes": {f"a{i}": "x" * 16 for i in range(16)}}
    writes, removals = [], []
    try:
        for i in range(count):
            path = folder / f"{i:036d}-gpu-0.json"
            writes.append(paced(lambda p=path: write_device_file(p, document), pause))  # type: ignore[misc]
            removals.append(paced(path.unlink, pause))
    finally:
        folder.rmdir()
    return writes, removals


def thread_hops(count: int, pause: float = 0.0) -> list[float]:
    """An `anyio.to_thread.run_sync` of a no-op: what each blocking file step costs the event loop."""

    async def measure() -> list[float]:
        hops = []
        for _ in range(count):
            start = time.perf_counter()
            await anyio.to_thread.run_sync(int)
            hops.append(time.perf_counter() - start)
            if pause:
                await anyio.sleep(pause)
        return hops

    return anyio.run(measure)


def paced(call: Callable[[], Any], pause: float) -> float:
    """`call`'s time, then `pause` seconds idle (none: back to back)."""
    took = timed(call)[0]
    if pause:
        time.sleep(pause)
    return took


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    answer = call()
    return time.perf_counter() - start, answer


def paced_floors(
    figures: Mapping[str, float],
    kubelet: Kubelet,
    *,
    url: str,
    claim: Mapping[str, str],
    state: Path,
    device_files: bool,
) -> dict[str, float]:
    """The floors again, each probe as far apart as the sequence's calls (one prepare and one
    unprepare): the kubelet's client, the agent, the API server, the worker thread and the disk
    are then idle between them, as they are around a prepare; back to back they answer faster
    than a prepare ever sees (the empty round trip of the targets is measured back to back)."""
    pause = (figures["prepare p50 (ms)"] + figures["unprepare p50 (ms)"]) / 1000
    paced_empty = pct([paced(lambda: kubelet.prepare([]), pause) for _ in range(200)], 0.5)
    paced_get = pct(claim_get_round_trips(url, claim, 200, pause), 0.5)
    paced_append = pct(durable_appends(state, 200, pause), 0.5)
    paced_hop = pct(thread_hops(200, pause), 0.5)
    write = removal = 0.0
    if device_files:
        writes, removals = device_file_writes(state, 200, pause)
        write, removal = pct(writes, 0.5), pct(removals, 0.5)
    empty = figures["empty round trip p50 (ms)"]
    prepare_floor = paced_empty + paced_get + paced_append + paced_hop + write
    unprepare_floor = paced_empty + paced_append + paced_hop + removal
    return {
        "paced: empty round trip p50 (ms)": paced_empty,
        "paced: claim GET round trip p50 (ms)": paced_get,
        "paced: durable checkpoint append p50 (ms)": paced_append,
        "paced: thread hop p50 (ms)": paced_hop,
        "paced: fake device file write p50 (ms)": write,
        "paced: prepare floor (ms)": prepare_floor,
        "paced: prepare floor / empty p50": prepare_floor / empty,
        "paced: prepare p50 above its floor (ms)": figures["prepare p50 (ms)"] - prepare_floor,
        "paced: unprepare floor (ms)": unprepare_floor,
        "paced: unprepare floor / empty p50": unprepare_floor / empty,
        "paced: unprepare p50 above its floor (ms)": figures["unprepare p50 (ms)"] - unprepare_floor,
    }


def deployed_env(timeline: Path | None = None) -> dict[str, str]:
    """The agent's environment as in its image: modules run from compiled bytecode.

    pip compiles every module when it installs the image's wheels; a source checkout with
    ``PYTHONDONTWRITEBYTECODE=1`` (as this machine sets it) would compile the agent's ~130 modules
    at every start instead (~95 ms here). `compile_agent` compiles them beforehand, as pip does.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if timeline is not None:
        env["DRA_BENCH_TIMELINE"] = str(timeline)
    return env


def compile_agent() -> None:
    """Compile the agent's modules into their ``__pycache__`` (pip's install-time step; git ignores it)."""
    source = Path(__file__).resolve().parents[1]
    folders = [str(source / "agent"), str(source / "backends")]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *folders],
        env=deployed_env(),
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _settled(read: Callable[[], float], quiet: float = 1.0, limit: float = 30.0) -> float:
    """`read()` once it has not changed for `quiet` seconds (or after `limit`)."""
    value, since, start = read(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() - start < limit:
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


class AgentProcess:
    """``dra-agent run`` against the emulator, its sockets under `root`."""

    def __init__(
        self,
        root: Path,
        cdi_root: Path,
        state_dir: Path,
        kubeconfig: Path,
        pod_uid: str = "",
        *,
        backend: str = "fake:profile=nvidia-a100-8x,control=off",
        timeline: Path | None = None,
    ) -> None:
        self.root = root
        self.timeline = timeline
        with socket.socket() as probe:  # a free port, so the bench can read the agent's /metrics
            probe.bind(("127.0.0.1", 0))
            self.metrics_port = probe.getsockname()[1]
        # With a timeline, the agent runs through `benchmarks.prepare_timeline` (its marks).
        module = "benchmarks.prepare_timeline" if timeline is not None else "agent.cli"
        self.args = [
            sys.executable, "-m", module, "run", "--node-name", NODE,
            "--kube", "kubeconfig", "--kubeconfig", str(kubeconfig),
            "--backend", backend,
            "--registry-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins"),
            "--cdi-root", str(cdi_root), "--state-dir", str(state_dir),
            "--metrics-address", f"127.0.0.1:{self.metrics_port}", "--log-level", "info",
        ]  # fmt: skip
        self.registration = root / "registry" / f"{DRIVER}-reg.sock"
        self.dra_socket = root / "plugins" / DRIVER / "dra.sock"
        if pod_uid:  # as the chart runs it: per-pod socket names and the rolling-update file lock
            self.args += ["--pod-uid", pod_uid]
            self.registration = root / "registry" / f"{DRIVER}-{pod_uid}-reg.sock"
            self.dra_socket = root / "plugins" / DRIVER / f"dra-{pod_uid}.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> float:
        """Start the process; seconds until the registration socket exists."""
        self.registration.unlink(missing_ok=True)
        self.started_at = start = time.perf_counter()
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.DEVNULL,
            stderr=self.root.joinpath("agent.log").open("ab"),
            env=deployed_env(self.timeline),
        )
        while not self.registration.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: see {self.root / 'agent.log'}")
            time.sleep(0.001)
        return time.perf_counter() - start

    def status_writes(self) -> float:
        """``dra_agent_claim_status_writes_total`` of every result, from the agent's /metrics."""
        connection = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            connection.request("GET", "/metrics")
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("dra_agent_claim_status_writes_total{")
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get_info(protos: GrpcioProtos, agent: AgentProcess) -> float:
    """GetInfo on the registration socket, as the kubelet calls it on seeing the socket; when it answered."""
    with grpc.insecure_channel(f"unix://{agent.registration}") as channel:
        call = channel.unary_unary(
            "/pluginregistration.Registration/GetInfo",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=protos.registration.PluginInfo.FromString,
        )
        call(protos.registration.InfoRequest(), timeout=5)
    return time.perf_counter()


@contextmanager
def profiled(output: str, phase: str, pid: int) -> Iterator[None]:
    """``py-spy record`` (from PATH) of the agent during one phase, into ``OUTPUT.PHASE.txt``."""
    if not output:
        yield
        return
    target = f"{output}.{phase}.txt"
    command = ["py-spy", "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "--output", target]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # py-spy attaches
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=60)


def run(
    prepares: int,
    settle: float,
    py_spy: str = "",
    state_parent: str = "/tmp",
    pod_uid: str = "",
    *,
    start_only: bool = False,
    device_files: bool = True,
    timeline: bool = False,
    held: int = 0,
) -> dict[str, float]:
    figures: dict[str, float] = {}
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dra-e2e-", dir="/tmp")))
        (root / "pb2").mkdir()
        compile_agent()
        protos = generate_grpcio_protos(root / "pb2")
        kubeconfig = root / "kubeconfig"
        emulator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent.emulator",
                "--port",
                "0",
                "--node",
                NODE,
                "--kubeconfig",
                str(kubeconfig),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        cdi = stack.enter_context(tempfile.TemporaryDirectory(prefix="dra-e2e-cdi-", dir=CDI_PARENT))
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="dra-e2e-state-", dir=state_parent))
        backend = "fake:profile=nvidia-a100-8x,control=off" + ("" if device_files else ",device_files=off")
        marks = root / "timeline.json" if timeline else None
        agent = AgentProcess(
            root, Path(cdi), Path(state), kubeconfig, pod_uid, backend=backend, timeline=marks
        )
        try:
            assert emulator.stdout is not None
            emulator.stdout.readline()
            url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
            port = int(url.rsplit(":", 1)[1])
            api = Api(url)
            figures["start to registration socket (ms)"] = agent.start() * 1000
            figures["start to GetInfo answered (ms)"] = (get_info(protos, agent) - agent.started_at) * 1000
            devices = api.devices()
            if start_only:
                kubelet = Kubelet(protos, agent.dra_socket)
                figures["kill -9, restart to next prepare answered (ms)"] = kill_and_restart(
                    api, protos, agent, kubelet, devices
                )
                return figures
            time.sleep(settle)
            figures["RSS idle (MiB)"] = rss_mib(agent.pid)
            kubelet = Kubelet(protos, agent.dra_socket)

            before_empty = cpu_ms(agent.pid)
            empty = [timed(lambda: kubelet.prepare([]))[0] for _ in range(prepares)]
            empty_cpu = cpu_ms(agent.pid) - before_empty
            # --held: claims kept prepared during the sequence (on the other devices, so that the
            # sequence's claims stay exclusive): what a call costs on a node with many claims.
            sequence_devices = devices[:1] if held else devices
            for i in range(held):
                kept = api.allocated_claim(f"held-{i}", devices[1 + i % (len(devices) - 1)])
                assert not kubelet.prepare([kept]).claims[kept["uid"]].error
            claims = [
                api.allocated_claim(f"seq-{i}", sequence_devices[i % len(sequence_devices)])
                for i in range(prepares)
            ]
            prepare, unprepare = [], []
            writes_before = agent.status_writes()
            with profiled(py_spy, "sequential", agent.pid):
                before_pairs = cpu_ms(agent.pid)
                for claim in claims:
                    took, answer = timed(lambda c=claim: kubelet.prepare([c]))  # type: ignore[misc]
                    assert not answer.claims[claim["uid"]].error, answer
                    prepare.append(took)
                    unprepare.append(timed(lambda c=claim: kubelet.unprepare([c]))[0])  # type: ignore[misc]
                pairs_cpu = cpu_ms(agent.pid) - before_pairs
            if marks is not None:  # now, before the bursts and the restart add their own calls
                print(prepare_timeline.format_table(marks), end="\n\n")
            # What the agent's threads spent on the CPU per call (the rest of a call's time is
            # waiting: the disk, the API server, the kubelet, the other threads and processes).
            figures["agent CPU per empty call (ms)"] = empty_cpu / prepares
            figures["agent CPU per prepare + unprepare (ms)"] = pairs_cpu / prepares
            # The claim status writer runs after the answers: wait for it to be done, then count.
            paired = _settled(agent.status_writes) - writes_before
            # A prepare's write and its unprepare's coalesce when the unprepare comes first.
            figures["claim status writes per prepare + unprepare (sequential)"] = paired / prepares
            figures["empty round trip p50 (ms)"] = pct(empty, 0.5)
            figures["empty round trip p99 (ms)"] = pct(empty, 0.99)
            figures["prepare p50 (ms)"] = pct(prepare, 0.5)
            figures["prepare p99 (ms)"] = pct(prepare, 0.99)
            figures["unprepare p50 (ms)"] = pct(unprepare, 0.5)
            figures["unprepare p99 (ms)"] = pct(unprepare, 0.99)
            figures["prepare p50 / empty p50"] = (
                figures["prepare p50 (ms)"] / figures["empty round trip p50 (ms)"]
            )
            figures["prepare p99 / empty p99"] = (
                figures["prepare p99 (ms)"] / figures["empty round trip p99 (ms)"]
            )
            figures["unprepare p50 / empty p50"] = (
                figures["unprepare p50 (ms)"] / figures["empty round trip p50 (ms)"]
            )

            # The floors of one prepare and unprepare, measured here in the same run: what the
            # kubelet's round trip, the API server, the disk and Python's thread hand-off cost
            # before the agent does anything of its own (see benchmarks/README.md).
            floors = {
                "claim GET round trip p50 (ms)": pct(claim_get_round_trips(url, claims[0], 200), 0.5),
                "durable checkpoint append p50 (ms)": pct(durable_appends(Path(state), 200), 0.5),
                "durable file replacement p50 (ms)": pct(durable_replacements(Path(state), 200), 0.5),
                "thread hop p50 (ms)": pct(thread_hops(500), 0.5),
            }
            if device_files:
                writes, removals = device_file_writes(Path(state), 200)
                floors["fake device file write p50 (ms)"] = pct(writes, 0.5)
                floors["fake device file removal p50 (ms)"] = pct(removals, 0.5)
            figures.update(floors)
            empty_p50 = figures["empty round trip p50 (ms)"]
            hop = floors["thread hop p50 (ms)"]
            # The fake backend plans its prepare (`agent.core.backend.PlansPrepare`): a prepare is
            # the claim GET and one hop (PrepareStarted appended, the device file, the CDI spec,
            # PrepareCompleted appended and fsynced); an unprepare one hop (the device file
            # removed, the entry's removal appended and fsynced, the spec removed). The device
            # file is the fake backend's own work, measured apart (`device_file_writes`).
            durable = floors["durable checkpoint append p50 (ms)"]
            backend_write = floors.get("fake device file write p50 (ms)", 0.0)
            backend_removal = floors.get("fake device file removal p50 (ms)", 0.0)
            prepare_floor = (
                empty_p50 + floors["claim GET round trip p50 (ms)"] + durable + hop + backend_write
            )
            unprepare_floor = empty_p50 + durable + hop + backend_removal
            figures["prepare floor (ms)"] = prepare_floor
            figures["prepare p50 above its floor (ms)"] = figures["prepare p50 (ms)"] - prepare_floor
            figures["unprepare floor (ms)"] = unprepare_floor
            figures["unprepare p50 above its floor (ms)"] = figures["unprepare p50 (ms)"] - unprepare_floor
            figures.update(
                paced_floors(
                    figures, kubelet, url=url, claim=claims[0], state=Path(state), device_files=device_files
                )
            )

            figures["RSS after the prepares (MiB)"] = rss_mib(agent.pid)
            # Rounds 1 and 2 are timed (a second shows whether memory grows per burst); round 3
            # counts the connections: sampling /proc every millisecond takes CPU from the client
            # and the agent on this 2-core machine, so its wall time is shown apart.
            status_writes = 0.0
            for round_ in (1, 2, 3):
                if round_ == 3:
                    status_writes = _settled(agent.status_writes)
                burst = [
                    api.allocated_claim(f"burst{round_}-{i}", devices[i % len(devices)]) for i in range(BURST)
                ]
                with (
                    profiled(py_spy if round_ == 1 else "", "burst", agent.pid),
                    sampling(lambda: api_connections(agent.pid, port), enabled=round_ == 3) as connections,
                ):
                    calls = Burst(lambda c: kubelet.prepare_future([c]), burst)
                wall = calls.wall
                answers = calls.answers
                errors = sum(1 for a, c in zip(answers, burst, strict=True) if a.claims[c["uid"]].error)
                if round_ == 3:  # (its wall time is not a figure: a pause here changes none)
                    writes_before = status_writes
                    status_writes = _settled(agent.status_writes)
                    figures["claim status writes per prepare (burst)"] = (
                        status_writes - writes_before
                    ) / BURST
                # As the kubelet unprepares them: one call per pod, all at once.
                unprepares = Burst(lambda c: kubelet.unprepare_future([c]), burst)
                errors += sum(
                    1 for a, c in zip(unprepares.answers, burst, strict=True) if a.claims[c["uid"]].error
                )
                time.sleep(settle)
                if round_ == 1:
                    figures.update(calls.figures("burst"))
                    figures.update(unprepares.figures("burst of unprepares"))
                    figures["burst errors"] = errors
                    figures["RSS after prepares + burst (MiB)"] = rss_mib(agent.pid)
                elif round_ == 2:
                    figures.update(calls.figures("second burst"))
                    figures.update(unprepares.figures("second burst of unprepares"))
                    figures["RSS after a second burst (MiB)"] = rss_mib(agent.pid)
                else:
                    removed = _settled(agent.status_writes) - status_writes
                    figures["claim status writes per unprepare (burst)"] = removed / BURST
                    figures["burst TCP connections to the API server (max)"] = max(connections, default=0)
                    figures["burst errors"] += errors
                    figures["third burst wall, sampling /proc every ms (ms)"] = wall * 1000
            # The same bursts written at once on one connection, each answer timed as it comes
            # (`RawBurst`): the agent's own answer times, without the grpcio client's.
            for round_ in (1, 2):
                burst = [
                    api.allocated_claim(f"raw{round_}-{i}", devices[i % len(devices)]) for i in range(BURST)
                ]
                raw_prepares = RawBurst(
                    agent.dra_socket, PREPARE, [kubelet.prepare_request([c]) for c in burst]
                )
                raw_unprepares = RawBurst(
                    agent.dra_socket, UNPREPARE, [kubelet.unprepare_request([c]) for c in burst]
                )
                errors = sum(
                    1
                    for c, status, reply in zip(
                        burst, raw_prepares.statuses, raw_prepares.replies, strict=True
                    )
                    if status != "0"
                    or kubelet.pb.NodePrepareResourcesResponse.FromString(reply).claims[c["uid"]].error
                )
                errors += sum(
                    1
                    for c, status, reply in zip(
                        burst, raw_unprepares.statuses, raw_unprepares.replies, strict=True
                    )
                    if status != "0"
                    or kubelet.pb.NodeUnprepareResourcesResponse.FromString(reply).claims[c["uid"]].error
                )
                figures["burst errors"] += errors
                time.sleep(settle)
                if round_ == 2:  # the first warms the path up
                    figures.update(raw_prepares.figures("raw burst"))
                    figures.update(raw_unprepares.figures("raw burst of unprepares"))
            raw_empties = RawBurst(agent.dra_socket, PREPARE, [b""] * BURST)
            figures.update(raw_empties.figures("raw burst of empty calls"))
            figures["peak RSS (MiB)"] = rss_mib(agent.pid, "VmHWM")

            # The floors of the burst: the same 100 calls without claims (gRPC only), and the 100
            # claim GETs alone against the emulator with as many in flight as the agent allows.
            empties = Burst(lambda _c: kubelet.prepare_future([]), [{} for _ in range(BURST)])
            figures["burst of 100 empty calls wall (ms)"] = empties.wall * 1000
            figures["burst of 100 empty calls per call p50 (ms)"] = pct(empties.latencies, 0.5)
            figures["100 claim GETs, 3 in flight, wall (ms)"] = get_all(url, burst, 3) * 1000

            figures["kill -9, restart to next prepare answered (ms)"] = kill_and_restart(
                api, protos, agent, kubelet, devices
            )
        finally:
            agent.stop()
            emulator.send_signal(signal.SIGINT)
            emulator.wait(timeout=30)
    return figures


def kill_and_restart(
    api: Api, protos: GrpcioProtos, agent: AgentProcess, kubelet: Kubelet, devices: Sequence[str]
) -> float:
    """kill -9 with a prepared claim; ms from the restart until the kubelet's retried prepare is answered."""
    kept = api.allocated_claim("kept", devices[0])
    assert not kubelet.prepare([kept]).claims[kept["uid"]].error
    kubelet.close()
    agent.kill()
    restarted = time.perf_counter()
    agent.start()
    kubelet = Kubelet(protos, agent.dra_socket)
    failed = []
    while True:
        try:
            answer = kubelet.prepare([kept], timeout=1.0)
            break
        except grpc.RpcError as error:
            failed.append(f"{(time.perf_counter() - restarted) * 1000:.0f} ms: {error.code()}")
            time.sleep(0.002)
    took = (time.perf_counter() - restarted) * 1000
    if failed:
        print(f"kill -9: prepare attempts that failed before the answer: {failed}", file=sys.stderr)
    assert not answer.claims[kept["uid"]].error, answer
    kubelet.close()
    return took


def main(
    prepares: int,
    settle: float,
    py_spy: str,
    state_parent: str,
    pod_uid: str,
    *,
    start_only: bool = False,
    device_files: bool = True,
    timeline: bool = False,
    held: int = 0,
) -> None:
    figures = run(
        prepares,
        settle,
        py_spy,
        state_parent,
        pod_uid,
        start_only=start_only,
        device_files=device_files,
        timeline=timeline,
        held=held,
    )
    width = max(len(k) for k in figures)
    print(f"{'measure'.ljust(width)}  {'value':>9}  target")
    for name, value in figures.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else f"<= {target:g}  {'met' if value <= target else 'NOT met'}"
        print(f"{name.ljust(width)}  {value:9.2f}  {verdict}")
    print(
        f"({prepares} sequential prepares + unprepares, {BURST} concurrent 1-claim prepares, grpcio client)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="end-to-end kubelet prepare benchmark")
    parser.add_argument("--quick", action="store_true", help="200 prepares instead of 1,000")
    parser.add_argument(
        "--settle", type=float, default=2.0, help="seconds to let the agent settle before RSS"
    )
    parser.add_argument(
        "--py-spy",
        default="",
        metavar="OUT",
        help="py-spy (on PATH) records the agent: OUT.sequential.txt and OUT.burst.txt (collapsed stacks)",
    )
    parser.add_argument(
        "--state-parent",
        default="/tmp",
        help="directory of the checkpoint (a disk, as /var/lib is; /dev/shm leaves the fsyncs out)",
    )
    parser.add_argument(
        "--pod-uid",
        default="",
        help="run the agent with --pod-uid as the chart does (with the rolling-update file lock)",
    )
    parser.add_argument(
        "--start-only",
        action="store_true",
        help="only the start-up figures: start to registration socket and GetInfo, kill -9 to answered",
    )
    parser.add_argument(
        "--no-device-files",
        action="store_true",
        help="the fake backend without its per-claim device files (device_files=off): like the "
        "hardware backends, which write no file per prepared claim",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="run the agent through benchmarks.prepare_timeline and print where a prepare's and an "
        "unprepare's wall time goes inside it (a timeline of marks; the figures then include them)",
    )
    parser.add_argument(
        "--held",
        type=int,
        default=0,
        metavar="N",
        help="keep N claims prepared (on all devices but the first) during the sequence, whose "
        "claims then all use the first device: a call's cost on a node with many claims",
    )
    args = parser.parse_args()
    main(
        200 if args.quick else 1000,
        args.settle,
        args.py_spy,
        args.state_parent,
        args.pod_uid,
        start_only=args.start_only,
        device_files=not args.no_device_files,
        timeline=args.timeline,
        held=args.held,
    )

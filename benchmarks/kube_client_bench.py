"""Claim GETs through `KubeClient` (aiohttp and our layer, `agent.kube.transport`) and a bare aiohttp session.

Starts the API emulator (``python -m agent.emulator``, HTTP on loopback) with one ResourceClaim,
then reads it through each client in the same process: 1,000 sequential GETs and 100 concurrent
ones (three in flight, as `REQUEST_CONCURRENCY` allows), after 50 warm-up GETs. Reported: wall
time and the client process's CPU time (the emulator runs in its own process, so this is the
client's side alone: request building, transport, JSON decoding).

The bare aiohttp row is the least any aiohttp client can do (an ``aiohttp.ClientSession`` with the
same pool settings, ``trust_env=False``, the same headers, semaphore and JSON decoding, no resend,
no bounds): what `KubeClient` adds above it is our layer. (Until issue 33 `KubeClient` ran on an
HTTP/1.1 client of our own; its figures are in benchmarks/README.md.)

Run: ``python -m benchmarks.kube_client_bench``.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import yaml

from benchmarks.kubelet_e2e_bench import CLAIMS, NODE, Api

SEQUENTIAL = 1000
CONCURRENT = 100
WARM_UP = 50


class AiohttpReference:
    """A bare aiohttp session: the same pool bounds and headers as KubeClient, nothing of our layer."""

    def __init__(self, cfg: Any) -> None:
        import aiohttp

        from agent.kube.client import CONNECTION_LIMIT, KEEPALIVE_SECONDS, REQUEST_CONCURRENCY

        self._aiohttp = aiohttp
        self._cfg = cfg
        self._base = str(cfg.host).rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=CONNECTION_LIMIT, keepalive_timeout=KEEPALIVE_SECONDS, ssl=False
            ),
            read_bufsize=2**21,
            trust_env=False,
        )
        self._requests = anyio.Semaphore(REQUEST_CONCURRENCY)

    async def get(self, path: str) -> dict[str, Any]:
        async with self._requests:
            headers = {"Accept": "application/json", "Content-Type": "application/json"}
            settings = self._cfg.auth_settings()
            if inspect.isawaitable(settings):
                settings = await settings
            for setting in settings.values():
                if setting.get("in") == "header" and setting.get("value"):
                    headers[str(setting["key"])] = str(setting["value"])
            response = await self._session.request(
                "GET", self._base + path, headers=headers, timeout=self._aiohttp.ClientTimeout(total=10)
            )
            try:
                data = json.loads(await response.read())
            finally:
                response.release()
            if response.status != 200:
                raise RuntimeError(f"GET {path}: {response.status}")
            return dict(data)

    async def close(self) -> None:
        await self._session.close()


async def measure(get: Callable[[str], Coroutine[Any, Any, dict[str, Any]]], path: str) -> dict[str, float]:
    for _ in range(WARM_UP):
        await get(path)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(SEQUENTIAL):
        await get(path)
    figures = {
        "sequential wall (us/GET)": (time.perf_counter() - wall) / SEQUENTIAL * 1e6,
        "sequential CPU (us/GET)": (time.process_time() - cpu) / SEQUENTIAL * 1e6,
    }
    wall, cpu = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as tg:
        for _ in range(CONCURRENT):
            tg.start_soon(get, path)
    figures["100 concurrent wall (ms)"] = (time.perf_counter() - wall) * 1000
    figures["100 concurrent CPU (ms)"] = (time.process_time() - cpu) * 1000
    return figures


async def bench(kubeconfig: Path, path: str) -> dict[str, dict[str, float]]:
    from agent.kube.client import KubeClient
    from agent.kube.credentials import load_credentials

    results: dict[str, dict[str, float]] = {}
    kube = await KubeClient.connect("kubeconfig", kubeconfig)
    try:
        results["KubeClient"] = await measure(lambda p: kube.request("GET", p), path)
    finally:
        await kube.close()
    reference = AiohttpReference(await load_credentials("kubeconfig", kubeconfig))
    try:
        results["bare aiohttp session"] = await measure(reference.get, path)
    finally:
        await reference.close()
    return results


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kube-client-bench-") as root:
        kubeconfig = Path(root) / "kubeconfig"
        command = [sys.executable, "-m", "agent.emulator", "--port", "0", "--node", NODE]
        emulator = subprocess.Popen(
            [*command, "--kubeconfig", str(kubeconfig)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert emulator.stdout is not None
            emulator.stdout.readline()
            url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
            spec = {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
            }
            Api(url).call("POST", CLAIMS, {"metadata": {"name": "bench-claim"}, "spec": spec})
            results = anyio.run(bench, kubeconfig, f"{CLAIMS}/bench-claim")
        finally:
            emulator.terminate()
            emulator.wait(timeout=10)
    names = list(next(iter(results.values())))
    print(f"{'claim GET against the emulator (loopback HTTP)':<40}" + "".join(f"{n:>26}" for n in names))
    for client, figures in results.items():
        print(f"{client:<40}" + "".join(f"{figures[n]:>26.1f}" for n in names))


if __name__ == "__main__":
    main()

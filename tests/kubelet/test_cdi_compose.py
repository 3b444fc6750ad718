"""Per-claim CDI specs compose: a container with two or three claims sees every claim's devices.

The kubelet hands the runtime the CDI device IDs of every claim of a container; containerd and
CRI-O inject them through the CDI library. `inject` below follows that library (read from
container-device-interface, not copied):

- ``Cache.InjectDevices`` (``pkg/cdi/cache.go``): for each device ID in order, the spec's own
  ``containerEdits`` the first time one of its devices comes, then the device's, appended into one
  set of edits (``ContainerEdits.Append``, ``pkg/cdi/container-edits.go``) applied once; an
  unknown ID fails the container.
- ``ContainerEdits.Apply`` (``pkg/cdi/container-edits.go``) through the spec editor
  (``internal/ociedit/spec_editor.go``): ``KEY=value`` overwrites the entry of the same key in
  place (the image's included; the last value wins) or is appended; a device node is completed from
  the host (``fillMissingInfo``, ``pkg/cdi/container-edits_unix.go``), replaces the node of the
  same path and adds a cgroup rule (``rwm`` for empty permissions); a mount replaces the one of
  the same container path, then mounts are sorted stably by depth (``sortMounts``); hooks are
  appended.

What the workload sees, by reader:

- nodes: a GPU is there when its device nodes are, with a cgroup rule allowing them (a MIG device:
  its parent's node and its two capability nodes);
- the NVIDIA Container Toolkit's runtime and legacy hook read ``NVIDIA_VISIBLE_DEVICES``
  (nvidia-container-toolkit ``internal/config/image/cuda_image.go`` ``devicesFromEnvvars``,
  ``internal/config/image/devices.go`` ``NewVisibleDevices``): unset, empty or ``void``: nothing;
  ``none``: no GPU; ``all``: every GPU of the node; else the GPUs listed, which it injects too;
- CUDA: what the nodes and the toolkit give, filtered by ``CUDA_VISIBLE_DEVICES`` only when set;
- ROCm filters by ``ROCR_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` when set (never set by us);
- the fake: ``FAKE_DEVICE_*`` values, the files under ``/run/dra-fake`` and, when set, the
  list variable ``FAKE_VISIBLE_DEVICES`` earlier agents wrote.

Every claim set is injected in every order of its devices; the container must end up the same
whatever the order, and every reader must see exactly the claims' devices.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.claims.cdi import EMPTY_EDITS_ENV, CdiDevice, CdiSpecWriter, cdi_device_name, qualified_device_id
from agent.core.backend import ClaimRef, ContainerEdits
from agent.core.model import Device
from backends.amd.edits import read_edits
from backends.nvidia.discovery import GpuInfo, MigInfo, NvDevice
from backends.nvidia.driverfiles import DriverFiles
from backends.nvidia.edits import DevDir, EditsConfig, own_edits, toolkit_edits
from tests.fake.helpers import make_backends
from tests.support.cdi_check import cdi_problems

FAKE_DEVICE_PREFIX = "FAKE_DEVICE_"
"""What a fake workload reads (`backends.fake.devicefile`): one variable per device."""

HostNodes = Mapping[str, tuple[str, int, int]]
"""Host path -> (type, major, minor): what ``deviceInfoFromPath`` would stat on the host."""


# --- The CDI library, as far as a container's devices, environment and mounts go -----------------


@dataclass
class Container:
    """The parts of an OCI spec CDI edits."""

    env: list[str] = field(default_factory=list)
    devices: list[dict[str, Any]] = field(default_factory=list)
    cgroup: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    hooks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        """The process environment (a later duplicate key would win in execve's reader too)."""
        return dict(entry.partition("=")[::2] for entry in self.env)

    def node_paths(self) -> set[str]:
        """Device nodes the container can open: present, with a cgroup rule allowing them."""
        allowed = {(r["type"], r["major"], r["minor"]) for r in self.cgroup if r["allow"] and r["access"]}
        return {d["path"] for d in self.devices if (d["type"], d["major"], d["minor"]) in allowed}


@dataclass(frozen=True)
class Registry:
    """The CDI cache: qualified device ID -> (its spec, the device)."""

    devices: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Any]]]

    @classmethod
    def load(cls, root: Path) -> Registry:
        """Every spec file under `root`, read with a YAML parser as the CDI library reads them."""
        found: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
        for path in sorted(root.iterdir()):
            spec = yaml.safe_load(path.read_text())
            if spec["kind"].startswith("k8s."):  # ours (the vendored schema lacks the spec-wide edits)
                assert cdi_problems(spec) == [], path
            for device in spec["devices"]:
                qualified = f"{spec['kind']}={device['name']}"
                assert qualified not in found, f"{qualified} defined twice"  # the cache refuses that
                found[qualified] = (spec, device)
        return cls(found)


def _append(into: dict[str, list[Any]], edits: Mapping[str, Any] | None) -> None:
    for key in ("env", "deviceNodes", "mounts", "hooks"):
        into[key] += (edits or {}).get(key, [])


def inject(registry: Registry, container: Container, device_ids: Sequence[str], host: HostNodes) -> None:
    """``Cache.InjectDevices`` then ``ContainerEdits.Apply``."""
    edits: dict[str, list[Any]] = {"env": [], "deviceNodes": [], "mounts": [], "hooks": []}
    seen: list[Mapping[str, Any]] = []
    for device_id in device_ids:
        if device_id not in registry.devices:
            raise LookupError(f"unresolvable CDI devices {device_id}")
        spec, device = registry.devices[device_id]
        if not any(spec is s for s in seen):
            seen.append(spec)
            _append(edits, spec.get("containerEdits"))
        _append(edits, device.get("containerEdits"))
    _apply(edits, container, host)


def _apply(edits: Mapping[str, list[Any]], container: Container, host: HostNodes) -> None:
    index = {entry.partition("=")[0]: i for i, entry in enumerate(container.env)}  # a later duplicate wins
    for entry in edits["env"]:
        key = entry.partition("=")[0]
        if key in index:
            container.env[index[key]] = entry
        else:
            index[key] = len(container.env)
            container.env.append(entry)
    for node in edits["deviceNodes"]:
        dev = _fill_missing_info(node, host)
        container.devices[:] = [d for d in container.devices if d["path"] != dev["path"]] + [dev]
        if dev["type"] in ("b", "c"):
            access = {"": "rwm", "none": ""}.get(node.get("permissions", ""), node.get("permissions", ""))
            rule = {
                "allow": True,
                "type": dev["type"],
                "major": dev["major"],
                "minor": dev["minor"],
                "access": access,
            }
            container.cgroup.append(rule)
    if edits["mounts"]:
        for mount in edits["mounts"]:
            same = [i for i, m in enumerate(container.mounts) if m["containerPath"] == mount["containerPath"]]
            if same:  # RemoveMount drops the first of that destination
                del container.mounts[same[0]]
            container.mounts.append(dict(mount))
        container.mounts.sort(key=lambda m: os.path.normpath(m["containerPath"]).count("/"))  # stable
    for hook in edits["hooks"]:
        container.hooks.setdefault(hook["hookName"], []).append(hook)


def _fill_missing_info(node: Mapping[str, Any], host: HostNodes) -> dict[str, Any]:
    kind, major, minor = node.get("type", ""), node.get("major", 0), node.get("minor", 0)
    minimal = kind != "" and (major != 0 or kind == "p")
    info = host.get(node.get("hostPath") or node["path"])
    if info is None:
        if not minimal:
            raise FileNotFoundError(
                f"failed to stat CDI host device {node.get('hostPath') or node['path']!r}"
            )
    elif not minimal:
        if kind == "":
            kind = info[0]
        assert kind == info[0], f"host type mismatch for {node['path']}"
        if kind != "p" and major == 0:
            major, minor = info[1], info[2]
    return {"path": node["path"], "type": kind, "major": major, "minor": minor}


# --- Claims and what a container with some of them must see ----------------------------------------


@dataclass(frozen=True)
class Claim:
    """A prepared claim: the CDI device IDs of each of its devices, as the kubelet hands them on."""

    uid: str
    devices: tuple[tuple[str, ...], ...]
    visible: frozenset[str]
    """What the workload must see of it, in the identifiers the scenario's readers return."""


Readers = Callable[[Container], Mapping[str, set[str] | None]]
"""A container -> what each reader sees (None: the reader finds nothing set, so it claims nothing)."""


def orders(chosen: Sequence[Claim]) -> Iterable[list[str]]:
    """The claims' CDI device IDs in every order of their devices (every order of the claims too);
    the IDs of one device stay together, as the kubelet lists them."""
    for order in itertools.permutations([ids for claim in chosen for ids in claim.devices]):
        yield [device_id for ids in order for device_id in ids]


def check_composes(
    registry: Registry,
    claims: Sequence[Claim],
    readers: Readers,
    host: HostNodes,
    image_env: Sequence[str] = (),
) -> int:
    """Every two and three of `claims` in every order, each set in one container: every reader sees
    every claim's devices, and the environment is the same whatever the order. Returns the orders tried."""
    tried = 0
    for size in (2, 3):
        for chosen in itertools.combinations(claims, size):
            expected = frozenset().union(*(c.visible for c in chosen))
            environments = []
            for device_ids in orders(chosen):
                container = Container(env=list(image_env))
                inject(registry, container, device_ids, host)
                seen = readers(container)
                assert any(v is not None for v in seen.values()), "no reader finds the devices"
                for reader, got in seen.items():
                    assert got is None or got == expected, (
                        f"{reader} sees {sorted(got)}, not {sorted(expected)}, with the devices in the "
                        f"order {device_ids}"
                    )
                environments.append(container.environ())
                tried += 1
            assert all(env == environments[0] for env in environments), (
                f"the environment depends on the order of the claims {[c.uid for c in chosen]}"
            )
    return tried


ORDERS = 2 + 6 + 6 + 24
"""Claims of 1, 1 and 2 devices: pairs of 2, 3 and 3 devices, then all 4 devices, in every order."""


def _listed(env: Mapping[str, str], name: str) -> set[str] | None:
    value = env.get(name)
    return None if value is None else {v.strip() for v in value.split(",") if v.strip()}


def toolkit_injects(env: Mapping[str, str], node_gpus: Iterable[str]) -> set[str]:
    """The GPUs the NVIDIA Container Toolkit adds for ``NVIDIA_VISIBLE_DEVICES`` (a non-legacy image)."""
    listed = _listed(env, "NVIDIA_VISIBLE_DEVICES")
    if not listed or "void" in listed or "none" in listed:
        return set()
    return set(node_gpus) if "all" in listed else listed


# --- NVIDIA: own mode (our nodes) and toolkit mode (the toolkit's spec) ----------------------------


@dataclass(frozen=True)
class NvGpu:
    minor: int
    uuid: str
    mig: tuple[int, int, int, int, str] | None = None
    """(gpu instance, compute instance, GI cap minor, CI cap minor, MIG UUID)."""


NODE_GPUS = (
    NvGpu(0, "GPU-00000000-0000-0000-0000-000000000000"),
    NvGpu(1, "GPU-11111111-0000-0000-0000-000000000000"),
    NvGpu(
        2,
        "GPU-22222222-0000-0000-0000-000000000000",
        (1, 0, 30, 31, "MIG-22222222-0001-0000-0000-000000000000"),
    ),
    NvGpu(3, "GPU-33333333-0000-0000-0000-000000000000"),
    NvGpu(4, "GPU-44444444-0000-0000-0000-000000000000"),  # never claimed: "all" would show it
)
NV_DRIVER = "gpu.nvidia.com"
NV_CLAIMS = {"nv-a": ("gpu-0",), "nv-b": ("gpu-2-mig",), "nv-c": ("gpu-1", "gpu-3")}


def nv_device(name: str) -> NvDevice:
    gpu = NODE_GPUS[int(name.split("-")[1])]
    info = GpuInfo(
        index=gpu.minor, minor=gpu.minor, uuid=gpu.uuid, handle=None, mig_enabled=gpu.mig is not None
    )
    mig = None
    if name.endswith("-mig"):
        assert gpu.mig is not None
        gi, ci, _, _, uuid = gpu.mig
        mig = MigInfo(uuid, None, gi, ci, "1g.10gb", 19, 0, 1)
    return NvDevice(Device(name, NV_DRIVER, uuid=mig.uuid if mig else gpu.uuid), info, mig)


def nv_host(tmp_path: Path) -> tuple[EditsConfig, dict[str, tuple[str, int, int]]]:
    """A host /dev and /proc with the node's GPUs; the host's nodes as CDI would stat them."""
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    nodes = {"nvidiactl": 255, "nvidia-uvm": 0}
    host = {"/dev/nvidiactl": ("c", 195, 255), "/dev/nvidia-uvm": ("c", 510, 0)}
    for gpu in NODE_GPUS:
        nodes[f"nvidia{gpu.minor}"] = gpu.minor
        host[f"/dev/nvidia{gpu.minor}"] = ("c", 195, gpu.minor)
        if gpu.mig:
            gi, ci, gi_minor, ci_minor, _ = gpu.mig
            base = proc / "driver/nvidia/capabilities" / f"gpu{gpu.minor}/mig/gi{gi}"
            (base / f"ci{ci}").mkdir(parents=True)
            (base / "access").write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\n")
            (base / f"ci{ci}/access").write_text(f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\n")
            for cap in (gi_minor, ci_minor):
                nodes[f"nvidia-caps/nvidia-cap{cap}"] = cap
                host[f"/dev/nvidia-caps/nvidia-cap{cap}"] = ("c", 237, cap)
    for name in nodes:
        (dev / name).parent.mkdir(parents=True, exist_ok=True)
        (dev / name).touch()  # not a character device: the spec leaves type and numbers to the runtime
    return EditsConfig(mode="own", dev=DevDir(dev, "/dev"), proc_root=proc), host


def nv_readers(container: Container) -> dict[str, set[str] | None]:
    """Nodes, the toolkit, CUDA, by GPU or MIG UUID."""
    paths = container.node_paths()
    by_nodes = set()
    for gpu in NODE_GPUS:
        if "/dev/nvidiactl" not in paths or f"/dev/nvidia{gpu.minor}" not in paths:
            continue
        if gpu.mig is None:
            by_nodes.add(gpu.uuid)
        elif {
            f"/dev/nvidia-caps/nvidia-cap{gpu.mig[2]}",
            f"/dev/nvidia-caps/nvidia-cap{gpu.mig[3]}",
        } <= paths:
            by_nodes.add(gpu.mig[4])
    env = container.environ()
    toolkit = toolkit_injects(env, [g.uuid for g in NODE_GPUS])
    cuda = by_nodes | toolkit
    only = _listed(env, "CUDA_VISIBLE_DEVICES")
    return {
        "device nodes": by_nodes,
        "NVIDIA_VISIBLE_DEVICES (toolkit)": toolkit or None,
        "CUDA": cuda if only is None else cuda & only,
    }


def nv_claims(root: Path, config: EditsConfig, edits_of: Callable[[NvDevice], ContainerEdits]) -> list[Claim]:
    writer = CdiSpecWriter(root, NV_DRIVER)
    claims = []
    for uid, names in NV_CLAIMS.items():
        devices = [(name, edits_of(nv_device(name))) for name in names]
        writer.write_claim_spec(uid, [CdiDevice(cdi_device_name(uid, n), e) for n, e in devices])
        ids = tuple(
            (qualified_device_id(NV_DRIVER, cdi_device_name(uid, n)), *e.cdi_device_ids) for n, e in devices
        )
        claims.append(Claim(uid, ids, frozenset(nv_device(n).uuid for n in names)))
    return claims


@pytest.mark.parametrize("image_env", [(), ("NVIDIA_VISIBLE_DEVICES=all", "PATH=/usr/bin")])
def test_nvidia_own_mode_claims_compose(tmp_path: Path, image_env: tuple[str, ...]) -> None:
    """Own mode: our nodes carry every claim's GPUs; ``NVIDIA_VISIBLE_DEVICES`` hides none of them.

    A CUDA base image sets ``NVIDIA_VISIBLE_DEVICES=all``: the specs overwrite it (NVIDIA's DRA
    driver, k8s-dra-driver-gpu ``cmd/gpu-kubelet-plugin/cdi.go``, sets ``void`` in every claim
    spec), so the toolkit never adds the node's other GPUs.
    """
    config, host = nv_host(tmp_path)
    root = tmp_path / "cdi"
    claims = nv_claims(root, config, lambda d: own_edits(d, config, DriverFiles()))
    assert check_composes(Registry.load(root), claims, nv_readers, host, image_env) == ORDERS


@pytest.mark.parametrize("toolkit_void", [True, False])
def test_nvidia_toolkit_mode_claims_compose(tmp_path: Path, toolkit_void: bool) -> None:
    """Toolkit mode: each device also names ``nvidia.com/gpu=<uuid>`` of the toolkit's own spec.

    ``nvidia-ctk cdi generate`` puts ``NVIDIA_VISIBLE_DEVICES=void`` in that spec's common edits
    (nvidia-container-toolkit ``pkg/nvcdi/wrapper.go`` ``GetCommonEdits``); older toolkits did not.
    Either way the container ends up the same in every order.
    """
    config, host = nv_host(tmp_path)
    root = tmp_path / "cdi"
    claims = nv_claims(root, config, toolkit_edits)
    toolkit: dict[str, Any] = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"] if toolkit_void else [],
            "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
        },
        "devices": [],
    }
    for gpu in NODE_GPUS:
        toolkit["devices"].append(
            {"name": gpu.uuid, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{gpu.minor}"}]}}
        )
        if gpu.mig:
            caps = [{"path": f"/dev/nvidia-caps/nvidia-cap{m}"} for m in gpu.mig[2:4]]
            nodes = [{"path": f"/dev/nvidia{gpu.minor}"}, *caps]
            toolkit["devices"].append({"name": gpu.mig[4], "containerEdits": {"deviceNodes": nodes}})
    (root / "nvidia.yaml").write_text(json.dumps(toolkit))
    image_env = ("NVIDIA_VISIBLE_DEVICES=all",)
    assert check_composes(Registry.load(root), claims, nv_readers, host, image_env) == ORDERS


def test_the_check_catches_a_list_variable_and_a_missing_void(tmp_path: Path) -> None:
    """The check fails for the two designs left out: a per-claim list (the last claim wins), and no
    variable at all (a CUDA image's ``all`` stays, and the toolkit adds every GPU of the node)."""
    config, host = nv_host(tmp_path)

    def listing(device: NvDevice) -> ContainerEdits:
        edits = own_edits(device, config, DriverFiles())
        return ContainerEdits(
            edits.device_nodes,
            {"NVIDIA_VISIBLE_DEVICES": device.uuid},
            list_env=frozenset({"NVIDIA_VISIBLE_DEVICES"}),
        )

    def unset(device: NvDevice) -> ContainerEdits:
        return ContainerEdits(own_edits(device, config, DriverFiles()).device_nodes)

    for name, edits_of in (("listing", listing), ("unset", unset)):
        root = tmp_path / name
        claims = nv_claims(root, config, edits_of)
        with pytest.raises(AssertionError, match=r"NVIDIA_VISIBLE_DEVICES \(toolkit\) sees"):
            check_composes(Registry.load(root), claims, nv_readers, host, ("NVIDIA_VISIBLE_DEVICES=all",))


# --- AMD: device nodes only -------------------------------------------------------------------------

AMD_CARDS = {"gpu-0": (0, 128), "gpu-1": (1, 129), "gpu-2": (2, 130), "gpu-3": (3, 131)}


def test_amd_claims_compose(tmp_path: Path) -> None:
    """AMD: the render and card nodes of every claim, no variable ROCm would filter by.

    As AMD's DRA driver (ROCm/k8s-gpu-dra-driver ``cmd/gpu-kubeletplugin/cdi.go``): device nodes only.
    """
    host: dict[str, tuple[str, int, int]] = {"/host/dev/kfd": ("c", 235, 0)}
    for card, render in AMD_CARDS.values():
        host[f"/host/dev/dri/card{card}"] = ("c", 226, card)
        host[f"/host/dev/dri/renderD{render}"] = ("c", 226, render)

    def stat_fn(path: str) -> os.stat_result:
        _, major, minor = host[path]
        return os.stat_result(
            (stat.S_IFCHR | 0o666, 0, 0, 0, 0, 0, 0, 0, 0, 0), {"st_rdev": os.makedev(major, minor)}
        )

    root, driver = tmp_path / "cdi", "gpu.amd.com"
    writer = CdiSpecWriter(root, driver)
    claims = []
    for uid, names in {"amd-a": ("gpu-0",), "amd-b": ("gpu-1",), "amd-c": ("gpu-2", "gpu-3")}.items():
        devices = [
            CdiDevice(cdi_device_name(uid, n), read_edits("/host/dev", *AMD_CARDS[n], stat_fn)) for n in names
        ]
        writer.write_claim_spec(uid, devices)
        ids = tuple((qualified_device_id(driver, d.name),) for d in devices)
        claims.append(Claim(uid, ids, frozenset(names)))

    def readers(container: Container) -> dict[str, set[str] | None]:
        paths = container.node_paths()
        env = container.environ()
        seen: dict[str, set[str] | None] = {
            "device nodes": {
                name
                for name, (card, render) in AMD_CARDS.items()
                if {"/dev/kfd", f"/dev/dri/card{card}", f"/dev/dri/renderD{render}"} <= paths
            }
        }
        for variable in (
            "AMD_VISIBLE_DEVICES",
            "ROCR_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES",
            "GPU_DEVICE_ORDINAL",
        ):
            assert variable not in env, f"{variable} would filter the GPUs ROCm enumerates"
        return seen

    assert check_composes(Registry.load(root), claims, readers, host) == ORDERS


# --- The fake backend: a variable per device and a file per device, two drivers --------------------


async def test_fake_claims_of_two_drivers_compose(tmp_path: Path) -> None:
    """The ``mixed`` profile: two drivers, a claim with devices of both (a spec per driver), and a
    device two claims share (consumable shares): the same variable and file from both."""
    backends, _ = make_backends("mixed", device_files=str(tmp_path / "files"))
    by_driver = {b.driver_name: b for b in backends}
    uuids = {f"{b.driver_name}/{d.name}": d.uuid for b in backends for d in await b.discover() if d.uuid}
    plan = {
        "fake-a": (("gpu.nvidia.com", "gpu-0"),),
        "fake-b": (("gpu.amd.com", "gpu-1-128"),),
        "fake-c": (("gpu.nvidia.com", "gpu-1"), ("gpu.amd.com", "gpu-2-129")),  # one claim, two specs
        "fake-d": (("gpu.nvidia.com", "gpu-0"),),  # shares gpu-0 with fake-a
    }
    root = tmp_path / "cdi"
    claims = []
    for uid, devices in plan.items():
        ids = []
        for driver in sorted({d for d, _ in devices}):
            mine = [
                CdiDevice(
                    cdi_device_name(uid, name),
                    await by_driver[driver].prepare(name, ClaimRef("ns", uid, uid)),
                )
                for d, name in devices
                if d == driver
            ]
            CdiSpecWriter(root, driver).write_claim_spec(uid, mine)
            ids += [(qualified_device_id(driver, d.name),) for d in mine]
        claims.append(Claim(uid, tuple(ids), frozenset(f"{d}/{n}" for d, n in devices)))

    every = {f"{d}/{n}" for devices in plan.values() for d, n in devices}

    def readers(container: Container) -> dict[str, set[str] | None]:
        env = container.environ()
        files = {
            m["containerPath"].removeprefix("/run/dra-fake/").removesuffix(".json")
            for m in container.mounts
            if m["containerPath"].startswith("/run/dra-fake/")
        }
        nvidia = {uuids[v] for v in files if v.startswith("gpu.nvidia.com/")}
        toolkit = toolkit_injects(env, uuids.values())
        assert not toolkit or toolkit == nvidia, (
            f"NVIDIA_VISIBLE_DEVICES names {sorted(toolkit)}, not {sorted(nvidia)}"
        )
        listed = _listed(env, "FAKE_VISIBLE_DEVICES")  # earlier agents' list, device names without driver
        return {
            "device files": files,
            "FAKE_DEVICE_*": {v for k, v in env.items() if k.startswith(FAKE_DEVICE_PREFIX)} or None,
            "FAKE_VISIBLE_DEVICES": None
            if listed is None
            else {v for v in every if v.partition("/")[2] in listed},
        }

    # Pairs: 2 + 6 + 2 + 6 + 2 + 6 orders; triples: 24 + 6 + 24 + 24.
    assert check_composes(Registry.load(root), claims, readers, {}) == 24 + 78


# --- The core's marker for a device without edits ---------------------------------------------------


def test_markers_of_devices_without_edits_compose(tmp_path: Path) -> None:
    """A backend returning no edits: the core names each device in a variable of its own."""
    root, driver = tmp_path / "cdi", "gpu.example.com"
    writer = CdiSpecWriter(root, driver)
    claims = []
    for uid, names in {"e-a": ("gpu-0",), "e-b": ("gpu-1",), "e-c": ("gpu-2", "gpu-3")}.items():
        devices = [CdiDevice(cdi_device_name(uid, n), ContainerEdits()) for n in names]
        writer.write_claim_spec(uid, devices)
        ids = tuple((qualified_device_id(driver, d.name),) for d in devices)
        claims.append(Claim(uid, ids, frozenset(i for (i,) in ids)))

    def readers(container: Container) -> dict[str, set[str] | None]:
        env = container.environ()
        return {EMPTY_EDITS_ENV: {v for k, v in env.items() if k.startswith(EMPTY_EDITS_ENV)} or None}

    assert check_composes(Registry.load(root), claims, readers, {}) == ORDERS


# --- The applier itself -----------------------------------------------------------------------------


def test_the_applier_follows_cdi_rules() -> None:
    """Env: in place, last wins; nodes: one per path, a cgroup rule each; mounts: one per destination,
    sorted by depth; an unknown device fails."""
    spec: dict[str, Any] = {
        "kind": "v.com/c",
        "containerEdits": {"env": ["S=spec"]},
        "devices": [
            {
                "name": "a",
                "containerEdits": {
                    "env": ["K=a", "A=1"],
                    "deviceNodes": [{"path": "/dev/x", "type": "c", "major": 1, "minor": 2}],
                    "mounts": [{"hostPath": "/h/a", "containerPath": "/m/deep/a"}],
                },
            },
            {
                "name": "b",
                "containerEdits": {
                    "env": ["K=b"],
                    "deviceNodes": [
                        {"path": "/dev/x", "type": "c", "major": 1, "minor": 3, "permissions": "rw"}
                    ],
                    "mounts": [
                        {"hostPath": "/h/b", "containerPath": "/m/deep/a"},
                        {"hostPath": "/h/c", "containerPath": "/c"},
                    ],
                },
            },
        ],
    }
    registry = Registry({f"v.com/c={d['name']}": (spec, d) for d in spec["devices"]})
    container = Container(env=["PATH=/bin", "K=image"])
    inject(registry, container, ["v.com/c=a", "v.com/c=b"], {})
    assert container.env == ["PATH=/bin", "K=b", "S=spec", "A=1"]
    assert container.devices == [{"path": "/dev/x", "type": "c", "major": 1, "minor": 3}]
    assert [r["access"] for r in container.cgroup] == ["rwm", "rw"]
    assert [m["hostPath"] for m in container.mounts] == ["/h/c", "/h/b"]
    with pytest.raises(LookupError, match=r"unresolvable CDI devices v\.com/c=z"):
        inject(registry, Container(), ["v.com/c=z"], {})
    with pytest.raises(FileNotFoundError, match="failed to stat CDI host device"):
        _fill_missing_info({"path": "/dev/absent"}, {})
    assert _fill_missing_info({"path": "/dev/y"}, {"/dev/y": ("c", 4, 5)}) == {
        "path": "/dev/y",
        "type": "c",
        "major": 4,
        "minor": 5,
    }

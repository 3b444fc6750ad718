"""A stand-in for libnvidia-ml under the real pynvml: nvml.h's C functions over `devices` GPUs.

``LibNvml(gpus).module`` is a fresh copy of the installed ``pynvml`` (nvidia-ml-py, its own code)
whose ``nvmlLib`` is this library, so every pynvml function the backend calls runs as on a node:
it builds its ctypes arguments, calls the C function pointer, and turns the ``nvmlReturn_t`` into
its ``NVMLError_*`` class. Each C function is declared with nvml.h's prototype (`cabi`) and answers
with the return codes nvml.h documents for it (the line is cited). Handles are opaque pointers
that stand for a GPU, a MIG device, a GPU or compute instance, or an event set.

Test controls: `emit` / `emit_error` feed events, `fail` makes a C function return a code for one
GPU, `lose` loses a GPU, `hang` makes a function block like a wedged driver (until `release`),
`missing` names symbols an older driver lacks. NVIDIA's mock NVML (k8s-test-infra ``mocknvml``)
differs in places (../shared/reference/nvml-mock-vs-fake.md): `devices.as_mock`, `lose(...,
event=False)` (its ``lost`` mode), `fall_off_bus` (its ``fallen_off_bus`` mode) and `raise_ecc`
(its ``ecc_uncorrectable`` mode) answer as it does.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from tests.fakes.libnvml.devicecalls import DeviceCalls
from tests.fakes.libnvml.healthcalls import HealthCalls


class LibNvml(DeviceCalls, HealthCalls):
    """The stand-in library; `module` is the pynvml the backend gets."""


def install(monkeypatch: Any, fake: LibNvml) -> types.ModuleType:
    """Make ``import pynvml`` give `fake.module` (pynvml's own code over the stand-in library)."""
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    return fake.module

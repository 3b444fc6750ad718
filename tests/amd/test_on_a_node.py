"""What AMD's library does on a real node, through the real amdsmi binding (issue 30).

Each test names the behaviour of AMD's C sources the stand-in reproduces (see
tests/fakes/amdsmi_standin/standin.c): an empty CPER ring, a lost GPU whose cached identity still
answers, the processor list fixed until re-initialisation, partitions sharing a UUID, and values
the library should never answer.
"""

from __future__ import annotations

import logging
import time

import pytest

from agent.core.errors import BackendError
from agent.core.model import Device
from tests.amd.conftest import MakeBackend
from tests.amd.test_health import SETTINGS, monitoring, next_poll, one_pass
from tests.fakes.amd_standin import STATUS_DRIVER_NOT_LOADED, cper_record, mi300x
from tests.support.clock import FakeClock


@pytest.mark.parametrize("file_error", [True, False], ids=["7.0.x", "fixed"])
async def test_an_empty_cper_ring_then_a_fatal_record_is_reported(
    make_backend: MakeBackend, fake_clock: FakeClock, file_error: bool
) -> None:
    """7.0.x answers FILE_ERROR for an empty ring (amd_smi_utils.cc amdsmi_read_cper_file); the
    check must stay on, so a fatal record that comes later is reported (issue 30 #2)."""
    gpus = mi300x(count=2)
    settings = dict(SETTINGS)
    async with monitoring(make_backend, gpus, settings, cper_empty_file_error=file_error) as (_, _, sink):
        await next_poll(sink, fake_clock)
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(fake_clock.time() - 5))
        gpus[1].cper = [cper_record(stamp, record_id="7")]
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)
    (fatal,) = sink.of("cper-fatal")
    assert (fatal.device, fatal.value) == ("gpu-2-129", "mce")
    assert fatal.message.startswith("fatal CPER record 7 at ")
    assert sink.of("gpu-lost") == [] and sink.of("unmonitored") == []
    assert all(failed == [] for _, failed in sink.passes)


async def test_a_lost_gpu_keeps_its_name_and_attributes_with_gpu_lost(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    """Its PCI address, KFD and DRM ids still answer from amdsmi_init's cache (amd_smi.cc
    amdsmi_get_gpu_device_bdf), its device calls DRM_ERROR (amd_smi_drm.cc): rediscovery keeps the
    device as published, and the pass reports it lost (issue 30 #4)."""
    gpus = mi300x(count=2)
    async with monitoring(make_backend, gpus) as (backend, _, sink):
        before = {d.name: d for d in await backend.discover()}
        gpus[1].lost = True
        after = {d.name: d for d in await backend.discover()}
        await next_poll(sink, fake_clock)
    assert after == before
    assert after["gpu-2-129"].attributes["productName"] == "AMD_Instinct_MI300X_OAM"
    (lost,) = sink.of("gpu-lost")
    assert lost.device == "gpu-2-129" and "DRM_ERROR" in lost.message


async def test_a_partition_mode_change_appears_at_the_next_rediscovery(make_backend: MakeBackend) -> None:
    """amdsmi_get_processor_handles answers the list built at amdsmi_init (amd_smi.cc); rediscovery
    re-initialises the library, so SPX -> CPX appears without a restart (issue 30 #5)."""
    backend, fake = make_backend(mi300x("spx_nps1", count=1))
    await backend.start()
    assert [d.name for d in await backend.discover()] == ["gpu-1-128"]
    fake.remove(0)
    for spec in mi300x("cpx_nps4", count=1):
        fake.add(spec)
    devices = list(await backend.discover())
    await backend.stop()
    assert [d.name for d in devices] == [f"gpu-{1 + i}-{128 + i}" for i in range(8)]
    assert {d.attributes["partitionProfile"] for d in devices} == {"cpx_nps4"}


async def _partitions(make_backend: MakeBackend, **behaviour: object) -> list[Device]:
    backend, _ = make_backend(mi300x("cpx_nps4", count=1), **behaviour)
    await backend.start()
    devices = list(await backend.discover())
    await backend.stop()
    return devices


async def test_partitions_never_take_a_uuid_they_share(make_backend: MakeBackend) -> None:
    """7.0.x: amdsmi_uuid_gen(..., fcn = 0xff) gives all partitions their GPU's UUID; newer
    versions one per partition (issue 30 #7)."""
    shared = await _partitions(make_backend)
    assert {d.uuid for d in shared} == {""}
    assert len({d.pci_bus_id for d in shared}) == 8  # the partition's identity: its PCI function
    own = await _partitions(make_backend, uuid_per_partition=True)
    assert len({d.uuid for d in own}) == 8 and "" not in {d.uuid for d in own}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"compute_partition": "XPX"}, "'XPX'"),
        ({"asic_serial": "NOT-HEX"}, "NOT-HEX"),
    ],
    ids=["partition-not-in-enum", "serial-not-hex"],
)
async def test_a_bad_value_skips_that_gpu_with_one_line(
    make_backend: MakeBackend, caplog: pytest.LogCaptureFixture, change: dict[str, str], named: str
) -> None:
    caplog.set_level(logging.WARNING, "agent.backends.amd")
    gpus = mi300x(count=2)
    for key, value in change.items():
        setattr(gpus[1], key, value)
    backend, _ = make_backend(gpus)
    await backend.start()
    devices = await backend.discover()
    await backend.stop()
    assert [d.name for d in devices] == ["gpu-1-128"]
    (line,) = [r for r in caplog.records if "bad value" in r.getMessage()]
    assert named in str(line.__dict__["fields"]["error"])


async def test_an_unknown_status_fails_that_check_only(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi300x(count=2)
    async with monitoring(make_backend, gpus) as (_, _, sink):
        gpus[1].fail = {"amdsmi_get_gpu_bad_page_info": 12345}
        await next_poll(sink, fake_clock)
    devices, failed = sink.passes[-1]
    assert failed == ["bad-pages"] and devices == {"gpu-1-128"}
    assert sink.of("gpu-lost") == []


async def test_a_failed_reinitialisation_is_retried_at_the_next_rediscovery(
    make_backend: MakeBackend,
) -> None:
    backend, fake = make_backend(mi300x(count=1))
    await backend.start()
    await backend.discover()
    fake.set_behaviour(init_status=STATUS_DRIVER_NOT_LOADED)  # amdgpu unloaded under the agent
    with pytest.raises(BackendError, match="DRIVER_NOT_LOADED"):
        await backend.discover()
    fake.set_behaviour(init_status=0)
    assert [d.name for d in await backend.discover()] == ["gpu-1-128"]
    await backend.stop()


async def test_a_bdf_that_does_not_parse_skips_that_gpu(
    make_backend: MakeBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """7.0.2's `_format_bdf` always formats a valid address; a binding that does not would answer
    garbage here: that GPU is skipped with one line naming it (the binding's call is wrapped, the
    library below is the stand-in's)."""
    caplog.set_level(logging.WARNING, "agent.backends.amd")
    backend, fake = make_backend(mi300x(count=2))
    real = fake.module.amdsmi_get_gpu_device_bdf

    def bdf(handle: object) -> str:
        text = str(real(handle))
        return "0000:26:00.0-garbage" if text.startswith("0000:26") else text

    monkeypatch.setattr(fake.module, "amdsmi_get_gpu_device_bdf", bdf)
    await backend.start()
    devices = await backend.discover()
    await backend.stop()
    assert [d.name for d in devices] == ["gpu-1-128"]
    (line,) = [r for r in caplog.records if "bad value" in r.getMessage()]
    assert "0000:26:00.0-garbage" in str(line.__dict__["fields"]["error"])


async def test_a_negative_ecc_count_is_skipped_with_one_line(
    make_backend: MakeBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The C counts are unsigned, so only a binding could answer a negative one: that count is
    skipped (one line naming it), the block's other count and the rest of the pass go on."""
    caplog.set_level(logging.WARNING, "agent.backends.amd")
    gpus = mi300x(count=1)
    gpus[0].ecc_uncorrectable = {"UMC": 2}
    backend, fake = make_backend(gpus)
    real = fake.module.amdsmi_get_gpu_ecc_count

    def count(handle: object, block: object) -> dict[str, int]:
        answer = dict(real(handle, block))
        if getattr(block, "name", "") == "GFX":
            answer["uncorrectable_count"] = -1
        return answer

    monkeypatch.setattr(fake.module, "amdsmi_get_gpu_ecc_count", count)
    await backend.start()
    await backend.discover()
    sink = await one_pass(backend)
    await backend.stop()
    assert sink.passes[0][1] == []
    (line,) = [r for r in caplog.records if "not a count" in r.getMessage()]
    assert line.__dict__["fields"]["value"] == "-1"

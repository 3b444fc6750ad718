"""The kubelet's DRA messages: the hand-written wire format (`agent.kubelet.drawire`) against the
betterproto messages it replaced, for a 1-claim, 1-device call (v1).

Best of 5 `timeit` repeats per row, in microseconds. The betterproto answer is built as the
agent built it before (`tests.kubelet.test_drawire.reference_prepare_response`); both give the
same bytes (checked here before timing).

Run: ``python -m benchmarks.drawire_bench``.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

from agent.claims.preparer import PreparedDevice, PrepareResult
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1 as pb
from agent.kubelet.drawire import ClaimsRequest, encode_prepare_response, encode_unprepare_response
from tests.kubelet.test_drawire import reference_prepare_response

UID = "0b7e1c2a-5d1f-4a57-9c1e-3f0a2b4c6d8e"
RESULTS = {
    UID: PrepareResult(
        devices=(PreparedDevice(("gpu",), "node-1", "gpu-0", (f"k8s.gpu.example.com/claim={UID}-gpu-0",)),)
    )
}
ERRORS = {UID: ""}
REQUEST = bytes(pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace="default", uid=UID, name="claim")]))


def betterproto_prepare() -> bytes:
    return bytes(reference_prepare_response(pb, RESULTS, share_id=True))


def betterproto_unprepare() -> bytes:
    claims = {uid: pb.NodeUnprepareResourceResponse(error=e) for uid, e in ERRORS.items()}
    return bytes(pb.NodeUnprepareResourcesResponse(claims=claims))


def betterproto_request() -> list[tuple[str, str, str]]:
    return [(c.namespace, c.uid, c.name) for c in pb.NodePrepareResourcesRequest.FromString(REQUEST).claims]


def drawire_request() -> list[tuple[str, str, str]]:
    return [(c.namespace, c.uid, c.name) for c in ClaimsRequest.FromString(REQUEST).claims]


ROWS: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
    (
        "prepare answer built and encoded",
        betterproto_prepare,
        lambda: encode_prepare_response(RESULTS, share_id=True),
    ),
    ("unprepare answer built and encoded", betterproto_unprepare, lambda: encode_unprepare_response(ERRORS)),
    ("request decoded, its claims read", betterproto_request, drawire_request),
]


def best_us(call: Callable[[], object]) -> float:
    timer = timeit.Timer(call)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def main() -> None:
    for _, old, new in ROWS:
        assert old() == new(), "the two codecs disagree"
    print(f"{'1 claim, 1 device (v1)':<38}{'betterproto (us)':>18}{'drawire (us)':>14}")
    for name, old, new in ROWS:
        print(f"{name:<38}{best_us(old):>18.2f}{best_us(new):>14.2f}")


if __name__ == "__main__":
    main()

"""Prepare and unprepare: the claim state machine, the checkpoint, the ResourceClaim reader, CDI specs.

- `preparer`: the contract with the kubelet layer (`ClaimPreparer`, `PrepareResult`, `ClaimSource`).
- `state`: the claim state machine of one driver (`state.machine.DeviceState`), by composition.
- `checkpoint`: the crash-safe record of prepared claims (`checkpoint.store.CheckpointStore`).
- `reader`: a ResourceClaim read the way the kubelet plugin helper reads it.
- `cdi`: one CDI spec file per prepared claim. `filelock`: the cross-process prepare lock.

Imports `agent.core` and `agent.observe`; the kubelet layer reaches it only through `claims.preparer`.
"""

"""The claim state machine of one driver: `machine.DeviceState`, the `ClaimPreparer` the kubelet calls.

Prepare: GET every claim concurrently (before any lock), check it, then per claim under its own
lock: checkpoint ``PrepareStarted`` -> backend prepare of each device -> one CDI spec -> checkpoint
``PrepareCompleted`` (spec and checkpoint in one worker-thread hop). Any failure rolls back what was
done for that claim; unprepare reverses it. `start` reconciles the checkpoint (rebuilt from the
specs when corrupt) with the CDI files and the API server: after any crash no spec exists without an
entry and no completed entry lacks its spec.

By composition: one object, `driver.DriverState`, holds the driver's state (backend, claim source,
CDI writer, checkpoint store, locks, `report.Reporter`); the paths are module functions that receive
it, each readable alone. Lowest first: `hooks` (what the machine tells and asks outside it),
`report`, `driver`, `unprepare` (and rollback), `prepare` (the async and the planned one-hop path),
`startup` (load or rebuild, then reconcile) and `machine` (`DeviceState`: builds it, answers calls).
"""

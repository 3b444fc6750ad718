"""`DeviceState`, the `agent.claims.preparer.ClaimPreparer` of one driver: it builds the driver's
`DriverState` and answers each call with its path (`startup`, `prepare`, `unprepare`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from agent.claims.cdi import CdiSpecWriter
from agent.claims.checkpoint.commit import PeerWatch
from agent.claims.checkpoint.file import BOOT_ID_PATH, read_boot_id
from agent.claims.checkpoint.format import CHECKPOINT_FILE, ClaimEntry, ClaimPhase
from agent.claims.checkpoint.store import CheckpointStore
from agent.claims.filelock import FileLock
from agent.claims.preparer import ClaimSource, PrepareResult
from agent.claims.reader import check_claim
from agent.claims.state import startup
from agent.claims.state.driver import DriverState, each
from agent.claims.state.hooks import EventRecorder, PreparedListener, StepHook
from agent.claims.state.prepare import fetch_claims, prepare_one
from agent.claims.state.report import Reporter
from agent.claims.state.unprepare import unprepare_one
from agent.core.backend import Backend, ClaimRef
from agent.core.clock import Clock, SystemClock
from agent.core.errors import ClaimRequestError
from agent.observe.metrics import Metrics


class DeviceState:
    """Prepares and unprepares claims of one driver on this node (a `ClaimPreparer`)."""

    def __init__(
        self,
        driver: str,
        backend: Backend,
        claims: ClaimSource,
        *,
        node_name: str,
        cdi_root: Path,
        state_dir: Path,
        metrics: Metrics | None = None,
        events: EventRecorder | None = None,
        lock_path: Path | None = None,
        clock: Clock | None = None,
        boot_id: str | None = None,
        boot_id_path: Path = BOOT_ID_PATH,
        hooks: StepHook | None = None,
        listener: PreparedListener | None = None,
        peers: Callable[[], bool] | None = None,
    ) -> None:
        clock = clock or SystemClock()
        boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        # `peers` (blocking): whether another agent pod serves this driver now (rolling update).
        watch = PeerWatch(peers) if peers is not None else None
        self.store = CheckpointStore(state_dir / CHECKPOINT_FILE, boot_id, peers=watch)
        self.cdi = CdiSpecWriter(cdi_root, driver)
        self.claims = claims
        report = Reporter(
            driver, self.store, clock, metrics=metrics, events=events, hooks=hooks, listener=listener
        )
        self._state = DriverState(
            driver=driver,
            backend=backend,
            claims=claims,
            node_name=node_name,
            cdi=self.cdi,
            store=self.store,
            state_dir=state_dir,
            clock=clock,
            report=report,
            file_lock=FileLock(lock_path, clock=clock) if lock_path is not None else None,
        )

    async def start(self) -> None:
        """Load (or rebuild) the checkpoint and reconcile it with the CDI files and the API server."""
        await startup.start(self._state)

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        """Prepare every claim; see `agent.claims.preparer.ClaimPreparer.prepare`."""
        refs = list({ref.uid: ref for ref in claims}.values())
        if not refs:
            return {}
        state = self._state
        with state.report.counted_call():
            objects = await fetch_claims(state, refs)
            try:
                for ref in refs:
                    check_claim(ref, objects[ref.uid])
            except ClaimRequestError:
                state.report.count("prepare", "error", "claim_state")
                raise
            results: dict[str, PrepareResult] = {}
            async with state.serialized():
                await each(lambda ref: prepare_one(state, ref, objects[ref.uid], results), refs)
            state.report.claims_read({ref: objects[ref.uid] for ref in refs if not results[ref.uid].error})
            return results

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare every claim; unknown claims succeed. No API call."""
        refs = list({ref.uid: ref for ref in claims}.values())
        if not refs:
            return {}
        state = self._state
        results: dict[str, str] = {}
        with state.report.counted_call():
            async with state.serialized():
                await each(lambda ref: unprepare_one(state, ref, results), refs)
        return results

    def prepared_claims(self) -> dict[str, ClaimEntry]:
        """Completed claims by UID (for metrics and debugging)."""
        return {uid: e for uid, e in self.store.entries().items() if e.phase is ClaimPhase.COMPLETED}

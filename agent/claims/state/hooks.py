"""What the claim state machine tells and asks outside it: crash-test steps, Events, the listener."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import Any, Protocol

from agent.core.backend import ClaimRef


class Step(enum.Enum):
    """Points of prepare/unprepare where a test hook may stop the process (crash tests)."""

    PREPARE_BEFORE_CHECKPOINT_START = "prepare-before-checkpoint-start"
    PREPARE_AFTER_PREPARE_STARTED = "prepare-after-prepare-started"
    PREPARE_AFTER_BACKEND_PREPARE = "prepare-after-backend-prepare"
    PREPARE_AFTER_CDI_WRITE = "prepare-after-cdi-write"
    PREPARE_AFTER_PREPARE_COMPLETED = "prepare-after-prepare-completed"
    UNPREPARE_BEFORE_BACKEND_UNPREPARE = "unprepare-before-backend-unprepare"
    UNPREPARE_AFTER_BACKEND_UNPREPARE = "unprepare-after-backend-unprepare"
    UNPREPARE_AFTER_CHECKPOINT_REMOVE = "unprepare-after-checkpoint-remove"
    UNPREPARE_AFTER_CDI_REMOVE = "unprepare-after-cdi-remove"


class StepHook(Protocol):
    """Test-only: called at every `Step` (a crash test kills the process there)."""

    def reached(self, step: Step, claim_uid: str) -> None: ...


class EventRecorder(Protocol):
    """Records a Kubernetes Event about the agent (reason, message, ``Normal``/``Warning``)."""

    async def record(self, reason: str, message: str, type: str) -> object: ...


class PreparedListener(Protocol):
    """Told which claims changed: after the start-up load (every prepared claim), then when the
    calls in flight end (the claims they prepared or unprepared)."""

    def prepared_changed(
        self,
        driver: str,
        prepared: Mapping[ClaimRef, tuple[str, ...]],
        unprepared: Collection[ClaimRef],
    ) -> None:
        """`prepared`: claims now prepared, new or with other devices (claim -> device names);
        `unprepared`: claims no longer prepared. Claims not named did not change."""
        ...

    def claims_read(self, claims: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        """The API objects of the claims a prepare just prepared, told right before `prepared_changed`."""
        ...


class Listeners:
    """Several `PreparedListener`s told in turn (the workload attribution, the claim status writer)."""

    def __init__(self, *listeners: PreparedListener) -> None:
        self._listeners = listeners

    def prepared_changed(
        self,
        driver: str,
        prepared: Mapping[ClaimRef, tuple[str, ...]],
        unprepared: Collection[ClaimRef],
    ) -> None:
        for listener in self._listeners:
            listener.prepared_changed(driver, prepared, unprepared)

    def claims_read(self, claims: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        for listener in self._listeners:
            listener.claims_read(claims)

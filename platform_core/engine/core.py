"""The engine-core loop, independent of how commands arrive and results leave: ``EngineCore``.

The loop applies a batch of typed commands (``SubmitGroup``, ``AbortRequests``, ``StopCore``),
steps the ``LLMEngine`` while any request is unfinished, and hands every result on (``Deliver``):
an acceptance (``ACCEPTED``) or the exception that refused a submission, then each step's
``RequestOutput``s, each tagged with the *owner* its submission named. Owners are opaque here:
``AsyncEngine`` (the loop on a thread) uses the submitter's ``StreamSink``; the engine-core
process (``core_process``) uses the client and submission that sent it.

When idle the loop blocks in ``receive``; every ``IDLE_HEALTH_CHECK_S`` without a command it checks
the model workers' health, so a dead tensor-parallel worker stops the engine within seconds even
with no traffic (a busy engine notices at its next step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.request_stream import GenerateRequest, StreamSink
from platform_core.errors import EngineDeadError

IDLE_HEALTH_CHECK_S = 1.0  # a check is a few ``is_alive`` calls
# With only KV transfers pending (blocks held for peers), how long to wait for a command
# before the next step polls them.
KV_TRANSFER_WAIT_S = 0.01

# The result that tells a submission's owner its requests were all added (``StreamSink.land``
# understands it).
ACCEPTED = StreamSink.ACCEPTED

Owner = TypeVar("Owner")

# A function applied to the engine once built, on the thread (or in the process) that runs it.
EngineSetup = Callable[[LLMEngine], None]


@dataclass(slots=True)
class SubmitGroup(Generic[Owner]):
    """Add these requests together: all are accepted or none. Results go to ``owner``."""

    requests: list[GenerateRequest]
    owner: Owner


@dataclass(slots=True)
class AbortRequests:
    """Stop these requests now and free their blocks (unknown ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True)
class StopCore:
    """Leave the loop after the current step; ``reason`` says why (requests left then fail)."""

    reason: str = "the engine has been shut down"


CoreCommand = SubmitGroup[Any] | AbortRequests | StopCore

# Commands queued now; waits up to ``timeout`` seconds for the first one when ``timeout > 0``.
Receive = Callable[[float], list[CoreCommand]]
# Hands each ``(owner, ACCEPTED | exception | RequestOutput)`` to its owner; the stats (``None``
# for the acceptances sent before a step) are the engine's counters after the step.
Deliver = Callable[[list[tuple[Any, object]], "dict[str, Any] | None"], None]


class EngineCore(Generic[Owner]):
    """Owns an ``LLMEngine`` and runs its loop; call everything on the loop's thread."""

    def __init__(self, engine: LLMEngine, deliver: Deliver) -> None:
        self.engine = engine
        self.stats = engine.stats()  # as of the end of the latest iteration
        self._deliver = deliver
        self._owners: dict[str, Owner] = {}  # request id -> owner, while unfinished
        self._undelivered: list[tuple[Owner, object]] = []

    def run(self, receive: Receive) -> StopCore:
        """Serve commands from ``receive`` until one says stop; return it. An exception (the
        engine failed) propagates: the caller fails what is left (``owners``)."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            transfers = not busy and engine.has_pending_kv_transfers()
            if transfers:  # steps poll the transfers; commands may arrive meanwhile
                commands = receive(KV_TRANSFER_WAIT_S)
            else:
                commands = receive(0.0) if busy else self._wait(receive)
            self._undelivered = results = []
            stop = self._apply(commands, results)
            if results:  # acceptances go out now, not after a step that may be long
                self._deliver(results, None)
                self._undelivered = results = []
            if stop is None and (
                self.engine.has_unfinished_requests() or self.engine.has_pending_kv_transfers()
            ):
                for output in self.engine.step():
                    find = self._owners.pop if output.finished else self._owners.get
                    owner = find(output.request_id, None)
                    if owner is not None:
                        results.append((owner, output))
            self.stats = self.engine.stats()
            self._deliver(results, self.stats)
            self._undelivered = []
            if stop is not None:
                return stop

    def _wait(self, receive: Receive) -> list[CoreCommand]:
        while True:
            commands = receive(IDLE_HEALTH_CHECK_S)
            if commands:
                return commands
            self.engine.check_health()  # raises when a worker is gone

    def _apply(
        self, commands: list[CoreCommand], results: list[tuple[Owner, object]]
    ) -> StopCore | None:
        stop = None
        aborts: list[str] = []  # consecutive aborts go to the engine as one batch
        for command in commands:
            if isinstance(command, AbortRequests):
                aborts += command.request_ids
                continue
            self.abort(aborts)
            aborts = []
            if isinstance(command, StopCore):
                stop = stop or command
            elif stop is None:
                results.append((command.owner, self._add(command)))
            else:  # submitted after the stop: refused like any submission to a stopped engine
                results.append((command.owner, EngineDeadError(stop.reason)))
        self.abort(aborts)
        return stop

    def _add(self, command: SubmitGroup[Owner]) -> object:
        """Add a group of requests; on any error remove the ones added and return the error."""
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(
                    r.request_id,
                    r.prompt,
                    r.params,
                    r.prompt_token_ids,
                    r.arrival_time,
                    deadline=r.deadline,
                    lora_request=r.lora_request,
                    kv_transfer_params=r.kv_transfer_params,
                )
                added.append(r.request_id)
        except Exception as exc:  # the owner gets the error; the loop goes on
            self.engine.abort_request(added)
            return exc
        for request_id in added:
            self._owners[request_id] = command.owner
        return ACCEPTED

    def abort(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` in the engine and forget their owners."""
        if request_ids:
            self.engine.abort_request(request_ids)
            for request_id in request_ids:
                self._owners.pop(request_id, None)

    def abort_where(self, owned: Callable[[Owner], bool]) -> None:
        """Abort every request whose owner satisfies ``owned`` (an owner nobody listens to)."""
        self.abort([rid for rid, owner in self._owners.items() if owned(owner)])

    def owners(self) -> list[Owner]:
        """The owners still waiting for results: requests in flight or results not delivered
        (each owner once, in no particular order)."""
        found = {id(o): o for o in self._owners.values()}
        found.update((id(owner), owner) for owner, _ in self._undelivered)
        return list(found.values())

    def abort_all(self) -> None:
        """Abort every request and forget every owner (after the loop ended)."""
        request_ids = list(self._owners)
        self._owners.clear()
        self._undelivered = []
        self.engine.abort_request(request_ids)

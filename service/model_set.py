# design:
# - ModelSet is the worker's Flask extension (service.runtime.EXTENSION): the
#   models SERVE_MODEL lists, each a ModelRuntime with its own batcher,
#   admission and watchdog, and what they share: the worker's bound on request
#   bodies and, with more than one, the model time (service.batching.model_time).
# - The first model is the default: what a request that names none gets, and
#   what the single-model attributes (model, batcher, precision) read, so that a
#   service of one model behaves as it always did.
# - The models load one after another, in one thread: each measures its cost
#   model and checks its precision on the worker's threads, which a neighbour
#   loading beside it would take. The worker is ready when every model is: a
#   worker that answered some models' requests and 503 to others' would make a
#   client's retries land by chance. A model that fails to load stops the
#   service (service.host.lifecycle) with its name in the reason; those after
#   it are not loaded.
# - A batch-thread fault in any model fails every model's queued requests with
#   503 and replaces the worker: a stalled model may hold the model time, which
#   the others would wait on for ever.
# - pick() resolves a request's model name. Unnamed entries answer to the name
#   their model gives itself, known once it has loaded; two models answering to
#   one name are a load error.

"""The models one worker serves, and picking a request's model by name."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flask import Flask

from service.batching import native
from service.batching.batcher import Batcher
from service.batching.model_time import ModelTime
from service.batching.observer import BatchObserver
from service.config.budget import Budget, body_budget_bytes
from service.config.settings import Settings
from service.errors import BadRequest, NotReady, ServeError
from service.models import Model
from service.models.base import task_of
from service.runtime import EXTENSION, LOAD_FAILED, ModelRuntime


class UnknownModel(ServeError):
    """The request names a model this service does not serve. 404, as Triton and OpenAI answer."""

    status = 404

    def __init__(self, message: str, name: object, served: str) -> None:
        super().__init__(message)
        self.name = name
        self.served = served


class ModelSet:
    def __init__(
        self, settings: Settings, observer_for: Callable[[str | None], BatchObserver] | None = None
    ) -> None:
        self.settings = settings
        entries = settings.models
        self.bodies = Budget(body_budget_bytes(settings.max_body_bytes))
        self.model_time = ModelTime() if len(entries) > 1 else None
        self.runtimes = [
            ModelRuntime(
                settings,
                observer_for(entry.name) if observer_for is not None else None,
                entry=entry,
                model_time=self.model_time,
                bodies=self.bodies,
            )
            for entry in entries
        ]
        self.default = self.runtimes[0]
        self.pid = self.default.pid
        self._by_name: dict[str, ModelRuntime] = {}
        self._names_error: str | None = None

    def init_app(self, app: Flask) -> None:
        app.extensions[EXTENSION] = self

    @property
    def single(self) -> bool:
        return len(self.runtimes) == 1

    # -- the default model, as a service of one model has it --------------------

    @property
    def model(self) -> Model | None:
        return self.default.model

    @property
    def batcher(self) -> Batcher | None:
        return self.default.batcher

    @property
    def device(self) -> str:
        return self.default.device

    # -- life ---------------------------------------------------------------------

    def start(self) -> None:
        if self.single:
            self.default.start()
            return
        for runtime in self.runtimes:
            runtime.start(load=False)
        native.start_thread(self._load_in_turn)

    def _load_in_turn(self) -> None:
        failed: str | None = None
        for runtime in self.runtimes:
            if failed is not None:
                runtime.skip(f"not loaded: model {failed!r} failed to load first")
                continue
            runtime.load()
            if runtime.load_error is not None:
                failed = runtime.label

    def wait_loaded(self, timeout: float) -> bool:
        """Block until every model has loaded or one failed to, for at most ``timeout`` seconds."""
        until = time.monotonic() + timeout
        for runtime in self.runtimes:
            if not runtime.wait_loaded(max(0.0, until - time.monotonic())):
                return False
            if runtime.load_error is not None:
                return True  # the service stops: the others need not be waited for
        self._index_names()
        return True

    def _index_names(self) -> None:
        if self._by_name or self._names_error is not None:
            return
        if any(runtime.model is None for runtime in self.runtimes):
            return  # an unnamed model's name is known once it has loaded
        by_name: dict[str, ModelRuntime] = {}
        for runtime in self.runtimes:
            for name in runtime.names:
                other = by_name.setdefault(name, runtime)
                if other is not runtime:
                    self._names_error = (
                        f"two models answer to the name {name!r} ({other.settings.model!r} and "
                        f"{runtime.settings.model!r}); name them in SERVE_MODEL (name=spec)"
                    )
                    return
        self._by_name = by_name

    @property
    def load_error(self) -> str | None:
        """Why the service cannot serve: the first model that failed to load, with its name."""
        for runtime in self.runtimes:
            if runtime.load_error is not None:
                return runtime.load_error
        return self._names_error

    @property
    def failure(self) -> str | None:
        return next((r.failure for r in self.runtimes if r.failure is not None), None)

    @property
    def on_fault(self) -> Callable[[str], None] | None:
        return self.default.on_fault

    @on_fault.setter
    def on_fault(self, handler: Callable[[str], None] | None) -> None:
        # A fault of any model's batch thread replaces the worker, with all its models.
        for runtime in self.runtimes:
            runtime.on_fault = None if handler is None else self._fault_handler(runtime, handler)

    def _fault_handler(self, faulty: ModelRuntime, handler: Callable[[str], None]) -> Callable[[str], None]:
        def fault(reason: str) -> None:
            # The faulty model's own requests have had their 503 (ModelRuntime._fault).
            for runtime in self.runtimes:
                if runtime is not faulty and runtime.batcher is not None:
                    error = NotReady(
                        f"model {faulty.label!r} of this worker failed ({reason}); retry",
                        reason="batch_thread_failed",
                    )
                    runtime.batcher.abandon(error)
            handler(reason)

        return fault

    def readiness(self) -> str | None:
        """None when every model is ready to serve, else why not (fit for a client to read)."""
        if self._names_error is not None:
            return LOAD_FAILED
        for runtime in self.runtimes:
            reason = runtime.readiness()
            if reason is not None:
                return (
                    reason if self.single or reason == LOAD_FAILED else f"model {runtime.label!r}: {reason}"
                )
        return None

    def require_ready(self) -> None:
        reason = self.readiness()
        if reason == LOAD_FAILED:
            raise NotReady(LOAD_FAILED, retry_after_s=5)
        if reason is not None:
            raise NotReady(f"not ready: {reason}", retry_after_s=5)

    def stop(self, timeout: float | None = None) -> bool:
        """Drain every model's batcher (within ``timeout`` in all): all refuse new work first."""
        if self.failure is not None:
            timeout = 0  # a faulty thread may never end, and may hold the others' model time
        for runtime in self.runtimes:
            runtime.stop(0)
        until = None if timeout is None else time.monotonic() + timeout
        drained = True
        for runtime in self.runtimes:
            left = None if until is None else max(0.0, until - time.monotonic())
            drained = (runtime.batcher is None or runtime.batcher.wait_exit(left)) and drained
        return drained

    # -- picking a request's model --------------------------------------------------

    def pick(self, name: Any) -> ModelRuntime:
        """The model a request names (None: the default); UnknownModel (404) naming those served."""
        if name is None or (self.single and name == self.default.served_name):
            return self.default
        if not isinstance(name, str):
            raise BadRequest(f'"model" must be a string naming a model; {self.served()}')
        self._index_names()
        runtime = self._by_name.get(name)
        if runtime is None:
            served = self.served()
            raise UnknownModel(f"unknown model {name[:200]!r}; {served}", name[:200], served)
        return runtime

    def named(self, name: str) -> ModelRuntime | None:
        """The model ``name`` names, or None (no such name, or not known until every model loads).

        The door's lookup: it never raises, since an unknown name is the route's to refuse (404).
        """
        self._index_names()
        return self._by_name.get(name)

    def first_of(self, task: str) -> str | None:
        """The name of the first model serving ``task`` (None: the default is as good as any)."""
        if self.single:
            return None
        for runtime in self.runtimes:
            if runtime.model is not None and task_of(runtime.model) == task:
                return runtime.label
        return None

    def served(self) -> str:
        """The models served, as an error names them."""
        names = [", ".join(repr(n) for n in r.names) or repr(r.label) for r in self.runtimes]
        return f"this service serves {'; '.join(names)}"

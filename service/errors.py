"""The service's exceptions.

A :class:`ServeError` carries the HTTP status its client should see; the routes
turn it into ``{"error": message}``. Where callers already catch a stdlib
exception for the same condition, the class subclasses it too. A shed request
(503, 504) also carries a short ``reason`` that the metrics count it under, set
where the cause is known: the same status has several causes an operator must
tell apart (a full queue is not a GPU out of memory). ``json_type`` names a
value's JSON type in the messages that refuse it, in a client's body or in a
model directory's config alike.
"""

from __future__ import annotations

from typing import Any


class SettingsError(ValueError):
    """A ``SERVE_*`` variable holds a value the service cannot use."""


class ServeError(Exception):
    status = 500
    reason = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason


class BadRequest(ServeError, ValueError):
    status = 400


class Unauthorized(ServeError):
    status = 401


class PayloadTooLarge(ServeError, ValueError):
    status = 413


class UnsupportedMediaType(ServeError, ValueError):
    status = 415


class InvalidInput(ServeError, ValueError):
    """The body parsed but its ``inputs`` do not fit the model."""

    status = 422


class ModelError(ServeError, RuntimeError):
    """The model raised, or broke its contract, for this request's items."""

    status = 500


class Overloaded(ServeError):
    """The worker cannot take the request now; the client should retry later."""

    status = 503
    reason = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1, *, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s


class NotReady(Overloaded):
    """The model is still loading, or the batcher has stopped."""

    reason = "not_ready"


class DeadlineExceeded(ServeError, TimeoutError):
    status = 504
    reason = "deadline"


class ClientClosed(ServeError):
    """The client hung up while its request waited: nothing is computed for it, and no answer sent.

    499, as nginx logs a request whose client closed the connection first.
    """

    status = 499
    reason = "client_closed"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)

"""Domain errors of the coordinator's handlers. The servicer maps each to one gRPC status code."""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of the errors a handler raises for a bad or untimely request; the message says what to do."""


class Unauthenticated(CoordinatorError):
    """Missing or wrong job token."""


class InvalidArgument(CoordinatorError):
    """A malformed or absurd request."""


class NotFound(CoordinatorError):
    """An unknown node (join first) or an unknown job."""


class AlreadyExists(CoordinatorError):
    """Another live node holds the claimed node id. `retry_after_s`: when a join may be tried once more (the
    holder's lease lapses then), sent as the `atoll.rpc.RETRY_AFTER_KEY` trailing metadata; None: never."""

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FailedPrecondition(CoordinatorError):
    """The request does not fit the coordinator's state: another job, a future plan epoch."""


class RateLimited(CoordinatorError):
    """A node made a call more often than its rate allows; `retry_after_s`: when it may again (sent as the
    `atoll.rpc.RETRY_AFTER_KEY` trailing metadata)."""

    def __init__(self, message: str, *, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(CoordinatorError):
    """The coordinator is shutting down."""

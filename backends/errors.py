"""The backends' errors a user can cause and fix, all `UserError`s (`policies.errors`): the CLI
and the HTTP router answer them with a clear 4xx-style message."""

from policies.errors import UserError

__all__ = ["ModelLoadError", "ModelSetupError", "Overloaded", "RequestError", "TrainingError", "UserError"]


class ModelLoadError(UserError):
    """A model could not be loaded."""


class ModelSetupError(UserError):
    """The embedded model could not be fetched or converted."""


class RequestError(UserError):
    """A request the engine cannot serve as given."""


class TrainingError(UserError):
    """Drafter training cannot run with the settings given."""


class Overloaded(RequestError):
    """The backend is full: the request was not started; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

"""Errors a user can cause and fix. Each message says what to change; callers (the CLI, later
the HTTP router) turn any `UserError` into a clear 4xx-style answer and let every other
exception keep its traceback, since that one is a bug."""


class UserError(ValueError):
    """Base of every error whose message tells the user what to change."""


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

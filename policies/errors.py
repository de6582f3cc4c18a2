"""The one base of every error a user can cause and fix, at any layer (policy, profile, model,
request, command line). Its message says what to change; callers (the CLI, the HTTP router) turn
a `UserError` into a clear 4xx-style answer and let every other exception keep its traceback,
since that one is a bug."""


class UserError(ValueError):
    """Base of every error whose message tells the user what to change."""

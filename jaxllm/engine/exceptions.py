"""Errors the engine's clients raise."""


class EngineDeadError(RuntimeError):
    """The engine core process has died: every pending and every later call raises this."""

    def __init__(self, message: str = "the engine core process died; build a new engine to go on"):
        super().__init__(message)

"""Errors graphopt shows to users: each carries one line that names the fix."""


class GraphoptError(Exception):
    """Base of every error graphopt raises on purpose. ``str(e)`` is one line for the user."""


class OptionsError(GraphoptError, ValueError):
    """An unknown option key or a value outside the allowed set."""


class ModelLoadError(GraphoptError):
    """A model spec that cannot be loaded: unknown name, missing or corrupt file."""


class PassFailed(GraphoptError):
    """A pass raised or broke the graph, and the user asked for ``fallback="error"``."""


class TargetUnavailable(GraphoptError):
    """A target whose hardware or package is not present here."""


class BackendFailed(GraphoptError):
    """A target failed to compile or run a graph, and ``fallback="error"`` was asked."""

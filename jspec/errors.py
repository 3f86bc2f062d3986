"""Typed errors: each names the field, tensor or limit at fault."""

from checkpoints.errors import CheckpointError


class JspecError(Exception):
    """Base of every jspec error."""


class ConfigError(JspecError, ValueError):
    """An engine or model configuration is inconsistent or impossible."""


class UnsupportedModelError(ConfigError):
    """A checkpoint uses an architecture or a config field jspec does not implement."""


class InvalidRequestError(JspecError, ValueError):
    """A request (prompt, sampling parameters) is invalid; other requests are unaffected."""


class EngineShutdownError(JspecError, RuntimeError):
    """An engine was used after `shutdown()`: its device buffers are gone."""


__all__ = [
    "EngineShutdownError",
    "JspecError",
    "ConfigError",
    "UnsupportedModelError",
    "InvalidRequestError",
    "CheckpointError",
]

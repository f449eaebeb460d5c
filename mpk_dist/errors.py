"""User-facing errors.

Every problem a user can cause (bad checkpoint, unsupported config, bad flags) raises an
``MpkError`` subclass whose message reads ``<what>: expected <x>, got <y>`` plus what to do. The CLI
prints these as one line and exits non-zero; other exceptions are bugs and keep their traceback.
"""


class MpkError(Exception):
    """Base class of errors caused by input the user can fix."""


class ConfigError(MpkError):
    """config.json (or a preset) describes something we cannot run."""


class CheckpointError(MpkError):
    """A weight file is missing, unreadable, or holds the wrong tensors."""


class ShardingError(MpkError):
    """The model's shapes do not divide by the requested tensor-parallel degree."""


class InputError(MpkError):
    """A prompt, token id or flag value is out of range."""


class BackendUnavailable(MpkError):
    """The requested backend cannot run on this machine."""


class DeviceTimeout(MpkError):
    """A bounded wait (in the kernel or in the launcher) expired; the message names who waited on what."""

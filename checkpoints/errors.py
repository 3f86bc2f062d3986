"""Errors raised while reading or writing checkpoints.

`checkpoints` imports nothing of `jspec`, so the error type lives here and
`jspec.errors` re-exports it.
"""


class CheckpointError(ValueError):
    """A checkpoint cannot be read as asked: names the tensor and/or file at fault."""

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None):
        parts = []
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if file is not None:
            parts.append(f"file {file!r}")
        prefix = (", ".join(parts) + ": ") if parts else ""
        super().__init__(prefix + message)
        self.tensor = tensor
        self.file = file

"""Errors the engine raises on purpose.

Every one carries a message a person can act on: what went wrong and what to do.
The CLI prints ``str(error)`` on one line; the app shows it in a dialog.
"""


class EngineError(Exception):
    """Base of every deliberate engine failure."""


class ModelLoadError(EngineError):
    """A model folder or file cannot be read (missing, corrupt, truncated)."""


class UnsupportedModelError(EngineError):
    """The architecture or a feature of the model is not supported."""


class OutOfMemoryBudget(EngineError):
    """Loading (or continuing) would exceed the memory budget."""


class TemplateError(EngineError):
    """The chat template raised or could not be parsed."""


class MediaError(EngineError):
    """An image or audio file cannot be decoded, or the model cannot take it."""


class AdapterError(EngineError):
    """A LoRA adapter does not fit the loaded model."""

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


class OutOfKVRoom(OutOfMemoryBudget):
    """A request's KV cache at its full length does not fit what the memory budget leaves,
    even with nothing else running (the server answers 503: the machine is too full)."""


class TemplateError(EngineError):
    """The chat template raised or could not be parsed."""


class MediaError(EngineError):
    """An image or audio file cannot be decoded, or the model cannot take it."""


class AdapterError(EngineError):
    """A LoRA adapter does not fit the loaded model."""


class WrongModelKind(EngineError):
    """The loaded model cannot do what was asked: chat with an embedding model, or embed with a chat model."""


class InvalidTokenIds(EngineError):
    """Token ids given as they are (a prompt of ids, ids to embed) name no row of the model's vocabulary."""


def backend_hint(exc: BaseException) -> str | None:
    """A readable line for an import failure of MLX itself, or None for any other error.

    On Linux MLX's compute library comes from a separate package (mlx-cpu or mlx-cuda);
    without one, ``import mlx.core`` fails with a loader message that names no fix."""
    text = str(exc)
    if isinstance(exc, ImportError) and ("libmlx" in text or "mlx.core" in text or getattr(exc, "name", "") == "mlx"):
        return (
            "MLX is installed without a compute backend: pip install 'mlx-desk[cpu]', "
            "or 'mlx-desk[cuda]' on a machine with an NVIDIA GPU"
        )
    return None

"""The engine's command line (``python -m engine``): generate, template, inspect,
transcribe, convert and bench. The top layer: it may import every layer below it."""

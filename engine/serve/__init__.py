"""OpenAI- and Anthropic-compatible HTTP over the engine's worker (``python -m engine serve``)."""

"""Voxtral's audio tower (a Whisper encoder in 30 s chunks) and projector."""

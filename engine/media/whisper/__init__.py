"""Whisper: the MLX model, long-form transcription and its timestamp rules."""

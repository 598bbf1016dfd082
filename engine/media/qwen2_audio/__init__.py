"""Qwen2-Audio's audio tower (a Whisper encoder) and projector."""

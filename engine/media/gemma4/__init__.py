"""Gemma 4's vision and audio towers and their processors."""

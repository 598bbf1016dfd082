"""Qwen2.5-VL's vision tower and its image processor settings."""

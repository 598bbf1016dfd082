"""Qwen3.5 / Qwen3.6 media: Qwen3-VL's vision tower, image and video encoders
(engine/media/qwen3_vl), with what differs for this family in encoders.py."""

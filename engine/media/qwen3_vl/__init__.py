"""Qwen3-VL (and Qwen3-VL-MoE) media: the vision tower with DeepStack (tower.py), video
decoding with PyAV (decode.py), frame sampling and patching as the model's video
processor does it (processor.py), and the image and video encoders (encoders.py)."""

"""Media for multimodal chats: decoding, preprocessing, caching and the towers.

audio.py (load_audio, log_mel_spectrogram), resample.py, mel.py, image.py (load_image and
the image processors from image_processors.py), cache.py (EncodedMediaCache), whisper.py
(the MLX Whisper model).

Multimodal prompts: parts.py (content parts of messages -> ordered MediaInput list),
prompt.py (placeholder expansion, per-token media keys, the MediaEncoder protocol),
towers.py (MediaTowers: which media a model takes, lazy tower loading, encoded cache).

Per-family folders hold a tower with its processor: qwen3_vl/ (Qwen3-VL images and video:
PyAV decoding, frame sampling, DeepStack tower), pixtral/ (Mistral 3 images).
"""

"""Media for multimodal chats: decoding, preprocessing, caching and the towers.

audio.py (load_audio, log_mel_spectrogram), resample.py, mel.py, image.py (load_image and
the image processors from image_processors.py), cache.py (EncodedMediaCache), whisper.py
(the MLX Whisper model; the only module here that imports mlx).
"""

"""Media for multimodal chats: decoding, preprocessing, caching and the towers.

Shared pieces: audio.py (load_audio, log_mel_spectrogram), resample.py, mel.py, image.py
(load_image and the image processors from image_processors.py), encoded_cache.py
(EncodedMediaCache), siglip.py (the SigLIP vision transformer).

Multimodal prompts: parts.py (content parts of messages -> ordered MediaInput list),
prompt.py (placeholder expansion, per-token media keys, the MediaEncoder protocol),
towers.py (MediaTowers: which media a model takes, lazy tower loading, encoded cache).

One folder per multimodal family holds its tower and processor: gemma3/, qwen2_5_vl/,
qwen2_audio/, voxtral/, whisper/ (the Whisper model and transcription), qwen3_vl/ (Qwen3-VL
images and video: PyAV decoding, frame sampling, DeepStack tower), pixtral/ (Mistral 3 images).
"""

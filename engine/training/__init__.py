"""LoRA / DoRA training of a loaded model (``python -m engine train``, the app's Train… dialog)."""

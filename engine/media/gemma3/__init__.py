"""Gemma 3's image path: the SigLIP tower, its projector and the image processor settings."""

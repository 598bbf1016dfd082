"""Mistral 3 media: the Pixtral vision tower with its patch merger (tower.py) and its image processor."""

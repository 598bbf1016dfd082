"""MLX Desk's desktop app (PySide6 + qasync). Never imports mlx: see app/bridge.py."""

__version__ = "0.1.0"

"""The frozen app's entry point: the same `app.main:main` that the `mlx-desk` script runs."""

import sys

from app.main import main

if __name__ == "__main__":
    sys.exit(main())

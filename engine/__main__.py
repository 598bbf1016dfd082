"""``python -m engine``: the command line lives in engine/cli."""

from engine.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

"""Start gpt-inspector: `python main.py` opens the window; any sub-command goes to the CLI."""

from gpt_inspector.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m graftrl.cli``: the console script's entry."""

from graftrl.cli import app

app()

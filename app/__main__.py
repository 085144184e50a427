"""`python -m app` is the `dflash` command."""

from app.cli import main

main()

"""The command line (`featherweight ...`): assembled in `main.py` from the command modules."""

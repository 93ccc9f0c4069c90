"""`python -m featherweight.cli`: the same command line as the `featherweight` script."""

from featherweight.cli.main import main

main()

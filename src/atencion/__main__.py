import sys

from .cli import main

status = main()
if status == 130:
    # Ctrl-C: a KeyboardInterrupt that passed through an exec() of source text (dataclasses and
    # namedtuple build their methods so, at import) leaves CPython's "unhandled KeyboardInterrupt"
    # mark set even though main() caught it, and under `python -m` the process would then end
    # killed by SIGINT instead of exiting with 130. An exec() of nothing clears the mark.
    exec("")
sys.exit(status)

"""``smgd`` and ``python -m smgd``: the command line (:mod:`smgd.cli`).

This module imports nothing of smgd before it acts on one signal: a SIGHUP (a reload) that
reaches ``smgd serve`` while it still imports (about half a second, longer on a loaded host;
a supervisor's workers get the SIGHUPs it forwards) would end it, SIGHUP's default action.
It is ignored until the daemon's own handler takes it over; the file read at start is the
newest anyway.
"""

import signal
import sys


def main() -> int:
    if "serve" in sys.argv[1:]:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from smgd.cli import main as cli_main  # after the signal (the docstring says why)

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())

"""The daemon's open-files limit: raised to the hard limit at start.

Every client connection is a descriptor (and each engine a few more), and the soft limit most
hosts start a service with is 1,024 (systemd's default ``LimitNOFILE=1024:524288``, and a
login shell's ``ulimit -n``). Past it, accepts fail with ``EMFILE`` and the accept loop can
only log and wait (:mod:`smgd.api.http.accepting`): a gateway that keeps a few thousand
connections open would be refused. Nothing but the soft limit stands in the way, so smgd
raises it to the hard limit at start, as nginx's ``worker_rlimit_nofile`` or Go's runtime do;
an administrator who wants less sets the hard limit (``LimitNOFILE=`` in the unit).

The engines smgd launches inherit the raised limit; SGLang and vLLM raise their own anyway.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("smgd")

# Where the hard limit is unlimited, raise the soft limit this far only: some kernels refuse
# RLIM_INFINITY for RLIMIT_NOFILE (it is capped by fs.nr_open, 1,048,576 by default), and no
# daemon on one host needs more connections than that.
UNLIMITED_CAP = 1 << 20


def open_files_target(soft: int, hard: int) -> int:
    """The soft limit to set: the hard one (capped where unlimited), never lower than now."""
    ceiling = UNLIMITED_CAP if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= ceiling:
        return soft
    return ceiling


def raise_open_files_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit (:func:`open_files_target`); the limit now in force.

    A refusal (a container that forbids it) is logged and the daemon runs on the old limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = open_files_target(soft, hard)
    if target == soft:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning(
            "could not raise the open-files limit from %d to %d (%s): clients past ~%d "
            "connections will be refused",
            soft,
            target,
            exc,
            soft,
        )
        return soft
    log.debug("open-files limit raised from %d to %d", soft, target)
    return target

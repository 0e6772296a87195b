"""The one way a ``streamrec`` handler reports a usage error.

A handler raises :class:`UsageError` with a message naming the option or field
and the value given; :func:`deploy.cli.dispatch` prints it as argparse prints
its own usage errors (``streamrec <cmd>: error: <message>``, on stderr) and
exits with :data:`USAGE_EXIT`. Every other outcome is the handler's own exit
code (``None`` for 0).

>>> str(UsageError("--port 70000: expected 0-65535"))
'--port 70000: expected 0-65535'
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.config import JobConfig

# argparse's exit code for a command line it cannot parse: ours for one it can, but
# whose values do not go together or cannot be used.
USAGE_EXIT = 2


class UsageError(Exception):
    """A command line, or the job file it names, that the command cannot run with.

    The message names the option or field and the value, and says what is expected.
    """


def load_job(path: Path) -> JobConfig:
    """The job config at ``path``, or a usage error naming the file and what is wrong in it."""
    # Imported here: deploy.config pulls in every source's config, which `--help` must
    # not wait for.
    from deploy.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc

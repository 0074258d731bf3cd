"""`--store`: where a command keeps canonical KV and patches, parsed one way for every command.

A value is either a directory (a disk tier there, created when first written) or a redis:// /
rediss:// URL (a Redis tier shared across processes and machines); both are opened by
`agentwin.store.open_store`. Anything else that looks like a URL (`scheme://...`, or `redis:`
without its `//`) is refused while the arguments are parsed: exit status 2 and one line, before
any model loads, instead of a local folder named after the URL.
"""

from __future__ import annotations

import argparse
import re

FORMS = "a directory or a redis:// / rediss:// URL"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def store_arg(text: str) -> str:
    """The `--store` value `text`, checked (see the module docstring); ArgumentTypeError otherwise.
    A Redis URL is checked as `open_store` will check it (a host, no query options that the tier
    sets itself); messages never show a URL's password."""
    from agentwin.store.remote import check_url

    if not text.strip():
        raise argparse.ArgumentTypeError(f"is empty; give {FORMS}")
    scheme = _SCHEME.match(text)
    if scheme is None:
        if text.lower().startswith(("redis:", "rediss:")):
            raise argparse.ArgumentTypeError(
                f"{text.split(':', 1)[0]}:... looks like a Redis URL without '//': write "
                f"redis://host[:port][/db]; --store takes {FORMS}")
        return text
    if scheme.group(1) not in ("redis", "rediss"):
        raise argparse.ArgumentTypeError(f"must be {FORMS}, got {scheme.group(1)}://...")
    try:
        check_url(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"must be {FORMS}: {err}") from None
    return text


def add_store_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """`--store DIR|URL` on `parser`; `what` ends the help text (who shares the store, the default)."""
    parser.add_argument("--store", metavar="DIR|URL", type=store_arg,
                        help=f"keep canonical KV and patches in a directory or on a Redis server "
                             f"(redis://host[:port][/db], rediss:// with TLS) {what}")

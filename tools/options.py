"""Option types and checks the commands share (`agentwin doc | web | video | batch | demo`): each
type raises argparse's ArgumentTypeError with what to type instead; the window options are checked
together before any model loads, and the window they describe is built here."""

from __future__ import annotations

import json
import sys
from argparse import ArgumentTypeError
from typing import Any


def make_window(km: Any, args: Any) -> Any:
    """The window the options describe; `args.store` (checked by the command's parser: a directory
    or a redis:// / rediss:// URL) is opened by `open_store`, as `agentwin batch` opens it."""
    from agentwin import Window
    from agentwin.store import open_store

    from agentwin.patches.policies import PATCH_POLICIES

    store = open_store(args.store, model_fingerprint=km.fingerprint) if args.store else None
    evict = getattr(args, "evict", "fifo")
    if args.patch not in PATCH_POLICIES:  # exact, survive, refresh: no patch settings
        return Window(km, budget_tokens=args.budget_tokens, patch=args.patch, evict=evict, store=store)
    return Window(km, budget_tokens=args.budget_tokens, patch=args.patch, evict=evict, rank=args.rank, store=store,
                  patch_bytes=getattr(args, "patch_bytes", None), max_kl=getattr(args, "max_kl", None))


def window_option_error(args: Any) -> str | None:
    """What is wrong with the window options together (`--rank`, `--patch-bytes`, `--max-kl`), to be
    refused before a model is loaded; None when they agree."""
    from agentwin.patches.policies import PATCH_POLICIES

    rank = "exact" if args.rank is None else args.rank
    patch = getattr(args, "patch", "exact")
    given = [flag for flag, set_ in (("--rank", args.rank not in ("budget", None)), ("--patch-bytes", getattr(args, "patch_bytes", None)
                                                                         is not None),
                                     ("--max-kl", getattr(args, "max_kl", None) is not None)) if set_]
    if patch not in PATCH_POLICIES and given:
        return (f"{', '.join(given)} set(s) the patches of a patch policy, and --patch {patch} fits none; "
                "add --patch origin-akin (or another patch policy) to use them")
    if getattr(args, "patch_bytes", None) is not None and args.rank != "budget":
        return f"--patch-bytes sets the patch ranks itself; use it with --rank budget, not --rank {rank}"
    if getattr(args, "max_kl", None) is not None and args.rank is None:
        return ("--max-kl is a fidelity target for low-rank patches; exact patches (--rank exact) meet any: "
                "drop --max-kl, or use --rank budget or a rank with it")
    return None


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=repr)


def refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def rank_arg(text: str) -> int | str | None:
    """`--rank`: `budget` (each chunk's patch within --patch-bytes of its KV bytes), a positive
    int, or `exact` (full-rank float32 patches: the window equals a re-prefill)."""
    if text.lower() in ("exact", "none", "full"):
        return None
    if text.lower() == "budget":
        return "budget"
    try:
        return positive_arg(text)
    except ArgumentTypeError:
        raise ArgumentTypeError(f"--rank must be 'budget', a positive integer or 'exact', got {text!r}") from None


def fraction_arg(text: str) -> float:
    """`--patch-bytes`: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def kl_arg(text: str) -> float:
    """`--max-kl`: a positive, finite number of nats."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive KL in nats (such as 0.0024), got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"expected a positive KL in nats (such as 0.0024), got {text!r}")
    return value


def question_arg(text: str) -> str:
    """`--question` / `--task`: text with something in it, encodable as UTF-8 (argv bytes that are
    not UTF-8 reach Python as lone surrogates)."""
    if not text.strip():
        raise ArgumentTypeError("is empty; say what the agent should find out or do")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ArgumentTypeError(f"is not valid UTF-8 text (byte {text[err.start].encode('utf-8', 'surrogateescape')!r} "
                                f"at character {err.start}); write it in UTF-8") from None
    return text


def positive_float_arg(text: str) -> float:
    """A positive, finite number (seconds, frames per second)."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive, finite number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"expected a positive, finite number, got {text!r}")
    return value


def positive_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value

"""`--store` on every command that takes it: one parser; a directory, or a redis:// / rediss:// URL
that always opens a Redis tier; any other scheme refused (exit 2) before a model is loaded."""

import json
from argparse import ArgumentTypeError
from types import SimpleNamespace

import pytest

from agents.doc import write_text_pdf
from agents.local_site import serve
from tests.tools.test_agents_cli import no_model_load  # noqa: F401 (the fixture)
from tools import cli

BAD_STORES = ["http://kv.example/", "s3://bucket/kv", "file:///srv/kv", "redis:/127.0.0.1:6379/0", "rediss:kv:6380",
              "redis://", "redis://kv.example/0?socket_timeout=1"]


def _argv(command, folder, site):
    pdf = write_text_pdf(folder / "a.pdf", ["The keeper is Tobias."])
    if command == "doc":
        return ["doc", str(pdf), "--question", "Who is the keeper?", "--quiet"]
    if command == "web":
        return ["web", f"{site}/", "--task", "Find the keeper", "--quiet"]
    if command == "video":
        return ["video", str(pdf), "--question", "What is shown?", "--model", "tiny-qwen2.5-vl",
                "--allow-random-weights", "--quiet"]
    tasks = folder / "tasks.jsonl"
    tasks.write_text(json.dumps({"kind": "doc", "source": str(pdf), "question": "Who?"}) + "\n")
    return ["batch", str(tasks), "--model", "tiny-llama-gqa", "--quiet"]


@pytest.mark.parametrize("store", BAD_STORES)
@pytest.mark.parametrize("command", ["doc", "web", "video", "batch"])
def test_a_store_that_is_neither_a_directory_nor_a_redis_url_is_refused_first(command, store, tmp_path, monkeypatch,
                                                                               capsys, no_model_load):
    from agentwin import KameraModel

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before --store was checked")

    monkeypatch.setattr(KameraModel, "from_pretrained", staticmethod(load))  # what batch workers call
    monkeypatch.chdir(tmp_path)
    with serve({"/index.html": "<title>Keeper</title><p>Tobias</p>"}) as site:
        argv = _argv(command, tmp_path, site)
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(SystemExit) as exit:
            cli.main(argv + ["--store", store])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"agentwin {command}: error: argument --store:" in err
    assert "a directory or a redis:// / rediss:// URL" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder named after the URL


def test_the_store_parser_keeps_directories_and_redis_urls():
    from tools.store_args import store_arg

    for value in ("kv-store", "/srv/kv", "./redis", "C:/kv", "redis-kv", "redis://127.0.0.1:6379/0",
                  "rediss://user:secret@kv.example:6380/1", "redis://kv.example"):
        assert store_arg(value) == value
    with pytest.raises(ArgumentTypeError, match="empty"):
        store_arg("")
    with pytest.raises(ArgumentTypeError, match=r"got s3://\.\.\."):
        store_arg("s3://bucket/kv")
    with pytest.raises(ArgumentTypeError, match=r"looks like a Redis URL without '//'"):
        store_arg("redis:/127.0.0.1:6379/0")
    with pytest.raises(ArgumentTypeError) as err:
        store_arg("rediss://user:secret@kv:6380/?socket_timeout=1")
    assert "socket_timeout" in str(err.value) and "secret" not in str(err.value)  # no password in messages


def test_a_redis_url_opens_a_redis_tier_and_no_folder(tmp_path, monkeypatch):
    """The agent commands' window gets the same store `agentwin batch` opens: a Redis tier for a
    redis:// URL (nothing connects until it is used), a disk tier for a directory."""
    from agentwin import KameraModel
    from tools.options import make_window

    monkeypatch.chdir(tmp_path)
    km = KameraModel.from_pretrained("tiny-llama-gqa")
    args = cli.build_parser().parse_args(["doc", "a.pdf", "--question", "q", "--store", "redis://127.0.0.1:1/0"])
    window = make_window(km, args)
    try:
        assert window.store.remote is not None and window.store.model_fingerprint == km.fingerprint
    finally:
        window.store.close()
    assert list(tmp_path.iterdir()) == []
    args = SimpleNamespace(**{**vars(args), "store": str(tmp_path / "kv")})
    window = make_window(km, args)
    try:
        assert window.store.remote is None
    finally:
        window.store.close()

"""Secrets stay secret (issue 41): a URL's query values (``?token=...``) and user information
(``user:password@``) appear in no output of feedpipe, in a succeeding run or a failing one: no
exception text, repr or traceback, no log record, warning, stdout or stderr line, no file it
writes (manifest copy, shard cache, ledger, probe JSON, plot), no ``stats()`` or state.

Against ``tests/_http_server.py`` on 127.0.0.1 wanting the token on every request, and, for s3://,
a moto server whose secret key is in the environment."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import string
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from _data import make_dataset
from _servers import forget_s3_clients, moto_binary, moto_s3, python_server
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import feedpipe
from feedpipe import FeedDataset, FeedLoader
from feedpipe._helpers import retry
from feedpipe._redact import MARK, cause, redact
from feedpipe.caches._manifest_copy import copy_path
from feedpipe.cli._main import main
from feedpipe.errors import AccessDeniedError, RemoteError, SourceNotFoundError

TOKEN = "SECRETVALUE123"
PASSWORD = "PASSWORD456"
SECRETS = (TOKEN, PASSWORD)
FAST = retry.RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01)


class Outputs:
    """Every text a run gave a human or a file, each with where it came from."""

    def __init__(self, caplog: pytest.LogCaptureFixture,
                 capfd: pytest.CaptureFixture[str], caught: list[warnings.WarningMessage]) -> None:
        self.texts: list[tuple[str, str]] = []
        self.secrets = list(SECRETS)
        self._caplog, self._capfd, self._caught = caplog, capfd, caught

    def add(self, where: str, text: object) -> None:
        if isinstance(text, bytes):
            text = text.decode("latin-1")
        self.texts.append((where, str(text)))

    def error(self, where: str, e: BaseException) -> None:
        self.add(f"{where}: str", e)
        self.add(f"{where}: repr", repr(e))
        self.add(f"{where}: traceback", "".join(traceback.format_exception(e)))

    def tree(self, where: str, root: Path) -> None:
        for p in sorted(root.rglob("*")):
            self.add(f"{where}: name {p}", p.name)
            if p.is_file():
                self.add(f"{where}: file {p}", p.read_bytes())

    def start(self) -> None:
        """Forget the log records made so far (a test's own setup of a server)."""
        self._caplog.clear()

    def check(self) -> None:
        """Adds the log records (with their tracebacks), warnings, stdout and stderr so far, then
        asserts that no secret is in anything gathered."""
        for w in self._caught:
            self.add("warning", f"{w.category.__name__}: {w.message}")
        for r in self._caplog.records:
            if r.levelno < logging.INFO and not r.name.startswith("feedpipe"):
                continue  # a storage library's own DEBUG trace of its requests (documented)
            self.add(f"log {r.name}", r.getMessage())
            if r.exc_info:
                self.add(f"log {r.name} exc", "".join(traceback.format_exception(*r.exc_info)))
        stdout, stderr = self._capfd.readouterr()
        self.add("stdout", stdout)
        self.add("stderr", stderr)
        assert len(self.texts) > 5
        leaks = sorted({f"{where}: ...{text[max(0, text.find(s) - 150):text.find(s) + 40]}..."
                        for where, text in self.texts for s in self.secrets if s in text})
        assert not leaks, "\n".join(leaks)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("secrets")
    make_dataset(str(r))
    return r


@pytest.fixture
def outputs(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> Iterator[
        Outputs]:
    """Collects every log record (feedpipe's from DEBUG up, any other logger's from INFO up),
    every warning, and stdout and stderr (the file descriptors, so worker processes' output too)
    of the test."""
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield Outputs(caplog, capfd, caught)


def cli(out: Outputs, *argv: str) -> int:
    status = main(list(argv))
    out.add(f"feedpipe {argv[0]} status", status)
    return status


def test_redact_keeps_keys_and_hosts_and_replaces_every_value() -> None:
    assert redact(f"GET http://feeder:{PASSWORD}@127.0.0.1:8080/shards/data-000001.tar"
                  f"?token={TOKEN}&sv=2024&sig={TOKEN}#k={TOKEN}: 503") == (
        f"GET http://{MARK}@127.0.0.1:8080/shards/data-000001.tar?token={MARK}&sv={MARK}"
        f"&sig={MARK}#k={MARK}: 503")
    assert redact(f"URL('https://h/x?{TOKEN}')") == f"URL('https://h/x?{MARK}')"
    assert redact(f"(at https://h/x?t={TOKEN}).") == f"(at https://h/x?t={MARK})."
    local = f"/data/odd?token={TOKEN}/manifest.json and s3://bucket/shards"
    assert redact(local) == local  # a local path's ? is a file name character


_word = st.text(string.ascii_letters + string.digits + "-._~%", min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(scheme=st.sampled_from(["http", "https", "s3", "gs", "HTTPS"]), user=st.booleans(),
       host=_word, path=st.lists(_word, max_size=3), keys=st.lists(_word, min_size=1, max_size=4),
       secret=st.text(string.ascii_letters + string.digits + "+/=-_.~%:@?", min_size=6,
                      max_size=40),
       password=st.text(string.ascii_letters + string.digits + "-_.~%!$*+,;=", min_size=6,
                        max_size=20),
       fragment=st.booleans(), before=st.sampled_from(["", "GET ", "url='", "(", "<"]),
       after=st.sampled_from(["", ": 503", "'", ").", ", then", ">", "\n"]))
def test_redact_leaves_no_secret_and_keeps_the_rest(
    scheme: str, user: bool, host: str, path: list[str], keys: list[str], secret: str,
    password: str, fragment: bool, before: str, after: str
) -> None:
    """Wherever a URL stands in a text, the secrets of its query, fragment and user information
    are gone, everything up to the query is kept, and redacting again changes nothing."""
    plain = " ".join([scheme, host, *path, *keys, before, after, MARK])
    assume("://" not in secret and secret not in plain and password not in plain)
    query = "&".join(f"{k}={secret}" for k in keys)
    base = f"{scheme}://" + (f"me:{password}@" if user else "") + host + "".join(
        f"/{p}" for p in path)
    text = f"{before}{base}?{query}" + (f"#k={secret}" if fragment else "") + after
    clean = redact(text)
    assert secret not in clean.replace(MARK, "") and password not in clean.replace(MARK, "")
    kept = f"{scheme}://" + (f"{MARK}@" if user else "") + host + "".join(f"/{p}" for p in path)
    assert clean.startswith(before + kept + "?")
    assert all(f"{k}={MARK}" in clean for k in keys)
    assert redact(clean) == clean


def test_a_cause_with_a_secret_is_stood_in_for() -> None:
    e = ConnectionResetError(f"reset by http://h/x?token={TOKEN}")
    try:
        try:
            raise e
        except ConnectionResetError as x:
            raise RemoteError("http://h/x: still failing") from cause(x)
    except RemoteError as r:
        text = "".join(traceback.format_exception(r))
        assert TOKEN not in text and f"token={MARK}" in text and "ConnectionResetError" in text
        assert r.__cause__.original is e  # type: ignore[union-attr]
        again = pickle.loads(pickle.dumps(r.__cause__))
        assert str(again) == str(r.__cause__) and again.original is None


def _epoch(out: Outputs, url: str, tmp: Path, root: Path) -> None:
    cache, ledger = tmp / "cache", tmp / "ledger"
    ds = FeedDataset(url, cache_dir=cache, shuffle=True)
    loader = FeedLoader(ds, batch_size=4, ledger=ledger)
    n = sum(len(b["__key__"]) for b in loader)
    assert n == 25
    for what, value in (("dataset", ds), ("loader", loader), ("stats", loader.stats()),
                        ("state", loader.state_dict()), ("dataset state", ds.state_dict())):
        out.add(what, repr(value))
    # the state names the dataset by its manifest, not its URL: a state saved through one URL
    # (one token) resumes the same dataset read through another
    elsewhere = FeedLoader(FeedDataset(str(root / "shards"), shuffle=True), batch_size=4)
    elsewhere.load_state_dict(loader.state_dict())
    direct = FeedDataset(url)
    out.add("direct", repr(direct))
    assert sum(1 for _ in direct) == 25


def test_a_succeeding_http_run_says_no_secret(
    root: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "svg.fonttype", "none")  # the plot's text as text
    with python_server(root, "--token", TOKEN) as srv:
        url = srv.url.replace("://", f"://feeder:{PASSWORD}@") + f"/shards?token={TOKEN}"
        _epoch(outputs, url, tmp_path, root)
        assert cli(outputs, "verify", url, "--json") == 0
        # the probe takes a dataset URL with a query as one file (its own issue); it still names it
        probed = url.replace("/shards?", "/shards/manifest.json?")
        assert cli(outputs, "probe", probed, "--duration", "0.1", "--workers", "0", "--no-progress",
                   "--json-out", str(tmp_path / "probe.json"), "--plot",
                   str(tmp_path / "probe.svg")) == 0
        assert cli(outputs, "cache", "stats", str(tmp_path / "cache"), "--json") == 0
        assert cli(outputs, "ledger", str(tmp_path / "ledger"), "--json") == 0
        assert feedpipe.load_manifest(url).total_samples == 25
    # the storage is gone: the run starts from the manifest copy in the cache, and says so
    ds = FeedDataset(url, cache_dir=tmp_path / "cache")
    assert sum(1 for _ in ds) == 25
    # a renewed password and token find the same copy of the manifest
    renewed = url.replace(PASSWORD, "renewed").replace(TOKEN, "renewed")
    assert copy_path(str(tmp_path / "cache"), renewed) == copy_path(str(tmp_path / "cache"), url)
    assert (tmp_path / "probe.svg").exists() and (tmp_path / "probe.json").exists()
    outputs.tree("written", tmp_path)
    outputs.check()
    said = " ".join(t for w, t in outputs.texts if w.startswith("log"))
    assert "starting from the copy" in said and f"token={MARK}" in said


@pytest.mark.parametrize("failure", ["wrong token", "503", "404", "down"])
def test_a_failing_http_run_says_no_secret(
    root: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    args = {"wrong token": ["--token", "other"], "503": ["--fail-first", "100000"]}.get(failure, [])
    expected = {"wrong token": AccessDeniedError, "503": RemoteError, "404": SourceNotFoundError,
                "down": RemoteError}[failure]
    with python_server(root, *args) as srv:
        path = "/nothing" if failure == "404" else "/shards"
        url = srv.url.replace("://", f"://feeder:{PASSWORD}@") + f"{path}?token={TOKEN}"
        if failure == "down":
            srv.stop()
        with pytest.raises(expected) as e:
            _epoch(outputs, url, tmp_path, root)
        outputs.error("FeedDataset", e.value)
        assert cli(outputs, "verify", url, "--json") != 0
        assert cli(outputs, "probe", url, "--duration", "0.1", "--no-progress", "--json") != 0
    outputs.tree("written", tmp_path)
    outputs.check()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_fetch_failing_mid_epoch_says_no_secret(
    root: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The manifest is read, then the storage goes away: the error comes from the loader (from
    its worker processes with ``num_workers=2``)."""
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    with python_server(root, "--token", TOKEN) as srv:
        url = srv.url.replace("://", f"://feeder:{PASSWORD}@") + f"/shards?token={TOKEN}"
        ds = FeedDataset(url, cache_dir=tmp_path / "cache")
        loader = FeedLoader(ds, batch_size=4, ledger=tmp_path / "ledger", num_workers=workers)
    with pytest.raises(RemoteError) as e:
        for _ in loader:
            pass
    outputs.error("epoch", e.value)
    outputs.add("stats", repr(loader.stats()))
    outputs.tree("written", tmp_path)
    outputs.check()


def test_a_conversion_from_a_url_keeps_no_secret_in_its_dataset(
    tmp_path: Path, outputs: Outputs
) -> None:
    """``feedpipe shard`` of a Parquet table behind a URL with a password: the manifest records
    how the dataset was made (the source's URL), redacted; a failing one says no secret."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "tables").mkdir()
    pq.write_table(pa.table({"text": ["a", "b", "c"], "label": [1, 2, 3]}),
                   tmp_path / "tables" / "t.parquet")
    with python_server(tmp_path) as srv:
        base = srv.url.replace("://", f"://feeder:{PASSWORD}@")
        out = tmp_path / "out"
        assert cli(outputs, "shard", f"{base}/tables/t.parquet", str(out), "--no-progress") == 0
        assert cli(outputs, "shard", f"{base}/tables/gone.parquet", str(tmp_path / "out2"),
                   "--no-progress", "--json") != 0
    manifest = (out / "manifest.json").read_text()
    assert f"http://{MARK}@127.0.0.1:{srv.port}/tables/t.parquet" in manifest
    assert feedpipe.load_manifest(str(out)).total_samples == 3
    outputs.tree("written", tmp_path)
    outputs.check()


def test_verify_of_a_damaged_dataset_names_its_problems_without_secret(
    root: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard missing and one cut short behind a URL with a token: each problem is named, in
    the report the library returns and in what the CLI prints."""
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    site = tmp_path / "site" / "shards"
    shutil.copytree(root / "shards", site)
    (site / "data-000001.tar").unlink()
    with open(site / "data-000002.tar", "r+b") as f:
        f.truncate(3000)
    with python_server(tmp_path / "site", "--token", TOKEN) as srv:
        url = srv.url.replace("://", f"://feeder:{PASSWORD}@") + f"/shards?token={TOKEN}"
        report = feedpipe.verify(url, show_progress=False)
        assert {p.kind for p in report.problems} >= {"missing", "size"}
        for p in report.problems:
            outputs.add("problem", str(p))
        assert cli(outputs, "verify", url) == 1
        assert cli(outputs, "verify", url, "--json") == 1
    outputs.check()


@pytest.mark.skipif(moto_binary() is None, reason="moto_server is not installed")
def test_an_s3_run_says_no_credential(
    root: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The secret key lives in the environment: it must not reach any output either."""
    pytest.importorskip("s3fs")
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    with moto_s3({"shards": root / "shards"}) as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        forget_s3_clients()
        outputs.start()  # the setup's records hold the key, given to the test by moto
        secret = env["AWS_SECRET_ACCESS_KEY"]
        outputs.secrets.append(secret)
        _epoch(outputs, "s3://feedpipe-test/shards", tmp_path, root)
        assert cli(outputs, "verify", "s3://feedpipe-test/shards", "--json") == 0
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret[:-1] + "x")  # a wrong key
        forget_s3_clients()
        with pytest.raises(AccessDeniedError) as e:
            FeedDataset("s3://feedpipe-test/shards")
        outputs.error("wrong key", e.value)
    forget_s3_clients()
    outputs.tree("written", tmp_path)
    outputs.check()
    assert os.environ.get("AWS_SECRET_ACCESS_KEY")  # still set while outputs are checked


@pytest.mark.slow
@pytest.mark.skipif(moto_binary() is None, reason="moto_server is not installed")
def test_a_conversion_from_s3_and_its_probe_say_no_credential(
    root: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("s3fs")
    with moto_s3({"shards": root / "shards", "src": root / "src"}) as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        forget_s3_clients()
        outputs.start()
        outputs.secrets.append(env["AWS_SECRET_ACCESS_KEY"])
        assert cli(outputs, "shard", "s3://feedpipe-test/src", str(tmp_path / "copy"),
                   "--labels-from-dirs", "--no-progress") == 0
        assert cli(outputs, "probe", "s3://feedpipe-test/shards", "--duration", "0.1",
                   "--workers", "0", "--no-progress", "--json-out",
                   str(tmp_path / "probe.json")) == 0
    forget_s3_clients()
    assert feedpipe.load_manifest(str(tmp_path / "copy")).total_samples == 25
    outputs.tree("written", tmp_path)
    outputs.check()


def test_every_feedpipe_logger_redacts() -> None:
    """A module that made its logger with ``logging.getLogger`` would log URLs whole: every
    logger comes from :func:`feedpipe._redact.logger`, which adds the redacting filter."""
    package = Path(feedpipe.__file__).parent
    direct = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
              if p.name != "_redact.py" and "logging.getLogger(" in p.read_text(encoding="utf-8")]
    assert direct == []

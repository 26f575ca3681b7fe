"""`aiayn data download NAME`: a recipe's corpus (catalog.py) fetched and checked.

Each file is streamed into a hidden `.NAME.part` beside its final name, hashed as it arrives,
and renamed to NAME only once its sha256 is the recorded one, so the final name never holds a
partial or wrong file: a killed process or a dropped connection leaves at most the `.part`,
which the next run starts over. A file already there with the right content is kept. Plain
text upstream is gzip-compressed as it is written (the recipes read `.gz`); its checksum is of
the text. Standard library only: http(s):// and file:// URLs, and a mirror (`--mirror` or
AIAYN_DATA_MIRROR: a base URL holding NAME/<upstream file name>) for machines without
GitHub.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import os
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from aiayn.corpora.catalog import CORPORA, DOWNLOADED, Corpus, RemoteFile
from aiayn.errors import DataError
from aiayn.runtime.durable import fsync_path, size_text

MIRROR_ENV = "AIAYN_DATA_MIRROR"
_BLOCK = 1 << 20
_TIMEOUT_S = 60  # per blocking read: a stalled connection fails instead of hanging


def listing(corpora: dict[str, Corpus] = CORPORA) -> str:
    """The corpora `aiayn data download` knows, one paragraph each."""
    out = []
    for c in corpora.values():
        total = size_text(sum(f.size for f in c.files))
        files = f"{len(c.files)} file{'s' if len(c.files) > 1 else ''}"
        out.append(f"{c.name}: {c.about}; {files}, {total}\n  licence: {c.licence}")
        out += [f"  {f.name}  <- {f.url}" for f in c.files]
    return "\n".join(out)


def source_url(corpus: str, f: RemoteFile, mirror: str | None) -> str:
    """The file's upstream URL, or its copy under a mirror: MIRROR/CORPUS/<upstream name>."""
    if not mirror:
        return f.url
    return f"{mirror.rstrip('/')}/{corpus}/{PurePosixPath(urlsplit(f.url).path).name}"


def download(
    name: str,
    output: Path | None = None,
    force: bool = False,
    mirror: str | None = None,
    corpora: dict[str, Corpus] = CORPORA,
) -> Path:
    """Every file of corpus NAME in `output` (default data/corpora/NAME), checked; returns the
    folder. `force` fetches files that are already there and right; `mirror` (default
    $AIAYN_DATA_MIRROR) replaces the upstream hosts."""
    if name not in corpora:
        raise DataError(f"no corpus named {name!r}; `aiayn data download --list` lists them")
    corpus = corpora[name]
    dest = Path(output) if output is not None else DOWNLOADED / name
    mirror = mirror if mirror is not None else os.environ.get(MIRROR_ENV)
    dest.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for f in corpus.files:
        final = dest / f.name
        if not force and final.is_file():
            if stored_sha256(final, f.gzip) == f.sha256:
                print(f"kept {final} ({size_text(final.stat().st_size)}, sha256 checked)")
                continue
            print(f"{final} differs from the recorded sha256: downloading it again")
        _fetch(f, source_url(name, f, mirror), final)
        fetched += 1
    files = f"{len(corpus.files)} file{'s' if len(corpus.files) > 1 else ''}"
    print(f"{name}: {files} in {dest} ({fetched} downloaded)", flush=True)
    return dest


def _fetch(f: RemoteFile, url: str, final: Path) -> None:
    """`url` into `final`, through `.NAME.part`, renamed only when its sha256 is f.sha256."""
    part = final.with_name(f".{final.name}.part")  # a killed run's is started over
    how = ", gzip-compressed as written" if f.gzip else ""
    print(f"downloading {final.name} ({size_text(f.size)}{how}) from {url}", flush=True)
    started = time.perf_counter()
    try:
        with open(part, "wb") as raw:
            # mtime 0 and no name: the same text gives the same .gz bytes on every machine.
            gz = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") if f.gzip else None
            with gz or contextlib.nullcontext(raw) as out:
                got, digest = _stream(url, out, f, final)
            raw.flush()
            os.fsync(raw.fileno())
        if digest != f.sha256:
            raise DataError(
                f"{final.name}: checksum mismatch for {url}: expected sha256 {f.sha256}, got "
                f"{digest} ({got} bytes, {f.size} expected). Nothing was kept; if the source "
                "really changed, the registry (aiayn/corpora/catalog.py) must be updated"
            )
        os.replace(part, final)
    except BaseException:
        part.unlink(missing_ok=True)  # an error, ^C or a failed check keeps nothing
        raise
    fsync_path(final.parent)
    seconds = time.perf_counter() - started
    print(f"{final.name}: sha256 {f.sha256[:12]}... checked ({seconds:.1f} s)", flush=True)


def _stream(url: str, out, f: RemoteFile, final: Path) -> tuple[int, str]:
    """Copy the response of `url` into `out`: (bytes received, their sha256). A network error
    or a body shorter than its Content-Length raises a DataError saying what to do."""
    digest = hashlib.sha256()
    got = 0
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            while block := response.read(_BLOCK):
                digest.update(block)
                out.write(block)
                got += len(block)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        # An HTTP error reads best whole ("HTTP Error 404: Not Found"); a URLError by its reason.
        reason = e if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", None) or e
        raise DataError(f"could not download {url}: {reason}{_by_hand(f, final)}") from e
    # http.client returns a short body without an error when the peer closes early.
    if length is not None and got != int(length):
        raise DataError(
            f"could not download {url}: the connection closed after {got} of {length} bytes"
            f"{_by_hand(f, final)}"
        )
    return got, digest.hexdigest()


def _by_hand(f: RemoteFile, final: Path) -> str:
    how = f" gzip-compressed (gzip -n < {PurePosixPath(f.url).name} > {final})" if f.gzip else ""
    return (
        f". Nothing was kept. Run the command again (it starts the file over), set {MIRROR_ENV} "
        f"(or --mirror) to a copy of the files, or fetch {f.url} another way and save it as "
        f"{final}{how}: it is kept when its sha256 is {f.sha256}"
    )


def stored_sha256(path: Path, gzipped: bool) -> str | None:
    """sha256 of the file's content (for `gzipped`, of the text inside); None if unreadable."""
    digest = hashlib.sha256()
    try:
        with gzip.open(path, "rb") if gzipped else open(path, "rb") as fh:
            while block := fh.read(_BLOCK):
                digest.update(block)
    except (OSError, EOFError, zlib.error):  # not gzip, or cut short
        return None
    return digest.hexdigest()

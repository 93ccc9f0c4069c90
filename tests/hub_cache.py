"""A Hugging Face Hub cache laid out as `huggingface_hub` lays it out, for tests without a network:

<cache>/models--<org>--<name>/blobs/<sha256>              the files' bytes
<cache>/models--<org>--<name>/snapshots/<commit>/<file>   relative links into blobs/
<cache>/models--<org>--<name>/refs/main                   the commit main points at
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(cache: Path, repo_id: str, files: Path, commit: str = "a" * 40) -> Path:
    """Put the files of directory `files` into `cache` as revision `commit` of model `repo_id`,
    with `refs/main` pointing at it; returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(files.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def hub_refusal(error: type[Exception], status: int, repo_id: str) -> Exception:
    """The exception `huggingface_hub` raises when the Hub answers `status` for `repo_id`."""
    import httpx2  # huggingface_hub's HTTP client

    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
    return error(f"{status} for {repo_id}", response=httpx2.Response(status, request=request))

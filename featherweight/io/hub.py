"""Models by their Hugging Face Hub name (`org/name`): a snapshot of the repository on this disk.

`model: {path: meta-llama/Llama-3.1-8B-Instruct}`, and the same name given to `plan`, `generate`,
`chat`, `convert` and `export --base-model`, is resolved by `huggingface_hub.snapshot_download`:
online it downloads what featherweight reads (config, safetensors, tokenizer files -- never
pickles) into the Hub cache, or finds them there; offline (`HF_HUB_OFFLINE=1`, or the Hub out of
reach) it reads the cache as `huggingface_hub` laid it out (`models--org--name/snapshots/<commit>`,
with `refs/main` naming the commit). A path on this machine always wins over a name: a directory
or file of that name is read as it is.

The environment (`HF_HUB_OFFLINE`, `HF_HUB_CACHE`, `HF_HOME`) is read at each call, not when
`huggingface_hub` was first imported, so a long-lived process and the tests see what is set now.
A run records the commit it trained on; a resume or an export asks for that commit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from featherweight.errors import HubModelError

# `org/name`, the form every model repository on the Hub has (huggingface_hub's validate_repo_id)
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
_FILE_SUFFIXES = (".gguf", ".json", ".safetensors", ".bin", ".pt", ".pth", ".ckpt")
WEIGHT_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CONFIG_FILES = ("config.json",)
_TRUE = {"1", "on", "yes", "true"}


def looks_like_hub_name(source: str) -> bool:
    """Whether `source` has the shape of a Hub repository name (`org/name`, no file suffix)."""
    return bool(_HUB_NAME.match(source)) and Path(source).suffix.lower() not in _FILE_SUFFIXES


def is_hub_name(source: str | Path) -> bool:
    """A Hub name that is not also a path on this machine (relative to the working directory)."""
    text = str(source)
    return looks_like_hub_name(text) and not Path(text).expanduser().exists()


def hub_cache() -> Path:
    """Where `huggingface_hub` keeps models: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as `huggingface_hub` reads it (1, ON, YES, TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_snapshot(
    name: str, files: tuple[str, ...] = WEIGHT_FILES, revision: str | None = None
) -> Path:
    """The local snapshot directory of the Hub model `name` holding `files` (glob patterns):
    downloaded when online, from the Hub cache offline; typed errors that say what to do."""
    from huggingface_hub import errors, snapshot_download

    cache, offline = hub_cache(), hub_offline()
    where = f"the local Hub cache {cache}"
    page = f"https://huggingface.co/{name}"
    try:
        return Path(
            snapshot_download(
                name,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
                allow_patterns=list(files),
            )
        )
    except errors.GatedRepoError:
        raise HubModelError(
            f"model {name} is gated on the Hugging Face Hub: accept its license at {page}, log in "
            "(hf auth login, or set HF_TOKEN), then run again"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubModelError(
            f"model {name!r} is neither a path on this machine nor a model on the Hugging Face Hub "
            "(or it is private and you are not logged in); check the name, or give a local "
            "directory or .gguf file"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubModelError(
            f"model {name} has no revision {revision!r} on the Hub any more; put that snapshot "
            f"back in {where}, or start a new run"
        ) from None
    except errors.IncompleteSnapshotError:
        raise HubModelError(
            f"model {name} is only partly in {where} (a download was interrupted); run again "
            "online to complete it"
        ) from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        fix = "unset HF_HUB_OFFLINE" if offline else "connect to the network"
        raise HubModelError(
            f"model {name} is neither a path on this machine nor in {where}, and {why}; {fix} "
            "to download it (or set HF_HOME / HF_HUB_CACHE to the cache that holds it), or give "
            "a local directory"
        ) from None
    except errors.HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        raise HubModelError(
            f"the Hugging Face Hub refused model {name} (HTTP {status}); check the name and your "
            "token (hf auth login, or HF_TOKEN), or give a local directory"
        ) from None


def snapshot_revision(snapshot: Path) -> str | None:
    """The commit a snapshot directory holds (`.../snapshots/<commit>`), else None."""
    return snapshot.name if snapshot.parent.name == "snapshots" else None


def model_location(
    source: str | Path, files: tuple[str, ...] = WEIGHT_FILES, revision: str | None = None
) -> Path:
    """Where the model `source` is on this disk: the path itself, or a Hub name's snapshot."""
    if is_hub_name(source):
        return hub_snapshot(str(source), files, revision)
    return Path(source).expanduser()

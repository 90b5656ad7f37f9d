"""Models from the Hugging Face Hub: an `org/name` id resolved to a snapshot directory of the local
Hub cache, downloaded through `huggingface_hub` when it is not there yet (docs/checkpoint-format.md,
"Models from the Hugging Face Hub").

The cache, the token, offline mode and the endpoint are huggingface_hub's own: HF_HUB_CACHE (or
HF_HOME/hub), HF_TOKEN (or the token `hf auth login` saved), HF_HUB_OFFLINE=1, HF_ENDPOINT (a mirror).
Only the files a checkpoint is served from are fetched (CHECKPOINT_PATTERNS), with huggingface_hub's
progress bars.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from depthserve.errors import HubModelError

# What an HF-style checkpoint is served from (depthserve/loading/hf_loader.py, tokenizer.py): its
# config, its safetensors weights (one file or shards and their index), the tokenizer and chat
# template files transformers reads, and the generation defaults.
CHECKPOINT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# huggingface_hub's own rule for a model id: one namespace, one name, each of word characters, '-'
# and '.', at most 96 characters, no '--' or '..' (those are its cache's separators).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_TRUE = ("1", "on", "yes", "true")


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hub model id (`org/name`)."""
    return bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name and not name.endswith(".git")


def hub_cache_dir() -> str | None:
    """The Hub cache the environment names now (HF_HUB_CACHE, else HF_HOME/hub; None: huggingface_hub's
    default). Read at each call, as HF_HUB_OFFLINE and HF_ENDPOINT are: huggingface_hub reads them once,
    when it is first imported (by transformers, early), so a process that sets them later would
    otherwise not be heard."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def hub_offline() -> bool:
    """Whether the Hub may not be contacted (HF_HUB_OFFLINE, or transformers' TRANSFORMERS_OFFLINE),
    read at each call, as hub_cache_dir is."""
    from huggingface_hub import constants

    named = (os.environ.get(var, "").strip().lower() for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(value in _TRUE for value in named) or constants.HF_HUB_OFFLINE


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; None: main) in the
    local Hub cache, its checkpoint files downloaded first unless offline. Raises HubModelError saying
    what to do when the id, the revision or the access is wrong, or the model is neither cached nor
    reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    from depthserve import __version__

    offline = hub_offline()
    shown = _shown(repo_id, revision)
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=list(CHECKPOINT_PATTERNS),
                                   cache_dir=hub_cache_dir(), local_files_only=offline,
                                   endpoint=_hub_url(), library_name="depthserve",
                                   library_version=__version__)
    except GatedRepoError as exc:
        raise HubModelError(f"'{repo_id}' is a gated model: accept its terms on {_hub_url()}/{repo_id} "
                            "and set HF_TOKEN to a token of that account") from exc
    except RepositoryNotFoundError as exc:
        raise HubModelError(f"no model '{repo_id}' on the Hugging Face Hub (or it is private: set HF_TOKEN to a "
                            f"token that can read it), nor a checkpoint directory '{repo_id}' here") from exc
    except RevisionNotFoundError as exc:
        raise HubModelError(f"'{repo_id}' on the Hugging Face Hub has no revision '{revision}' (a branch, tag or "
                            "commit)") from exc
    except LocalEntryNotFoundError as exc:
        raise HubModelError(_not_cached_message(repo_id, revision, offline, exc)) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no answer"
        hint = ": set HF_TOKEN to a token that can read it" if status in (401, 403) else ""
        raise HubModelError(f"the Hugging Face Hub refused {shown} (HTTP {status}){hint}") from exc
    except OSError as exc:  # the cache folder not writable, the disk full
        raise HubModelError(f"cannot download {shown} into the Hugging Face cache: {exc}") from exc
    return _checked_snapshot(Path(folder), shown)


def _hub_url() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _shown(repo_id: str, revision: str | None) -> str:
    return f"'{repo_id}'" if revision is None else f"'{repo_id}' at revision '{revision}'"


def _not_cached_message(repo_id: str, revision: str | None, offline: bool, exc: Exception) -> str:
    """One line (the command line prints it as one `error:` line): huggingface_hub's own message for
    this case runs over several, so only the first line of its cause is quoted."""
    cache = hub_cache_dir() or "huggingface_hub's default cache, ~/.cache/huggingface/hub"
    cause = exc.__cause__ or exc
    reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}".rstrip(": ")
    why = "HF_HUB_OFFLINE=1 forbids contacting the Hub" if offline else f"the Hub cannot be reached ({reason})"
    flag = "" if revision is None else f" --revision {revision}"
    return (f"{_shown(repo_id, revision)} is not in the Hugging Face cache ({cache}), or only in part, and {why}: "
            f"download it once where the Hub is reachable, with `hf download {repo_id}{flag}` (the same "
            "HF_HUB_CACHE or HF_HOME), or load it once with the Hub reachable")


def _checked_snapshot(folder: Path, shown: str) -> Path:
    """The snapshot, if it holds what an HF-style checkpoint is served from."""
    if not (folder / "config.json").is_file():
        raise HubModelError(f"{shown} has no config.json: depthserve serves Hub repositories holding a "
                            "Hugging Face checkpoint (config.json and *.safetensors weights)")
    if not any(folder.glob("*.safetensors")):
        raise HubModelError(f"{shown} has no *.safetensors weights: depthserve reads a Hub checkpoint's "
                            "weights from safetensors files only")
    return folder

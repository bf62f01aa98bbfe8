"""Hugging Face Hub ids for models and drafts, resolved to local paths.

Accepted forms (a local path that exists always wins):

- ``org/name`` and ``org/name@revision`` (branch, tag or commit, or a full ref:
  ``refs/pr/N`` for a pull request, ``refs/heads/BRANCH``, ``refs/tags/TAG``): a safetensors
  repo; only the files the loaders read are fetched (top-level weights and
  index, config, tokenizer and chat-template files).
- ``org/name:QUANT`` (as llama.cpp's ``-hf`` and ollama's ``hf.co/`` take it) or
  ``org/name/path/file.gguf``, either with ``@revision``: one GGUF file of a
  GGUF repo, and only that file is fetched.

Downloads go through ``huggingface_hub`` into its standard cache (``HF_HOME``,
``HF_HUB_CACHE``) with its progress bars; with ``HF_HUB_OFFLINE=1``, or when the
Hub cannot be reached, the cached copy is used.
"""

import functools
import os
import re
from pathlib import Path
from typing import Optional, Tuple, Union

from ..errors import DFlashError

# What the folder loaders read (mlx_dflash.loading.hf, mlx-lm's tokenizer loader); no *.py.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jinja"]
IGNORE_PATTERNS = ["*/*"]  # the loaders read the top level only

_PART = r"[A-Za-z0-9][\w.-]*"
# A revision: a branch, tag or commit, or a full git ref as huggingface_hub takes
# one: refs/pr/N (a pull request), refs/heads/BRANCH, refs/tags/TAG (either may hold slashes).
_REV = r"[\w.-]+|refs/pr/\d+|refs/(?:heads|tags)/[\w.-]+(?:/[\w.-]+)*"
_HUB_ID = re.compile(
    rf"^(?P<repo>{_PART}/{_PART})"
    rf"(?:(?::(?P<quant>[\w.-]+))|(?:/(?P<file>[^@:]+\.gguf)))?"
    rf"(?:@(?P<rev>{_REV}))?$"
)


def parse(spec: str) -> Optional[Tuple[str, Optional[str], Optional[str], Optional[str]]]:
    """(repo_id, revision, quant tag, file) for a hub id, None for anything else."""
    m = _HUB_ID.match(spec)
    if m is None or spec.startswith(("/", ".", "~")):
        return None
    repo, rev = m["repo"], m["rev"]
    if "--" in repo or ".." in repo or repo.endswith((".", "-")) or len(repo.split("/")[1]) > 96:
        return None
    if rev is not None and ".." in rev:  # no git ref holds one; in the cache's refs/ it would climb out
        return None
    return repo, rev, m["quant"], m["file"]


def resolve(path_or_id: Union[str, Path, None]) -> Optional[Path]:
    """A local path for a model/draft argument: the path itself when it exists
    (or does not look like a hub id), else the hub id's cached or downloaded files."""
    if path_or_id is None:
        return None
    if not isinstance(path_or_id, (str, os.PathLike)):
        raise DFlashError(f"a model or draft is a path or a Hugging Face id, got {type(path_or_id).__name__}")
    if not str(path_or_id).strip():  # Path("") is the current folder
        raise DFlashError("a model or draft path is empty")
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    parsed = parse(str(path_or_id))
    if parsed is None:
        return p  # the loaders say the path does not exist
    repo, rev, quant, file = parsed
    with _hub_errors(str(path_or_id), repo, rev, file):
        if file is not None:
            return _download_file(repo, file, rev)
        if quant is not None:
            return _download_file(repo, _pick_gguf(repo, rev, quant), rev)
        return _download_repo(repo, rev)


def _download_repo(repo: str, rev: Optional[str]) -> Path:
    from huggingface_hub import snapshot_download

    folder = Path(
        _offline_first(
            snapshot_download, repo, revision=rev, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS
        )
    )
    if not any(folder.glob("*.safetensors")):
        ggufs = _gguf_names(_repo_files(repo, rev))
        if ggufs:
            raise DFlashError(
                f"{repo} is a GGUF repo: name one file, as {repo}:QUANT or {repo}/FILE.gguf (files: {', '.join(ggufs)})"
            )
    return folder


def _download_file(repo: str, file: str, rev: Optional[str]) -> Path:
    from huggingface_hub import hf_hub_download

    from .gguf import split_parts

    parts = split_parts(file)
    if parts is None:
        return Path(_offline_first(hf_hub_download, repo, file, revision=rev))
    # A part of a split GGUF: every part, into one snapshot folder; the loader finds them by name.
    listed = set(_repo_files(repo, rev))
    missing = [f for f in parts if f not in listed]
    if missing:  # before fetching the others (many GB, on the models that come split)
        where = "the Hugging Face cache holds" if _offline() else "the repo lists"
        raise DFlashError(f"{repo}/{parts[0]} is split in {len(parts)} parts, and {where} no {', '.join(missing)}")
    paths = [Path(_offline_first(hf_hub_download, repo, f, revision=rev)) for f in parts]
    return paths[parts.index(file)]


def _no_network(e: BaseException) -> bool:
    from huggingface_hub import errors as he

    return isinstance(e, (he.OfflineModeIsEnabled, ConnectionError, TimeoutError)) or type(e).__module__.startswith(
        "httpx"
    )  # httpx's connection errors are no OSErrors


def _offline_first(fetch, *args, **kwargs):
    """``fetch`` (a huggingface_hub download function), from the cache alone when offline or
    when the Hub cannot be reached (for a commit-hash revision huggingface_hub would
    otherwise still ask the Hub for the commit's file list)."""
    if not _offline() and _reachable():
        try:
            return fetch(*args, **kwargs)
        except Exception as e:
            if not _no_network(e):
                raise
    return fetch(*args, local_files_only=True, **kwargs)


@functools.cache
def _reachable() -> bool:
    """Whether the Hub answers one request (asked once a process): a file
    download retries a connection error five times with backoff (25 s of
    "Retrying" lines offline), where one failed request says enough."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception as e:  # another fault (a proxy's, say) is left to the download to report
        return not _no_network(e)
    return True


def _repo_files(repo: str, rev: Optional[str]) -> list:
    """The repo's file names: from the Hub, else those of the cached snapshot."""
    import huggingface_hub as hf

    if not _offline():
        try:
            return hf.list_repo_files(repo, revision=rev)
        except Exception as e:
            if not _no_network(e):
                raise
    # An empty pattern list asks for no file: huggingface_hub only resolves the revision's snapshot folder.
    folder = Path(hf.snapshot_download(repo, revision=rev, local_files_only=True, allow_patterns=[]))
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())


def _gguf_names(files) -> list:
    """The model GGUFs among ``files``, a split one once, as its first part (the
    name llama.cpp's -hf takes)."""
    from .gguf import split_parts

    names = [f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower()]
    return sorted({(split_parts(f) or [f])[0] for f in names})


def _pick_gguf(repo: str, rev: Optional[str], quant: str) -> str:
    """The GGUF file of ``repo`` whose name carries the tag ``quant`` (case-insensitive, as llama.cpp matches)."""
    files = _gguf_names(_repo_files(repo, rev))
    tag = re.compile(rf"(?:^|[-_.]){re.escape(quant)}(?:[-_.]|$)", re.IGNORECASE)
    hits = [f for f in files if tag.search(Path(f).name[: -len(".gguf")])]
    if not hits:
        raise DFlashError(
            f"{repo} has no GGUF file tagged {quant!r}"
            + (f" (files: {', '.join(files)})" if files else " (no .gguf files)")
        )
    if len(hits) > 1:
        raise DFlashError(f"{repo}:{quant} matches several files ({', '.join(hits)}); name one as {repo}/FILE.gguf")
    return hits[0]


class _hub_errors:
    """huggingface_hub's exceptions as one DFlashError naming the id and the cause."""

    def __init__(self, spec: str, repo: str, rev: Optional[str], file: Optional[str]):
        self.spec, self.repo, self.rev, self.file = spec, repo, rev, file

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, DFlashError):
            return False
        from huggingface_hub import errors as he

        where = f"{self.spec!r} is not a local path, and as a Hugging Face repo id"
        if isinstance(e, he.GatedRepoError):
            msg = (
                f"{where}: {self.repo} is gated; accept its terms on huggingface.co and log in "
                "(`hf auth login`, or HF_TOKEN)"
            )
        elif isinstance(e, he.RepositoryNotFoundError):
            msg = f"{where}: no repo {self.repo} on the Hub (or it is private and you are not logged in)"
        elif isinstance(e, he.RevisionNotFoundError):
            msg = f"{where}: {self.repo} has no revision {self.rev!r}"
        elif isinstance(e, he.LocalEntryNotFoundError):
            msg = (
                f"{where}: {self.repo}"
                + (f"@{self.rev}" if self.rev else "")
                + " is not in the Hugging Face cache and the Hub cannot be reached"
                + (" (HF_HUB_OFFLINE is set)" if _offline() else " (no network?)")
            )
        elif isinstance(e, he.EntryNotFoundError):
            msg = f"{where}: {self.repo} has no file {self.file or ''}".rstrip()
        elif isinstance(e, (he.HfHubHTTPError, OSError)) or _no_network(e):
            msg = f"{where}: cannot fetch {self.repo}: {type(e).__name__}: {e}"
        elif isinstance(e, ValueError):  # huggingface_hub refuses the id or file name itself (a '..', say)
            msg = f"{where}: {e}"
        else:
            return False
        raise DFlashError(msg.splitlines()[0]) from None


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


# --- which published draft fits a target --------------------------------------------------

# z-lab's published DFlash drafts for Qwen3.5/3.6 targets (the "Supported Models" table of
# github.com/z-lab/dflash's README and the drafts' Hugging Face model pages). A target is
# recognised by its text config (model type, hidden size, layers: from the public config.json
# files of Qwen/Qwen3.5-9B and fine-tunes of the others, and slime's Qwen3.5 model scripts),
# which survives renamed folders; Qwen3.6 has Qwen3.5's shapes, so the name tells them apart.
# (family, size, draft repo, (model_type, hidden_size, num_hidden_layers) or None = by name only)
PUBLISHED_DRAFTS = [
    ("Qwen3.5", "4B", "z-lab/Qwen3.5-4B-DFlash", ("qwen3_5", 2560, 32)),
    ("Qwen3.5", "9B", "z-lab/Qwen3.5-9B-DFlash", ("qwen3_5", 4096, 32)),
    ("Qwen3.5", "27B", "z-lab/Qwen3.5-27B-DFlash", ("qwen3_5", 5120, 64)),
    ("Qwen3.6", "27B", "z-lab/Qwen3.6-27B-DFlash", ("qwen3_5", 5120, 64)),
    ("Qwen3.5", "35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", ("qwen3_5_moe", 2048, 40)),
    ("Qwen3.6", "35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", ("qwen3_5_moe", 2048, 40)),
    ("Qwen3.5", "122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash", None),
    ("Qwen3.5", "397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash", ("qwen3_5_moe", 4096, 60)),
]

_NAME = re.compile(r"qwen3\.?([56])[-_ ]?(\d+b(?:[-_]a\d+b)?)", re.IGNORECASE)


def _shape(config: dict) -> Tuple[Optional[str], Optional[int], Optional[int]]:
    c = {**config, **(config.get("text_config") or {})}
    mt = str(c.get("model_type") or config.get("model_type") or "")
    mt = mt[: -len("_text")] if mt.endswith("_text") else mt
    if mt == "qwen3_5" and (c.get("num_experts") or 0) > 0:
        mt = "qwen3_5_moe"
    return mt, c.get("hidden_size"), c.get("num_hidden_layers")


def suggest_draft(config: dict, name: str = "") -> list:
    """The published drafts (repo ids) that fit a target, by its config, else by its name."""
    m = _NAME.search(name or "")
    family = f"Qwen3.{m[1]}" if m else None
    size = m[2].upper().replace("_", "-") if m else None
    shape = _shape(config)
    by_shape = [d for d in PUBLISHED_DRAFTS if d[3] is not None and d[3] == shape]
    if by_shape:
        same_family = [d for d in by_shape if d[0] == family]
        return [d[2] for d in (same_family or by_shape)]
    return [d[2] for d in PUBLISHED_DRAFTS if d[0] == family and d[1] == size]


class DraftHint(UserWarning):
    """A target was loaded without a draft, and a published draft fits it."""


def draft_hint(drafts: list) -> Optional[str]:
    """One line naming the published draft(s) (``suggest_draft``'s list) for a target loaded without one."""
    if not drafts:
        return None
    return f"no draft given, decoding without one; the published DFlash draft for this target is {' or '.join(drafts)}"

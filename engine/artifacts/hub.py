"""Models on disk and on the Hugging Face Hub: cache scan, name resolution, search, download.

The local cache is read directly (``models--org--name/{refs,blobs,snapshots}``), which
is cheap and works offline; only search and download talk to the Hub, through
huggingface_hub. Downloads go one file at a time (hub_resume.py) so a cancel lands
between files or between chunks of one; a restarted download skips the files already
complete and continues a stopped one from its last byte.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.artifacts.hub_resume import (
    ChecksumMismatch,
    DiskFull,
    discard_stale_partials,
    fetch_blob,
    listed_etag,
    partial_path,
)
from engine.errors import EngineError, ModelLoadError
from engine.files import read_text_bounded

# What a model download fetches by default: weights, configs, tokenizer, templates.
# Never code (*.py): models' code is not run here.
DEFAULT_PATTERNS = (
    "*.safetensors",
    "*.json",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
)

_REPO_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")


class HubError(EngineError):
    """Searching or downloading from the Hub failed (network, unknown repo, access)."""


class DownloadCancelled(EngineError):
    """A download was cancelled; files completed so far stay in the cache."""


@dataclass
class LocalModel:
    name: str  # repo id for cached models, folder or file name otherwise
    path: Path  # snapshot folder, model folder, or .gguf file
    source: str  # "hf-cache", "folder" or "gguf"
    repo_id: str | None = None
    family: str = ""
    parameters: int = 0
    quantization: str = ""
    size_on_disk: int = 0
    context_length: int = 0
    error: str | None = None  # why it cannot be used, when it cannot


@dataclass
class HubModel:
    repo_id: str
    library: str | None = None
    downloads: int = 0
    likes: int = 0
    tags: list[str] = field(default_factory=list)
    last_modified: str | None = None


# ---- the local cache ----------------------------------------------------------------


def hf_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads, honouring HF_HUB_CACHE and HF_HOME."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def snapshot_path(repo_id: str, cache_dir: Path | None = None, revision: str = "main") -> Path | None:
    """The snapshot folder a revision points to, or None when the repo is not cached."""
    folder = repo_folder(repo_id, cache_dir)
    snapshots = folder / "snapshots"
    ref = folder / "refs" / revision
    if ref.is_file():
        candidate = snapshots / read_text_bounded(ref, 4096, "a cache ref (a commit hash)", ModelLoadError).strip()
        if candidate.is_dir():
            return candidate
    if (snapshots / revision).is_dir():  # a commit hash given as the revision
        return snapshots / revision
    if snapshots.is_dir():  # no ref (e.g. downloaded by hash): the newest snapshot
        found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


def resolve_model_path(name_or_path: str | Path, cache_dir: Path | None = None) -> Path:
    """A model folder, a .gguf file, or a repo id already in the HF cache -> a path to read."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        if path.name == "config.json":
            return path.parent
        raise ModelLoadError(f"{path} is a file but not a .gguf model; point at the model's folder instead")
    if path.exists():  # a device, a pipe or a socket: nothing a model is made of
        raise ModelLoadError(f"{path} is not a file or folder; give a model folder, a .gguf file, or a repo id")
    if _REPO_ID.match(text) and not text.startswith((".", "/")):
        snap = snapshot_path(text, cache_dir)
        if snap is not None:
            return snap
        raise ModelLoadError(
            f"{text} is not in the Hugging Face cache ({cache_dir or hf_cache_dir()}); download it first "
            f"from the model browser or with `hf download {text}`"
        )
    raise ModelLoadError(f"{text} does not exist; give a model folder, a .gguf file, or a Hugging Face repo id")


def model_name(path: Path) -> str:
    """A readable name: the repo's name for cache snapshots, else the folder or file name."""
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return path.stem if path.is_file() else path.name


def _blobs_size(folder: Path) -> int:
    """Bytes the repo takes: each blob once, however many snapshots link to it."""
    blobs = folder / "blobs"
    if blobs.is_dir():
        return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file() and not p.name.endswith(".incomplete"))
    return _folder_size(folder)


def scan_local_models(
    extra_dirs: tuple[str | Path, ...] | list[str | Path] = (), cache_dir: Path | None = None
) -> list[LocalModel]:
    """Every usable model in the HF cache and in ``extra_dirs`` (model folders, folders
    of models, or .gguf files). Models that cannot be read are listed with ``error``."""
    found: list[LocalModel] = []
    cache = cache_dir or hf_cache_dir()
    if cache.is_dir():
        for folder in sorted(cache.glob("models--*")):
            repo_id = folder.name[len("models--") :].replace("--", "/", 1)
            snap = snapshot_path(repo_id, cache)
            if snap is None:
                continue
            ggufs = sorted(snap.glob("*.gguf"))
            if (snap / "config.json").exists():
                entry = describe(snap, source="hf-cache", name=repo_id)
                entry.repo_id = repo_id
                entry.size_on_disk = _blobs_size(folder)
                found.append(entry)
            for g in ggufs:
                entry = describe(g, source="hf-cache", name=f"{repo_id}/{g.name}")
                entry.repo_id = repo_id
                found.append(entry)
    for extra in extra_dirs:
        path = Path(extra).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            found.append(describe(path, source="gguf"))
        elif (path / "config.json").is_file():
            found.append(describe(path, source="folder"))
        elif path.is_dir():
            for child in sorted(path.iterdir()):
                if child.is_file() and child.suffix.lower() == ".gguf":
                    found.append(describe(child, source="gguf"))
                elif child.is_dir() and (child / "config.json").is_file():
                    found.append(describe(child, source="folder"))
    return found


def describe(path: Path, *, source: str, name: str | None = None) -> LocalModel:
    """One entry of the model list, from headers only; errors become ``error`` text."""
    try:
        if path.is_file():
            from engine.artifacts.gguf import read_gguf_header

            return describe_read(path, None, read_gguf_header(path), source=source, name=name)
        from engine.artifacts.config import read_config
        from engine.artifacts.weights import find_weights, read_headers

        config = read_config(path)
        return describe_read(path, config, read_headers(find_weights(path)), source=source, name=name)
    except EngineError as e:
        return LocalModel(name=name or model_name(path), path=path, source=source, error=str(e))


def describe_read(path: Path, config: Any, headers: Any, *, source: str, name: str | None = None) -> LocalModel:
    """``describe``'s entry from what was read already: a folder's config and safetensors
    headers, or a .gguf file's header (``config`` None). Nothing is read again, so a load
    that read its files describes the model from that one read."""
    entry = LocalModel(name=name or model_name(path), path=path, source=source)
    try:
        if path.is_file():
            from engine.artifacts.gguf import gguf_config

            entry.size_on_disk = path.stat().st_size
            entry.quantization = headers.quantization()
            entry.parameters = sum(t.numel for t in headers.tensors.values())
            entry.family = headers.architecture
            entry.context_length = gguf_config(headers)["max_position_embeddings"]
        else:
            from engine.artifacts.weights import parameter_count

            entry.family = config.model_type
            entry.context_length = config.context_length
            entry.size_on_disk = _folder_size(path)
            entry.parameters = parameter_count(headers, config.quantization)
            entry.quantization = describe_quantization(config, headers)
    except EngineError as e:
        entry.error = str(e)
    return entry


def describe_quantization(config: Any, headers: dict[str, Any]) -> str:
    if config.quantization is not None:
        return config.quantization.describe()
    if config.foreign_quantization:
        return config.foreign_quantization
    counts: dict[str, int] = {}
    for info in headers.values():
        counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
    main = max(counts, key=counts.__getitem__) if counts else "?"
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(main, main.lower())


def _folder_size(path: Path) -> int:
    """Bytes of every file below ``path``, each real file once (links resolved)."""
    seen: set[Path] = set()
    total = 0
    for p in path.rglob("*"):
        real = p.resolve()
        if real.is_file() and real not in seen:
            seen.add(real)
            total += real.stat().st_size
    return total


def delete_local_model(repo_id: str, cache_dir: Path | None = None) -> int:
    """Remove a repo from the HF cache (all revisions). Returns the bytes freed."""
    cache = cache_dir or hf_cache_dir()
    folder = repo_folder(repo_id, cache)
    if not folder.is_dir():
        raise ModelLoadError(f"{repo_id} is not in the Hugging Face cache ({cache}); nothing to delete")
    freed = _blobs_size(folder)
    shutil.rmtree(folder)
    shutil.rmtree(cache / ".locks" / folder.name, ignore_errors=True)
    return freed


# ---- the Hub --------------------------------------------------------------------------


def search_hub(
    query: str,
    limit: int = 20,
    *,
    library: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> list[HubModel]:
    """Models whose id contains ``query``, for MLX (library "mlx") or GGUF; both by default."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    libraries = [library] if library else ["mlx", "gguf"]
    results: dict[str, HubModel] = {}
    try:
        for lib in libraries:
            for info in api.list_models(search=query or None, filter=lib, limit=limit, sort="downloads"):
                if info.id not in results:
                    results[info.id] = HubModel(
                        repo_id=info.id,
                        library=getattr(info, "library_name", None) or lib,
                        downloads=int(getattr(info, "downloads", 0) or 0),
                        likes=int(getattr(info, "likes", 0) or 0),
                        tags=list(getattr(info, "tags", None) or []),
                        last_modified=str(info.last_modified) if getattr(info, "last_modified", None) else None,
                    )
    except Exception as e:  # httpx / huggingface_hub errors, whatever their class
        raise HubError(f"searching the Hugging Face Hub failed: {_short(e)}; check the network connection") from None
    ranked = sorted(results.values(), key=lambda m: m.downloads, reverse=True)
    return ranked[:limit]


def download(
    repo_id: str,
    *,
    progress: Callable[[int, int], None] | None = None,
    cancel: threading.Event | None = None,
    allow_patterns: list[str] | tuple[str, ...] | None = None,
    revision: str = "main",
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """Fetch a repo's model files into the HF cache; returns the snapshot folder.

    ``progress(done_bytes, total_bytes)`` follows the whole download and never goes
    back; setting ``cancel`` stops it between chunks with DownloadCancelled. A restarted
    download counts the files already in the cache and the bytes kept of a stopped
    file as done at once, and asks the server only for the rest.
    """
    from huggingface_hub import HfApi, hf_hub_download

    patterns = list(allow_patterns or DEFAULT_PATTERNS)
    cache = Path(cache_dir) if cache_dir is not None else hf_cache_dir()
    cancel = cancel or threading.Event()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:
        raise HubError(f"cannot list {repo_id} on the Hugging Face Hub: {_short(e)}") from None
    files = [s for s in info.siblings or [] if any(fnmatch.fnmatch(s.rfilename, p) for p in patterns)]
    if not files:
        raise HubError(f"{repo_id} has no files matching {', '.join(patterns)}")
    folder = repo_folder(repo_id, cache)
    blobs = folder / "blobs"
    # Partial files of blobs this revision no longer has (changed upstream) cannot be resumed.
    discard_stale_partials(blobs, {e for e in map(listed_etag, info.siblings or []) if e})
    total = sum(s.size or 0 for s in files)
    on_disk: dict[str, int] = {}  # bytes of each file already here, complete or partial
    for sibling in files:
        etag = listed_etag(sibling)
        partial = partial_path(blobs, etag) if etag else None
        if _cached_file(repo_id, sibling.rfilename, info.sha, cache) is not None:
            on_disk[sibling.rfilename] = sibling.size or 0
        elif partial is not None and partial.is_file():
            on_disk[sibling.rfilename] = min(partial.stat().st_size, sibling.size or 0)
    lock = threading.Lock()
    shown = [0]

    def report(name: str, n: int, *, stop: bool = True) -> None:
        if stop and cancel.is_set():
            raise DownloadCancelled("cancelled")
        with lock:
            on_disk[name] = n
            # Never backwards: a partial the server would not continue (200 instead of 206)
            # or that turned out bad is fetched again under a bar that waits for it.
            shown[0] = done = max(shown[0], sum(on_disk.values()))
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(sum(on_disk.values()), total)
        shown[0] = sum(on_disk.values())
    for sibling in files:
        name = sibling.rfilename
        if cancel.is_set():
            raise DownloadCancelled(f"download of {repo_id} cancelled; start it again to continue")
        if _cached_file(repo_id, name, info.sha, cache) is not None:
            continue
        try:
            fetch_blob(
                repo_id,
                name,
                folder=folder,
                revision=info.sha or revision,
                endpoint=endpoint,
                token=token,
                position=lambda n, name=name: report(name, n),
            )
            # The blob is in place: the library links the snapshot and writes the ref itself.
            hf_hub_download(
                repo_id,
                name,
                revision=revision,
                cache_dir=str(cache),
                endpoint=endpoint,
                token=token,
                tqdm_class=_silent_bar(),
            )
        except DownloadCancelled:
            raise DownloadCancelled(f"download of {repo_id} cancelled; start it again to continue") from None
        except (DiskFull, ChecksumMismatch) as e:
            raise HubError(f"downloading {name} of {repo_id} failed: {e}") from None
        except Exception as e:
            raise HubError(f"downloading {name} of {repo_id} failed: {_short(e)}") from None
        report(name, sibling.size or 0, stop=False)  # a cancel now is seen before the next file
    snap = snapshot_path(repo_id, cache, info.sha or revision)
    if snap is None:
        raise HubError(f"{repo_id} downloaded, but its snapshot is missing from {cache}")
    return snap


def _cached_file(repo_id: str, filename: str, commit: str | None, cache: Path) -> Path | None:
    if not commit:
        return None
    pointer = repo_folder(repo_id, cache) / "snapshots" / commit / filename
    return pointer if pointer.exists() else None


def _silent_bar() -> type:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class _Silent(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

    return _Silent


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."

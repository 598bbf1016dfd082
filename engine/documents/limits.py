"""What a document drop may hold, and the one-line refusal when it holds more.

Each limit is checked before the file is read whole: the size from ``stat``, the page
count from the PDF's header, a zip's members from its central directory, a folder's
files while walking it (the walk stops at the limit, so 50,000 files cost 1,000 stats).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError


class DocumentError(EngineError):
    """A document cannot be used: the message names the file and what to do."""


@dataclass(frozen=True)
class DocumentLimits:
    max_file_bytes: int = 100_000_000  # a 2 GB file is refused from its size alone
    max_pages: int = 2000
    max_files: int = 1000  # per drop, a folder counted file by file
    max_total_bytes: int = 512 * 1024 * 1024
    # Zip containers (DOCX, EPUB): what may come out of them, all members together, and
    # how much one member may grow (deflate's honest best is ~1000:1 on runs of one byte).
    max_unzipped_bytes: int = 128 * 1024 * 1024
    max_zip_ratio: int = 200
    max_zip_members: int = 5000
    max_walk_entries: int = 20000  # directory entries looked at in one folder drop


DEFAULT_LIMITS = DocumentLimits()

PDF_EXT = {".pdf"}
HTML_EXT = {".html", ".htm", ".xhtml"}
DOCX_EXT = {".docx"}
EPUB_EXT = {".epub"}
MARKDOWN_EXT = {".md", ".markdown", ".rst"}
TEXT_EXT = {".txt", ".text", ".log", ".csv", ".tsv", ".json", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".xml", ".tex"}
CODE_EXT = {
    ".py", ".js", ".ts", ".tsx", ".jsx", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
    ".kt", ".swift", ".m", ".mm", ".rb", ".php", ".sh", ".zsh", ".bash", ".sql", ".lua", ".r",
    ".scala", ".cs", ".css", ".scss", ".vue", ".svelte", ".zig", ".hs", ".ml", ".ex", ".exs",
}  # fmt: skip
DOCUMENT_EXT = PDF_EXT | HTML_EXT | DOCX_EXT | EPUB_EXT | MARKDOWN_EXT | TEXT_EXT | CODE_EXT
SUPPORTED = "PDF, text, Markdown, HTML, code, .docx or .epub"


def is_document(path: str | Path) -> bool:
    return Path(path).suffix.lower() in DOCUMENT_EXT


def check_file(path: Path, limits: DocumentLimits = DEFAULT_LIMITS) -> int:
    """The file's size, after refusing what cannot be a document here; one line each."""
    if not path.exists():
        raise DocumentError(f"{path.name}: the file is gone; pick it again.")
    if not path.is_file():
        raise DocumentError(f"{path.name}: not a regular file.")
    if not is_document(path):
        raise DocumentError(f"{path.name}: not a document this app reads ({SUPPORTED}).")
    size = path.stat().st_size
    if size == 0:
        raise DocumentError(f"{path.name}: the file is empty (0 bytes).")
    if size > limits.max_file_bytes:
        raise DocumentError(
            f"{path.name}: {_mb(size)} is over the {_mb(limits.max_file_bytes)} limit for one document; "
            "split it or pick the part you need."
        )
    return size


def collect(paths: list[Path], limits: DocumentLimits = DEFAULT_LIMITS) -> tuple[list[Path], list[str]]:
    """Files to index out of what was dropped (files and folders), and one line per skip.

    A folder is walked breadth-first without following links; hidden entries are skipped.
    Over ``max_files`` documents, or ``max_walk_entries`` entries looked at, the whole drop
    is refused: indexing the first thousand of 50,000 files would answer from an arbitrary
    part of them.
    """
    files: list[Path] = []
    skipped: list[str] = []
    seen = 0
    for root in paths:
        if root.is_dir() and not root.is_symlink():
            queue = [root]
            while queue:
                folder = queue.pop(0)
                try:
                    entries = sorted(os.scandir(folder), key=lambda e: e.name)
                except OSError as exc:
                    skipped.append(f"{folder.name}: cannot be read ({exc.strerror}).")
                    continue
                for entry in entries:
                    seen += 1
                    if seen > limits.max_walk_entries:
                        raise DocumentError(_too_many(root, f"over {limits.max_walk_entries:,} entries"))
                    if entry.name.startswith("."):
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        queue.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False) and is_document(entry.name):
                        files.append(Path(entry.path))
                        if len(files) > limits.max_files:
                            raise DocumentError(_too_many(root, f"over {limits.max_files:,} documents"))
        else:
            files.append(root)
    return files, skipped


def _too_many(root: Path, what: str) -> str:
    return f"{root.name}: {what} is more than one drop takes; drop a smaller folder."


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"

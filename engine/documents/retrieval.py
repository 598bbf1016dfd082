"""What the model reads about the documents: all of them when they fit, else the best chunks.

``retrieve`` ranks chunks with the lexical index (BM25) and, when an embedding of the
question is given, the vector index too, and fuses the two lists by reciprocal rank
(each chunk scores the sum of 1 / (60 + rank) over the lists it is in; 60 is the constant
of Cormack et al., which keeps one list's top from drowning the other's).

``build_context`` returns the sources and the text block for the prompt: when every
document's text fits the budget, all of it goes in, section by section, each with its
source; otherwise the top ``k`` retrieved chunks, as many as fit the budget. The block numbers the sources [1], [2],
... and asks the model to cite them that way; the same numbers label the reply's cards.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from engine.documents.index import DocumentIndex, Hit

RRF_K = 60


@dataclass
class Source:
    number: int  # [n] in the prompt and on the card
    path: str
    page: int | None
    heading: str | None
    passage: str

    def label(self) -> str:
        where = f"page {self.page}" if self.page else (self.heading or "")
        return f"{os.path.basename(self.path)}, {where}" if where else os.path.basename(self.path)

    def to_dict(self) -> dict:
        return {
            "number": self.number,
            "path": self.path,
            "page": self.page,
            "heading": self.heading,
            "passage": self.passage,
        }


@dataclass
class Context:
    sources: list[Source]
    text: str  # the block to put before the question
    whole: bool  # True when every document went in whole
    top: list[Source]  # the best few chunks for the question: the cards of a reply citing none


def fuse(*rankings: list[Hit], k: int = RRF_K) -> list[Hit]:
    scores: dict[int, float] = {}
    hits: dict[int, Hit] = {}
    for ranking in rankings:
        for rank, hit in enumerate(ranking):
            scores[hit.chunk_id] = scores.get(hit.chunk_id, 0.0) + 1.0 / (k + rank + 1)
            hits.setdefault(hit.chunk_id, hit)
    order = sorted(scores, key=lambda cid: -scores[cid])
    return [Hit(**{**hits[c].__dict__, "score": scores[c]}) for c in order]


def retrieve(
    index: DocumentIndex, question: str, k: int = 5, query_vec: list[float] | None = None, model: str = ""
) -> list[Hit]:
    depth = max(20, k * 4)  # fuse deeper lists than we keep, so a chunk second in both wins
    lexical = index.search_lexical(question, depth)
    if query_vec is None:
        return lexical[:k]
    return fuse(lexical, index.search_vector(query_vec, model, depth))[:k]


def build_context(
    index: DocumentIndex,
    question: str,
    budget_chars: int,
    k: int = 5,
    query_vec: list[float] | None = None,
    model: str = "",
    cards: int = 3,
) -> Context:
    top = retrieve(index, question, max(k, cards), query_vec, model)
    if index.total_chars() <= budget_chars:
        hits, whole = _merge_pages(index.all_chunks()), True
    else:  # the best k, as many of them as fit the budget (the best one always)
        hits, whole, used = [], False, 0
        for h in top[:k]:
            if hits and used + len(h.text) > budget_chars:
                break
            hits.append(h)
            used += len(h.text)
    sources = [Source(i + 1, h.path, h.page, h.heading, h.text) for i, h in enumerate(hits)]
    best = [Source(0, h.path, h.page, h.heading, h.text) for h in top[:cards]]
    return Context(sources, format_block(sources), whole, best)


def cards(ctx: Context, answer: str, passage_chars: int = 400) -> list[dict]:
    """The source cards under a reply: the sources it cites as [n], else the best chunks."""
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", answer)}
    chosen = [s for s in ctx.sources if s.number in cited] or ctx.top
    return [{**s.to_dict(), "passage": s.passage[:passage_chars]} for s in chosen]


def format_block(sources: list[Source]) -> str:
    if not sources:
        return ""
    parts = [
        "Answer from these sources. Cite each fact with its source number in brackets, like [1]. "
        "If the sources do not say, say so."
    ]
    for s in sources:
        parts.append(f"[{s.number}] {s.label()}\n{s.passage}")
    return "\n\n".join(parts)


def _merge_pages(chunks: list[Hit]) -> list[Hit]:
    """Whole documents as one source per page (or heading): chunks rejoined, overlap dropped."""
    merged: list[Hit] = []
    for h in chunks:
        last = merged[-1] if merged else None
        if last and (last.path, last.page, last.heading) == (h.path, h.page, h.heading):
            text = h.text
            # a chunk after the first of its section starts with the tail of the one before
            for cut in range(min(len(text), 400), 0, -1):
                if last.text.endswith(text[:cut]):
                    text = text[cut:].lstrip()
                    break
            last.text = f"{last.text}\n\n{text}"
        else:
            merged.append(Hit(**h.__dict__))
    return merged

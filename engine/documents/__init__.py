"""Documents in a chat: text out of files, chunks, a search index, and what goes in the prompt.

mlx-free and Qt-free, so the app, the server and the CLI all use it alike:

- ``limits``: what a drop may hold (bytes, pages, files in a folder); over a limit is one
  ``DocumentError`` line naming the file and the limit, raised before anything is read whole.
- ``extract``: PDF (pypdfium2, page numbers kept, pages without a text layer reported),
  plain text, Markdown and code, HTML (a real parser; scripts and styles dropped unrun),
  DOCX and EPUB (zip archives read with size and ratio limits against zip bombs).
- ``chunking``: pieces by structure (pages, headings, paragraphs) with overlap.
- ``index``: one SQLite file per chat: FTS5 (BM25) for words, a float32 blob table for
  vectors, refreshed when a file changes, deleted with the chat.
- ``retrieval``: reciprocal-rank fusion of the two, and the prompt's context block: every
  chunk when the documents fit, else the top ones, each with its source.
"""

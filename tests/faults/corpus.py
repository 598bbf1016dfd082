"""The bad-input corpus: what a careless or hostile user gave the app and the engine,
and what each must get. Tests in this folder are driven by these tables.

Each render case is (name, text, what the rendered message must show as text). Each CLI
case is (name, arguments, a piece of the one stderr line it must print); arguments may
name ``{model}`` (a tiny model folder) and ``{tmp}`` (a scratch folder).
"""

from __future__ import annotations

# ---- Replies are text, not HTML ---------------------------------------------------------

LONG_WORD = "x" * 600
LONG_URL = "https://example.com/" + "a" * 280
BASE64 = "QUJD" * 150

RENDER_CASES = [
    ("template type", "Use `std::vector<int>` here, or std::vector<int> in prose.",
     ["std::vector<int> here", "std::vector<int> in prose"]),
    ("strikethrough tag", "the <s> element strikes text; everything after it stays visible",
     ["the <s> element strikes text; everything after it stays visible"]),
    ("stories260K bos", "<s> Once upon a time</s> there was a cat.",
     ["<s> Once upon a time</s> there was a cat."]),
    ("div block", "<div>\nhidden?\n</div>\nafter the div", ["<div>", "hidden?", "</div>", "after the div"]),
    ("span restyle", '<span style="font-size:90px;color:red">big</span> small',
     ['<span style="font-size:90px;color:red">big</span> small']),
    ("script", "<script>alert(1)</script>", ["<script>alert(1)</script>"]),
    ("img tag", '<img src="file:///etc/passwd"> text', ['<img src="file:///etc/passwd"> text']),
    ("comment", "before <!-- hidden --> after", ["before <!-- hidden --> after"]),
    ("entities", "a &lt;b&gt; &amp; c", ["a <b> & c"]),  # Markdown entities decode, as in GitHub
    ("markdown kept", "**bold** and *em*\n\n- one\n- two\n\n1. first\n2. second",
     ["bold and em", "one", "two", "first", "second"]),
    ("code fence with html", "```html\n<div style=\"x\">hi</div>\n```\nafter",
     ['<div style="x">hi</div>', "after"]),
    ("long word", LONG_WORD, [LONG_WORD]),
    ("long url", LONG_URL, [LONG_URL]),
    ("base64", BASE64, [BASE64]),
]

# Links: (markdown, the address a click may open or None when it must not be a link at all).
LINK_CASES = [
    ("[site](https://example.com/page)", "https://example.com/page"),
    ("[plain](http://example.com/)", "http://example.com/"),
    ("[passwd](file:///etc/passwd)", None),
    ("[js](javascript:alert(1))", None),
    ("[data](data:text/html;base64,PHNjcmlwdD4=)", None),
    ("<file:///etc/passwd>", None),
    ("[smb](smb://host/share)", None),
]

# Text that must widen nothing: the column stays within the window.
WIDE_CASES = [
    ("long word", LONG_WORD),
    ("long url", LONG_URL),
    ("base64", BASE64),
    ("long code line", "```\n" + "y" * 600 + "\n```"),
]

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
    (
        "template type",
        "Use `std::vector<int>` here, or std::vector<int> in prose.",
        ["std::vector<int> here", "std::vector<int> in prose"],
    ),
    (
        "strikethrough tag",
        "the <s> element strikes text; everything after it stays visible",
        ["the <s> element strikes text; everything after it stays visible"],
    ),
    ("stories260K bos", "<s> Once upon a time</s> there was a cat.", ["<s> Once upon a time</s> there was a cat."]),
    ("div block", "<div>\nhidden?\n</div>\nafter the div", ["<div>", "hidden?", "</div>", "after the div"]),
    (
        "span restyle",
        '<span style="font-size:90px;color:red">big</span> small',
        ['<span style="font-size:90px;color:red">big</span> small'],
    ),
    ("script", "<script>alert(1)</script>", ["<script>alert(1)</script>"]),
    ("img tag", '<img src="file:///etc/passwd"> text', ['<img src="file:///etc/passwd"> text']),
    ("comment", "before <!-- hidden --> after", ["before <!-- hidden --> after"]),
    ("entities", "a &lt;b&gt; &amp; c", ["a <b> & c"]),  # Markdown entities decode, as in GitHub
    (
        "markdown kept",
        "**bold** and *em*\n\n- one\n- two\n\n1. first\n2. second",
        ["bold and em", "one", "two", "first", "second"],
    ),
    ("code fence with html", '```html\n<div style="x">hi</div>\n```\nafter', ['<div style="x">hi</div>', "after"]),
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


# ---- The engine CLI -------------------------------------------------------------------
# Placeholders: {model} a tiny llama (2,048-token context), {ctx64} the same with a 64-token
# context, {<variant>} a damaged copy (see test_engine_faults.VARIANTS), {tmp} a scratch
# folder with the files FILES writes.

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LOOPING_TEMPLATE = NESTED_LOOPS + "{% for m in messages %}{{ m.content }}{% endfor %}"
RAISING_TEMPLATE = "{{ raise_exception('this template only takes one system message') }}"

FILES = {
    "nested.jinja": NESTED_LOOPS,
    "multiply.jinja": "{{ 'x' * 2000000000 }}",
    "power.jinja": "{{ 10 ** 100000000 }}",
    "doubling.jinja": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "macro_bomb.jinja": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}"),
    "recursion.jinja": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "type_error.jinja": "{{ messages[0].content + 1 }}",
    "messages.json": '{"messages": [{"role": "user", "content": "hi"}]}',
    "deep_messages.json": '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}",
}

LONG_PROMPT = "word " * 3000  # about 3,000 tokens: more than {ctx64} and {model} hold

ENGINE_CASES = [
    # Sampling settings that mean nothing.
    (
        "temp nan",
        ["generate", "--model", "{model}", "--prompt", "hi", "--temp", "nan"],
        "temperature must be a finite number",
    ),
    (
        "temp inf",
        ["generate", "--model", "{model}", "--prompt", "hi", "--temp", "inf"],
        "temperature must be a finite number",
    ),
    (
        "temp -inf",
        ["generate", "--model", "{model}", "--prompt", "hi", "--temp=-inf"],
        "temperature must be a finite number",
    ),
    ("temp negative", ["generate", "--model", "{model}", "--prompt", "hi", "--temp", "-1"], "temperature must be >= 0"),
    (
        "temp absurd",
        ["generate", "--model", "{model}", "--prompt", "hi", "--temp", "1e30"],
        "temperature must be at most",
    ),
    (
        "repetition penalty nan",
        ["generate", "--model", "{model}", "--prompt", "hi", "--repetition-penalty", "nan"],
        "repetition penalty must be a finite number",
    ),
    (
        "repetition penalty inf",
        ["generate", "--model", "{model}", "--prompt", "hi", "--repetition-penalty", "inf"],
        "repetition penalty must be a finite number",
    ),
    (
        "repetition penalty zero",
        ["generate", "--model", "{model}", "--prompt", "hi", "--repetition-penalty", "0"],
        "repetition penalty must be > 0",
    ),
    (
        "repetition penalty absurd",
        ["generate", "--model", "{model}", "--prompt", "hi", "--repetition-penalty", "1e9"],
        "repetition penalty must be at most",
    ),
    (
        "top-p nan",
        ["generate", "--model", "{model}", "--prompt", "hi", "--top-p", "nan"],
        "top-p must be a finite number",
    ),
    ("top-p zero", ["generate", "--model", "{model}", "--prompt", "hi", "--top-p", "0"], "top-p must be in (0, 1]"),
    (
        "top-p above one",
        ["generate", "--model", "{model}", "--prompt", "hi", "--top-p", "1.5"],
        "top-p must be in (0, 1]",
    ),
    (
        "min-p nan",
        ["generate", "--model", "{model}", "--prompt", "hi", "--min-p", "nan"],
        "min-p must be a finite number",
    ),
    (
        "min-p negative",
        ["generate", "--model", "{model}", "--prompt", "hi", "--min-p", "-0.1"],
        "min-p must be in [0, 1]",
    ),
    ("top-k negative", ["generate", "--model", "{model}", "--prompt", "hi", "--top-k", "-3"], "top-k must be >= 0"),
    (
        "seed negative",
        ["generate", "--model", "{model}", "--prompt", "hi", "--seed", "-1", "--temp", "1"],
        "seed must be between 0 and 2**64-1",
    ),
    (
        "seed huge",
        ["generate", "--model", "{model}", "--prompt", "hi", "--seed", str(2**70), "--temp", "1"],
        "seed must be between 0 and 2**64-1",
    ),
    (
        "max tokens zero",
        ["generate", "--model", "{model}", "--prompt", "hi", "--max-tokens", "0"],
        "--max-tokens must be at least 1",
    ),
    # The context is a hard limit.
    (
        "prompt past the context",
        ["generate", "--model", "{ctx64}", "--prompt", LONG_PROMPT],
        "too long for the model's context",
    ),
    (
        "chat past the context",
        ["generate", "--model", "{ctx64}", "--chat", "--prompt", LONG_PROMPT],
        "This chat is too long for the model's context",
    ),
    (
        "prompt ids past the context",
        ["generate", "--model", "{ctx64}", "--prompt-ids", ",".join(["5"] * 64)],
        "(64 tokens of 64)",
    ),
    (
        "prompt past a 2,048 context",
        ["generate", "--model", "{model}", "--prompt", LONG_PROMPT * 2],
        "tokens of 2,048)",
    ),
    # Text that is not text.
    (
        "invalid UTF-8 prompt",
        ["generate", "--model", "{model}", "--prompt", "ab\udcffcd"],
        "--prompt is not valid UTF-8",
    ),
    (
        "invalid UTF-8 system",
        ["generate", "--model", "{model}", "--chat", "--prompt", "hi", "--system", "\udcfe"],
        "--system is not valid UTF-8",
    ),
    # Garbage weights are named.
    (
        "NaN weights",
        ["generate", "--model", "{nan_weights}", "--prompt", "hi", "--max-tokens", "4"],
        "the model produced NaN: its weights look damaged",
    ),
    (
        "inf weights",
        ["generate", "--model", "{inf_weights}", "--prompt", "hi", "--max-tokens", "4"],
        "the model produced NaN: its weights look damaged",
    ),
    (
        "NaN weights sampled",
        ["generate", "--model", "{nan_weights}", "--prompt", "hi", "--temp", "0.8", "--max-tokens", "4"],
        "the model produced NaN: its weights look damaged",
    ),
    (
        "NaN weights with logprobs",
        ["generate", "--model", "{nan_weights}", "--prompt", "hi", "--logprobs", "--max-tokens", "4"],
        "the model produced NaN: its weights look damaged",
    ),
    (
        "NaN weights, n-gram drafting",
        ["generate", "--model", "{nan_weights}", "--prompt", "a b a b a b", "--ngram", "2", "--max-tokens", "6"],
        "the model produced NaN: its weights look damaged",
    ),
    (
        "NaN weights, draft model",
        ["generate", "--model", "{nan_weights}", "--prompt", "hi", "--draft-model", "{model}", "--max-tokens", "6"],
        "the model produced NaN: its weights look damaged",
    ),
    # Absurd configs are refused before anything is allocated, by inspect and generate alike.
    (
        "a million layers (inspect)",
        ["inspect", "{layers_1e6}"],
        "says num_hidden_layers is 1,000,000 but the weight files hold 2",
    ),
    (
        "a million layers (generate)",
        ["generate", "--model", "{layers_1e6}", "--prompt", "hi"],
        "says num_hidden_layers is 1,000,000 but the weight files hold 2",
    ),
    ("hidden size zero (inspect)", ["inspect", "{hidden_0}"], "hidden_size is 0"),
    ("hidden size zero", ["generate", "--model", "{hidden_0}", "--prompt", "hi"], "hidden_size is 0"),
    ("zero heads", ["generate", "--model", "{heads_0}", "--prompt", "hi"], "num_attention_heads is 0"),
    ("zero heads (inspect)", ["inspect", "{heads_0}"], "num_attention_heads is 0"),
    ("zero kv heads", ["generate", "--model", "{kv_heads_0}", "--prompt", "hi"], "num_key_value_heads is 0"),
    ("negative width", ["generate", "--model", "{negative_width}", "--prompt", "hi"], "intermediate_size is -5"),
    ("width as text", ["inspect", "{text_width}"], "hidden_size is 'big'"),
    ("fractional layers", ["inspect", "{fractional_layers}"], "num_hidden_layers is 2.5"),
    (
        "vocabulary past 32 bits",
        ["generate", "--model", "{huge_vocab}", "--prompt", "hi"],
        "vocab_size is 1000000000000",
    ),
    (
        "config width disagrees with the weights",
        ["inspect", "{wrong_width}"],
        "says hidden_size is 96 but model.embed_tokens.weight in the weight files is 300×64",
    ),
    ("config nested 200,000 deep", ["inspect", "{deep_config}"], "nested too deeply"),
    (
        "config nested 200,000 deep (generate)",
        ["generate", "--model", "{deep_config}", "--prompt", "hi"],
        "nested too deeply",
    ),
    ("GGUF alignment zero", ["inspect", "{tmp}/align0.gguf"], "general.alignment 0"),
    (
        "GGUF alignment zero (generate)",
        ["generate", "--model", "{tmp}/align0.gguf", "--prompt", "hi"],
        "general.alignment 0",
    ),
    # Templates get a time and size limit.
    (
        "template nested loops",
        ["template", "--template", "{tmp}/nested.jinja", "--messages", "{tmp}/messages.json"],
        "ran for more than",
    ),
    (
        "template 2 GB string",
        ["template", "--template", "{tmp}/multiply.jinja", "--messages", "{tmp}/messages.json"],
        "tried to build a value of 2,000,000,000 items",
    ),
    (
        "template huge power",
        ["template", "--template", "{tmp}/power.jinja", "--messages", "{tmp}/messages.json"],
        "more than 10,000 digits",
    ),
    (
        "template doubling string",
        ["template", "--template", "{tmp}/doubling.jinja", "--messages", "{tmp}/messages.json"],
        "tried to build a value of",
    ),
    (
        "template macro bomb",
        ["template", "--template", "{tmp}/macro_bomb.jinja", "--messages", "{tmp}/messages.json"],
        "ran for more than",
    ),
    (
        "template endless recursion",
        ["template", "--template", "{tmp}/recursion.jinja", "--messages", "{tmp}/messages.json"],
        "maximum recursion depth",
    ),
    (
        "template type error",
        ["template", "--template", "{tmp}/type_error.jinja", "--messages", "{tmp}/messages.json"],
        "failed on this conversation",
    ),
    (
        "messages nested 200,000 deep",
        ["template", "--template", "{tmp}/nested.jinja", "--messages", "{tmp}/deep_messages.json"],
        "nested too deeply",
    ),
    (
        "chat template that never ends",
        ["generate", "--model", "{looping_template}", "--chat", "--prompt", "hi"],
        "The chat template ran for more than 2 s",
    ),
    (
        "chat template that raises",
        ["generate", "--model", "{raising_template}", "--chat", "--prompt", "hi"],
        "refused the conversation: this template only takes one system message",
    ),
    # Audio whose header lies.
    (
        "WAV at 1 Hz",
        ["transcribe", "{tmp}/one_hz.wav", "--whisper", "{tmp}/no-whisper"],
        "claims a sample rate of 1 Hz",
    ),
    (
        "WAV at 0 Hz",
        ["transcribe", "{tmp}/zero_hz.wav", "--whisper", "{tmp}/no-whisper"],
        "claims a sample rate of 0 Hz",
    ),
]


# ---- The app: what a message sent in the window gets ---------------------------------
# (name, model variant as in ENGINE_CASES, the message, a piece of the one line shown)
APP_SEND_CASES = [
    ("chat past the context", "ctx64", "word " * 400, "This chat is too long for the model's context ("),
    ("NaN weights", "nan_weights", "hello", "the model produced NaN: its weights look damaged"),
    ("inf weights", "inf_weights", "hello", "the model produced NaN: its weights look damaged"),
    ("template that never ends", "looping_template", "hello", "ran for more than"),
    ("template that raises", "raising_template", "hello", "this template only takes one system message"),
]

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
    (
        "invalid UTF-8 stop",
        ["generate", "--model", "{model}", "--prompt", "hi", "--stop", "\udcff"],
        "--stop is not valid",
    ),
    ("thinking without chat", ["generate", "--model", "{model}", "--prompt", "hi", "--thinking", "on"], "needs --chat"),
    (
        "pan and scan without an image",
        ["generate", "--model", "{model}", "--prompt", "hi", "--pan-and-scan"],
        "needs --image",
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


def _gen(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", "{" + model + "}", "--prompt", "hi", "--max-tokens", "4", *extra]


def _with_adapter(adapter: str) -> list[str]:
    return _gen("model", "--adapter", adapter)


def _bench(*extra: str) -> list[str]:
    return ["bench", "--shape", "tiny", "-p", "8", "-g", "4", *extra]


def _template(template: str, messages: str) -> list[str]:
    return ["template", "--template", template, "--messages", messages]


# Numbers on the command line: refused by the flag's own parser, before anything loads.
NUMBER_CASES = [
    ("memory budget 1e400", _gen("model", "--memory-budget", "1e400"), "--memory-budget must be a size"),
    ("memory budget nan", _gen("model", "--memory-budget", "nan"), "--memory-budget must be a size"),
    ("memory budget inf (inspect)", ["inspect", "{model}", "--memory-budget", "inf"], "--memory-budget must be"),
    (
        "max tokens as words",
        ["generate", "--model", "{model}", "--prompt", "hi", "--max-tokens", "lots"],
        "--max-tokens",
    ),
    ("seed 1.5", _gen("model", "--seed", "1.5"), "argument --seed: invalid int value: '1.5'"),
    ("ngram 10**20", _gen("model", "--ngram", str(10**20)), "--ngram must be at least 1 and at most 256"),
    ("num-draft 10**20", _gen("model", "--ngram", "2", "--num-draft", str(10**20)), "--num-draft must be at least"),
    ("adapter multiplier 1e30", _gen("model", "--adapter", "{adapter}:1e30"), "use a multiplier from -100 to 100"),
    ("bench repeat 0", _bench("--repeat", "0"), "--repeat must be a whole number from 1 to 1,000"),
    ("bench prompt -5", _bench("-p", "-5"), "-p must be a whole number from 1"),
    ("bench group size 0", _bench("--group-size", "0"), "argument --group-size: invalid choice: 0"),
    ("bench stagger -1", _bench("--concurrent", "2", "--stagger", "-1"), "--stagger must be a whole number"),
    ("bench ngram size 0", _bench("--speculative", "ngram", "--ngram-size", "0"), "--ngram-size must be a whole"),
    (
        "bench negative frame size",
        _bench("--media", "video", "--media-size=-64x-64"),
        "--media-size takes WIDTHxHEIGHT in pixels",
    ),
    ("bench frame size read as a flag", _bench("--media", "video", "--media-size", "-64x-64"), "written --flag=VALUE"),
    ("bench negative clip", _bench("--media", "video", "--media-seconds", "-5"), "--media-seconds must be a finite"),
    ("bench NaN clip", _bench("--media", "video", "--media-seconds", "nan"), "--media-seconds must be a finite"),
    ("convert 7 bits", ["convert", "{model}", "{tmp}/out7", "-q", "--bits", "7"], "argument --bits: invalid choice"),
]

# Files read whole are read with a bound: a device, a pipe or a 40 GB file is refused at once.
BOUNDED_READ_CASES = [
    ("messages from /dev/zero", _template("{tmp}/nested.jinja", "/dev/zero"), "too large to be a conversation"),
    ("messages 40 GB", _template("{tmp}/nested.jinja", "{tmp}/huge.json"), "too large to be a conversation"),
    ("template from /dev/zero", _template("/dev/zero", "{tmp}/messages.json"), "too large to be a chat template"),
    ("config.json 40 GB", ["inspect", "{config_40gb}"], "too large to be a model's settings"),
    ("generation_config.json 40 GB", _gen("generation_40gb"), "too large to be a model's settings"),
    ("index 40 GB", ["inspect", "{index_40gb}"], "too large to be a model's settings"),
    ("tokenizer.json 40 GB", _gen("tokenizer_40gb"), "too large to be a tokenizer"),
    ("tokenizer_config.json 40 GB", _gen("tokenizer_config_40gb"), "too large to be a tokenizer's settings"),
    ("chat_template.jinja 40 GB", _gen("template_40gb", "--chat"), "too large to be a chat template"),
    ("adapter_config.json 40 GB", _with_adapter("{adapter_config_40gb}"), "too large to be an adapter's settings"),
    ("a device as the model", ["inspect", "/dev/zero"], "/dev/zero is not a file or folder"),
    ("GGUF array of 2**40 items", ["inspect", "{tmp}/huge_array.gguf"], "huge_array.gguf is truncated inside its GGUF"),
]

# Settings that mean nothing are refused when the folder is read, by the artifacts layer.
SETTINGS_CASES = [
    ("int32 weights", _gen("int32_weights"), "as integers, but its config.json declares no quantization"),
    ("int32 weights (convert)", ["convert", "{int32_weights}", "{tmp}/out_int32", "-q"], "as integers"),
    ("rms_norm_eps negative", _gen("eps_negative"), "rms_norm_eps is -1.0; it must be a small positive number"),
    ("rms_norm_eps text", _gen("eps_text"), "rms_norm_eps is 'tiny'"),
    ("rope_scaling garbage", _gen("rope_garbage"), "rope_scaling is 'garbage'; it must be null or an object"),
    ("rope_scaling a list", ["inspect", "{rope_list}"], "rope_scaling is [1, 2, 3]"),
    ("rope factor negative", _gen("rope_factor_negative"), "rope_scaling.factor is -2; it must be a positive number"),
    ("yarn without its length", _gen("yarn_without_length"), "without rope_scaling.original_max_position_embeddings"),
    ("rope_theta 0", _gen("theta_0"), "rope_theta is 0; it must be a positive number"),
    ("rope_theta negative", _gen("theta_negative"), "rope_theta is -5"),
    ("rope_theta text", ["inspect", "{theta_text}"], "rope_theta is 'big'"),
    ("max_position_embeddings 0", _gen("positions_0"), "max_position_embeddings is 0; it must be a whole number"),
    ("max_position_embeddings negative", ["inspect", "{positions_negative}"], "max_position_embeddings is -7"),
    ("tie_word_embeddings text", _gen("tie_text"), "tie_word_embeddings is 'yes'; it must be true or false"),
    ("eos_token_id text", _gen("eos_text"), "eos_token_id is 'end'; it must be a token id"),
    ("generation temperature NaN", _gen("generation_nan"), "generation_config.json says temperature is nan"),
    ("generation top_p 5", _gen("generation_top_p"), "top_p is 5; it must be a number in (0, 1]"),
    ("generation top_k -3", _gen("generation_top_k"), "top_k is -3"),
    ("generation temperature text", _gen("generation_text"), "temperature is 'hot'"),
    ("generation max_new_tokens -1", _gen("generation_max_new"), "max_new_tokens is -1"),
    ("generation penalty inf", _gen("generation_penalty_inf"), "repetition_penalty is inf"),
    ("generation a list", ["inspect", "{generation_list}"], "must hold a JSON object, not list"),
    ("quantization bits as a word", _gen("quantization_text"), "quantization.bits is 'four'; it must be a whole"),
    ("chat_template a number", _gen("template_number", "--chat"), "says chat_template is 5; it must be"),
    (
        "cache file that is an adapter's weights",
        _gen("model", "--cache-file", "{adapter}/adapters.safetensors"),
        "holds tensors that are not a saved KV cache",
    ),
    # Adapters: ranks, alphas and scales that cannot be, and files cut short.
    ("PEFT r=0", _with_adapter("{peft_r0}"), "says r is 0; a LoRA rank is a whole number of at least 1"),
    ("PEFT r negative", _with_adapter("{peft_r_negative}"), "says r is -4"),
    ("PEFT r disagrees with the weights", _with_adapter("{peft_r_mismatch}"), "lora_A has rank 4 but"),
    ("PEFT alpha text", _with_adapter("{peft_alpha_text}"), "says lora_alpha is 'x'"),
    ("PEFT alpha 1e300", _with_adapter("{peft_alpha_huge}"), "says lora_alpha is 1e+300"),
    ("mlx-lm scale text", _with_adapter("{mlx_scale_text}"), "lora_parameters.scale is 'big'"),
    ("mlx-lm scale NaN", _with_adapter("{mlx_scale_nan}"), "lora_parameters.scale is nan"),
    ("mlx-lm scale 1e30", _with_adapter("{mlx_scale_1e30}"), "lora_parameters.scale is 1e+30"),
    ("mlx-lm rank disagrees", _with_adapter("{mlx_rank_mismatch}"), "lora_a has rank 4 but"),
    ("adapter weights truncated", _with_adapter("{adapter_truncated}"), "adapters.safetensors is truncated"),
]

ENGINE_CASES += NUMBER_CASES + BOUNDED_READ_CASES + SETTINGS_CASES


# ---- The app: what a message sent in the window gets ---------------------------------
# (name, model variant as in ENGINE_CASES, the message, a piece of the one line shown)
APP_SEND_CASES = [
    ("chat past the context", "ctx64", "word " * 400, "This chat is too long for the model's context ("),
    ("NaN weights", "nan_weights", "hello", "the model produced NaN: its weights look damaged"),
    ("inf weights", "inf_weights", "hello", "the model produced NaN: its weights look damaged"),
    ("template that never ends", "looping_template", "hello", "ran for more than"),
    ("template that raises", "raising_template", "hello", "this template only takes one system message"),
]

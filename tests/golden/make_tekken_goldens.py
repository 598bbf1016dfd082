"""Make a small tekken.json and record what mistral-common does with it.

Run with an environment that has mistral-common (never needed by the tests):

    python tests/golden/make_tekken_goldens.py [--data ../shared/data]

Writes tests/golden/tekken/:

- tekken.json: a tokenizer in the exact schema of Mistral's files (config with the real
  pre-tokenizer pattern, base64 ranked vocabulary, special tokens as Voxtral numbers them
  with the last four left for the loader to fill as ``<SPECIAL_i>``). The ranks past the
  256 bytes are merges learnt here from a small mixed corpus (English, digits, code,
  accented Latin, CJK, emoji); ``default_vocab_size`` cuts the last 20 of them off.
- voxtral_tekken.json: the same kind of file for the tiny Voxtral folder: Voxtral's 36
  special tokens, the byte tokens only, ``default_vocab_size`` 160 as the tiny model's
  vocabulary, and Voxtral's audio section.
- vectors.json: mistral-common's ``encode`` (no BOS; with BOS) and ``decode`` (ignoring
  special tokens, and keeping them) for varied strings, ``decode`` of chosen id runs, and
  ``encode_chat_completion`` ids for conversations under instruct formats v3, v7 and v11,
  with audio chunks (jfk.wav, and jfk.wav three times) for the Voxtral file.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from collections import Counter
from pathlib import Path

import regex

HERE = Path(__file__).resolve().parent
OUT = HERE / "tekken"
PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOXTRAL_SPECIALS = {
    0: "<unk>",
    1: "<s>",
    2: "</s>",
    3: "[INST]",
    4: "[/INST]",
    5: "[AVAILABLE_TOOLS]",
    6: "[/AVAILABLE_TOOLS]",
    7: "[TOOL_RESULTS]",
    8: "[/TOOL_RESULTS]",
    9: "[TOOL_CALLS]",
    10: "[IMG]",
    11: "<pad>",
    12: "[IMG_BREAK]",
    13: "[IMG_END]",
    14: "[PREFIX]",
    15: "[MIDDLE]",
    16: "[SUFFIX]",
    17: "[SYSTEM_PROMPT]",
    18: "[/SYSTEM_PROMPT]",
    19: "[TOOL_CONTENT]",
    24: "[AUDIO]",
    25: "[BEGIN_AUDIO]",
    32: "[ARGS]",
    33: "[CALL_ID]",
    34: "[TRANSCRIBE]",
}
CORPUS = (
    """
The quick brown fox jumps over the lazy dog. What is said in this clip? The speaker asks
the nation: ask not what your country can do for you, ask what you can do for your country.
Summarise the speech in one sentence, then answer the question. Hello, world! Numbers: 12345,
2024-06-01, 3.14159, 100%. def main(): return [x * 2 for x in range(10)]  # code
    if (a && b) { print("yes"); } else { print('no'); }
Café, naïve, résumé, Straße, Ελληνικά, русский текст. 日本語の文章です。中文测试，你好世界。
한국어 문장입니다. Emoji: 🙂 🚀 👍🏽 ❤️ and mixed: «quotes» — dashes… tabs\tand\r\nnewlines.
"""
    * 3
)
MERGES = 320
CUT = 20
VOXTRAL_AUDIO = {
    "sampling_rate": 16000,
    "frame_rate": 12.5,
    "chunk_length_s": 30.0,
    "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
}
STRINGS = [
    "Hello, world!",
    " leading space",
    "trailing space ",
    "two  spaces and   three",
    "line one\nline two\n\nline four\r\nwindows",
    "\ttab\tseparated\t",
    "digits 1234567890 and 3.14",
    "punctuation!?... (brackets) [square] {curly} <angle> 'quotes' \"double\"",
    "Café naïve résumé Straße",
    "日本語の文章です。中文测试，你好世界。",
    "한국어 문장입니다",
    "emoji 🙂🚀 👍🏽 ❤️ end",
    "def f(x):\n    return x * 2  # comment\n",
    "text with [INST] inside and </s> too",
    "<s>[SYSTEM_PROMPT]looks special[/SYSTEM_PROMPT]",
    "[AUDIO][BEGIN_AUDIO] <SPECIAL_37>",
    "",
    " ",
    "\n",
    "a",
    "ÿ€𝄞",
    "The quick brown fox jumps over the lazy dog.",
]


def learn_ranks() -> list[bytes]:
    """Byte-level BPE merges learnt on CORPUS: the order tekken's ranks have."""
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(PATTERN, CORPUS))
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    while len(ranks) < 256 + MERGES:
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        if merged not in known:
            ranks.append(merged)
            known.add(merged)
        new = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new[tuple(out)] += n
        words = new
    return ranks


def token_info(rank: int, token: bytes) -> dict:
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": text}


def tekken_file(
    ranks: list[bytes],
    specials: dict[int, str],
    listed: int,
    n_special: int,
    vocab_size: int,
    version: str,
    audio: dict | None = None,
) -> dict:
    data = {
        "config": {
            "pattern": PATTERN,
            "num_vocab_tokens": len(ranks),
            "default_vocab_size": vocab_size,
            "default_num_special_tokens": n_special,
            "version": version,
        },
        "vocab": [token_info(r, t) for r, t in enumerate(ranks)],
        "special_tokens": [
            {"rank": i, "token_str": specials.get(i, f"<SPECIAL_{i}>"), "is_control": True} for i in range(listed)
        ],
        "version": 1,
        "type": "Tekken",
    }
    if audio is not None:
        data["audio"] = audio
    return data


def wav_bytes(samples, rate: int = 16000) -> bytes:
    import wave

    import numpy as np

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def chats(jfk_wav: bytes | None, long_wav: bytes | None) -> dict[str, list[dict]]:
    out = {
        "user": [{"role": "user", "content": "What is said?"}],
        "system_user": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello.\nTwice."},
        ],
        "multi_turn": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help? "},
            {"role": "user", "content": "Count: 1, 2, 3"},
        ],
        "system_multi_turn": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Good morning"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "日本語は？ 🙂"},
        ],
        "parts_and_repeats": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}],
            },
            {"role": "user", "content": "a second user message"},
        ],
    }
    if jfk_wav is not None:
        b64 = base64.b64encode(jfk_wav).decode()
        b64_long = base64.b64encode(long_wav).decode()
        out["audio"] = [
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": b64},
                    {"type": "text", "text": "what is said in this clip ?"},
                ],
            }
        ]
        out["audio_multi_turn"] = [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": b64_long}, {"type": "text", "text": "Who speaks?"}],
            },
            {"role": "assistant", "content": "A president."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "And now?"}, {"type": "input_audio", "input_audio": b64}],
            },
        ]
    return out


def texts(messages: list[dict]) -> str:
    return "".join(
        m["content"] if isinstance(m["content"], str) else "".join(p.get("text", "") for p in m["content"])
        for m in messages
    )


def engine_view(messages: list[dict]) -> list[dict]:
    """The same conversation as the engine receives it: audio parts as {"type": "audio"}."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "audio"} if p["type"] == "input_audio" else p for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def audio_order(messages: list[dict], names: dict[str, str]) -> list[str]:
    return [
        names[p["input_audio"]]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "input_audio"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=HERE.parents[2] / "shared" / "data")
    args = parser.parse_args()

    import mistral_common
    import numpy as np
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    OUT.mkdir(parents=True, exist_ok=True)
    ranks = learn_ranks()
    specials = dict(VOXTRAL_SPECIALS)
    main_file = tekken_file(ranks, specials, 36, 40, 40 + len(ranks) - CUT, "v7")
    (OUT / "tekken.json").write_text(json.dumps(main_file, ensure_ascii=False, indent=1) + "\n")
    vox_file = tekken_file(ranks[:256], specials, 36, 36, 160, "v7", VOXTRAL_AUDIO)
    (OUT / "voxtral_tekken.json").write_text(json.dumps(vox_file, indent=1) + "\n")

    tek = Tekkenizer.from_file(OUT / "tekken.json")
    vectors: dict = {
        "strings": [],
        "id_runs": [],
        "chats": {},
        "versions": {"mistral_common": mistral_common.__version__},
    }
    for s in STRINGS:
        ids = tek.encode(s, bos=False, eos=False)
        vectors["strings"].append(
            {
                "text": s,
                "ids": ids,
                "ids_bos": tek.encode(s, bos=True, eos=False),
                "decoded": tek.decode(ids),
                "decoded_bos_keep": tek.decode([1, *ids], SpecialTokenPolicy.KEEP),
            }
        )
    rng = np.random.default_rng(0)
    n = tek.n_words
    runs = [
        [40 + 0xE6, 40 + 0x97],
        [40 + 0xF0, 40 + 0x9F, 40 + 0x99],
        [1, 3, 45, 4, 2, 37, 39],
        [40 + 0xC3, 3, 40 + 0xA9],
    ] + [rng.integers(36, n, 12).tolist() for _ in range(6)]
    for run in runs:
        vectors["id_runs"].append(
            {"ids": run, "decoded": tek.decode(run), "decoded_keep": tek.decode(run, SpecialTokenPolicy.KEEP)}
        )

    jfk = long = None
    wav = args.data / "audio" / "jfk.wav"
    if wav.is_file():
        jfk = wav.read_bytes()
        import wave

        with wave.open(str(wav)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
        long = wav_bytes(np.concatenate([pcm, pcm, pcm]))
    names = {}
    if jfk is not None:
        names = {base64.b64encode(jfk).decode(): "jfk", base64.b64encode(long).decode(): "jfk_x3"}
    for label, file in (("main", OUT / "tekken.json"), ("voxtral", OUT / "voxtral_tekken.json")):
        for version in ("v3", "v7", "v11"):
            data = json.loads(file.read_text())
            data["config"]["version"] = version
            if version == "v3":
                data.pop("audio", None)
            tmp = OUT / f"_tmp_{version}_tekken.json"
            tmp.write_text(json.dumps(data))
            try:
                mt = MistralTokenizer.from_file(str(tmp))
            finally:
                tmp.unlink()
            for name, messages in chats(jfk if label == "voxtral" else None, long).items():
                if version == "v3" and any(
                    isinstance(m["content"], list) and any(p["type"] == "input_audio" for p in m["content"])
                    for m in messages
                ):
                    continue
                if label == "voxtral" and not all(ord(c) < 124 for c in texts(messages)):
                    continue  # that vocabulary holds only the bytes below 124
                tokens = mt.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
                vectors["chats"][f"{label}/{version}/{name}"] = {
                    "messages": engine_view(messages),
                    "audio": audio_order(messages, names),
                    "ids": tokens,
                }
    (OUT / "vectors.json").write_text(json.dumps(vectors, ensure_ascii=False, indent=1) + "\n")
    print(
        f"{len(ranks)} ranks, {len(vectors['strings'])} strings, {len(vectors['chats'])} chats:",
        sorted(vectors["chats"]),
    )


if __name__ == "__main__":
    main()

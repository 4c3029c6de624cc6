"""Assemble backend/assets/corpus.txt (run once; its output is committed).

The corpus mixes English prose, Chinese (the project's own seed notes), other scripts, emoji
(including ZWJ sequences and flags), code and odd whitespace, so that the trained byte-level BPE
splits multi-byte characters across tokens and keeps spaces meaningful.
"""
import pathlib
import random

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEEDS = ROOT.parent / "shared" / "seeds"

ENGLISH = """\
Large language model serving turns a trained network into a service that many people use at once.
A request arrives with a prompt; the server tokenizes it, runs a prefill pass that fills the KV cache,
then decodes one token at a time until it meets an end-of-sequence token, a stop string, or a length limit.
Continuous batching lets requests join and leave the batch between steps, so short answers never wait for long ones.
The paged KV cache stores keys and values in fixed-size blocks, like pages of virtual memory, and a block table maps
each sequence's logical positions to physical blocks. Blocks with the same prefix are shared and counted by reference;
when a shared block must change, it is copied first. Prefix caching keeps finished blocks around, keyed by a hash chain,
so the next turn of a conversation reuses the history instead of computing it again.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
Hello, world. How are you today? I am fine, thank you. What time is it? It is half past three.
Once upon a time, there was a little robot who loved to read books about the stars and the sea.
She said: "Streaming must be exact, byte for byte, including spaces   and tabs\tand new lines."
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 3.14159 1e-5 -7 +8 50% $19.99 #1 @user a_b-c.
"""

OTHER = """\
Le cœur a ses raisons que la raison ne connaît point. Äpfel, Öl und Übermut; straße, café, naïve, façade.
¿Dónde está la biblioteca? Привет, как дела? Γειά σου κόσμε. שלום עולם. مرحبا بالعالم. नमस्ते दुनिया।
こんにちは世界、今日はいい天気ですね。カタカナとひらがな。안녕하세요 세계, 반갑습니다. Xin chào thế giới. สวัสดีชาวโลก
"""

EMOJI = [
    "😀", "😂", "🥲", "😍", "🤖", "🚀", "🔥", "✨", "🎉", "👍", "👍🏽", "❤️", "🧡", "💡", "🌏", "🐍", "🦀", "🍜", "☕",
    "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇨🇳", "🇺🇸", "🇯🇵", "🧑🏿‍🚀", "🤷‍♀️", "✅", "❌", "⚡", "🌈", "🎵", "📚", "🧠",
]

CODE = '''\
def generate(prompt: str, max_tokens: int = 16) -> str:
    """Return the model's continuation."""
    ids = tokenizer.encode(prompt)
    for _ in range(max_tokens):
        ids.append(model.step(ids))
    return tokenizer.decode(ids)

{"role": "user", "content": "你好"}  [1, 2, 3]  x = a + b * (c - d) / e;  if (ok) { return 0; }
'''


def main() -> None:
    rng = random.Random(1234)
    parts = [ENGLISH, OTHER, CODE]
    for path in sorted(SEEDS.glob("*")):
        parts.append(path.read_text(encoding="utf-8"))
    lines = []
    words = ENGLISH.split() + OTHER.split()
    for _ in range(400):  # sentences with emoji and spacing variants woven in
        picked = [rng.choice(words) for _ in range(rng.randint(4, 14))]
        for _ in range(rng.randint(0, 3)):
            picked.insert(rng.randint(0, len(picked)), rng.choice(EMOJI))
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n", "，", "、"])
        lines.append(sep.join(picked))
    parts.append("\n".join(lines))
    parts.append(" ".join(EMOJI) + "\n" + "".join(EMOJI) + "\n")
    (ROOT / "backend" / "assets" / "corpus.txt").write_text("\n\n".join(parts), encoding="utf-8")


if __name__ == "__main__":
    main()

"""A GGUF's tokenizer metadata -> a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``.

llama.cpp stores a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as its token list,
token types, merges and a pre-tokenizer name (``tokenizer.ggml.pre``) that stands for a split
regex. We rebuild the same thing with the ``tokenizers`` library: the regex per pre-tokenizer name
is the one the model's original ``tokenizer.json`` used (and llama.cpp's llama-vocab.cpp mirrors).
Control tokens become special added tokens so the chat template's markers encode as one id each.

End-of-generation ids: llama.cpp stops on the file's EOS id and on any control token whose text is
a known end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``...); we do the same, so a ChatML model
whose file names ``<|im_start|>`` as EOS (SmolLM2's does) still stops at ``<|im_end|>``.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from backend.model.gguf_reader import GGUFError, GGUFFile

# tokenizer.ggml.pre -> split regexes applied before byte-level mapping (None: GPT-2's own regex,
# which tokenizers' ByteLevel applies itself). Names as llama.cpp's convert_hf_to_gguf writes them.
_GPT2 = None
_DIGITS_THEN_GPT2 = ["\\p{N}"]       # each digit alone, then GPT-2's regex (StarCoder family)
_LLAMA3 = ["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
           "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]
_QWEN2 = ["(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
          "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]
PRE_TOKENIZERS: dict[str, list[str] | None] = {
    "default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
}
# Llama 3's tokenizer.json sets ignore_merges: a whole word in the vocab wins over merging.
_IGNORE_MERGES = ("llama-bpe", "llama3", "smaug-bpe")
# Control-token texts that end a turn (llama.cpp's end-of-generation list, the common ones).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>", "<|end_of_text|>", "<EOT>")
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


@dataclass
class TokenizerFiles:
    tokenizer: object                     # tokenizers.Tokenizer
    config: dict                          # tokenizer_config.json
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)   # end-of-generation, preferred first
    pad_token_id: int | None = None

    def save(self, out: pathlib.Path) -> None:
        self.tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(
            json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")


def _id(gf: GGUFFile, key: str, n_vocab: int) -> int | None:
    value = gf.get_int(f"tokenizer.ggml.{key}", None, hi=1 << 63)
    return value if value is not None and value < n_vocab else None


def build_tokenizer(gf: GGUFFile) -> TokenizerFiles:
    """The tokenizer of a GGUF with a byte-level BPE vocabulary; GGUFError for other kinds and for
    metadata the ``tokenizers`` library refuses (merges of unknown tokens...)."""
    try:
        return _build(gf)
    except GGUFError:
        raise
    except BaseException as exc:
        # tokenizers (Rust) raises Exception, or PanicException (a BaseException) when it panics.
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        raise GGUFError(f"{gf.path}: the tokenizer cannot be rebuilt from its metadata "
                        f"({type(exc).__name__}: {str(exc)[:200]})") from None


def _build(gf: GGUFFile) -> TokenizerFiles:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = gf.get_str("tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise GGUFError(f"{gf.path}: tokenizer model {kind!r} is not supported; supported: 'gpt2' "
                        "(byte-level BPE). SentencePiece ('llama') vocabularies are not yet imported")
    pre = gf.get_str("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{gf.path}: pre-tokenizer {pre!r} is not known; known: "
                        f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = gf.get_strs("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{gf.path}: tokenizer.ggml.tokens is empty")
    types = gf.get_ints("tokenizer.ggml.token_type", None)
    if types is not None and len(types) != len(tokens):
        raise GGUFError(f"{gf.path}: {len(types)} token types for {len(tokens)} tokens")
    types = [_NORMAL] * len(tokens) if types is None else types.tolist()
    merges = [tuple(m.split(" ", 1)) for m in gf.get_strs("tokenizer.ggml.merges", [])]
    if not merges:
        raise GGUFError(f"{gf.path}: a gpt2 tokenizer without merges cannot be rebuilt")
    bad = next((i for i, m in enumerate(merges) if len(m) != 2 or not all(m)), None)
    if bad is not None:
        raise GGUFError(f"{gf.path}: merge {bad} is not two tokens separated by a space")

    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    regexes = PRE_TOKENIZERS[pre]
    if regexes is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif regexes is _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])

    n = len(tokens)
    bos, eos = _id(gf, "bos_token_id", n), _id(gf, "eos_token_id", n)
    pad, unk = _id(gf, "padding_token_id", n), _id(gf, "unknown_token_id", n)
    template = gf.get_str("tokenizer.chat_template", None)
    # A BOS the chat template already writes as text (ChatML's "<|im_start|>") is a turn marker,
    # not a sequence start: adding it again would double it.
    add_bos = gf.get_bool("tokenizer.ggml.add_bos_token", False) and bos is not None and not (
        template and tokens[bos] in template)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    eog = [i for i in (eos, _id(gf, "eot_token_id", n), _id(gf, "eom_token_id", n)) if i is not None]
    eog += [i for i, t in enumerate(types) if t == _CONTROL and tokens[i] in END_OF_TURN]
    # Prefer a marker the chat template writes at the end of each turn (what a chat answer ends on).
    eog.sort(key=lambda i: 0 if template and tokens[i] in END_OF_TURN and tokens[i] in template else 1)
    eog = list(dict.fromkeys(eog))
    name = lambda i: tokens[i] if i is not None else None          # noqa: E731
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos), "eos_token": name(eog[0] if eog else None),
        "pad_token": name(pad), "unk_token": name(unk),
        "add_bos_token": add_bos, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": gf.get_int(gf.arch_key("context_length"), 2048, lo=1, hi=1 << 24),
    }
    if template:
        config["chat_template"] = str(template)
    return TokenizerFiles(tokenizer=tok, config=config, bos_token_id=bos, eos_token_ids=eog,
                          pad_token_id=pad)

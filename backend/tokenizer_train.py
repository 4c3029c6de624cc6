"""Train the project's byte-level BPE tokenizer on backend/assets/corpus.txt.

The result (backend/assets/tokenizer/) is committed so token ids are identical on every machine;
``triton-llm make-model`` copies it into each checkpoint, where it loads through the normal
Hugging Face path (tokenizer.json + tokenizer_config.json with a ChatML chat template).
"""
from __future__ import annotations

import json
import pathlib

ASSETS = pathlib.Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2 uses it. A trailing generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train(out_dir: pathlib.Path = TOKENIZER_DIR) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(ASSETS / "corpus.txt")], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "additional_special_tokens": ["<|im_start|>"]}, indent=2) + "\n")


if __name__ == "__main__":
    train()
    print(f"wrote {TOKENIZER_DIR}")

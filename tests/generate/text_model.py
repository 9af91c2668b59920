"""A tiny transformers Llama with a real (word-level) tokenizer, saved as a checkpoint directory:
what ``graphopt generate`` reads, in seconds rather than SmolLM2's minutes."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "river", "blue", "red", "big", "small", "runs", "sleeps",
         "and", "then", "is", "was", "of", "to", "in", "it", "we", "you"]
# A chat template in the Jinja dialect transformers renders: one user turn, then the reply cue.
CHAT_TEMPLATE = ("{% for m in messages %}user {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}then{% endif %}")


def tokenizer(chat: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "</s>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def model(vocab: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                                      eos_token_id=2, pad_token_id=1, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def save(folder: Path, chat: bool = True) -> Path:
    tok = tokenizer(chat)
    model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder

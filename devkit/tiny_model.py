"""Generate a tiny random-weight Llama model with its own tokenizer, offline.

Tests and the demo run the real vLLM engine without downloading a model: a two-layer
Llama with random weights loads like any hub model, and its text is noise. Two
vocabularies: ``bytes`` (the tests'), a byte-level BPE tokenizer that encodes any text, so
multi-byte characters split across tokens as on a real model; ``words`` (the demo's), a
word-level tokenizer over a few hundred common English words, so random tokens read as
a stream of words rather than broken UTF-8. Generation is deterministic, so a directory
is reused.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

Vocabulary = Literal["bytes", "words"]

DEFAULT_DIR = Path(".cache/tiny-llama")
WORDS_DIR = Path(".cache/tiny-llama-words")
"""Where the demo's model (``vocabulary="words"``) is built."""

# Enough text for the BPE trainer to learn merges over plain English.
_CORPUS = [
    "The future of artificial intelligence is bright and uncertain.",
    "In a galaxy far, far away, a small ship drifted between the stars.",
    "The key to happiness is a quiet mind and good friends.",
    "Redis streams carry tokens from workers to the people who wait for them.",
    "A queue decouples producers from the machines that do the work.",
    "Hello! How are you today? I am fine, thank you for asking.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 appear in text too, with symbols: #$%&*+-=/<>@[]{}|~^_`'\"().,;:?!",
]

# A ChatML-style template, as many instruct models use; rendered by the tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_UNKNOWN_WORD = "<|unk|>"
"""A special token, so a random model that samples it writes nothing."""

_WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have this from or had by not
word but what some we can out other were all there when up use your how said an each she which do their time if
will way about many then them write would like so these her long make thing see him two has look more day could
go come did number sound no most people my over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came show every good me give
our under name very through just form great think say help low line turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home read hand large add even land here
must big high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree cross farm
hard start might story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish mountain stop
once base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red list
though feel talk bird soon body dog family direct leave song measure door product black short class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground interest reach fast
sing listen six table travel less morning ten simple several toward war lay against pattern slow center love
person money serve appear road map rain rule pull cold notice voice unit power town fine certain fly fall lead
cry dark machine note wait plan figure star box field rest correct able done beauty drive stood contain front
teach week final gave green oh quick develop ocean warm free minute strong special mind behind clear tail
produce fact street nothing course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane age dry wonder laugh thousand ago ran check game shape
yes hot miss brought heat snow bring distance fill east paint language among future artificial intelligence
galaxy away key happiness quiet stars hello today thank please user assistant . , ! ?
"""
"""The ``words`` vocabulary: common English words, the demo prompts' words, the chat
template's roles and a few punctuation marks."""


def build_tiny_model(
    out_dir: Path = DEFAULT_DIR, *, max_position_embeddings: int = 1024, vocabulary: Vocabulary = "bytes"
) -> Path:
    """Write config, random weights and tokenizer to ``out_dir`` (skipped if a model of
    this ``vocabulary`` is there, or if ``out_dir`` holds ``devkit.gpu_model``'s model, which
    ``python -m bench --model-dir`` runs)."""
    out_dir = Path(out_dir)
    marker = out_dir / "streamq-tiny-model.json"
    if (out_dir / "streamq-gpu-model.json").exists():
        return out_dir
    if marker.exists() and json.loads(marker.read_text()).get("vocabulary", "bytes") == vocabulary:
        return out_dir

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if vocabulary == "words":
        words = word_level_tokenizer([*SPECIAL_TOKENS, _UNKNOWN_WORD, *_WORDS.split()], _UNKNOWN_WORD)
        fast = fast_tokenizer(words, unk_token=_UNKNOWN_WORD)
    else:
        fast = fast_tokenizer(_byte_level_tokenizer())
    fast.save_pretrained(out_dir)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: the CPU attention backend rejects smaller
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    marker.write_text(json.dumps({"vocab_size": len(fast), "layers": 2, "vocabulary": vocabulary}))
    return out_dir


def _byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``_CORPUS``: any text, any characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer


def word_level_tokenizer(tokens: Sequence[str], unknown: str) -> Tokenizer:
    """One token per word (and punctuation mark), ids in the order of ``tokens``: text is
    split at whitespace and punctuation, lowercased, and a word not in ``tokens`` becomes
    ``unknown``. Decoding joins the words with spaces (none before punctuation)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("a token is listed twice: the ids would skip")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unknown))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tokenizer


def fast_tokenizer(tokenizer: Tokenizer, *, unk_token: str | None = None) -> PreTrainedTokenizerFast:
    """``tokenizer`` as transformers (and vLLM) load it, with the special tokens and the
    chat template of every model this project generates."""
    from transformers import PreTrainedTokenizerFast

    unknown = {} if unk_token is None else {"unk_token": unk_token}  # none: not even a null entry
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        **unknown,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, help=f"default: {DEFAULT_DIR}, or {WORDS_DIR} for words")
    parser.add_argument("--vocabulary", choices=get_args(Vocabulary), default="bytes")
    args = parser.parse_args()
    default = WORDS_DIR if args.vocabulary == "words" else DEFAULT_DIR
    print(build_tiny_model(args.out_dir or default, vocabulary=args.vocabulary))


if __name__ == "__main__":
    main()

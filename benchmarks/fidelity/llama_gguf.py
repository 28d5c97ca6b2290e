"""A Llama-family model as a GGUF file, built here: random weights, a tokenizer trained on the
repository's texts (no download). For checks that need a second real-shaped model passed as a
``.gguf`` file, as a user passes one (``ctxc compile --model file.gguf``).

    python -m benchmarks.fidelity.llama_gguf OUT.gguf [--seed 0] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[2]
TEXTS = sorted([*(ROOT / "examples").glob("*.txt"), *(ROOT / "benchmarks" / "texts").glob("*.txt")])

__all__ = ["write_llama_gguf"]


def _tokenizer(vocab: int) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the repository's texts (GGUF's ``gpt2`` model)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    specials = ["<pad>", "<s>", "</s>"]
    bpe.train([str(p) for p in TEXTS], vocab_size=vocab, min_frequency=2, special_tokens=specials)
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def write_llama_gguf(
    path: Path, seed: int = 0, hidden: int = 256, layers: int = 4, vocab: int = 4096
) -> Path:
    """Write a random Llama (``LlamaForCausalLM``) with its tokenizer as the GGUF file ``path``.

    Args:
        path: the ``.gguf`` file to write (its folder must exist).
        seed: the weights' seed.
        hidden: the hidden size (intermediate 8/3 of it, heads of 32, two query heads per
            key-value head).
        layers: decoder layers.
        vocab: the tokenizer's largest vocabulary (fewer when the texts have fewer merges).

    Returns:
        ``path``. Side effect: the file is written, F32 matrices (llama.cpp's names and keys,
        by ctxc's GGUF writer).
    """
    from ctxc.backends.gguf.write import write_gguf

    tok = _tokenizer(vocab)
    heads = max(2, hidden // 32)
    config = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2048,
        initializer_range=0.06,  # wide enough that the context moves the next token
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as tmp:  # the writer reads the tokenizer's files
        tok.save_pretrained(tmp)
        tok = tf.AutoTokenizer.from_pretrained(tmp)
        write_gguf(model, tok, path, "F32")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(write_llama_gguf(args.out, args.seed, args.hidden, args.layers))


if __name__ == "__main__":
    main()

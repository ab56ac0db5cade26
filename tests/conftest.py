import os

import pytest

# Every model in the tests is built from a config; nothing is downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``fitbench ARGV`` in this process (its workers are child processes); exit code, stdout, stderr."""
    from fitbench.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_tiny_checkpoint(directory, fill: float | None = None, tokenizer: bool = True, seed: int = 0):
    """``tiny`` as a transformers-layout checkpoint in ``directory``: config.json, model.safetensors with
    the native model's bf16 weights (random from ``seed``, or every element ``fill``) and, with
    ``tokenizer``, a word-level tokenizer.json trained offline on fitbench's shipped text."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig

    from fitbench.models.native import build_native
    from fitbench.models.registry import resolve
    from fitbench.run.quality import reference_text

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arch = resolve("tiny")
    torch.manual_seed(seed)
    model = build_native(arch, "cpu", torch.bfloat16)
    if fill is not None:
        for parameter in model.parameters():
            parameter.data.fill_(fill)
    # the output projection is tied to the embedding; safetensors stores a tensor once
    save_file({name: value for name, value in model.state_dict().items() if name != "lm_head.weight"},
              str(directory / "model.safetensors"))
    LlamaConfig(hidden_size=arch.hidden_size, intermediate_size=arch.ffn_size, num_hidden_layers=arch.num_layers,
                num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads, vocab_size=arch.vocab_size,
                max_position_embeddings=arch.max_seq_len, tie_word_embeddings=True, rms_norm_eps=arch.norm_eps,
                rope_theta=arch.rope_theta).save_pretrained(directory)
    if tokenizer:
        words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        words.train_from_iterator([reference_text()], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
        words.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """``write_tiny_checkpoint``, for tests and fixtures of any scope."""
    return write_tiny_checkpoint

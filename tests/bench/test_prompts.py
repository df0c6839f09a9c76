"""Prompt building, middle truncation and batched greedy generation."""

import argparse

import pytest
import torch

from restkv.bench import generation
from restkv.data import prompts


def test_middle_truncate():
    ids = list(range(10))
    assert prompts.middle_truncate(ids, 20) == ids
    assert prompts.middle_truncate(ids, 4) == [0, 1, 8, 9]
    assert prompts.middle_truncate(ids, 5) == [0, 1, 2, 8, 9]
    assert prompts.middle_truncate(ids, 1) == [0]
    assert prompts.middle_truncate(torch.arange(10), 5).tolist() == [0, 1, 2, 8, 9]


def test_build_prompt_and_batched_greedy_generation(smollm2):
    model, tokenizer = smollm2
    text = "What is the capital of France?"
    wrapped = prompts.build_prompt(tokenizer, text, "auto")
    assert wrapped.startswith("<|im_start|>") and text in wrapped and wrapped.endswith("assistant\n")
    assert prompts.build_prompt(tokenizer, text, "off") == text
    with pytest.raises(ValueError, match="chat template"):
        prompts.build_prompt(argparse.Namespace(chat_template=None), text, "on")
    texts = [wrapped, prompts.build_prompt(tokenizer, "Name a color of the sky. Answer in one word.", "on")]
    batch = generation.generate_batch(model, tokenizer, texts, max_new_tokens=6)
    single = [generation.generate_batch(model, tokenizer, [p], max_new_tokens=6)[0] for p in texts]
    assert batch == single and "Paris" in batch[0]
    assert all("<|im" not in s for s in batch)

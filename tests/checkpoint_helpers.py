"""Shared by the single-process checkpoint tests: a small BERT config, the CLI runner, an HF checkpoint fixture."""

import subprocess
import sys

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

CONFIG = dict(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)


def cli(*args):
    """``shardlib <args>`` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "shardlib.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def hf_dir(tmp_path):
    """An HF checkpoint of a small BertForMaskedLM written with save_pretrained, and the model."""
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**CONFIG))
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model

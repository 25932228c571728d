"""Shared by the single-process checkpoint tests: a small BERT config, the CLI runner, an HF checkpoint fixture."""

import contextlib
import io
import subprocess

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

CONFIG = dict(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)


def cli(*args):
    """``shardlib <args>`` run in this process (``shardlib.cli.main``; a subprocess would spend ~5 s importing torch
    and transformers per call), as a ``CompletedProcess`` with its exit code and output. The installed entry point
    itself runs every launch of test_launcher.py."""
    from shardlib.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["shardlib", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def hf_dir(tmp_path):
    """An HF checkpoint of a small BertForMaskedLM written with save_pretrained, and the model."""
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**CONFIG))
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model

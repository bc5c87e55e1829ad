"""The served model's edge: JSON mode's token table, started at server start, never aborts a
process that exits while it is being built."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_process_exiting_while_the_token_table_builds_exits_cleanly():
    """A daemon thread still inside torch when the interpreter exits made it abort ("terminate
    called without an active exception", status 134); the thread is joined at exit instead."""
    script = textwrap.dedent(
        """
        import time

        import torch

        from evospec.models.registry import DEFAULT_MODEL, REGISTRY, ensure_converted
        from evospec.tokenizer import TextCodec
        from service.context import ServedModel

        torch.set_num_threads(2)
        (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # torch's thread pool running, as in a server
        codec = TextCodec.from_folder(ensure_converted(REGISTRY[DEFAULT_MODEL], progress=False))
        served = ServedModel("m", codec, 256, codec.vocab_size)
        thread = served.prepare_json()
        time.sleep(0.3)
        assert thread.is_alive()  # the table takes ~1 s: the interpreter exits while it builds
        print("exiting")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exiting" in out.stdout and "terminate called" not in out.stderr

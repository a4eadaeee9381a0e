"""Loading a model stays light: no torch._dynamo import on the way (seconds per process)."""

from __future__ import annotations

import subprocess
import sys


def test_loading_weights_does_not_import_torch_dynamo() -> None:
    """from_state_dict builds the Transformer on the meta device; an initialised nn.Embedding there runs normal_
    through torch's Python reference ops, whose first use imports torch._dynamo (3.9 s without bytecode, and
    nothing in decoding needs it). Checked in a fresh interpreter: the test process has imported it already."""
    code = (
        "import sys, torch\n"
        "from treedraft.models.tiny import tiny_llama\n"
        "from treedraft.models.loaders import from_state_dict\n"
        "m = tiny_llama()\n"
        "m2 = from_state_dict(m.config, m.state_dict(), 'tiny', torch.float32, 'cpu')\n"
        "assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

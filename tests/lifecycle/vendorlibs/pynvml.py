"""Stand-in for ``pynvml`` in the agent processes of the lifecycle tests (put first on PYTHONPATH).

``DRA_TEST_NVIDIA_GPUS=N`` gives a node with N H100s (tests/fakes/fake_pynvml.py); 0 or unset is
a node without the NVIDIA driver: the module imports (the image ships nvidia-ml-py) but
``nvmlInit`` fails with NVML_ERROR_LIBRARY_NOT_FOUND, as on an AMD-only node.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
# The fakes need the real module's constants: import it from behind this stand-in.
_path = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
import pynvml as _real  # noqa: E402

sys.path[:] = _path

from tests.fakes.fake_pynvml import FakeNvml, h100  # noqa: E402

_count = int(os.environ.get("DRA_TEST_NVIDIA_GPUS", "0"))
_fake = FakeNvml(
    [h100(i, bus=f"00000000:{0x18 + i:02X}:00.0") for i in range(_count)],
    init_error=None if _count else int(_real.NVML_ERROR_LIBRARY_NOT_FOUND),
)
sys.modules[__name__] = _fake.module

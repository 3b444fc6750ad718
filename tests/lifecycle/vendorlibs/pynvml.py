"""Makes ``import pynvml`` in the agent processes of the lifecycle tests give the real pynvml over
the stand-in libnvidia-ml (put this directory first on PYTHONPATH).

``DRA_TEST_NVIDIA_GPUS=N`` gives a node with N H100s (tests/fakes/libnvml); 0 or unset is a node
without the NVIDIA driver: the module imports (the image ships nvidia-ml-py) but ``nvmlInit``
fails with NVML_ERROR_LIBRARY_NOT_FOUND from pynvml's own loader, as on an AMD-only node.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
# The installed pynvml is behind this file on the path: import it from there.
_path = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
import pynvml as _installed  # noqa: E402

sys.path[:] = _path

from tests.fakes.libnvml import LibNvml, h100  # noqa: E402

_count = int(os.environ.get("DRA_TEST_NVIDIA_GPUS", "0"))
_library = LibNvml(
    [h100(i, bus=f"00000000:{0x18 + i:02X}:00.0") for i in range(_count)],
    init_error=None if _count else int(_installed.NVML_ERROR_LIBRARY_NOT_FOUND),
)
sys.modules[__name__] = _library.module

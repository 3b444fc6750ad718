"""Stand-in for ``amdsmi`` in the agent processes of the lifecycle tests (put first on PYTHONPATH).

``DRA_TEST_AMD_GPUS=N`` gives a node with N MI300X GPUs (tests/fakes/fake_amdsmi.py); 0 or unset
is a node without ROCm: the import fails as it does when libamd_smi.so is missing.
"""

import os
import sys

_count = int(os.environ.get("DRA_TEST_AMD_GPUS", "0"))
if not _count:
    raise ImportError("libamd_smi.so: cannot open shared object file: No such file or directory")

from tests.fakes.fake_amdsmi import FakeAmdSmi, mi300x  # noqa: E402

sys.modules[__name__] = FakeAmdSmi(mi300x("spx_nps1", count=_count))

"""AMD's real ``amdsmi`` in the agent processes of the lifecycle tests, over the stand-in library.

This directory is first on the agent's PYTHONPATH; this module points the real binding at the
stand-in ``libamd_smi.so`` (tests/fakes/amd_standin.py) through ``ROCM_PATH`` and imports it from
behind itself. ``DRA_TEST_AMD_GPUS=N`` gives a node with N MI300X GPUs; 0 or unset is a node
without ROCm: ``ROCM_PATH`` names an empty directory and the real import fails as it does there.
A host ROCm that is not the binding's: ``DRA_TEST_AMD_LIBRARY`` names the stand-in's variant
(``no-cper``: a library lacking a symbol the binding binds), ``DRA_TEST_AMD_LIB_VERSION`` the
version the library reports (``amdsmi_get_lib_version``).
"""

import os
import sys
import tempfile

_here = os.path.dirname(os.path.abspath(__file__))
_count = int(os.environ.get("DRA_TEST_AMD_GPUS", "0"))
_path = list(sys.path)
# The real package, not this module, from here on (the stand-in's build reads its wrapper).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
try:
    if _count:
        from tests.fakes.amd_standin import environment, mi300x

        _variant = os.environ.get("DRA_TEST_AMD_LIBRARY", "full")
        _version = os.environ.get("DRA_TEST_AMD_LIB_VERSION")
        _behaviour = {"lib_version": _version} if _version else {}
        os.environ.update(environment(mi300x("spx_nps1", count=_count), _variant, **_behaviour))
    else:
        os.environ["ROCM_PATH"] = tempfile.mkdtemp(prefix="no-rocm-")
    import amdsmi as _real
finally:
    sys.path[:] = _path
sys.modules[__name__] = _real

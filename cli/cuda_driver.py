"""Is there a GPU driver at all? Answered from the file system in milliseconds, so that
``--device cuda`` on a machine without one is refused before torch is imported (seconds).

Only a sure "no" counts: any sign of a driver (NVIDIA's, WSL's GPU bridge, ROCm's, which torch
also calls cuda) or a platform this does not know leaves the answer to torch."""

from __future__ import annotations

import glob
import os
import shutil
import sys

# Linux: the NVIDIA kernel module's proc entry and device nodes, WSL's GPU bridge, ROCm's node
DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")
# where a libcuda.so may be besides LD_LIBRARY_PATH (WSL's is under /usr/lib/wsl/lib)
LIBCUDA_DIRS = ("/usr/lib/wsl/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64")


def missing_gpu_driver() -> str | None:
    """-> why this machine surely cannot run CUDA (one phrase), or None when it might."""
    if sys.platform == "darwin":
        return "macOS has no CUDA"
    if not sys.platform.startswith("linux"):
        return None
    if any(os.path.exists(p) for p in DRIVER_PATHS) or shutil.which("nvidia-smi"):
        return None
    dirs = [*os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep), *LIBCUDA_DIRS]
    if any(glob.glob(os.path.join(d, "libcuda.so*")) for d in dirs if d):
        return None
    return ("no GPU driver on this machine (no /proc/driver/nvidia, /dev/nvidia*, nvidia-smi "
            "or libcuda.so)")

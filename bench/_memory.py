"""Memory figures of this process, for the benchmarks that measure a round's peak: the
resident size now, and the kernel's peak (VmHWM), which can be reset before a round."""

from __future__ import annotations

import os
import resource


def rss_bytes() -> int:
    """The resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Resets the kernel's peak RSS (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """The peak RSS since the process started or `reset_peak` last succeeded."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

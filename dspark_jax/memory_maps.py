"""Headroom in the process's memory maps before XLA:CPU compiles a program.

XLA:CPU places each compiled program's JIT code in memory maps: about 1000 per step program of
the default model (a dspark server at 16 slots and a 384-token context held 45k maps after its
warm-up), and Linux allows a process vm.max_map_count of them (65530 by default). Past the limit
LLVM aborts the whole process ("Unable to allocate section memory"), which a server cannot catch.
The Engine asks here before each compile and before each program's first run (XLA:CPU may set
up a program's kernels then), so a configuration with too many programs fails with a message that
names the cause and the ways out instead.
"""

from __future__ import annotations

HEADROOM = 8000  # maps kept free for the next program (programs average ~1000 here; some take more)


def map_count() -> int | None:
    """Memory maps this process holds (None where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """The kernel's vm.max_map_count (None where it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def free_maps() -> int | None:
    """Maps this process may still take before the headroom (None where it cannot be known)."""
    count, limit = map_count(), map_limit()
    return None if count is None or limit is None else limit - count - HEADROOM


def check_headroom(programs: int) -> None:
    """Raise before a CPU compile that would leave fewer than HEADROOM free maps; `programs`
    is how many this engine has compiled so far (for the message)."""
    count, limit = map_count(), map_limit()
    if count is None or limit is None or limit - count >= HEADROOM:
        return
    raise RuntimeError(
        f"this process holds {count} memory maps of the kernel's limit of {limit} (vm.max_map_count) after "
        f"compiling {programs} programs, and XLA:CPU needs about 1000 more per program: compiling another "
        "would abort the process. Raise the limit (sudo sysctl -w vm.max_map_count=262144) or compile fewer "
        "programs: fewer slots (row buckets), a shorter context (attention spans and prompt buckets), one "
        "value of rounds per step")


class FirstRunChecked:
    """A compiled program whose first call checks the headroom first; otherwise the program."""

    def __init__(self, program, programs: int):
        self.program = program
        self.programs = programs  # programs compiled before it (for the message)
        self.ran = False

    def __call__(self, *args):
        if not self.ran:
            check_headroom(self.programs)
            self.ran = True
        return self.program(*args)

    def __getattr__(self, name):  # as_text(), cost_analysis(), ...
        return getattr(self.program, name)

"""What the sandbox's hostile-program tests share (tests/test_sandbox*.py).

Each test runs on the full sandbox and, where the layer in question has a fallback, with the
mechanism forced off (``disable=``) so the degraded path is tested too; layers this machine cannot
provide are skipped with the reason. test_sandbox.py runs every file again as an unprivileged user
(user namespaces where the kernel allows them, and the "plain" mode: what a user without them gets).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from comlrl.sandbox import Sandbox

MODES = {
    "full": (),
    # no PID namespace: kill_tree falls back to the subreaper sweep
    "no_pidns": ("pid_namespace",),
    # what a user without namespaces gets: Landlock + seccomp only
    "plain": ("pid_namespace", "uid_drop", "network_namespace", "mount_namespace", "user_namespace"),
}


def make_sandbox(request, **kw) -> Sandbox:
    """A sandbox of its own for one test, closed at its end."""
    box = Sandbox(**kw)
    request.addfinalizer(box.close)
    return box


@pytest.fixture(scope="module")
def boxes():
    made = {name: Sandbox(timeout_s=2, workers=2, disable=off) for name, off in MODES.items()}
    yield made
    for box in made.values():
        box.close()


@pytest.fixture(params=list(MODES))
def box(request, boxes):
    return boxes[request.param]


@pytest.fixture(params=list(MODES))
def one_worker(request):
    """A one-worker sandbox per mode: consecutive requests go to the same zygote."""
    return make_sandbox(request, timeout_s=10, workers=1, disable=MODES[request.param])


def need(box, *layers):
    have = box.isolation()
    missing = [name for name in layers if not have[name]]
    if missing:
        pytest.skip(f"layer(s) {missing} not available here: {box.isolation_details()}")


def code(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def planted(folder: Path, name: str, text: str, mode: int) -> Path:
    """A file the program's user could reach by permissions alone (``mode`` for it and its folder)."""
    path = folder / name
    path.write_text(text)
    os.chmod(folder, mode | 0o111)
    os.chmod(path, mode)
    return path


def as_root() -> bool:
    return os.geteuid() == 0

"""The front door (issue 31): what a new user meets before any training. The package's version
and where it comes from, install hints that keep this package (never PyPI's comlrl 1.4.3), lazy
imports (``import comlrl`` and ``comlrl --help`` load no torch), and a clear error without torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from comlrl._imports import install_hint

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "wandb", "datasets", "numpy")


def _python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def _loaded_after(code: str) -> dict[str, bool]:
    """Which heavy packages are in sys.modules after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    result = _python(probe)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_version_has_one_source_and_sorts_above_comlrl_143():
    import comlrl
    from comlrl._version import __version__

    assert comlrl.__version__ == __version__ == metadata.version("comlrl")
    assert tuple(int(p) for p in re.match(r"(\d+)\.(\d+)\.(\d+)", __version__).groups()) > (1, 4, 3)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject.split("[tool.")[0]


def test_torch_is_an_extra_not_a_dependency():
    required = metadata.requires("comlrl") or []
    torch_lines = [r for r in required if re.match(r"torch\b", r)]
    assert torch_lines and all("extra ==" in r for r in torch_lines), torch_lines


@pytest.mark.parametrize("code", [
    "import comlrl",
    "import comlrl.exceptions, comlrl.sandbox",
    "from comlrl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "from comlrl.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass",
])
def test_front_door_imports_load_no_heavy_package(code):
    assert not any(_loaded_after(code).values())


def test_a_family_loads_without_the_others_and_without_wandb():
    probe = ("from comlrl.trainers.reinforce import MAGRPOTrainer\nimport sys\n"
             "print([m for m in ('comlrl.trainers.preference', 'comlrl.trainers.actor_critic', 'wandb') "
             "if m in sys.modules])")
    result = _python(probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_lazy_names_are_the_modules_objects():
    import comlrl
    import comlrl.trainers as trainers
    import comlrl.trainers.preference as preference
    from comlrl.trainers.preference import iterative
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    assert comlrl.MAGRPOTrainer is MAGRPOTrainer and comlrl.MAGRPOConfig is MAGRPOConfig
    assert {"MAGRPOTrainer", "ConfigError", "__version__"} <= set(dir(comlrl))
    for module in (comlrl, trainers, preference):
        assert all(getattr(module, name) is not None for name in module.__all__), module.__name__
    assert preference.MADPOIterTrainer is iterative.MADPOIterTrainer
    import wandb

    assert iterative.wandb is wandb  # CoMLRL 1.4.3's module global, imported when looked up
    with pytest.raises(AttributeError, match="no attribute 'MAGRPOTrainr'"):
        comlrl.MAGRPOTrainr  # noqa: B018
    namespace: dict = {}
    exec("from comlrl.trainers import *", namespace)  # noqa: S102
    assert set(trainers.__all__) <= set(namespace)


def test_without_torch_the_error_says_how_to_install_it():
    # sys.modules["torch"] = None: what Python does for a module that is not installed, without uninstalling
    code = ("import sys\nsys.modules['torch'] = None\nimport comlrl\nprint(comlrl.ConfigError.__name__)\n"
            "from comlrl.trainers.reinforce import MAGRPOTrainer")
    result = _python(code)
    assert result.returncode != 0 and result.stdout.strip() == "ConfigError"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: comlrl.trainers needs torch"), last
    assert "https://download.pytorch.org/whl/cpu" in last


@pytest.mark.parametrize("extra", ["code", "plot", "peft", "mlflow", "tensorboard", "api", "vllm", "sandbox"])
def test_install_hints_keep_this_package(extra):
    hint = install_hint(extra)
    assert f"pip install -e '{ROOT}[{extra}]'" in hint or f"pip install -e {ROOT}[{extra}]" in hint
    packages = [r.split(";")[0].strip() for r in metadata.requires("comlrl") or [] if f'extra == "{extra}"' in r]
    assert packages and all(p in hint for p in packages), (packages, hint)
    assert "comlrl[" not in hint.replace(f"{ROOT}[", "")


def test_no_message_or_example_installs_pypis_comlrl():
    """``pip install 'comlrl[x]'`` installs CoMLRL 1.4.3 in this package's place (PyPI's comlrl)."""
    pattern = re.compile(r"""pip install (-U |--upgrade )?['"]?comlrl(\[|['"\s]|$)""")
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("comlrl", "examples", "scripts")
             for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".sh", ".yaml", ".md")
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, found
    assert pattern.search("pip install 'comlrl[code]'") and pattern.search('pip install -U "comlrl[code]"')


def _fake_checkout(tmp_path: Path) -> Path:
    """scripts/setup_env.sh and pyproject.toml beside a .venv whose python logs what it is asked to
    run (pip installs succeed without doing anything; the installed-state check exits FAKE_RC)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_env.sh").write_text((ROOT / "scripts" / "setup_env.sh").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/bash\necho "$*" >> "$LOG"\ncase "$1" in\n  -VV) echo "Python 3.x fake";;\n'
                      '  -I) cat > /dev/null; exit "${FAKE_RC:-0}";;\nesac\n')
    python.chmod(0o755)
    return tmp_path


def _setup_pip_calls(checkout: Path, **env: str) -> list[str]:
    log = checkout / "calls.log"
    log.write_text("")
    subprocess.run(["bash", "scripts/setup_env.sh", "dev"], cwd=checkout, check=True, timeout=60,
                   env={**os.environ, "LOG": str(log), **env})
    return [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]


def test_setup_env_runs_pip_only_when_something_changed(tmp_path):
    checkout = _fake_checkout(tmp_path)
    assert _setup_pip_calls(checkout) == ["-m pip install --quiet --disable-pip-version-check torch==2.13.0",
                                          "-m pip install --quiet --disable-pip-version-check -e .[dev]"]
    assert _setup_pip_calls(checkout) == []  # nothing changed: no pip at all
    assert len(_setup_pip_calls(checkout, FAKE_RC="1")) == 2  # the install went away (pip uninstall)
    assert _setup_pip_calls(checkout) == []
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# a new dependency\n")
    assert len(_setup_pip_calls(checkout)) == 2
    assert len(_setup_pip_calls(checkout, COMLRL_SETUP_FORCE="1")) == 2
    assert _setup_pip_calls(checkout) == []
